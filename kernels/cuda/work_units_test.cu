// work_units_test.cu (CUDA builds, part of cuda_backend_test): the host code that cuts a
// launch's chunk list into units of work (adamw_kernel.cuh), against a walk over every portion.
// It needs no device. Compiled by nvcc because adamw_kernel.cuh holds a kernel launch.
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/adamw_kernel.cuh"

namespace fusedps {
namespace gpu {
namespace {

// The units of work (host code, no device needed): unit u starts at portion unit_portions * u of
// the list, found here by walking every portion of every chunk.
TEST(WorkUnitsTest, EachUnitStartsAtItsPortion) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<Chunk> chunks;
    const int tensors = 1 + static_cast<int>(rng() % 50);
    for (int t = 0; t < tensors; ++t) {
      ChunkSource source;
      source.tensor = t;
      source.numel = rng() % 4 == 0 ? rng() % 3 : rng() % 20000;  // Empty tensors too.
      AppendChunks(source, chunks);
    }
    const uint32_t unit_portions = trial % 2 == 0 ? kUnitPortions : 1 + rng() % 40;
    std::vector<UnitStart> expected;
    uint64_t index = 0;
    for (uint32_t c = 0; c < chunks.size(); ++c) {
      for (uint32_t p = 0; p < PortionsOf(chunks[c].count); ++p, ++index) {
        if (index % unit_portions == 0) expected.push_back(c << kUnitChunkShift | p);
      }
    }
    ASSERT_EQ(index, PortionsIn(chunks));
    EXPECT_EQ(UnitsOf(index, unit_portions), expected.size());
    EXPECT_EQ(WorkUnits(chunks, unit_portions), expected) << unit_portions << " portions a unit";
  }
}

// Where the chunks hold int8 state, one unit per warp: no more units than warps, and together
// they cover every portion.
TEST(WorkUnitsTest, Int8StateTakesOneUnitPerWarp) {
  for (const uint64_t portions : {1ull, 7ull, 2112ull, 2113ull, 485000ull}) {
    for (const uint32_t warps : {8u, 2112u}) {
      const uint32_t unit_portions = UnitPortions(portions, warps, /*int8_state=*/true);
      EXPECT_LE(UnitsOf(portions, unit_portions), warps);
      EXPECT_GE(static_cast<uint64_t>(unit_portions) * warps, portions);
      EXPECT_EQ(UnitPortions(portions, warps, /*int8_state=*/false), kUnitPortions);
    }
  }
}

}  // namespace
}  // namespace gpu
}  // namespace fusedps
