// work_units_test.cu (CUDA builds, part of cuda_backend_test): the host code that cuts a
// launch's chunk list into units of work (adamw_kernel.cuh), against a walk over every portion,
// and the choice of a launch's kernel.
// It needs no device. Compiled by nvcc because adamw_kernel.cuh holds a kernel launch.
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/adamw_kernel.cuh"

namespace fusedps {
namespace gpu {
namespace {

// The units of work (host code, no device needed), against a walk over every portion of every
// chunk that starts a unit whenever the last one is used up: units of plan.unit_portions until
// the head's portions are used (the last may be shorter), then a unit per portion.
TEST(WorkUnitsTest, EachUnitStartsAtItsPortion) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 60; ++trial) {
    std::vector<Chunk> chunks;
    const int tensors = 1 + static_cast<int>(rng() % 50);
    for (int t = 0; t < tensors; ++t) {
      ChunkSource source;
      source.tensor = t;
      source.numel = rng() % 4 == 0 ? rng() % 3 : rng() % 20000;  // Empty tensors too.
      AppendChunks(source, chunks);
    }
    const uint64_t portions = PortionsIn(chunks);
    UnitPlan plan;
    plan.portions = static_cast<uint32_t>(portions);
    plan.unit_portions = trial % 3 == 0 ? kUnitPortions : 1 + rng() % 40;
    plan.tail = trial % 2 == 0 ? 0 : static_cast<uint32_t>(rng() % (portions + 1));
    std::vector<UnitStart> expected;
    std::vector<uint32_t> lengths;
    uint64_t index = 0, left = 0;  // left: portions of the current unit not yet walked.
    for (uint32_t c = 0; c < chunks.size(); ++c) {
      for (uint32_t p = 0; p < PortionsOf(chunks[c].count); ++p, ++index) {
        if (left == 0) {
          const uint64_t head_left = portions - plan.tail - std::min(index, portions - plan.tail);
          left = head_left > 0 ? std::min<uint64_t>(plan.unit_portions, head_left) : 1;
          expected.push_back(c << kUnitChunkShift | p);
          lengths.push_back(static_cast<uint32_t>(left));
        }
        --left;
      }
    }
    ASSERT_EQ(index, portions);
    ASSERT_EQ(plan.units(), expected.size());
    EXPECT_EQ(WorkUnits(chunks, plan), expected)
        << plan.unit_portions << " portions a unit, a tail of " << plan.tail;
    for (uint32_t u = 0; u < plan.units(); ++u) {
      EXPECT_EQ(plan.length(u), lengths[u]) << "unit " << u;
    }
  }
}

// A launch's plan: units of kUnitPortions (kInt8UnitPortions in the int8-state kernel) and a
// tail of kTailUnitsPerWarp single portions per warp (all of a launch smaller than that); in the
// any-storage kernel with int8 state, one unit per warp and no tail. Every plan covers every
// portion, in order, and fits the unit table (MostUnits).
TEST(WorkUnitsTest, PlansCoverEveryPortion) {
  for (const uint64_t portions : {1ull, 7ull, 2112ull, 2113ull, 40000ull, 485000ull}) {
    for (const int grid : {1, 264}) {
      const uint32_t warps = ApplyBlocks(grid, portions) * kWarpsPerBlock;  // As launched.
      for (const LaunchStorage storage :
           {LaunchStorage{ApplyKinds::kFloat32Only, false}, LaunchStorage{ApplyKinds::kAny, false},
            LaunchStorage{ApplyKinds::kInt8State, true}, LaunchStorage{ApplyKinds::kAny, true}}) {
        SCOPED_TRACE(testing::Message() << "kinds " << static_cast<int>(storage.kinds)
                                        << (storage.int8_state ? ", int8 state" : ""));
        const UnitPlan plan = PlanUnits(portions, warps, storage);
        EXPECT_EQ(plan.portions, portions);
        if (storage.kinds == ApplyKinds::kAny && storage.int8_state) {
          EXPECT_EQ(plan.tail, 0u);
          EXPECT_LE(plan.units(), warps);
          EXPECT_GE(static_cast<uint64_t>(plan.unit_portions) * warps, portions);
        } else {
          EXPECT_EQ(plan.unit_portions,
                    storage.kinds == ApplyKinds::kInt8State ? kInt8UnitPortions : kUnitPortions);
          EXPECT_EQ(plan.tail, std::min<uint64_t>(portions, kTailUnitsPerWarp * warps));
        }
        uint64_t covered = 0;
        for (uint32_t u = 0; u < plan.units(); ++u) {
          EXPECT_EQ(plan.first(u), covered) << "unit " << u;
          covered += plan.length(u);
        }
        EXPECT_EQ(covered, portions);
        EXPECT_LE(plan.units(), MostUnits(portions, grid));
      }
    }
  }
}

// A launch's kernel holds only the storage paths its chunks need: fp32 only, fp32 params with
// fp32 or int8 state, or any; a chunk never narrows what the others already need.
TEST(ApplyKindsTest, WithLayoutTakesTheNarrowestKernelThatHoldsEveryChunk) {
  const auto layout = [](ParamsDType params, StateDType state) {
    TensorLayout l;
    l.params = params;
    l.state = state;
    return l;
  };
  const TensorLayout fp32 = layout(ParamsDType::kFloat32, StateDType::kFloat32);
  const TensorLayout int8 = layout(ParamsDType::kFloat32, StateDType::kInt8);
  const TensorLayout bf16_state = layout(ParamsDType::kFloat32, StateDType::kBFloat16);
  const TensorLayout bf16_params = layout(ParamsDType::kBFloat16, StateDType::kFloat32);
  const TensorLayout bf16_params_int8 = layout(ParamsDType::kBFloat16, StateDType::kInt8);
  const ApplyKinds none = ApplyKinds::kFloat32Only;
  EXPECT_EQ(WithLayout(none, fp32), ApplyKinds::kFloat32Only);
  EXPECT_EQ(WithLayout(none, int8), ApplyKinds::kInt8State);
  EXPECT_EQ(WithLayout(none, bf16_state), ApplyKinds::kAny);
  EXPECT_EQ(WithLayout(none, bf16_params), ApplyKinds::kAny);
  EXPECT_EQ(WithLayout(none, bf16_params_int8), ApplyKinds::kAny);
  EXPECT_EQ(WithLayout(WithLayout(none, int8), fp32), ApplyKinds::kInt8State);
  EXPECT_EQ(WithLayout(WithLayout(none, int8), bf16_state), ApplyKinds::kAny);
  EXPECT_EQ(WithLayout(WithLayout(none, bf16_state), int8), ApplyKinds::kAny);
  EXPECT_EQ(WithLayout(WithLayout(none, bf16_params), fp32), ApplyKinds::kAny);
  // LaunchStorage adds up the same kinds, and remembers int8 state in any chunk.
  LaunchStorage storage;
  storage.Add(fp32);
  EXPECT_EQ(storage.kinds, ApplyKinds::kFloat32Only);
  EXPECT_FALSE(storage.int8_state);
  storage.Add(bf16_params);
  EXPECT_EQ(storage.kinds, ApplyKinds::kAny);
  EXPECT_FALSE(storage.int8_state);
  storage.Add(bf16_params_int8);
  EXPECT_EQ(storage.kinds, ApplyKinds::kAny);
  EXPECT_TRUE(storage.int8_state);
}

// Which launches run a block per chunk: only fp32 storage without amsgrad can; kAuto takes the
// large, well-filled ones; kPersistent and kChunkBlocks force the choice where it can be made.
TEST(WorkUnitsTest, RunsChunkBlocksOnlyWhereItCanAndPays) {
  const uint32_t big = kChunkBlocksMinChunks;
  const uint64_t full = static_cast<uint64_t>(kPortions) * big;  // Every portion holds elements.
  ApplyConfig fp32;
  EXPECT_TRUE(RunsChunkBlocks(fp32, big, full));
  EXPECT_TRUE(RunsChunkBlocks(fp32, big, full * 7 / 8));
  EXPECT_FALSE(RunsChunkBlocks(fp32, big, full * 7 / 8 - 1));      // Too many empty portions.
  EXPECT_FALSE(RunsChunkBlocks(fp32, big - 1, full - kPortions));  // Too small.
  ApplyConfig amsgrad = fp32;
  amsgrad.amsgrad = true;
  EXPECT_FALSE(RunsChunkBlocks(amsgrad, big, full));
  for (ApplyKinds kinds : {ApplyKinds::kInt8State, ApplyKinds::kAny}) {
    ApplyConfig other = fp32;
    other.kinds = kinds;
    EXPECT_FALSE(RunsChunkBlocks(other, big, full));
    other.kernel = StepKernel::kChunkBlocks;  // Cannot: the storage is not fp32.
    EXPECT_FALSE(RunsChunkBlocks(other, big, full));
  }
  ApplyConfig forced = fp32;
  forced.kernel = StepKernel::kChunkBlocks;
  EXPECT_TRUE(RunsChunkBlocks(forced, 1, 1));
  forced.amsgrad = true;  // Cannot: the kernel has no amsgrad path.
  EXPECT_FALSE(RunsChunkBlocks(forced, 1, 1));
  ApplyConfig persistent = fp32;
  persistent.kernel = StepKernel::kPersistent;
  EXPECT_FALSE(RunsChunkBlocks(persistent, big, full));
}

}  // namespace
}  // namespace gpu
}  // namespace fusedps
