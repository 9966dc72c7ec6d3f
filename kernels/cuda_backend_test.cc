// GPU tests of the CUDA backend against the CPU backend and a float64 reference. They skip
// cleanly on machines without a CUDA device (CI), and run on the GPU machine.
//
// Every run draws fresh random inputs. The gradient staging between tensors is poisoned with
// NaN (a kernel that read padding would skip the step), and every param changes on every step,
// so an element the kernel failed to write shows up as a mismatch.
#include <cmath>
#include <cstdio>
#include <map>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/adamw_reference.h"
#include "kernels/backend_factory.h"
#ifdef FUSEDPS_HAVE_CUDA
#include "kernels/cupti_kernel_counter.h"
#endif

namespace fusedps {
namespace {

struct Case {
  std::string name;
  std::vector<AdamWHyperparameters> groups;
  GradDType grad_dtype = GradDType::kFloat32;
  ParamCopyDType copy = ParamCopyDType::kNone;
  float grad_scale = 0.0f;
};

std::vector<Case> Cases() {
  AdamWHyperparameters base;
  std::vector<Case> cases;
  cases.push_back({"defaults", {base}});
  AdamWHyperparameters h = base;
  h.lr = 0.01;
  h.weight_decay = 0.1;
  cases.push_back({"lr_weight_decay", {h}});
  h.maximize = true;
  cases.push_back({"maximize", {h}});
  h.maximize = false;
  h.amsgrad = true;
  cases.push_back({"amsgrad", {h}});
  AdamWHyperparameters l2 = base;
  l2.decoupled_weight_decay = false;
  l2.weight_decay = 0.1;
  cases.push_back({"l2", {l2}});
  cases.push_back({"grad_scale", {base}, GradDType::kFloat32, ParamCopyDType::kNone, 512.0f});
  cases.push_back({"bf16_grads_bf16_copy", {base}, GradDType::kBFloat16, ParamCopyDType::kBFloat16});
  cases.push_back({"fp16_grads_fp16_copy", {h}, GradDType::kFloat16, ParamCopyDType::kFloat16});
  AdamWHyperparameters other = base;
  other.lr = 0.05;
  other.beta1 = 0.8;
  other.beta2 = 0.99;
  other.eps = 1e-6;
  cases.push_back({"three_groups", {base, other, l2}});
  return cases;
}

struct Shard {
  std::unique_ptr<OptimizerBackend> cpu, cuda;
  std::vector<uint64_t> sizes;
  std::vector<std::vector<ReferenceAdamW>> reference;
};

std::vector<uint64_t> Sizes(int count, std::mt19937& rng) {
  // Odd sizes, tails that are not multiples of 4 or 8, chunk edges, and one empty tensor.
  const uint64_t palette[] = {1, 3, 5, 7, 8, 9, 13, 31, 100, 1000, 2047, 2048, 2049, 4099, 70001};
  std::vector<uint64_t> sizes(count);
  for (int i = 0; i < count; ++i) {
    sizes[i] = count >= 1000 ? 1 + rng() % 300 : palette[rng() % std::size(palette)];
  }
  if (count > 2) sizes[1] = 0;
  return sizes;
}

Shard MakeShard(const Case& c, int tensor_count, std::mt19937& rng) {
  Shard shard;
  BackendOptions options;
  options.param_copy_dtype = c.copy;
  shard.cpu = MakeCpuBackend(options);
  auto cuda = MakeBackend("cuda:0", options);
  EXPECT_TRUE(cuda.ok()) << cuda.status();
  shard.cuda = *std::move(cuda);
  for (uint32_t g = 0; g < c.groups.size(); ++g) {
    EXPECT_TRUE(shard.cpu->SetParamGroup(g, c.groups[g]).ok());
    EXPECT_TRUE(shard.cuda->SetParamGroup(g, c.groups[g]).ok());
  }
  shard.sizes = Sizes(tensor_count, rng);
  std::vector<NewTensor> specs;
  for (int t = 0; t < tensor_count; ++t) {
    specs.push_back({shard.sizes[t], static_cast<uint32_t>(t % c.groups.size())});
  }
  EXPECT_TRUE(shard.cpu->AddTensors(specs).ok());
  EXPECT_TRUE(shard.cuda->AddTensors(specs).ok());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int t = 0; t < tensor_count; ++t) {
    std::vector<float> values(shard.sizes[t]);
    shard.reference.emplace_back(values.size());
    for (uint64_t i = 0; i < values.size(); ++i) {
      values[i] = normal(rng);
      shard.reference[t][i].param = values[i];
    }
    EXPECT_TRUE(shard.cpu->WriteParams(t, 0, values).ok());
    EXPECT_TRUE(shard.cuda->WriteParams(t, 0, values).ok());
  }
  return shard;
}

// Staged gradients of one push: tensors in the given order, NaN in the padding.
struct Staged {
  std::vector<uint32_t> tensors;
  std::vector<uint64_t> offsets;
  std::vector<float> f32;
  std::vector<uint16_t> half;
  const void* data(GradDType d) const {
    return d == GradDType::kFloat32 ? static_cast<const void*>(f32.data()) : half.data();
  }
};

Staged Stage(const Shard& shard, const std::vector<uint32_t>& tensors, GradDType dtype,
             float scale, std::mt19937& rng) {
  Staged s;
  s.tensors = tensors;
  uint64_t total = 0;
  for (uint32_t t : tensors) {
    s.offsets.push_back(total);
    total += AlignedNumel(shard.sizes[t]);
  }
  s.f32.assign(total, NAN);
  s.half.assign(total, 0x7fc0);  // NaN in bf16 and in fp16.
  std::normal_distribution<float> normal(0.0f, scale > 0 ? scale : 1.0f);
  for (size_t r = 0; r < tensors.size(); ++r) {
    for (uint64_t i = 0; i < shard.sizes[tensors[r]]; ++i) {
      float g = normal(rng);
      if (dtype == GradDType::kBFloat16) s.half[s.offsets[r] + i] = FloatToBFloat16(g);
      if (dtype == GradDType::kFloat16) s.half[s.offsets[r] + i] = FloatToFloat16(g);
      s.f32[s.offsets[r] + i] = g;
    }
  }
  return s;
}

std::vector<float> ReadAll(const OptimizerBackend& b, TensorField f, uint32_t t) {
  std::vector<float> out(b.numel(t));
  EXPECT_TRUE(b.Read(f, t, 0, out.size(), GradDType::kFloat32, out.data()).ok());
  return out;
}

void ExpectSameState(const Case& c, Shard& shard, uint32_t t) {
  const OptimizerBackend& cpu = *shard.cpu;
  const OptimizerBackend& cuda = *shard.cuda;
  ASSERT_EQ(cpu.step(t), cuda.step(t)) << "tensor " << t;
  std::vector<TensorField> fields = {TensorField::kParam, TensorField::kExpAvg,
                                     TensorField::kExpAvgSq};
  if (c.groups[t % c.groups.size()].amsgrad) fields.push_back(TensorField::kMaxExpAvgSq);
  for (TensorField f : fields) {
    const auto a = ReadAll(cuda, f, t), b = ReadAll(cpu, f, t);
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_TRUE(NearTorch(a[i], b[i], 1e-5, 1e-6))
          << c.name << " tensor " << t << " field " << static_cast<int>(f) << " element " << i
          << ": cuda " << a[i] << " cpu " << b[i];
    }
  }
  const auto params = ReadAll(cuda, TensorField::kParam, t);
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_TRUE(NearTorch(params[i], shard.reference[t][i].param))
        << c.name << " tensor " << t << " element " << i << ": cuda " << params[i]
        << " float64 " << shard.reference[t][i].param;
  }
  if (c.copy != ParamCopyDType::kNone) {
    std::vector<uint16_t> copy(params.size());
    const GradDType d = c.copy == ParamCopyDType::kBFloat16 ? GradDType::kBFloat16
                                                            : GradDType::kFloat16;
    ASSERT_TRUE(cuda.Read(TensorField::kParam, t, 0, copy.size(), d, copy.data()).ok());
    for (size_t i = 0; i < copy.size(); ++i) {
      const uint16_t want = d == GradDType::kBFloat16 ? FloatToBFloat16(params[i])
                                                      : FloatToFloat16(params[i]);
      ASSERT_EQ(copy[i], want) << c.name << " copy of tensor " << t << " element " << i;
    }
  }
}

class CudaBackendTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(CudaBackendTest, MatchesCpuBackendAndFloat64ForEveryOption) {
  const int tensor_count = GetParam();
  std::mt19937 rng(1000 + tensor_count);
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    Shard shard = MakeShard(c, tensor_count, rng);
    std::vector<uint32_t> all(tensor_count);
    for (int t = 0; t < tensor_count; ++t) all[t] = t;
    for (int step = 1; step <= 3; ++step) {
      // Step 2 pushes every other tensor in reverse order (a compact chunk list).
      std::vector<uint32_t> tensors;
      if (step == 2) {
        for (int t = tensor_count - 1; t >= 0; t -= 2) tensors.push_back(t);
      } else {
        tensors = all;
      }
      const Staged staged = Stage(shard, tensors, c.grad_dtype, c.grad_scale, rng);
      const StepRequest request{staged.tensors, staged.offsets, staged.data(c.grad_dtype),
                                c.grad_dtype, c.grad_scale};
      auto on_cpu = shard.cpu->Step(request);
      auto on_cuda = shard.cuda->Step(request);
      ASSERT_TRUE(on_cpu.ok() && on_cuda.ok()) << on_cuda.status();
      ASSERT_FALSE(on_cuda->skipped);
      ASSERT_EQ(on_cuda->tensors_updated, tensors.size());
      for (size_t r = 0; r < tensors.size(); ++r) {
        const uint32_t t = tensors[r];
        const AdamWHyperparameters& h = c.groups[t % c.groups.size()];
        for (uint64_t i = 0; i < shard.sizes[t]; ++i) {
          const double g = LoadGrad(staged.data(c.grad_dtype), c.grad_dtype, staged.offsets[r] + i);
          shard.reference[t][i].Step(h, g, shard.cpu->step(t), c.grad_scale);
        }
      }
    }
    for (int t = 0; t < tensor_count; ++t) ExpectSameState(c, shard, t);
  }
}

