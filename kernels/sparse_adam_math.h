// sparse_adam_math.h: the row-sparse (lazy) Adam update of fusedps's embedding tables, per
// element (and per row, for int8 state), for the CPU (row_sparse.h) and CUDA backends alike.
//
// This header is the only place the row-sparse optimizer math lives; like adamw_math.h it
// compiles as plain C++ and as CUDA (host and device), and it reuses adamw_math.h's per-step
// scalars (MakeStepScalars: bias corrections once per step in float64, by PowInt) and phases
// (UnscaledGrad, DecoupledDecay). The op order is that of torch.optim.SparseAdam
// (torch/optim/sparse_adam.py, SparseAdam.step; torch/optim/_functional.py, sparse_adam), per
// element of each row that has a gradient, in fp32:
//   0. the table's step count is incremented once per step, whichever rows are pushed (torch
//      keeps one state['step'] per param and increments it whenever the param has a gradient,
//      even an empty one); rows not pushed are not read or written (the "lazy" Adam)
//   1. g = the row's gradients summed over duplicate keys (torch: grad.coalesce()), then
//      g = g / grad_scale (if given; ours, as adamw_math.h's step 1); if maximize, g = -g
//      (torch negates before coalescing; negation is exact and rounding is sign-symmetric, so
//      the bits are the same)
//   2. ours, not torch's: decoupled weight decay, param -= lr * weight_decay * param, as
//      adamw_math.h's step 2 (torch's SparseAdam has no weight_decay; with weight_decay 0 the
//      update is exactly SparseAdam's)
//   3. exp_avg_update = (g - exp_avg) * (1 - beta1); exp_avg = exp_avg + exp_avg_update
//      exp_avg_sq_update = (g * g - exp_avg_sq) * (1 - beta2);
//      exp_avg_sq = exp_avg_sq + exp_avg_sq_update
//   4. bias_correction1 = 1 - beta1^step, bias_correction2 = 1 - beta2^step (step already
//      incremented); step_size = lr * sqrt(bias_correction2) / bias_correction1, in float64,
//      then rounded to fp32 (adamw_math.h's folded_step_size: the same expression)
//   5. denom = sqrt(exp_avg_sq) + eps
//   6. param += -step_size * (exp_avg / denom)   (the same bits as param -= step_size * (...))
// Steps 4 to 6 are Adam's own order (Kingma and Ba, "Adam: A Method for Stochastic
// Optimization", ICLR 2015, section 2: alpha_t and epsilon-hat): eps is added to sqrt(exp_avg_sq)
// unscaled, so the update is not AdamW's even in exact arithmetic (adamw_math.h's kTorch order
// adds eps to sqrt(exp_avg_sq) / sqrt(bias_correction2)), nor its kFolded order (which scales eps
// by sqrt(bias_correction2)).
//
// Not supported (row_sparse.h refuses them): amsgrad (torch's SparseAdam has none) and L2 weight
// decay (decoupled_weight_decay false with weight_decay != 0). The non-finite check, which skips
// a whole step, is ours (row_sparse.h), as for dense pushes.
//
// Usage:
//   AdamWStepScalars s = MakeStepScalars(hyper, step + 1, grad_scale);
//   for each pushed row, for (j...) {
//     const float g = SparseAdamGrad(s, summed_grad[j]);  // check every g before any update
//     SparseAdamUpdate(s, g, param[j], exp_avg[j], exp_avg_sq[j]);
//   }
#ifndef FUSEDPS_KERNELS_SPARSE_ADAM_MATH_H_
#define FUSEDPS_KERNELS_SPARSE_ADAM_MATH_H_

#include <cmath>

#include "common/half_float.h"  // FUSEDPS_HOST_DEVICE.
#include "kernels/adamw_math.h"
#include "kernels/quant_math.h"

