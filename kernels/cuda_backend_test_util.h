// cuda_backend_test_util.h (tests only): what the CUDA backend's tests share: the option cases,
// a shard registered on both backends with a float64 reference beside it, staged pushes with
// NaN in the padding, and synchronous steps and reads.
#ifndef FUSEDPS_KERNELS_CUDA_BACKEND_TEST_UTIL_H_
#define FUSEDPS_KERNELS_CUDA_BACKEND_TEST_UTIL_H_

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/adamw_reference.h"
#include "kernels/backend_factory.h"

namespace fusedps {
namespace cuda_test {

// A test that needs a CUDA device: skipped without one. Base is ::testing::Test or
// ::testing::TestWithParam<...>.
template <typename Base = ::testing::Test>
class NeedsCuda : public Base {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

struct Case {
  std::string name;
  std::vector<AdamWHyperparameters> groups;
  GradDType grad_dtype = GradDType::kFloat32;
  ParamCopyDType copy = ParamCopyDType::kNone;
  float grad_scale = 0.0f;
  StepKernel step_kernel = StepKernel::kAuto;
};

inline std::vector<Case> Cases() {
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
  cases.push_back(
      {"bf16_grads_bf16_copy", {base}, GradDType::kBFloat16, ParamCopyDType::kBFloat16});
  cases.push_back({"fp16_grads_fp16_copy", {h}, GradDType::kFloat16, ParamCopyDType::kFloat16});
  AdamWHyperparameters other = base;
  other.lr = 0.05;
  other.beta1 = 0.8;
  other.beta2 = 0.99;
  other.eps = 1e-6;
  cases.push_back({"three_groups", {base, other, l2}});
  // Low-precision storage (issue 16): compared with the CPU backend bit for bit.
  AdamWHyperparameters bf16_state = base;
  bf16_state.state_dtype = StateDType::kBFloat16;
  cases.push_back({"bf16_state", {bf16_state}, GradDType::kBFloat16, ParamCopyDType::kBFloat16});
  AdamWHyperparameters int8_state = h;  // amsgrad off below: it needs fp32 state.
  int8_state.amsgrad = false;
  int8_state.state_dtype = StateDType::kInt8;
  cases.push_back({"int8_state", {int8_state}});
  AdamWHyperparameters bf16_params = other;
  bf16_params.params_dtype = ParamsDType::kBFloat16;
  bf16_params.rounding_seed = 42;
  cases.push_back({"bf16_params", {bf16_params}, GradDType::kBFloat16});
  AdamWHyperparameters int8_bf16 = int8_state;
  int8_bf16.params_dtype = ParamsDType::kBFloat16;
  cases.push_back({"int8_state_bf16_params", {int8_bf16}, GradDType::kFloat16});
  cases.push_back({"mixed_groups_copy",
                   {h, int8_state, bf16_params, bf16_state},
                   GradDType::kBFloat16,
                   ParamCopyDType::kBFloat16,
                   256.0f});
  return cases;
}

// Whether every group of a case keeps fp32 params and fp32 state (the float64 reference then
// applies to the params).
inline bool AllFloat32(const Case& c) {
  for (const AdamWHyperparameters& h : c.groups) {
    if (h.state_dtype != StateDType::kFloat32 || h.params_dtype != ParamsDType::kFloat32) {
      return false;
    }
  }
  return true;
}

// Tensor t is in group t % groups.size() on both backends.
struct Shard {
  std::unique_ptr<OptimizerBackend> cpu, cuda;
  std::vector<uint64_t> sizes;
  std::vector<std::vector<ReferenceAdamW>> reference;
};

inline std::vector<uint64_t> Sizes(int count, std::mt19937& rng) {
  // Odd sizes, tails that are not multiples of 4 or 8, chunk edges, int8 block edges and the
  // int8 threshold (4096), and one empty tensor.
  const uint64_t palette[] = {1,    3,    5,    7,    8,    9,    13,   31,   100,  1000,
                              2047, 2048, 2049, 4095, 4096, 4099, 4352, 5000, 70001};
  std::vector<uint64_t> sizes(count);
  for (int i = 0; i < count; ++i) {
    sizes[i] = count >= 1000 ? 1 + rng() % 300 : palette[rng() % std::size(palette)];
  }
  if (count > 2) sizes[1] = 0;
  if (count >= 1000) sizes[count / 2] = 9000;  // One int8 tensor among many small ones.
  if (count == 1) sizes[0] = 6001;             // Whole chunks, a partial block, int8 state.
  return sizes;
}

// Registers `sizes` (random ones when empty) on a CPU and a CUDA backend and writes the same
// random params to both and to the float64 reference.
inline Shard MakeShard(const Case& c, int tensor_count, std::mt19937& rng,
                       std::vector<uint64_t> sizes = {}) {
  Shard shard;
  BackendOptions options;
  options.param_copy_dtype = c.copy;
  options.step_kernel = c.step_kernel;
  shard.cpu = MakeCpuBackend(options);
  auto cuda = MakeBackend("cuda:0", options);
  EXPECT_TRUE(cuda.ok()) << cuda.status();
  shard.cuda = *std::move(cuda);
  for (uint32_t g = 0; g < c.groups.size(); ++g) {
    EXPECT_TRUE(shard.cpu->SetParamGroup(g, c.groups[g]).ok());
    EXPECT_TRUE(shard.cuda->SetParamGroup(g, c.groups[g]).ok());
  }
  shard.sizes = sizes.empty() ? Sizes(tensor_count, rng) : sizes;
  std::vector<NewTensor> specs;
  for (int t = 0; t < tensor_count; ++t) {
    specs.push_back({shard.sizes[t], static_cast<uint32_t>(t % c.groups.size()),
                     0x9e3779b97f4a7c15ull * (t + 1)});
  }
  EXPECT_EQ(*shard.cpu->AddTensors(specs), 0u);
  EXPECT_EQ(*shard.cuda->AddTensors(specs), 0u);
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
  GradDType dtype = GradDType::kFloat32;
  float grad_scale = 0.0f;
  const void* data() const {
    return dtype == GradDType::kFloat32 ? static_cast<const void*>(f32.data()) : half.data();
  }
  StepRequest Request() const { return {tensors, offsets, data(), dtype, grad_scale}; }
};

inline Staged Stage(const std::vector<uint64_t>& sizes, const std::vector<uint32_t>& tensors,
                    GradDType dtype, float scale, std::mt19937& rng) {
  Staged s;
  s.tensors = tensors;
  s.dtype = dtype;
  s.grad_scale = scale;
  uint64_t total = 0;
  for (uint32_t t : tensors) {
    s.offsets.push_back(total);
    total += AlignedNumel(sizes[t]);
  }
  s.f32.assign(total, NAN);
  s.half.assign(total, 0x7fc0);  // NaN in bf16 and in fp16.
  std::normal_distribution<float> normal(0.0f, scale > 0 ? scale : 1.0f);
  for (size_t r = 0; r < tensors.size(); ++r) {
    for (uint64_t i = 0; i < sizes[tensors[r]]; ++i) {
      float g = normal(rng);
      if (dtype == GradDType::kBFloat16) s.half[s.offsets[r] + i] = FloatToBFloat16(g);
      if (dtype == GradDType::kFloat16) s.half[s.offsets[r] + i] = FloatToFloat16(g);
      s.f32[s.offsets[r] + i] = g;
    }
  }
  return s;
}

inline Staged Stage(const Shard& shard, const std::vector<uint32_t>& tensors, GradDType dtype,
                    float scale, std::mt19937& rng) {
  return Stage(shard.sizes, tensors, dtype, scale, rng);
}

inline std::vector<uint32_t> AllTensors(int count) {
  std::vector<uint32_t> all(count);
  for (int t = 0; t < count; ++t) all[t] = t;
  return all;
}

// Applies a push to the float64 reference, with each tensor's step as `backend` counts it
// after the push.
inline void StepReference(const Case& c, const Staged& staged, const OptimizerBackend& backend,
                          Shard& shard) {
  for (size_t r = 0; r < staged.tensors.size(); ++r) {
    const uint32_t t = staged.tensors[r];
    const AdamWHyperparameters& h = c.groups[t % c.groups.size()];
    for (uint64_t i = 0; i < shard.sizes[t]; ++i) {
      const double g = LoadGrad(staged.data(), staged.dtype, staged.offsets[r] + i);
      shard.reference[t][i].Step(h, g, backend.step(t), staged.grad_scale);
    }
  }
}

// Steps the CUDA backend with `cuda_request` (the staged grads, wherever it reads them),
// which must apply them, then the CPU backend with staged.Request() and the float64 reference
// after it: what ExpectSameState compares. Call it inside ASSERT_NO_FATAL_FAILURE.
inline void StepBoth(const Case& c, const Staged& staged, Shard& shard,
                     const StepRequest& cuda_request) {
  auto on_cuda = StepNow(*shard.cuda, cuda_request);
  ASSERT_TRUE(on_cuda.ok()) << on_cuda.status();
  ASSERT_FALSE(on_cuda->skipped);
  ASSERT_TRUE(StepNow(*shard.cpu, staged.Request()).ok());
  StepReference(c, staged, *shard.cpu, shard);
}

inline std::vector<float> ReadAll(OptimizerBackend& b, TensorField f, uint32_t t) {
  std::vector<float> out(b.numel(t));
  EXPECT_TRUE(ReadTensor(b, f, t, out.data()).ok());
  return out;
}

// The 16-bit param copy of one tensor.
inline std::vector<uint16_t> ReadCopy(OptimizerBackend& b, uint32_t t) {
  std::vector<uint16_t> out(b.numel(t));
  EXPECT_TRUE(ReadParamCopy(b, t, out.data()).ok());
  return out;
}

// A stored field of one tensor as bytes (StoredCount x StoredElementBytes), or nothing when
// the tensor has no such field.
inline std::vector<char> ReadStoredBytes(OptimizerBackend& b, TensorField f, uint32_t t) {
  const TensorLayout layout = b.layout(t);
  std::vector<char> out(StoredCount(layout, f, b.numel(t)) * StoredElementBytes(layout, f));
  if (out.empty()) return out;
  EXPECT_TRUE(ReadStored(b, f, t, out.data()).ok());
  return out;
}

// The CUDA backend matches the CPU backend bit for bit (every field in its stored form and as
// fp32, the step): both run the same operations of adamw_math.h and quant_math.h, rounded
// alike (--fmad=false, -ffp-contract=off). Where the shard is all fp32, the params also match
// the float64 reference within torch's tolerance; the param copy is the params rounded.
inline void ExpectSameState(const Case& c, Shard& shard, uint32_t t) {
  OptimizerBackend& cpu = *shard.cpu;
  OptimizerBackend& cuda = *shard.cuda;
  ASSERT_EQ(cpu.step(t), cuda.step(t)) << "tensor " << t;
  std::vector<TensorField> fields = {TensorField::kParam, TensorField::kExpAvg,
                                     TensorField::kExpAvgSq, TensorField::kExpAvgAbsmax,
                                     TensorField::kExpAvgSqAbsmax};
  if (c.groups[t % c.groups.size()].amsgrad) fields.push_back(TensorField::kMaxExpAvgSq);
  for (TensorField f : fields) {
    const std::vector<char> a = ReadStoredBytes(cuda, f, t), b = ReadStoredBytes(cpu, f, t);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_EQ(a[i], b[i]) << c.name << " tensor " << t << " (" << shard.sizes[t]
                            << " elements) stored " << TensorFieldName(f) << " byte " << i;
    }
    if (f == TensorField::kExpAvgAbsmax || f == TensorField::kExpAvgSqAbsmax) continue;
    const auto x = ReadAll(cuda, f, t), y = ReadAll(cpu, f, t);  // As fp32 (StateRead).
    ASSERT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * sizeof(float)))
        << c.name << " tensor " << t << " fp32 read of " << TensorFieldName(f);
  }
  const auto params = ReadAll(cuda, TensorField::kParam, t);
  if (AllFloat32(c)) {
    for (size_t i = 0; i < params.size(); ++i) {
      ASSERT_TRUE(NearTorch(params[i], shard.reference[t][i].param))
          << c.name << " tensor " << t << " element " << i << ": cuda " << params[i] << " float64 "
          << shard.reference[t][i].param;
    }
  }
  if (c.copy != ParamCopyDType::kNone && cuda.layout(t).params == ParamsDType::kFloat32) {
    const std::vector<uint16_t> copy = ReadCopy(cuda, t);
    for (size_t i = 0; i < copy.size(); ++i) {
      const uint16_t want = c.copy == ParamCopyDType::kBFloat16 ? FloatToBFloat16(params[i])
                                                                : FloatToFloat16(params[i]);
      ASSERT_EQ(copy[i], want) << c.name << " copy of tensor " << t << " element " << i;
    }
  }
}

}  // namespace cuda_test
}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_CUDA_BACKEND_TEST_UTIL_H_