TEST_P(CudaBackendTest, NonFiniteGradLeavesEverythingBitIdentical) {
  const int tensor_count = GetParam();
  std::mt19937 rng(2000 + tensor_count);
  Case c = Cases()[3];  // amsgrad, weight decay.
  c.copy = ParamCopyDType::kBFloat16;
  Shard shard = MakeShard(c, tensor_count, rng);
  std::vector<uint32_t> all(tensor_count);
  for (int t = 0; t < tensor_count; ++t) all[t] = t;
  Staged good = Stage(shard, all, GradDType::kFloat32, 0, rng);
  ASSERT_FALSE(shard.cuda->Step({good.tensors, good.offsets, good.f32.data(),
                                 GradDType::kFloat32, 0})->skipped);
  auto snapshot = [&] {
    std::vector<std::vector<float>> s;
    for (int t = 0; t < tensor_count; ++t) {
      for (TensorField f : {TensorField::kParam, TensorField::kExpAvg, TensorField::kExpAvgSq,
                            TensorField::kMaxExpAvgSq}) {
        s.push_back(ReadAll(*shard.cuda, f, t));
      }
      std::vector<uint16_t> copy(shard.sizes[t]);
      EXPECT_TRUE(shard.cuda->Read(TensorField::kParam, t, 0, copy.size(), GradDType::kBFloat16,
                                   copy.data()).ok());
      s.emplace_back(reinterpret_cast<float*>(copy.data()),
                     reinterpret_cast<float*>(copy.data()) + copy.size() / 2);
      s.push_back({static_cast<float>(shard.cuda->step(t))});
    }
    return s;
  };
  const auto before = snapshot();
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    Staged poisoned = Stage(shard, all, GradDType::kFloat32, 0, rng);
    const uint32_t victim = tensor_count - 1;
    poisoned.f32[poisoned.offsets[victim] + shard.sizes[victim] - 1] = bad;
    auto outcome = shard.cuda->Step({poisoned.tensors, poisoned.offsets, poisoned.f32.data(),
                                     GradDType::kFloat32, 0});
    ASSERT_TRUE(outcome.ok());
    EXPECT_TRUE(outcome->skipped);
    const auto after = snapshot();
    ASSERT_EQ(before.size(), after.size());
    for (size_t k = 0; k < before.size(); ++k) {
      ASSERT_EQ(before[k].size(), after[k].size());
      ASSERT_EQ(0, std::memcmp(before[k].data(), after[k].data(), before[k].size() * 4)) << k;
    }
  }
  // The device step counters were restored too: the next good step uses step 2.
  Staged next = Stage(shard, all, GradDType::kFloat32, 0, rng);
  ASSERT_TRUE(shard.cpu->Step({good.tensors, good.offsets, good.f32.data(),
                               GradDType::kFloat32, 0}).ok());
  ASSERT_TRUE(shard.cpu->Step({next.tensors, next.offsets, next.f32.data(),
                               GradDType::kFloat32, 0}).ok());
  ASSERT_FALSE(shard.cuda->Step({next.tensors, next.offsets, next.f32.data(),
                                 GradDType::kFloat32, 0})->skipped);
  for (int t = 0; t < tensor_count; ++t) {
    const auto a = ReadAll(*shard.cuda, TensorField::kParam, t);
    const auto b = ReadAll(*shard.cpu, TensorField::kParam, t);
    for (size_t i = 0; i < a.size(); ++i) ASSERT_TRUE(NearTorch(a[i], b[i], 1e-5, 1e-6)) << t;
  }
}

