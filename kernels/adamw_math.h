// adamw_math.h: the one AdamW update of fusedps, shared by the CPU and CUDA backends.
//
// This header is the only place the optimizer math lives. It compiles as plain C++ and as CUDA
// (host and device). The op order is that of PyTorch's fused AdamW
// (torch/optim/adamw.py, aten/src/ATen/native/cuda/fused_adam_utils.cuh), per element, in fp32:
//   1. g = grad / grad_scale (if given; a division, as torch's fused kernel does, so that every
//      positive finite scale works: 1 / 1e-39 would overflow); if maximize, g = -g
//   2. decoupled: param -= lr * weight_decay * param   |  L2: g += weight_decay * param
//   3. exp_avg = lerp(exp_avg, g, 1 - beta1); exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g^2
//   4. bias_correction1 = 1 - beta1^step, bias_correction2 = 1 - beta2^step (step already
//      incremented), computed once per tensor in float64 as torch does in Python (beta^step by
//      binary exponentiation, PowInt, so that every host and device gets the same bits)
//   5. denom = sqrt(amsgrad ? max_exp_avg_sq : exp_avg_sq) / sqrt(bias_correction2) + eps
//   6. param -= (lr / bias_correction1) * exp_avg / denom
// Steps 5 and 6 have a second order, UpdateOrder::kFolded, for int8 state (quant_math.h):
//   5. denom = sqrt(exp_avg_sq) + eps * sqrt(bias_correction2)
//   6. param -= (lr * sqrt(bias_correction2) / bias_correction1) * exp_avg / denom
// the same value in exact arithmetic (both terms of denom times sqrt(bias_correction2)), with
// one division per element instead of two. It is Adam's own "more efficient" order (Kingma and
// Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015, section 2: alpha_t and
// epsilon-hat) and the one bitsandbytes' 8-bit optimizers compute.
//
// Usage:
//   AdamWStepScalars s = MakeStepScalars(hyper, step + 1);
//   for (i...) AdamWUpdate(s, LoadGrad(grads, i), params[i], exp_avg[i], exp_avg_sq[i], nullptr);
#ifndef FUSEDPS_KERNELS_ADAMW_MATH_H_
#define FUSEDPS_KERNELS_ADAMW_MATH_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/half_float.h"  // FUSEDPS_HOST_DEVICE, the bf16 and fp16 conversions.
#ifdef __CUDA_ARCH__            // The device pass: unroll the loops of AdamWUpdateN.
#define FUSEDPS_UNROLL _Pragma("unroll")
#else
#define FUSEDPS_UNROLL
#endif

