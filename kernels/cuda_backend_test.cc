// GPU tests of the CUDA backend against the CPU backend and a float64 reference: the update for
// every option, skipped steps, staged grads, launch counts, device memory, and the device that
// calls from any thread act on. They skip cleanly on machines without a CUDA device (CI), and
// run on the GPU machine. Queued work (markers, reads, snapshots, registration) is tested in
// cuda_backend_queue_test.cc.
//
// Each test draws its random inputs from a fixed seed. The gradient staging between tensors is
// poisoned with NaN (a kernel that read padding would skip the step), and every param changes on
// every step, so an element the kernel failed to write shows up as a mismatch.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend_accumulate_test.h"
#include "kernels/backend_write_test.h"
#include "kernels/cuda_backend_test_util.h"
#ifdef FUSEDPS_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cupti_kernel_counter.h"
#endif

namespace fusedps {
namespace cuda_test {
namespace {

class CudaBackendTest : public NeedsCuda<::testing::TestWithParam<int>> {};

// Three steps of case c over tensor_count tensors on both backends (the second a compact list
// of every other tensor, in reverse), then every stored byte compared, and the params against
// the float64 reference.
void CheckCase(const Case& c, int tensor_count, std::mt19937& rng) {
  SCOPED_TRACE(c.name);
  Shard shard = MakeShard(c, tensor_count, rng);
  for (int step = 1; step <= 3; ++step) {
    // Step 2 pushes every other tensor in reverse order (a compact chunk list).
    std::vector<uint32_t> tensors;
    if (step == 2) {
      for (int t = tensor_count - 1; t >= 0; t -= 2) tensors.push_back(t);
    } else {
      tensors = AllTensors(tensor_count);
    }
    const Staged staged = Stage(shard, tensors, c.grad_dtype, c.grad_scale, rng);
    auto on_cpu = StepNow(*shard.cpu, staged.Request());
    auto on_cuda = StepNow(*shard.cuda, staged.Request());
    ASSERT_TRUE(on_cpu.ok() && on_cuda.ok()) << on_cuda.status();
    ASSERT_FALSE(on_cuda->skipped);
    ASSERT_EQ(on_cuda->tensors_updated, tensors.size());
    StepReference(c, staged, *shard.cpu, shard);
  }
  for (int t = 0; t < tensor_count; ++t) ExpectSameState(c, shard, t);
}

// Each case with each step kernel: the persistent grid, and a block per chunk (which applies
// only launches of fp32 storage without amsgrad; the others run the persistent grid again). Each
// kernel's pass draws the same sizes, params and grads.
TEST_P(CudaBackendTest, MatchesCpuBackendAndFloat64ForEveryOption) {
  const int tensor_count = GetParam();
  for (StepKernel kernel : {StepKernel::kPersistent, StepKernel::kChunkBlocks}) {
    std::mt19937 rng(1000 + tensor_count);
    for (Case c : Cases()) {
      c.step_kernel = kernel;
      c.name += kernel == StepKernel::kPersistent ? " (persistent)" : " (chunk blocks)";
      CheckCase(c, tensor_count, rng);
    }
  }
}

TEST_P(CudaBackendTest, NonFiniteGradLeavesEverythingBitIdentical) {
  const int tensor_count = GetParam();
  std::mt19937 rng(2000 + tensor_count);
  Case c = Cases()[3];  // amsgrad, weight decay.
  c.copy = ParamCopyDType::kBFloat16;
  Shard shard = MakeShard(c, tensor_count, rng);
  const std::vector<uint32_t> all = AllTensors(tensor_count);
  Staged good = Stage(shard, all, GradDType::kFloat32, 0, rng);
  ASSERT_FALSE(StepNow(*shard.cuda, good.Request())->skipped);
  auto snapshot = [&] {
    std::vector<std::vector<float>> s;
    for (int t = 0; t < tensor_count; ++t) {
      for (TensorField f : {TensorField::kParam, TensorField::kExpAvg, TensorField::kExpAvgSq,
                            TensorField::kMaxExpAvgSq}) {
        s.push_back(ReadAll(*shard.cuda, f, t));
      }
      const std::vector<uint16_t> copy = ReadCopy(*shard.cuda, t);
      s.emplace_back(copy.size());
      std::memcpy(s.back().data(), copy.data(), copy.size() * 2);
      s.push_back({static_cast<float>(shard.cuda->step(t))});
    }
    return s;
  };
  const auto before = snapshot();
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    Staged poisoned = Stage(shard, all, GradDType::kFloat32, 0, rng);
    const uint32_t victim = tensor_count - 1;
    poisoned.f32[poisoned.offsets[victim] + shard.sizes[victim] - 1] = bad;
    auto outcome = shard.cuda->Step(poisoned.Request());
    ASSERT_TRUE(outcome.ok());
    EXPECT_TRUE(outcome->skipped);
    EXPECT_EQ(outcome->marker, 0u);  // Nothing queued.
    const auto after = snapshot();
    ASSERT_EQ(before.size(), after.size());
    for (size_t k = 0; k < before.size(); ++k) {
      ASSERT_EQ(before[k].size(), after[k].size());
      ASSERT_EQ(0, std::memcmp(before[k].data(), after[k].data(), before[k].size() * 4)) << k;
    }
  }
  // The device step counters were untouched too: the next good step uses step 2.
  Staged next = Stage(shard, all, GradDType::kFloat32, 0, rng);
  ASSERT_TRUE(StepNow(*shard.cpu, good.Request()).ok());
  ASSERT_TRUE(StepNow(*shard.cpu, next.Request()).ok());
  ASSERT_FALSE(StepNow(*shard.cuda, next.Request())->skipped);
  for (int t = 0; t < tensor_count; ++t) {
    const auto a = ReadAll(*shard.cuda, TensorField::kParam, t);
    const auto b = ReadAll(*shard.cpu, TensorField::kParam, t);
    for (size_t i = 0; i < a.size(); ++i) ASSERT_TRUE(NearTorch(a[i], b[i], 1e-5, 1e-6)) << t;
  }
}

// Grads staged tensor by tensor into the device staging (which grows many times), then a step
// that reads them there.
TEST_P(CudaBackendTest, GradsStagedTensorByTensorMatchHostGrads) {
  const int tensor_count = GetParam();
  std::mt19937 rng(5000 + tensor_count);
  const Case c = Cases()[6];  // bf16 grads, bf16 copy.
  Shard shard = MakeShard(c, tensor_count, rng);
  const std::vector<uint32_t> all = AllTensors(tensor_count);
  for (int step = 1; step <= 2; ++step) {
    const Staged staged = Stage(shard, all, c.grad_dtype, 0, rng);
    for (int t = 0; t < tensor_count; ++t) {
      ASSERT_TRUE(shard.cuda
                      ->StageGrads(staged.offsets[t] * 2, staged.half.data() + staged.offsets[t],
                                   shard.sizes[t], c.grad_dtype, 0)
                      .ok());
    }
    ASSERT_NO_FATAL_FAILURE(
        StepBoth(c, staged, shard, {staged.tensors, staged.offsets, nullptr, c.grad_dtype, 0}));
  }
  for (int t = 0; t < tensor_count; ++t) ExpectSameState(c, shard, t);
  // A non-finite value staged for one tensor skips the next step whole.
  const Staged bad = Stage(shard, all, c.grad_dtype, 0, rng);
  std::vector<uint16_t> poisoned(bad.half.begin(), bad.half.end());
  const int victim = tensor_count - 1;
  if (shard.sizes[victim] == 0) return;
  poisoned[bad.offsets[victim]] = 0x7f80;  // +inf in bf16.
  for (int t = 0; t < tensor_count; ++t) {
    ASSERT_TRUE(shard.cuda
                    ->StageGrads(bad.offsets[t] * 2, poisoned.data() + bad.offsets[t],
                                 shard.sizes[t], c.grad_dtype, 0)
                    .ok());
  }
  auto skipped = shard.cuda->Step({bad.tensors, bad.offsets, nullptr, c.grad_dtype, 0});
  ASSERT_TRUE(skipped.ok());
  EXPECT_TRUE(skipped->skipped);
  EXPECT_EQ(shard.cuda->step(0), 2);
}

TEST_P(CudaBackendTest, OneLaunchPerStepWhateverTheTensorCount) {
  const int tensor_count = GetParam();
  std::mt19937 rng(3000 + tensor_count);
  Shard shard = MakeShard(Cases()[0], tensor_count, rng);
  const Staged staged = Stage(shard, AllTensors(tensor_count), GradDType::kFloat32, 0, rng);
  const uint64_t before = shard.cuda->launches_total();
  ASSERT_TRUE(StepNow(*shard.cuda, staged.Request()).ok());
  EXPECT_EQ(shard.cuda->launches_total() - before, 1u);
}

#ifdef FUSEDPS_HAVE_CUDA
TEST_P(CudaBackendTest, LaunchCounterAgreesWithCupti) {
  const int tensor_count = GetParam();
  std::mt19937 rng(4000 + tensor_count);
  Shard shard = MakeShard(Cases()[0], tensor_count, rng);
  std::vector<uint32_t> half;
  for (int t = 0; t < tensor_count; t += 2) half.push_back(t);
  const Staged full = Stage(shard, AllTensors(tensor_count), GradDType::kFloat32, 0, rng);
  const Staged partial = Stage(shard, half, GradDType::kBFloat16, 0, rng);
  CuptiKernelCounter cupti;
  ASSERT_TRUE(cupti.Start().ok());
  const uint64_t before = shard.cuda->launches_total();
  constexpr int kPushes = 5;
  std::vector<Marker> markers;  // All queued before any is waited for.
  for (int i = 0; i < kPushes; ++i) {
    for (const Staged* push : {&full, &partial}) {
      auto outcome = shard.cuda->Step(push->Request());
      ASSERT_TRUE(outcome.ok()) << outcome.status();
      markers.push_back(outcome->marker);
    }
  }
  for (Marker m : markers) ASSERT_TRUE(shard.cuda->Wait(m).ok());
  auto kernels = cupti.Stop();
  ASSERT_TRUE(kernels.ok()) << kernels.status();
  uint64_t cupti_total = 0;
  for (const auto& [name, count] : *kernels) cupti_total += count;
  EXPECT_EQ(CuptiKernelCounter::CountMatching(*kernels, "AdamWApply"), 2u * kPushes);
  EXPECT_EQ(shard.cuda->launches_total() - before, cupti_total);
}
#endif

INSTANTIATE_TEST_SUITE_P(TensorCounts, CudaBackendTest,
                         ::testing::Values(1, 35, 36, 37, 423, 424, 425, 10000));

// The device memory the backend reports, per parameter: 12 bytes (params, exp_avg,
// exp_avg_sq) of fp32 storage, 4 more with amsgrad, 2 more for a bf16 copy, plus staging in the
// wire dtype; 8 with bf16 state; 6 + 8/256 with int8 state (codes and a scale per 256-element
// block of each state), 2 less with bf16 params.
TEST(CudaBackendMemoryTest, DeviceBytesPerParameter) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  // Multiples of 256: no padding in the arenas; large enough that the fixed tables (the int8
  // codebooks) are a small part of "tables", which then is mostly the chunk list (64 bytes per
  // 2048 elements) and the units of work (4 bytes per 512).
  constexpr uint64_t kNumel = 1 << 22;
  struct Config {
    bool amsgrad;
    ParamCopyDType copy;
    StateDType state;
    ParamsDType params;
    double params_and_state;  // Bytes per parameter of params, exp_avg, exp_avg_sq.
  };
  const Config configs[] = {
      {false, ParamCopyDType::kNone, StateDType::kFloat32, ParamsDType::kFloat32, 12.0},
      {true, ParamCopyDType::kNone, StateDType::kFloat32, ParamsDType::kFloat32, 12.0},
      {false, ParamCopyDType::kBFloat16, StateDType::kFloat32, ParamsDType::kFloat32, 12.0},
      {true, ParamCopyDType::kBFloat16, StateDType::kFloat32, ParamsDType::kFloat32, 12.0},
      {false, ParamCopyDType::kNone, StateDType::kBFloat16, ParamsDType::kFloat32, 8.0},
      {false, ParamCopyDType::kNone, StateDType::kInt8, ParamsDType::kFloat32, 6.0},
      {false, ParamCopyDType::kNone, StateDType::kInt8, ParamsDType::kBFloat16, 4.0},
      {false, ParamCopyDType::kNone, StateDType::kFloat32, ParamsDType::kBFloat16, 10.0}};
  for (const Config& config : configs) {
    BackendOptions options;
    options.param_copy_dtype = config.copy;
    auto cuda = MakeBackend("cuda:0", options);
    ASSERT_TRUE(cuda.ok());
    AdamWHyperparameters h;
    h.amsgrad = config.amsgrad;
    h.state_dtype = config.state;
    h.params_dtype = config.params;
    ASSERT_TRUE((*cuda)->SetParamGroup(0, h).ok());
    ASSERT_TRUE((*cuda)->AddTensors({{kNumel / 2, 0}, {kNumel / 2, 0}}).ok());
    std::vector<uint16_t> grads(kNumel, FloatToBFloat16(0.5f));
    const std::vector<uint32_t> tensors = {0, 1};
    const std::vector<uint64_t> offsets = {0, kNumel / 2};
    ASSERT_TRUE(StepNow(**cuda, {tensors, offsets, grads.data(), GradDType::kBFloat16, 0}).ok());
    std::map<std::string, uint64_t> bytes = (*cuda)->memory_bytes();
    const auto per_param = [&](const char* kind) {
      return static_cast<double>(bytes[kind]) / kNumel;
    };
    const bool int8 = config.state == StateDType::kInt8;
    EXPECT_EQ(per_param("params") + per_param("exp_avg") + per_param("exp_avg_sq"),
              config.params_and_state);
    EXPECT_EQ(per_param("state_scales"), int8 ? 8.0 / 256 : 0.0);
    EXPECT_EQ(per_param("max_exp_avg_sq"), config.amsgrad ? 4.0 : 0.0);
    EXPECT_EQ(per_param("param_copy"), config.copy == ParamCopyDType::kNone ? 0.0 : 2.0);
    EXPECT_EQ(per_param("grad_staging"), 2.0);  // bf16 on the wire.
    EXPECT_LT(per_param("tables"), 0.05);
    EXPECT_EQ(bytes["pull_snapshots"], 0u);
    double total = 0;
    for (const auto& [kind, b] : bytes) total += static_cast<double>(b) / kNumel;
    std::printf(
        "state=%s params=%s amsgrad=%d copy=%s: %.4f device bytes per parameter, %.4f without "
        "the gradient staging (tables %.4f)\n",
        StateDTypeName(config.state), ParamsDTypeName(config.params), config.amsgrad,
        config.copy == ParamCopyDType::kNone ? "none" : "bf16", total,
        total - per_param("grad_staging"), per_param("tables"));
  }
}

// Stochastic rounding is a function of (seed, tensor key, step, index): 10 steps after a
// restore of the stored fields and steps into a fresh backend give the same bits as 10 more
// steps on the original (bf16 params without an fp32 master, int8 state).
TEST(CudaBackendStateTest, StochasticRoundingReplaysAfterARestore) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  AdamWHyperparameters h;
  h.params_dtype = ParamsDType::kBFloat16;
  h.state_dtype = StateDType::kInt8;
  h.rounding_seed = 1234;
  const std::vector<uint64_t> sizes = {100000, 5000, 300};
  const auto make = [&] {
    auto b = MakeBackend("cuda:0", {});
    EXPECT_TRUE(b.ok());
    EXPECT_TRUE((*b)->SetParamGroup(0, h).ok());
    std::vector<NewTensor> specs;
    for (size_t t = 0; t < sizes.size(); ++t) specs.push_back({sizes[t], 0, 77 + t});
    EXPECT_TRUE((*b)->AddTensors(specs).ok());
    return *std::move(b);
  };
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto original = make();
  for (uint32_t t = 0; t < sizes.size(); ++t) {
    std::vector<float> v(sizes[t]);
    for (float& x : v) x = normal(rng);
    ASSERT_TRUE(original->WriteParams(t, 0, v).ok());
  }
  std::vector<Staged> pushes;
  for (int i = 0; i < 20; ++i) {
    pushes.push_back(Stage(sizes, AllTensors(3), GradDType::kBFloat16, 0, rng));
  }
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(StepNow(*original, pushes[i].Request()).ok());
  const std::vector<TensorField> fields = {TensorField::kParam, TensorField::kExpAvg,
                                           TensorField::kExpAvgSq, TensorField::kExpAvgAbsmax,
                                           TensorField::kExpAvgSqAbsmax};
  const auto stored = [&](OptimizerBackend& b) {
    std::vector<std::vector<char>> all;
    for (uint32_t t = 0; t < sizes.size(); ++t) {
      for (TensorField f : fields) all.push_back(ReadStoredBytes(b, f, t));
    }
    return all;
  };
  const std::vector<std::vector<char>> checkpoint = stored(*original);
  auto restored = make();
  size_t k = 0;
  for (uint32_t t = 0; t < sizes.size(); ++t) {
    for (TensorField f : fields) {
      const std::vector<char>& bytes = checkpoint[k++];
      if (bytes.empty()) continue;
      WriteRequest w;
      w.field = f;
      w.tensor = t;
      w.count = bytes.size() / StoredElementBytes(restored->layout(t), f);
      w.src = bytes.data();
      w.stored = true;
      ASSERT_TRUE(restored->Write(w).ok());
    }
    ASSERT_TRUE(restored->SetStep(t, original->step(t)).ok());
  }
  for (int i = 10; i < 20; ++i) {
    ASSERT_TRUE(StepNow(*original, pushes[i].Request()).ok());
    ASSERT_TRUE(StepNow(*restored, pushes[i].Request()).ok());
  }
  const auto a = stored(*original), b = stored(*restored);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "stored field " << i;
  EXPECT_NE(a, checkpoint);  // The 10 steps changed the state.
}

