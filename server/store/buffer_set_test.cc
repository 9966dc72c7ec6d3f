#include "server/store/buffer_set.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace fusedps {
namespace {

using safetensors::DType;

BufferValue Buffer(std::string name, DType dtype, std::vector<int64_t> shape, size_t bytes,
                   char fill = 1) {
  return {std::move(name), dtype, std::move(shape), std::string(bytes, fill)};
}

TEST(BufferSetTest, MergeReplacesByNameAndKeepsTheOthers) {
  std::vector<BufferValue> first;
  first.push_back(Buffer("bn.running_mean", DType::kF32, {3}, 12));
  first.push_back(Buffer("bn.num_batches_tracked", DType::kI64, {}, 8));
  absl::StatusOr<std::shared_ptr<const BufferSet>> a = BufferSet::Empty()->Merged(first);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->size(), 2u);
  EXPECT_EQ((*a)->bytes(), 20u);

  std::vector<BufferValue> second;
  second.push_back(Buffer("bn.running_mean", DType::kF64, {2}, 16, 7));  // Another dtype.
  absl::StatusOr<std::shared_ptr<const BufferSet>> b = (*a)->Merged(second);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->size(), 2u);
  EXPECT_EQ((*b)->bytes(), 24u);
  const BufferValue* mean = (*b)->Find("bn.running_mean");
  ASSERT_NE(mean, nullptr);
  EXPECT_EQ(mean->dtype, DType::kF64);
  EXPECT_EQ(mean->data, std::string(16, 7));
  ASSERT_NE((*b)->Find("bn.num_batches_tracked"), nullptr);
  // The first set is unchanged (sets are immutable).
  EXPECT_EQ((*a)->Find("bn.running_mean")->dtype, DType::kF32);
  EXPECT_EQ((*a)->bytes(), 20u);
}

TEST(BufferSetTest, BadWritesAreRefusedNamingTheBuffer) {
  const auto refused = [](std::vector<BufferValue> writes, const std::string& says) {
    absl::StatusOr<std::shared_ptr<const BufferSet>> r =
        BufferSet::Empty()->Merged(std::move(writes));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status();
  };
  refused({}, "none given");
  refused({Buffer("", DType::kF32, {}, 4)}, "buffer name");
  refused({Buffer("x", DType::kF32, {2}, 4)}, "'x': data has 4 bytes; shape [2] of F32 needs 8");
  refused({Buffer("x", DType::kF32, {-1}, 0)}, "dimension < 0");
  refused({Buffer("x", DType::kU8, {1}, 1), Buffer("x", DType::kU8, {1}, 1)}, "written twice");
  std::vector<BufferValue> many;
  for (size_t i = 0; i <= kMaxBuffers; ++i) {
    many.push_back(Buffer("b" + std::to_string(i), DType::kU8, {}, 1));
  }
  refused(std::move(many), "at most 4096");
  const uint64_t half = kMaxBufferSetBytes / 2 + 1;
  refused({Buffer("a", DType::kU8, {static_cast<int64_t>(half)}, half),
           Buffer("b", DType::kU8, {static_cast<int64_t>(half)}, half)},
          "at most 268435456 bytes");
}

}  // namespace
}  // namespace fusedps
