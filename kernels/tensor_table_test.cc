// Where the tensor table puts tensors in its arenas: a tensor of 256 elements or more starts on
// a multiple of 256 in the params and state arenas (so no kernel portion straddles a 1 KB
// boundary), a smaller one right after the last; small fp32 tensors of one group lie end to end
// in runs that start on a multiple of 256, and Packs finds those of equal steps; the canonical
// layout (gradient staging) stays packed at multiples of 8; tensors never overlap, and the sizes
// cover them.
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
  const std::vector<NewTensor> tensors = {{100000, 0, 0}, {10, 0, 0},   {1000, 0, 0}, {300, 0, 0},
                                          {8, 0, 0},      {5000, 1, 0}, {257, 0, 0}};
  ASSERT_TRUE(table.ArenaSizesWith(tensors).ok());
  table.Append(tensors);

  // fp32 params and state: 100000 at 0; 10 right after (100000); 1000, Packable, starts a run
  // on the next multiple of 256 after 100016 (100096); 300 after 101096 (101120); 8, Packable,
  // starts a run after 101424 (101632); the int8 group's tensor is in the int8 state arena, its
  // params after 101640 (101888); 257 then after 106888 (107008), ending at 107008 + 264, and
  // its state after 101640 (101888).
  const std::vector<uint64_t> params = {0, 100000, 100096, 101120, 101632, 101888, 107008};
  const std::vector<uint64_t> state = {0, 100000, 100096, 101120, 101632, 0, 101888};
  for (uint32_t t = 0; t < table.size(); ++t) {
    EXPECT_EQ(table.param_offset(t), params[t]) << t;
    EXPECT_EQ(table.state_offset(t), state[t]) << t;
  }
  EXPECT_EQ(table.sizes().params32, 107008u + 264u);
  EXPECT_EQ(table.sizes().state32, 101888u + 264u);
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

TEST(TensorTable, SmallFp32TensorsLieEndToEndAndPackByStep) {
  TensorTable table;
  AdamWHyperparameters int8_group;
  int8_group.state_dtype = StateDType::kInt8;
  AdamWHyperparameters bf16_group;
  bf16_group.state_dtype = StateDType::kBFloat16;
  ASSERT_TRUE(table.SetGroup(0, AdamWHyperparameters{}).ok());
  ASSERT_TRUE(table.SetGroup(1, AdamWHyperparameters{}).ok());
  ASSERT_TRUE(table.SetGroup(2, int8_group).ok());
  ASSERT_TRUE(table.SetGroup(3, bf16_group).ok());
  // 0-2: a run of group 0; 3-4: group 1's run; 5: too large; 6-7: a run; 8: not a whole number
  // of 8-element runs; 9-10: small tensors of an int8 group keep fp32 state, so they pack; 11:
  // bf16 state does not pack.
  const std::vector<NewTensor> tensors = {{1000, 0, 0}, {1000, 0, 0}, {1000, 0, 0}, {1000, 1, 0},
                                          {8, 1, 0},    {2048, 0, 0}, {8, 0, 0},    {16, 0, 0},
                                          {4, 0, 0},    {1000, 2, 0}, {512, 2, 0},  {1000, 3, 0}};
  ASSERT_TRUE(table.ArenaSizesWith(tensors).ok());
  table.Append(tensors);
  const std::vector<uint64_t> params = {0,    1000, 2000, 3072, 4072, 4096,
                                        6144, 6152, 6168, 6400, 7400, 7936};
  for (uint32_t t = 0; t < table.size(); ++t) {
    EXPECT_EQ(table.param_offset(t), params[t]) << t;
    if (t != 11) {
      EXPECT_EQ(table.state_offset(t), params[t]) << t;  // fp32 state, like params.
    }
  }
  EXPECT_EQ(table.state_offset(11), 0u);  // The first in the bf16 state arena.
  // The canonical layout is unchanged: every tensor after the last, at multiples of 8.
  EXPECT_EQ(table.offset(3), 3000u);
  EXPECT_EQ(table.offset(9), 3000u + 1000 + 8 + 2048 + 8 + 16 + 8);

  const std::vector<TensorPack> packs = {{0, 3}, {3, 2}, {6, 2}, {9, 2}};
  EXPECT_EQ(table.Packs(), packs);
  // A step of tensor 1 alone splits its pack; the others' steps bring it back.
  table.AdvanceSteps(std::vector<uint32_t>{1});
  EXPECT_EQ(table.Packs(), (std::vector<TensorPack>{{3, 2}, {6, 2}, {9, 2}}));
  table.AdvanceSteps(std::vector<uint32_t>{2});
  EXPECT_EQ(table.Packs(), (std::vector<TensorPack>{{1, 2}, {3, 2}, {6, 2}, {9, 2}}));
  table.AdvanceSteps(std::vector<uint32_t>{0});
  EXPECT_EQ(table.Packs(), packs);
  table.SetStep(7, 5);
  EXPECT_EQ(table.Packs(), (std::vector<TensorPack>{{0, 3}, {3, 2}, {9, 2}}));
}

TEST(TensorTable, ALongRunIsOnePack) {
  TensorTable table;
  ASSERT_TRUE(table.SetGroup(0, AdamWHyperparameters{}).ok());
  const std::vector<NewTensor> tensors(10000, NewTensor{1000, 0, 0});
  ASSERT_TRUE(table.ArenaSizesWith(tensors).ok());
  table.Append(tensors);
  EXPECT_EQ(table.param_offset(9999), 9999u * 1000);
  EXPECT_EQ(table.sizes().params32, 10000u * 1000);
  EXPECT_EQ(table.Packs(), (std::vector<TensorPack>{{0, 10000}}));
}

}  // namespace
}  // namespace fusedps
