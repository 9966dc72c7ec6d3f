// Where the tensor table puts tensors in its arenas: a tensor of 256 elements or more starts on
// a multiple of 256 in the params and state arenas (so no kernel portion straddles a 1 KB
// boundary), a smaller one right after the last; the canonical layout (gradient staging) stays
// packed at multiples of 8; tensors never overlap, and the sizes cover them.
#include "kernels/tensor_table.h"

#include <vector>

#include "gtest/gtest.h"

namespace fusedps {
namespace {

TEST(TensorTable, LargeTensorsStartOnWholePortions) {
  TensorTable table;
  AdamWHyperparameters int8_group;
  int8_group.state_dtype = StateDType::kInt8;
  ASSERT_TRUE(table.SetGroup(0, AdamWHyperparameters{}).ok());
  ASSERT_TRUE(table.SetGroup(1, int8_group).ok());
  const std::vector<NewTensor> tensors = {
      {100000, 0, 0}, {10, 0, 0}, {1000, 0, 0}, {300, 0, 0}, {8, 0, 0}, {5000, 1, 0}, {257, 0, 0}};
  ASSERT_TRUE(table.ArenaSizesWith(tensors).ok());
  table.Append(tensors);

  // fp32 params and state: 100000 at 0; 10 right after (100000); 1000 on the next multiple of
  // 256 after 100016 (100096); 300 after 101096 (101120); 8 right after 101424; the int8
  // group's tensor is in the int8 state arena, its params after 101432 (101632); 257 then
  // after 106632 (106752), ending at 106752 + 264.
  const std::vector<uint64_t> params = {0, 100000, 100096, 101120, 101424, 101632, 106752};
  const std::vector<uint64_t> state = {0, 100000, 100096, 101120, 101424, 0, 101632};
  for (uint32_t t = 0; t < table.size(); ++t) {
    EXPECT_EQ(table.param_offset(t), params[t]) << t;
    EXPECT_EQ(table.state_offset(t), state[t]) << t;
  }
  EXPECT_EQ(table.sizes().params32, 106752u + 264u);
  EXPECT_EQ(table.sizes().state32, 101632u + 264u);
  EXPECT_EQ(table.sizes().state8, 5120u);  // Whole 256-element blocks.
  // The canonical layout: every tensor after the last, at multiples of 8.
  EXPECT_EQ(table.offset(2), 100016u);
  EXPECT_EQ(table.arena_numel(), 100000u + 16 + 1000 + 304 + 8 + 5000 + 264);

  // The sizes ArenaSizesWith predicts are those Append reaches, one call or several.
  TensorTable one_by_one;
  ASSERT_TRUE(one_by_one.SetGroup(0, AdamWHyperparameters{}).ok());
  ASSERT_TRUE(one_by_one.SetGroup(1, int8_group).ok());
  for (const NewTensor& t : tensors) one_by_one.Append(absl::MakeConstSpan(&t, 1));
  EXPECT_EQ(one_by_one.sizes().params32, table.sizes().params32);
  EXPECT_EQ(one_by_one.sizes().state32, table.sizes().state32);

  // Truncation recounts the same layout.
  table.Truncate(3);
  EXPECT_EQ(table.sizes().params32, 101096u);
}

}  // namespace
}  // namespace fusedps