namespace fusedps {

// Step 1: the gradient the update uses, from one element of a row's summed (coalesced)
// gradient: divided by grad_scale when s.has_grad_scale, negated when s.maximize.
FUSEDPS_HOST_DEVICE float SparseAdamGrad(const AdamWStepScalars& s, float summed_grad) {
  const float g = s.has_grad_scale ? UnscaledGrad(s, summed_grad) : summed_grad;
  return s.maximize ? -g : g;
}

// Steps 2, 3, 5 and 6 for one element of a pushed row; g is SparseAdamGrad's. s is
// MakeStepScalars(hyper, step, grad_scale) for the table's incremented step (step 4).
// REQUIRES: !s.amsgrad; s.decoupled_weight_decay or s.weight_decay == 0.
FUSEDPS_HOST_DEVICE void SparseAdamUpdate(const AdamWStepScalars& s, float g, float& param,
                                          float& exp_avg, float& exp_avg_sq) {
  if (s.weight_decay != 0.0f) param = DecoupledDecay(s, param);
  const float exp_avg_update = (g - exp_avg) * s.one_minus_beta1;
  const float exp_avg_sq_update = (g * g - exp_avg_sq) * s.one_minus_beta2;
  exp_avg = exp_avg + exp_avg_update;
  exp_avg_sq = exp_avg_sq + exp_avg_sq_update;
  const float denom = sqrtf(exp_avg_sq) + s.eps;
  param = param + -s.folded_step_size * (exp_avg / denom);
}

// The same for a table with bf16 state (bf16 bit patterns): the moments are widened to fp32,
// updated as above (the param with the fp32 moments), and stored rounded to nearest even, as
// quant_math.h's AdamWUpdateBFloat16State stores a dense tensor's.
FUSEDPS_HOST_DEVICE void SparseAdamUpdateBFloat16State(const AdamWStepScalars& s, float g,
                                                       float& param, uint16_t& exp_avg,
                                                       uint16_t& exp_avg_sq) {
  float m = BFloat16ToFloat(exp_avg), v = BFloat16ToFloat(exp_avg_sq);
  SparseAdamUpdate(s, g, param, m, v);
  exp_avg = FloatToBFloat16(m);
  exp_avg_sq = FloatToBFloat16(v);
}

// --- Int8 state: a scale per row (quant_math.h's block-wise int8 state, with a row as the block).
//
// A row's update with int8 moments, in quant_math.h's steps: 1. dequantize each moment with the
// row's stored scales (m = signed_map[code] * absmax_m, v = unsigned_map[code] * absmax_v);
// 2. SparseAdamUpdate in fp32 with them (the param update uses the new fp32 moments); 3. the
// row's new scales: absmax_m = max |new m|, absmax_v = max new v (from 0, as QuantizeBlock's);
// 4. each new moment quantized to the nearest code against its new scale (QuantizeSigned,
// QuantizeUnsigned). Since step 4 needs the whole row's step 3, the row is computed twice: once
// for the scales, once to store (the same inputs, so the same values); nothing is written in
// the first pass.

// Steps 1 and 2 for element j of a row: its param updated in place, its new fp32 moments in m and
// v. absmax_m and absmax_v are the row's stored (old) scales.
FUSEDPS_HOST_DEVICE void SparseAdamUpdateInt8(const AdamWStepScalars& s, const Int8Codebooks& books,
                                              float g, float& param, uint8_t code_m, uint8_t code_v,
                                              float absmax_m, float absmax_v, float& m, float& v) {
  m = Dequantize(books.exp_avg.values, code_m, absmax_m);
  v = Dequantize(books.exp_avg_sq.values, code_v, absmax_v);
  SparseAdamUpdate(s, g, param, m, v);
}

// One pushed row of `dim` elements of a table with int8 state, all four steps, on one thread:
// g the row's gradients (SparseAdamGrad's), param its params, codes_m and codes_v its codes,
// absmax_m and absmax_v its scales (read, then replaced by the new ones). The CPU backend's; the
// CUDA kernel spreads a row over a warp with the same functions (table_rows_kernel.cu).
FUSEDPS_HOST_DEVICE void SparseAdamUpdateInt8Row(const AdamWStepScalars& s,
                                                 const Int8Codebooks& books, uint64_t dim,
                                                 const float* g, float* param, uint8_t* codes_m,
                                                 uint8_t* codes_v, float& absmax_m,
                                                 float& absmax_v) {
  float new_m = 0.0f, new_v = 0.0f;
  for (uint64_t j = 0; j < dim; ++j) {
    float p = param[j], m, v;
    SparseAdamUpdateInt8(s, books, g[j], p, codes_m[j], codes_v[j], absmax_m, absmax_v, m, v);
    new_m = fmaxf(new_m, fabsf(m));
    new_v = fmaxf(new_v, v);
  }
  const float inverse_m = InverseScale(new_m), inverse_v = InverseScale(new_v);
  for (uint64_t j = 0; j < dim; ++j) {
    float m, v;
    SparseAdamUpdateInt8(s, books, g[j], param[j], codes_m[j], codes_v[j], absmax_m, absmax_v, m,
                         v);
    codes_m[j] = static_cast<uint8_t>(
        QuantizeSigned(books.exp_avg.thresholds, books.exp_avg.buckets, m, inverse_m));
    codes_v[j] = static_cast<uint8_t>(
        QuantizeUnsigned(books.exp_avg_sq.thresholds, books.exp_avg_sq.buckets, v, inverse_v));
  }
  absmax_m = new_m;
  absmax_v = new_v;
}

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_SPARSE_ADAM_MATH_H_