// The data path's way in: grads staged tensor by tensor into the device staging (which grows
// many times), then a step that reads them there.
TEST_P(CudaBackendTest, GradsStagedTensorByTensorMatchHostGrads) {
  const int tensor_count = GetParam();
  std::mt19937 rng(5000 + tensor_count);
  const Case c = Cases()[6];  // bf16 grads, bf16 copy.
  Shard shard = MakeShard(c, tensor_count, rng);
  std::vector<uint32_t> all(tensor_count);
  for (int t = 0; t < tensor_count; ++t) all[t] = t;
  for (int step = 1; step <= 2; ++step) {
    const Staged staged = Stage(shard, all, c.grad_dtype, 0, rng);
    for (int t = 0; t < tensor_count; ++t) {
      ASSERT_TRUE(shard.cuda->StageGrads(staged.offsets[t] * 2, staged.half.data() + staged.offsets[t],
                                         shard.sizes[t], c.grad_dtype, 0).ok());
    }
    auto on_cuda = shard.cuda->Step({staged.tensors, staged.offsets, nullptr, c.grad_dtype, 0});
    ASSERT_TRUE(on_cuda.ok()) << on_cuda.status();
    ASSERT_FALSE(on_cuda->skipped);
    ASSERT_TRUE(shard.cpu->Step({staged.tensors, staged.offsets, staged.half.data(), c.grad_dtype,
                                 0}).ok());
    for (int t = 0; t < tensor_count; ++t) {
      for (uint64_t i = 0; i < shard.sizes[t]; ++i) {
        const double g = LoadGrad(staged.half.data(), c.grad_dtype, staged.offsets[t] + i);
        shard.reference[t][i].Step(c.groups[0], g, step, 0);
      }
    }
  }
  for (int t = 0; t < tensor_count; ++t) ExpectSameState(c, shard, t);
  // A non-finite value staged for one tensor skips the next step whole.
  const Staged bad = Stage(shard, all, c.grad_dtype, 0, rng);
  std::vector<uint16_t> poisoned(bad.half.begin(), bad.half.end());
  const int victim = tensor_count - 1;
  if (shard.sizes[victim] == 0) return;
  poisoned[bad.offsets[victim]] = 0x7f80;  // +inf in bf16.
  for (int t = 0; t < tensor_count; ++t) {
    ASSERT_TRUE(shard.cuda->StageGrads(bad.offsets[t] * 2, poisoned.data() + bad.offsets[t],
                                       shard.sizes[t], c.grad_dtype, 0).ok());
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
  std::vector<uint32_t> all(tensor_count);
  for (int t = 0; t < tensor_count; ++t) all[t] = t;
  const Staged staged = Stage(shard, all, GradDType::kFloat32, 0, rng);
  const uint64_t before = shard.cuda->launches_total();
  ASSERT_TRUE(shard.cuda->Step({staged.tensors, staged.offsets, staged.f32.data(),
                                GradDType::kFloat32, 0}).ok());
  EXPECT_EQ(shard.cuda->launches_total() - before, 1u);
}

#ifdef FUSEDPS_HAVE_CUDA
TEST_P(CudaBackendTest, LaunchCounterAgreesWithCupti) {
  const int tensor_count = GetParam();
  std::mt19937 rng(4000 + tensor_count);
  Shard shard = MakeShard(Cases()[0], tensor_count, rng);
  std::vector<uint32_t> all(tensor_count), half;
  for (int t = 0; t < tensor_count; ++t) all[t] = t;
  for (int t = 0; t < tensor_count; t += 2) half.push_back(t);
  const Staged full = Stage(shard, all, GradDType::kFloat32, 0, rng);
  const Staged partial = Stage(shard, half, GradDType::kBFloat16, 0, rng);
  CuptiKernelCounter cupti;
  ASSERT_TRUE(cupti.Start().ok());
  const uint64_t before = shard.cuda->launches_total();
  constexpr int kPushes = 5;
  for (int i = 0; i < kPushes; ++i) {
    ASSERT_TRUE(shard.cuda->Step({full.tensors, full.offsets, full.f32.data(),
                                  GradDType::kFloat32, 0}).ok());
    ASSERT_TRUE(shard.cuda->Step({partial.tensors, partial.offsets, partial.half.data(),
                                  GradDType::kBFloat16, 0}).ok());
  }
  auto kernels = cupti.Stop();
  ASSERT_TRUE(kernels.ok()) << kernels.status();
  uint64_t cupti_total = 0;
  for (const auto& [name, count] : *kernels) cupti_total += count;
  EXPECT_EQ(CuptiKernelCounter::CountMatching(*kernels, "AdamWApply"), 2u * kPushes);
  EXPECT_EQ(shard.cuda->launches_total() - before, cupti_total);
}
#endif

// The device memory the backend reports, per parameter: 12 bytes (params, exp_avg,
// exp_avg_sq), 4 more with amsgrad, 2 more for a bf16 copy, plus staging in the wire dtype.
TEST(CudaBackendMemoryTest, DeviceBytesPerParameter) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  constexpr uint64_t kNumel = 1 << 20;  // Multiples of 8: no padding in the arenas.
  for (const bool amsgrad : {false, true}) {
    for (const ParamCopyDType copy : {ParamCopyDType::kNone, ParamCopyDType::kBFloat16}) {
      BackendOptions options;
      options.param_copy_dtype = copy;
      auto cuda = MakeBackend("cuda:0", options);
      ASSERT_TRUE(cuda.ok());
      AdamWHyperparameters h;
      h.amsgrad = amsgrad;
      ASSERT_TRUE((*cuda)->SetParamGroup(0, h).ok());
      ASSERT_TRUE((*cuda)->AddTensors({{kNumel / 2, 0}, {kNumel / 2, 0}}).ok());
      std::vector<uint16_t> grads(kNumel, FloatToBFloat16(0.5f));
      const std::vector<uint32_t> tensors = {0, 1};
      const std::vector<uint64_t> offsets = {0, kNumel / 2};
      ASSERT_TRUE((*cuda)->Step({tensors, offsets, grads.data(), GradDType::kBFloat16, 0}).ok());
      std::map<std::string, uint64_t> bytes = (*cuda)->memory_bytes();
      const auto per_param = [&](const char* kind) {
        return static_cast<double>(bytes[kind]) / kNumel;
      };
      EXPECT_EQ(per_param("params") + per_param("exp_avg") + per_param("exp_avg_sq"), 12.0);
      EXPECT_EQ(per_param("max_exp_avg_sq"), amsgrad ? 4.0 : 0.0);
      EXPECT_EQ(per_param("param_copy"), copy == ParamCopyDType::kNone ? 0.0 : 2.0);
      EXPECT_EQ(per_param("grad_staging"), 2.0);  // bf16 on the wire.
      EXPECT_LT(per_param("tables"), 0.05);
      double total = 0;
      for (const auto& [kind, b] : bytes) total += static_cast<double>(b) / kNumel;
      std::printf("amsgrad=%d copy=%s: %.3f device bytes per parameter (tables %.4f)\n", amsgrad,
                  copy == ParamCopyDType::kNone ? "none" : "bf16", total, per_param("tables"));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(TensorCounts, CudaBackendTest,
                         ::testing::Values(1, 35, 36, 37, 423, 424, 425, 10000));

}  // namespace
}  // namespace fusedps
