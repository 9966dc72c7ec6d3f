// sparse_adam_math.h: the row-sparse (lazy) Adam update of fusedps's embedding tables, per
// element, for the CPU (row_sparse.h) and, later, CUDA backends alike.
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

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_SPARSE_ADAM_MATH_H_
