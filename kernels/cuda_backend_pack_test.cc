// GPU tests of packs (kernels/cuda/full_push_list.cuh): runs of small fp32 tensors with one
// step, stepped by the kernel as one tensor. Against the CPU backend bit for bit, and the float64
// reference, through everything that splits or re-forms packs: partial pushes of some members,
// partial pushes that bring the steps back together, restored steps, and registration of new
// tensors (at step 0) beside stepped ones. A pack whose members' steps the kernel did not
// advance, or whose step were not its members', shows up as a mismatch at the next step that
// reads them.
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda_backend_test_util.h"
#include "kernels/tensor_table.h"

namespace fusedps {
namespace cuda_test {
namespace {

class CudaPackTest : public NeedsCuda<> {};

// Mostly Packable sizes (whole 8-element runs under 2048), some that end a run.
std::vector<uint64_t> PackSizes(int count, std::mt19937& rng) {
  const uint64_t packable[] = {8, 16, 24, 256, 1000, 1024, 2040};
  const uint64_t others[] = {5, 2048, 5000};
  std::vector<uint64_t> sizes(count);
  for (uint64_t& n : sizes) {
    n = rng() % 8 == 0 ? others[rng() % std::size(others)] : packable[rng() % std::size(packable)];
  }
  return sizes;
}

// The packs a table of these sizes and steps forms (the backends' tables are not visible).
std::vector<TensorPack> PacksOf(const Case& c, const std::vector<uint64_t>& sizes,
                                const OptimizerBackend& backend) {
  TensorTable table;
  for (uint32_t g = 0; g < c.groups.size(); ++g) EXPECT_TRUE(table.SetGroup(g, c.groups[g]).ok());
  for (uint32_t t = 0; t < sizes.size(); ++t) {
    const NewTensor spec{sizes[t], static_cast<uint32_t>(t % c.groups.size()), 0};
    table.Append(absl::MakeConstSpan(&spec, 1));
    table.SetStep(t, backend.step(t));
  }
  return table.Packs();
}

void Push(const Case& c, Shard& shard, const std::vector<uint32_t>& tensors, std::mt19937& rng) {
  const Staged staged = Stage(shard, tensors, c.grad_dtype, c.grad_scale, rng);
  auto on_cpu = StepNow(*shard.cpu, staged.Request());
  auto on_cuda = StepNow(*shard.cuda, staged.Request());
  ASSERT_TRUE(on_cpu.ok() && on_cuda.ok()) << on_cuda.status();
  ASSERT_FALSE(on_cuda->skipped);
  StepReference(c, staged, *shard.cpu, shard);
}

void ExpectSameShard(const Case& c, Shard& shard, const char* phase) {
  SCOPED_TRACE(phase);
  for (uint32_t t = 0; t < shard.sizes.size(); ++t) ExpectSameState(c, shard, t);
}

TEST_F(CudaPackTest, PacksMatchCpuThroughSplitsRestoresAndRegistrations) {
  std::mt19937 rng(4242);
  for (const Case& c : Cases()) {
    // One group, so that neighbours may pack; int8 state keeps fp32 under 4096 elements, so its
    // small tensors pack in the int8-state kernel beside quantized ones.
    if (c.groups.size() != 1 || c.groups[0].params_dtype != ParamsDType::kFloat32 ||
        c.groups[0].state_dtype == StateDType::kBFloat16) {
      continue;
    }
    SCOPED_TRACE(c.name);
    const int count = 600;
    Shard shard = MakeShard(c, count, rng, PackSizes(count, rng));
    const std::vector<uint32_t> all = AllTensors(count);
    Push(c, shard, all, rng);
    Push(c, shard, all, rng);
    const size_t whole_packs = PacksOf(c, shard.sizes, *shard.cpu).size();
    ASSERT_GT(whole_packs, 10u) << "the sizes should form packs";
    ExpectSameShard(c, shard, "full pushes");

    // Every third of the first 300: packs split, then step as smaller ones.
    std::vector<uint32_t> some, rest;
    for (uint32_t t = 0; t < count; ++t) (t < 300 && t % 3 == 0 ? some : rest).push_back(t);
    Push(c, shard, some, rng);
    Push(c, shard, all, rng);
    ASSERT_NE(PacksOf(c, shard.sizes, *shard.cpu).size(), whole_packs);
    ExpectSameShard(c, shard, "split packs");

    // The others catch up: the packs form again.
    Push(c, shard, rest, rng);
    ASSERT_EQ(PacksOf(c, shard.sizes, *shard.cpu).size(), whole_packs);
    Push(c, shard, all, rng);
    ExpectSameShard(c, shard, "packs formed again");

    // A restore sets the steps of 100 to 149.
    for (uint32_t t = 100; t < 150; ++t) {
      ASSERT_TRUE(shard.cpu->SetStep(t, 11).ok());
      ASSERT_TRUE(shard.cuda->SetStep(t, 11).ok());
    }
    Push(c, shard, all, rng);
    ExpectSameShard(c, shard, "restored steps");

    // A restored step of a pack's second member leaves its first alone, outside any pack: it
    // reads its own step row again, which the pack's launches left behind.
    const TensorPack pack = PacksOf(c, shard.sizes, *shard.cpu).front();
    ASSERT_TRUE(shard.cpu->SetStep(pack.first + 1, 20).ok());
    ASSERT_TRUE(shard.cuda->SetStep(pack.first + 1, 20).ok());
    Push(c, shard, all, rng);
    ExpectSameShard(c, shard, "a member left alone");

    // New tensors, at step 0, right after stepped ones in the arenas.
    const std::vector<uint64_t> more(40, 1000);
    std::vector<NewTensor> specs;
    for (uint32_t i = 0; i < more.size(); ++i) specs.push_back({more[i], 0, 7u + i});
    ASSERT_EQ(*shard.cpu->AddTensors(specs), static_cast<uint32_t>(count));
    ASSERT_EQ(*shard.cuda->AddTensors(specs), static_cast<uint32_t>(count));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (uint32_t i = 0; i < more.size(); ++i) {
      std::vector<float> values(more[i]);
      shard.reference.emplace_back(values.size());
      for (uint64_t j = 0; j < values.size(); ++j) {
        values[j] = normal(rng);
        shard.reference.back()[j].param = values[j];
      }
      ASSERT_TRUE(shard.cpu->WriteParams(count + i, 0, values).ok());
      ASSERT_TRUE(shard.cuda->WriteParams(count + i, 0, values).ok());
      shard.sizes.push_back(more[i]);
    }
    const std::vector<uint32_t> grown = AllTensors(static_cast<int>(shard.sizes.size()));
    Push(c, shard, grown, rng);
    Push(c, shard, grown, rng);
    ExpectSameShard(c, shard, "registered beside stepped tensors");
  }
}

}  // namespace
}  // namespace cuda_test
}  // namespace fusedps