namespace fusedps {

// Element type of gradients on the wire and in staging. Values match proto fusedps.v1.DType.
enum class GradDType : uint8_t { kFloat32 = 1, kBFloat16 = 2, kFloat16 = 3 };

FUSEDPS_HOST_DEVICE int DTypeSize(GradDType dtype) { return dtype == GradDType::kFloat32 ? 4 : 2; }

// How a param group stores exp_avg and exp_avg_sq (kernels/quant_math.h has the math of each).
// Values match proto fusedps.v1.StateDType.
enum class StateDType : uint8_t { kFloat32 = 1, kBFloat16 = 2, kInt8 = 3 };

// The dtype of a param group's params: kFloat32 (the fp32 master copy) or kBFloat16 (no fp32
// master; every step rounds the fp32 result stochastically, quant_math.h). Values match proto
// fusedps.v1.DType.
enum class ParamsDType : uint8_t { kFloat32 = 1, kBFloat16 = 2 };

// Hyperparameters of one param group, as in torch.optim.AdamW. Defaults are torch's.
struct AdamWHyperparameters {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool amsgrad = false;
  bool maximize = false;
  bool decoupled_weight_decay = true;  // false: L2 (torch.optim.Adam's weight_decay).
  // Storage, fixed at registration (as amsgrad is). amsgrad needs state_dtype kFloat32.
  StateDType state_dtype = StateDType::kFloat32;
  ParamsDType params_dtype = ParamsDType::kFloat32;
  uint64_t rounding_seed = 0;  // Stochastic rounding of bf16 params (quant_math.h).
};

// The scalar hyperparameters by the name of their field in proto fusedps.v1.Hyperparameters, so
// that the server converts, compares and stores them in one loop (server/schema/
// hyperparameters.h). A double or bool added to AdamWHyperparameters is added here too (a unit
// test fails for a proto field that neither lists nor converts by name); decoupled_weight_decay
// (the proto's weight_decay_mode) and the storage fields are converted by name there.
template <typename T>
struct HyperparameterField {
  // (An alias: nvcc's front end writes a member pointer declared in place with parentheses,
  // which the host compiler's -Wparentheses refuses.)
  using Member = T AdamWHyperparameters::*;
  const char* name;
  Member member;
};
inline constexpr HyperparameterField<double> kDoubleHyperparameters[] = {
    {"lr", &AdamWHyperparameters::lr},
    {"beta1", &AdamWHyperparameters::beta1},
    {"beta2", &AdamWHyperparameters::beta2},
    {"eps", &AdamWHyperparameters::eps},
    {"weight_decay", &AdamWHyperparameters::weight_decay}};
inline constexpr HyperparameterField<bool> kBoolHyperparameters[] = {
    {"amsgrad", &AdamWHyperparameters::amsgrad}, {"maximize", &AdamWHyperparameters::maximize}};

// Per-tensor, per-step scalars. Computed in float64 from the hyperparameters and the
// (already incremented) step, then rounded to fp32 as torch's scalar arguments are.
struct AdamWStepScalars {
  float lr;
  float weight_decay;
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float eps;
  float step_size;              // lr / bias_correction1
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  float folded_step_size;       // lr * sqrt(bias_correction2) / bias_correction1 (kFolded)
  float folded_eps;             // eps * sqrt(bias_correction2) (kFolded)
  float grad_scale;             // Gradients are divided by it when has_grad_scale.
  bool has_grad_scale;
  bool amsgrad;
  bool maximize;
  bool decoupled_weight_decay;
};

// base^exponent (exponent >= 0) by binary exponentiation in float64: a fixed sequence of IEEE
// multiplications, so the CPU and CUDA backends get the same bits (pow() may differ in the last
// bit between libm and CUDA). Within a few float64 ulps of pow(), far below fp32 rounding.
FUSEDPS_HOST_DEVICE double PowInt(double base, int64_t exponent) {
  double result = 1.0;
  while (exponent > 0) {
    if (exponent & 1) result *= base;
    base *= base;
    exponent >>= 1;
  }
  return result;
}

// REQUIRES: step >= 1 (the step count after this update). grad_scale <= 0 means none. The lr
// used is h.lr / lr_divisor, in float64 (as torch computes a group's lr set to lr / (1 + tau)).
FUSEDPS_HOST_DEVICE AdamWStepScalars MakeStepScalars(const AdamWHyperparameters& h, int64_t step,
                                                     float grad_scale, double lr_divisor = 1.0) {
  AdamWStepScalars s;
  const double bias_correction1 = 1.0 - PowInt(h.beta1, step);
  const double bias_correction2 = 1.0 - PowInt(h.beta2, step);
  const double lr = lr_divisor == 1.0 ? h.lr : h.lr / lr_divisor;
  s.lr = static_cast<float>(lr);
  s.weight_decay = static_cast<float>(h.weight_decay);
  s.beta1 = static_cast<float>(h.beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.eps = static_cast<float>(h.eps);
  s.step_size = static_cast<float>(lr / bias_correction1);
  const double bias_correction2_sqrt = sqrt(bias_correction2);
  s.bias_correction2_sqrt = static_cast<float>(bias_correction2_sqrt);
  s.folded_step_size = static_cast<float>(lr * bias_correction2_sqrt / bias_correction1);
  s.folded_eps = static_cast<float>(h.eps * bias_correction2_sqrt);
  s.has_grad_scale = grad_scale > 0.0f;
  s.grad_scale = s.has_grad_scale ? grad_scale : 1.0f;
  s.amsgrad = h.amsgrad;
  s.maximize = h.maximize;
  s.decoupled_weight_decay = h.decoupled_weight_decay;
  return s;
}

// The phases of one update, in op order. AdamWUpdateN composes them for n elements at once (the
// CUDA kernel's 8 per lane), testing each per-step flag once for all of them; AdamWUpdate is
// AdamWUpdateN of one element (the CPU backend's), so both give the same bits.

// Step 1, with s.has_grad_scale: the gradient unscaled.
FUSEDPS_HOST_DEVICE float UnscaledGrad(const AdamWStepScalars& s, float grad) {
  return grad / s.grad_scale;
}
// Step 2, decoupled (AdamW): the param decayed.
FUSEDPS_HOST_DEVICE float DecoupledDecay(const AdamWStepScalars& s, float param) {
  return param - s.lr * s.weight_decay * param;
}
// Step 2, L2 (Adam): the gradient with the decay's term.
FUSEDPS_HOST_DEVICE float L2Decay(const AdamWStepScalars& s, float g, float param) {
  return g + s.weight_decay * param;
}

// The order of steps 5 and 6 (see the top of this file): torch's, bit for bit, or folded.
enum class UpdateOrder : uint8_t { kTorch, kFolded };

// Steps 3, 5 and 6: the moments from g, then the param's update. v_max (amsgrad only, else
// ignored) is max_exp_avg_sq, read and written.
template <bool kAmsgrad, UpdateOrder kOrder = UpdateOrder::kTorch>
FUSEDPS_HOST_DEVICE void AdamWMomentsAndParam(const AdamWStepScalars& s, float g, float& param,
                                              float& exp_avg, float& exp_avg_sq, float& v_max) {
  // torch.lerp(start, end, w) for w < 0.5: start + w * (end - start).
  const float m = exp_avg + s.one_minus_beta1 * (g - exp_avg);
  const float v = s.beta2 * exp_avg_sq + s.one_minus_beta2 * g * g;
  float v_used = v;
  if (kAmsgrad) {
    v_used = fmaxf(v_max, v);
    v_max = v_used;
  }
  if (kOrder == UpdateOrder::kFolded) {
    const float denom = sqrtf(v_used) + s.folded_eps;
    param -= s.folded_step_size * m / denom;
  } else {
    const float denom = sqrtf(v_used) / s.bias_correction2_sqrt + s.eps;
    param -= s.step_size * m / denom;
  }
  exp_avg = m;
  exp_avg_sq = v;
}

// AdamW updates of n elements: grad, param, exp_avg, exp_avg_sq and max_exp_avg_sq (read and
// written only when s.amsgrad) are arrays of n; grad is overwritten. Each per-step flag is
// tested once, not once per element: in the CUDA kernel every test per element cost a branch
// and its reconvergence (docs/benchmarks.md, issue 16's instruction counts).
template <int n, UpdateOrder kOrder = UpdateOrder::kTorch>
FUSEDPS_HOST_DEVICE void AdamWUpdateN(const AdamWStepScalars& s, float (&grad)[n],
                                      float (&param)[n], float (&exp_avg)[n],
                                      float (&exp_avg_sq)[n], float (&max_exp_avg_sq)[n]) {
  if (s.has_grad_scale) {
    FUSEDPS_UNROLL for (int k = 0; k < n; ++k) grad[k] = UnscaledGrad(s, grad[k]);
  }
  if (s.maximize) {
    FUSEDPS_UNROLL for (int k = 0; k < n; ++k) grad[k] = -grad[k];
  }
  if (s.weight_decay != 0.0f) {
    if (s.decoupled_weight_decay) {
      FUSEDPS_UNROLL for (int k = 0; k < n; ++k) param[k] = DecoupledDecay(s, param[k]);
    } else {
      FUSEDPS_UNROLL for (int k = 0; k < n; ++k) grad[k] = L2Decay(s, grad[k], param[k]);
    }
  }
  if (s.amsgrad) {
    FUSEDPS_UNROLL for (int k = 0; k < n; ++k) {
      AdamWMomentsAndParam<true, kOrder>(s, grad[k], param[k], exp_avg[k], exp_avg_sq[k],
                                         max_exp_avg_sq[k]);
    }
  } else {
    FUSEDPS_UNROLL for (int k = 0; k < n; ++k) {
      AdamWMomentsAndParam<false, kOrder>(s, grad[k], param[k], exp_avg[k], exp_avg_sq[k],
                                          max_exp_avg_sq[k]);
    }
  }
}

// One AdamW update of one element: AdamWUpdateN of one, so every backend runs one copy of the
// math. max_exp_avg_sq is read and written only when s.amsgrad.
template <UpdateOrder kOrder = UpdateOrder::kTorch>
FUSEDPS_HOST_DEVICE void AdamWUpdate(const AdamWStepScalars& s, float grad, float& param,
                                     float& exp_avg, float& exp_avg_sq, float* max_exp_avg_sq) {
  float g[1] = {grad}, p[1] = {param}, m[1] = {exp_avg}, v[1] = {exp_avg_sq};
  float v_max[1] = {s.amsgrad ? *max_exp_avg_sq : 0.0f};
  AdamWUpdateN<1, kOrder>(s, g, p, m, v, v_max);
  param = p[0];
  exp_avg = m[0];
  exp_avg_sq = v[0];
  if (s.amsgrad) *max_exp_avg_sq = v_max[0];
}

// Reads gradient element i of a staging buffer in the given dtype, as fp32.
FUSEDPS_HOST_DEVICE float LoadGrad(const void* grads, GradDType dtype, uint64_t i) {
  switch (dtype) {
    case GradDType::kBFloat16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(grads)[i]);
    case GradDType::kFloat16:
      return Float16ToFloat(static_cast<const uint16_t*>(grads)[i]);
    case GradDType::kFloat32:
    default:
      return static_cast<const float*>(grads)[i];
  }
}

// Reads `count` gradient elements of `src` in `dtype` into dst as fp32, on the host: LoadGrad
// over a range, with the dtype decided once (a copy for fp32).
inline void LoadFloats(const void* src, GradDType dtype, uint64_t count, float* dst) {
  if (dtype == GradDType::kFloat32) {
    std::memcpy(dst, src, count * sizeof(float));
    return;
  }
  const auto* half = static_cast<const uint16_t*>(src);
  if (dtype == GradDType::kBFloat16) {
    for (uint64_t i = 0; i < count; ++i) dst[i] = BFloat16ToFloat(half[i]);
  } else {
    for (uint64_t i = 0; i < count; ++i) dst[i] = Float16ToFloat(half[i]);
  }
}

// Writes `count` floats to dst in `dtype` (bf16 and fp16 rounded to nearest even), on the
// host: what a read of a field in that dtype returns.
inline void StoreFloats(const float* src, uint64_t count, GradDType dtype, void* dst) {
  if (dtype == GradDType::kFloat32) {
    std::memcpy(dst, src, count * sizeof(float));
    return;
  }
  auto* half = static_cast<uint16_t*>(dst);
  for (uint64_t i = 0; i < count; ++i) {
    half[i] = dtype == GradDType::kBFloat16 ? FloatToBFloat16(src[i]) : FloatToFloat16(src[i]);
  }
}

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_ADAMW_MATH_H_