#ifdef FUSEDPS_HAVE_CUDA
// Runs `f` on a thread of its own, which starts with no CUDA device set (so device 0).
template <typename F>
void OnNewThread(F f) {
  std::thread thread(f);
  thread.join();
}

// Free device memory of `device`, from this thread.
int64_t FreeBytes(int device) {
  size_t free = 0, total = 0;
  EXPECT_EQ(cudaSetDevice(device), cudaSuccess);
  EXPECT_EQ(cudaMemGetInfo(&free, &total), cudaSuccess);
  return static_cast<int64_t>(free);
}

// --device=cuda:1: the backend is created on one thread and used from others, as the server
// does (registration, the engine, the completion thread, gRPC threads). The CUDA current device
// is per thread, so a backend that set its device only when created would allocate its arenas
// and launch from device 0 on those threads. Its memory must come from device 1.
TEST(CudaBackendWriteTest, RestoreWritesLandExactly) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  absl::StatusOr<std::unique_ptr<OptimizerBackend>> backend =
      MakeBackend("cuda:0", {.param_copy_dtype = ParamCopyDType::kBFloat16});
  ASSERT_TRUE(backend.ok()) << backend.status();
  ExpectRestoreWritesLandExactly(**backend);
}

TEST(CudaBackendRoundTest, RoundsAverageIntoOneStep) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  absl::StatusOr<std::unique_ptr<OptimizerBackend>> backend = MakeBackend("cuda:0", {});
  ASSERT_TRUE(backend.ok()) << backend.status();
  ExpectRoundsAverageIntoOneStep(**backend, "fusedps_grad_accumulate");
}

