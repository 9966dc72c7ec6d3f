// Tests of the CPU backend: arenas, all-or-nothing steps, dtypes, reads, the param copy.
#include <sys/resource.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/adamw_reference.h"
#include "kernels/backend.h"
#include "kernels/backend_accumulate_test.h"
#include "kernels/backend_write_test.h"

namespace fusedps {
namespace {

std::vector<float> RandomVector(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

std::vector<float> ReadField(OptimizerBackend& b, TensorField field, uint32_t t) {
  std::vector<float> out(b.numel(t));
  EXPECT_TRUE(ReadTensor(b, field, t, out.data()).ok());
  return out;
}

TEST(CpuBackendTest, StepMatchesElementwiseMathForEveryTensorAndDType) {
  std::mt19937 rng(7);
  const std::vector<uint64_t> sizes = {1, 3, 7, 8, 9, 100, 32 * 1024 + 5, 70000};
  for (GradDType dtype : {GradDType::kFloat32, GradDType::kBFloat16, GradDType::kFloat16}) {
    auto backend = MakeCpuBackend({.threads = 2});
    AdamWHyperparameters h;
    h.amsgrad = true;
    h.weight_decay = 0.1;
    ASSERT_TRUE(backend->SetParamGroup(0, h).ok());
    std::vector<NewTensor> specs;
    for (uint64_t n : sizes) specs.push_back({n, 0});
    ASSERT_TRUE(backend->AddTensors(specs).ok());

    std::vector<std::vector<float>> params, m, v, vmax;
    std::vector<std::vector<ReferenceAdamW>> reference;  // float64, independent of adamw_math.h
    for (uint32_t t = 0; t < sizes.size(); ++t) {
      params.push_back(RandomVector(rng, sizes[t]));
      reference.emplace_back(sizes[t]);
      for (uint64_t i = 0; i < sizes[t]; ++i) reference[t][i].param = params[t][i];
      ASSERT_TRUE(backend->WriteParams(t, 0, params.back()).ok());
      m.emplace_back(sizes[t], 0.0f);
      v.emplace_back(sizes[t], 0.0f);
      vmax.emplace_back(sizes[t], 0.0f);
    }
    for (int step = 1; step <= 3; ++step) {
      // Stage grads for every tensor, in reverse order, at 8-aligned offsets.
      std::vector<uint32_t> tensors;
      std::vector<uint64_t> offsets;
      uint64_t total = 0;
      for (int t = static_cast<int>(sizes.size()) - 1; t >= 0; --t) {
        tensors.push_back(t);
        offsets.push_back(total);
        total += AlignedNumel(sizes[t]);
      }
      std::vector<float> grads_f32 = RandomVector(rng, total);
      std::vector<uint16_t> grads_16(total);
      for (uint64_t i = 0; i < total; ++i) {
        grads_16[i] = dtype == GradDType::kBFloat16 ? FloatToBFloat16(grads_f32[i])
                                                    : FloatToFloat16(grads_f32[i]);
      }
      const void* grads = dtype == GradDType::kFloat32 ? static_cast<const void*>(grads_f32.data())
                                                       : grads_16.data();
      StepRequest request{tensors, offsets, grads, dtype, 0.0f};
      auto outcome = backend->Step(request);
      ASSERT_TRUE(outcome.ok());
      EXPECT_FALSE(outcome->skipped);
      EXPECT_EQ(outcome->tensors_updated, sizes.size());
      const AdamWStepScalars s = MakeStepScalars(h, step, 0.0f);
      for (size_t r = 0; r < tensors.size(); ++r) {
        const uint32_t t = tensors[r];
        for (uint64_t i = 0; i < sizes[t]; ++i) {
          const float g = LoadGrad(grads, dtype, offsets[r] + i);
          AdamWUpdate(s, g, params[t][i], m[t][i], v[t][i], &vmax[t][i]);
          reference[t][i].Step(h, g, step, 0.0);
        }
      }
    }
    for (uint32_t t = 0; t < sizes.size(); ++t) {
      EXPECT_EQ(backend->step(t), 3);
      const std::vector<float> got = ReadField(*backend, TensorField::kParam, t);
      EXPECT_EQ(got, params[t]) << t;
      for (uint64_t i = 0; i < sizes[t]; ++i) {
        ASSERT_TRUE(NearTorch(got[i], reference[t][i].param))
            << "tensor " << t << " element " << i << ": " << got[i] << " vs float64 "
            << reference[t][i].param;
      }
      EXPECT_EQ(ReadField(*backend, TensorField::kExpAvg, t), m[t]) << t;
      EXPECT_EQ(ReadField(*backend, TensorField::kExpAvgSq, t), v[t]) << t;
      EXPECT_EQ(ReadField(*backend, TensorField::kMaxExpAvgSq, t), vmax[t]) << t;
    }
  }
}

TEST(CpuBackendTest, NonFiniteGradSkipsWholeStepBitIdentical) {
  std::mt19937 rng(8);
  auto backend = MakeCpuBackend({});
  ASSERT_TRUE(backend->SetParamGroup(0, {}).ok());
  ASSERT_TRUE(backend->AddTensors({{100, 0}, {50000, 0}}).ok());
  ASSERT_TRUE(backend->WriteParams(0, 0, RandomVector(rng, 100)).ok());
  ASSERT_TRUE(backend->WriteParams(1, 0, RandomVector(rng, 50000)).ok());
  const std::vector<uint32_t> tensors = {0, 1};
  const std::vector<uint64_t> offsets = {0, AlignedNumel(100)};
  std::vector<float> grads = RandomVector(rng, AlignedNumel(100) + 50000);
  ASSERT_FALSE(backend->Step({tensors, offsets, grads.data(), GradDType::kFloat32, 0})->skipped);
  const auto before0 = ReadField(*backend, TensorField::kParam, 0);
  const auto before1 = ReadField(*backend, TensorField::kExpAvgSq, 1);
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    std::vector<float> poisoned = RandomVector(rng, grads.size());
    poisoned[AlignedNumel(100) + 49999] = bad;  // Last element of the second tensor.
    auto outcome = backend->Step({tensors, offsets, poisoned.data(), GradDType::kFloat32, 0});
    ASSERT_TRUE(outcome.ok());
    EXPECT_TRUE(outcome->skipped);
    EXPECT_EQ(outcome->tensors_updated, 0u);
    EXPECT_EQ(backend->step(0), 1);
    EXPECT_EQ(backend->step(1), 1);
    const auto after0 = ReadField(*backend, TensorField::kParam, 0);
    const auto after1 = ReadField(*backend, TensorField::kExpAvgSq, 1);
    EXPECT_EQ(0, memcmp(before0.data(), after0.data(), after0.size() * 4));
    EXPECT_EQ(0, memcmp(before1.data(), after1.data(), after1.size() * 4));
  }
}

TEST(CpuBackendTest, Bfloat16CopyFollowsParamsAndServesBf16Reads) {
  std::mt19937 rng(9);
  auto backend = MakeCpuBackend({.param_copy_dtype = ParamCopyDType::kBFloat16});
  ASSERT_TRUE(backend->SetParamGroup(0, {}).ok());
  ASSERT_TRUE(backend->AddTensors({{1000, 0}}).ok());
  ASSERT_TRUE(backend->WriteParams(0, 0, RandomVector(rng, 1000)).ok());
  const std::vector<uint32_t> tensors = {0};
  const std::vector<uint64_t> offsets = {0};
  std::vector<float> grads = RandomVector(rng, 1000);
  ASSERT_TRUE(backend->Step({tensors, offsets, grads.data(), GradDType::kFloat32, 0}).ok());
  const auto params = ReadField(*backend, TensorField::kParam, 0);
  std::vector<uint16_t> copy(1000);
  ASSERT_TRUE(ReadParamCopy(*backend, 0, copy.data()).ok());
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(copy[i], FloatToBFloat16(params[i])) << i;
}

TEST(CpuBackendTest, MaxExpAvgSqNeedsAmsgrad) {
  auto backend = MakeCpuBackend({});
  ASSERT_TRUE(backend->SetParamGroup(0, {}).ok());
  ASSERT_TRUE(backend->AddTensors({{4, 0}}).ok());
  float out[4];
  EXPECT_EQ(ReadTensor(*backend, TensorField::kMaxExpAvgSq, 0, out).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(backend->AddTensors({{4, 3}}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend->tensor_count(), 1u);
}

// A group switched to amsgrad needs max_exp_avg_sq for every parameter. When that memory cannot
// be had, SetParamGroup must fail and change nothing; it used to commit the group first, and
// the next step wrote max_exp_avg_sq through an empty vector. Run in a child process (the
// death-test machinery) under an address-space limit just above what the backend holds. Not
// under the sanitizers: they reserve address space, so an RLIMIT_AS cannot bound the backend.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define FUSEDPS_NO_RLIMIT_AS 1
#else
void AmsgradSwitchWithoutMemory() {
  auto backend = MakeCpuBackend({.threads = 1});
  if (!backend->SetParamGroup(0, {}).ok()) std::exit(10);
  constexpr uint64_t kLarge = uint64_t{64} << 20;  // 256 MiB per field.
  if (!backend->AddTensors({{kLarge, 0}, {1000, 0}}).ok()) std::exit(11);
  unsigned long pages = 0;
  FILE* statm = std::fopen("/proc/self/statm", "r");
  if (statm == nullptr || std::fscanf(statm, "%lu", &pages) != 1) std::exit(12);
  std::fclose(statm);
  const rlim_t limit = pages * 4096 + (rlim_t{64} << 20);  // max_exp_avg_sq needs 256 MiB.
  const rlimit rl = {limit, limit};
  if (setrlimit(RLIMIT_AS, &rl) != 0) std::exit(13);
  AdamWHyperparameters amsgrad;
  amsgrad.amsgrad = true;
  const absl::Status set = backend->SetParamGroup(0, amsgrad);
  if (set.code() != absl::StatusCode::kResourceExhausted) std::exit(14);
  const std::vector<uint32_t> tensors = {1};
  const std::vector<uint64_t> offsets = {0};
  const std::vector<float> grads(1000, 0.5f);
  absl::StatusOr<StepOutcome> step =
      backend->Step({tensors, offsets, grads.data(), GradDType::kFloat32, 0});
  if (!step.ok() || !backend->Wait(step->marker).ok()) std::exit(15);
  std::exit(0);
}
#endif

TEST(CpuBackendTest, AnAmsgradSwitchWithoutMemoryChangesNothing) {
#ifdef FUSEDPS_NO_RLIMIT_AS
  GTEST_SKIP() << "sanitizers reserve address space: an RLIMIT_AS cannot bound the backend";
#else
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // A fresh process: no OpenMP threads.
  EXPECT_EXIT(AmsgradSwitchWithoutMemory(), ::testing::ExitedWithCode(0), "");
#endif
}

TEST(CpuBackendTest, AddTensorsReturnsTheFirstIndexAndTruncateUndoesIt) {
  std::mt19937 rng(10);
  auto backend = MakeCpuBackend({});
  ASSERT_TRUE(backend->SetParamGroup(0, {}).ok());
  EXPECT_EQ(*backend->AddTensors({{10, 0}, {20, 0}}), 0u);
  ASSERT_TRUE(backend->WriteParams(1, 0, RandomVector(rng, 20)).ok());
  EXPECT_EQ(*backend->AddTensors({{30, 0}}), 2u);
  ASSERT_TRUE(backend->WriteParams(2, 0, RandomVector(rng, 30)).ok());
  const std::vector<float> kept = ReadField(*backend, TensorField::kParam, 1);
  ASSERT_TRUE(backend->TruncateTensors(2).ok());
  EXPECT_EQ(backend->tensor_count(), 2u);
  EXPECT_EQ(ReadField(*backend, TensorField::kParam, 1), kept);
  // A tensor added where the removed one was starts from zero, like any new tensor.
  EXPECT_EQ(*backend->AddTensors({{30, 0}}), 2u);
  EXPECT_EQ(ReadField(*backend, TensorField::kParam, 2), std::vector<float>(30, 0.0f));
  EXPECT_FALSE(backend->TruncateTensors(4).ok());
}

TEST(CpuBackendTest, RestoreWritesLandExactly) {
  auto backend = MakeCpuBackend({.param_copy_dtype = ParamCopyDType::kBFloat16});
  ExpectRestoreWritesLandExactly(*backend);
}

TEST(CpuBackendTest, RoundsAverageIntoOneStep) {
  auto backend = MakeCpuBackend({.threads = 3});
  ExpectRoundsAverageIntoOneStep(*backend, "cpu_grad_accumulate");
}

TEST(CpuBackendTest, SnapshotHoldsTheValuesOfItsReadWhileStepsGoOn) {
  std::mt19937 rng(11);
  auto backend = MakeCpuBackend({});
  ASSERT_TRUE(backend->SetParamGroup(0, {}).ok());
  ASSERT_TRUE(backend->AddTensors({{100, 0}, {9, 0}}).ok());
  ASSERT_TRUE(backend->WriteParams(0, 0, RandomVector(rng, 100)).ok());
  ASSERT_TRUE(backend->WriteParams(1, 0, RandomVector(rng, 9)).ok());
  const std::vector<float> p0 = ReadField(*backend, TensorField::kParam, 0);
  const std::vector<float> p1 = ReadField(*backend, TensorField::kParam, 1);
  absl::StatusOr<void*> snapshot = backend->AllocateSnapshot(4 * (104 + 9));
  ASSERT_TRUE(snapshot.ok());
  const std::vector<uint32_t> tensors = {1, 0};
  const std::vector<uint64_t> offsets = {0, 4 * 16};
  ReadRequest read;
  read.tensors = tensors;
  read.dst_offsets = offsets;
  read.dst = *snapshot;
  read.dst_is_snapshot = true;
  ASSERT_TRUE(ReadNow(*backend, read).ok());
  std::vector<float> grads = RandomVector(rng, 104 + 16);
  const std::vector<uint64_t> grad_offsets = {0, 104};
  const std::vector<uint32_t> all = {0, 1};
  ASSERT_FALSE(backend->Step({all, grad_offsets, grads.data(), GradDType::kFloat32, 0})->skipped);
  std::vector<float> got0(100), got1(9);
  ASSERT_TRUE(backend->CopyFromSnapshot(*snapshot, 4 * 16, 400, got0.data()).ok());
  ASSERT_TRUE(backend->CopyFromSnapshot(*snapshot, 0, 36, got1.data()).ok());
  EXPECT_EQ(got0, p0);
  EXPECT_EQ(got1, p1);
  EXPECT_NE(ReadField(*backend, TensorField::kParam, 0), p0);
  EXPECT_EQ(backend->memory_bytes().at("pull_snapshots"), 4u * (104 + 9));
  ASSERT_TRUE(backend->FreeSnapshot(*snapshot).ok());
  EXPECT_EQ(backend->memory_bytes().at("pull_snapshots"), 0u);
}

}  // namespace
}  // namespace fusedps