TEST(CudaBackendDeviceTest, CallsFromOtherThreadsUseTheBackendsDevice) {
  if (CudaDeviceCount() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  constexpr uint64_t kNumel = uint64_t{64} << 20;  // 256 MiB of fp32 params.
  constexpr int64_t kArenaBytes = 3 * 4 * kNumel;  // params, exp_avg, exp_avg_sq.
  constexpr int64_t kSlack = int64_t{64} << 20;
  // Both contexts exist before the first measurement, so that only allocations move the numbers.
  const int64_t free0 = FreeBytes(0), free1 = FreeBytes(1);

  std::unique_ptr<OptimizerBackend> cuda;
  std::unique_ptr<OptimizerBackend> cpu = MakeCpuBackend({});
  OnNewThread([&] {
    auto made = MakeBackend("cuda:1", {});
    ASSERT_TRUE(made.ok()) << made.status();
    cuda = *std::move(made);
  });
  ASSERT_NE(cuda, nullptr);
  const std::vector<NewTensor> specs = {{kNumel - 4099, 0}, {4099, 0}};
  std::mt19937 rng(6000);
  std::vector<std::vector<float>> values(2);
  for (size_t t = 0; t < 2; ++t) {
    values[t].resize(specs[t].numel);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& v : values[t]) v = normal(rng);
  }
  for (OptimizerBackend* backend : {cpu.get(), cuda.get()}) {
    OnNewThread([&] {
      ASSERT_TRUE(backend->SetParamGroup(0, {}).ok());
      ASSERT_EQ(*backend->AddTensors(specs), 0u);
    });
    OnNewThread([&] {
      for (uint32_t t = 0; t < 2; ++t) ASSERT_TRUE(backend->WriteParams(t, 0, values[t]).ok());
    });
  }
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_GE(free1 - FreeBytes(1), kArenaBytes) << "the arenas are not on device 1";
  EXPECT_LT(free0 - FreeBytes(0), kSlack) << "the backend allocated on device 0";

  const Staged staged =
      Stage({specs[0].numel, specs[1].numel}, {0, 1}, GradDType::kFloat32, 0, rng);
  ASSERT_TRUE(StepNow(*cpu, staged.Request()).ok());
  Marker marker = 0;
  OnNewThread([&] {  // The engine thread.
    auto outcome = cuda->Step(staged.Request());
    ASSERT_TRUE(outcome.ok()) << outcome.status();
    marker = outcome->marker;
  });
  OnNewThread([&] {  // The completion thread.
    auto done = cuda->Wait(marker);
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_GT(done->device_seconds, 0.0);
  });
  std::vector<std::vector<float>> got(2);
  OnNewThread([&] {  // A pull.
    for (uint32_t t = 0; t < 2; ++t) got[t] = ReadAll(*cuda, TensorField::kParam, t);
  });
  ASSERT_FALSE(HasFatalFailure());
  for (uint32_t t = 0; t < 2; ++t) {
    const std::vector<float> want = ReadAll(*cpu, TensorField::kParam, t);
    ASSERT_EQ(got[t].size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_TRUE(NearTorch(got[t][i], want[i], 1e-5, 1e-6))
          << "tensor " << t << " element " << i << ": cuda:1 " << got[t][i] << " cpu " << want[i];
    }
  }
  EXPECT_GE(free1 - FreeBytes(1), kArenaBytes + 4 * static_cast<int64_t>(kNumel));  // + grads.
  EXPECT_LT(free0 - FreeBytes(0), kSlack) << "the backend allocated on device 0";
  OnNewThread([&] { cuda.reset(); });  // Frees on device 1, from yet another thread.
  EXPECT_LT(free1 - FreeBytes(1), kSlack) << "device 1's memory was not freed";
}
#endif

}  // namespace
}  // namespace cuda_test
}  // namespace fusedps
