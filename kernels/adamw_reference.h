// adamw_reference.h (tests only): AdamW in float64, written from the formulas of
// torch.optim.AdamW's documentation rather than from adamw_math.h, as an independent oracle.
#ifndef FUSEDPS_KERNELS_ADAMW_REFERENCE_H_
#define FUSEDPS_KERNELS_ADAMW_REFERENCE_H_

#include <algorithm>
#include <cmath>

#include "kernels/adamw_math.h"

namespace fusedps {

struct ReferenceAdamW {
  double param = 0, exp_avg = 0, exp_avg_sq = 0, max_exp_avg_sq = 0;

  // step: the step count after this update (1 on the first). grad_scale <= 0: none.
  void Step(const AdamWHyperparameters& h, double grad, int64_t step, double grad_scale) {
    double g = grad_scale > 0 ? grad / grad_scale : grad;
    if (h.maximize) g = -g;
    if (h.decoupled_weight_decay) {
      param *= 1 - h.lr * h.weight_decay;
    } else {
      g += h.weight_decay * param;
    }
    exp_avg = h.beta1 * exp_avg + (1 - h.beta1) * g;
    exp_avg_sq = h.beta2 * exp_avg_sq + (1 - h.beta2) * g * g;
    max_exp_avg_sq = std::max(max_exp_avg_sq, exp_avg_sq);
    const double m_hat = exp_avg / (1 - std::pow(h.beta1, static_cast<double>(step)));
    const double v_hat = (h.amsgrad ? max_exp_avg_sq : exp_avg_sq) /
                         (1 - std::pow(h.beta2, static_cast<double>(step)));
    param -= h.lr * m_hat / (std::sqrt(v_hat) + h.eps);
  }
};

// PyTorch's fused-vs-for-loop tolerance for fp32 (test_optim.py): |a - b| <= atol + rtol * |b|.
inline bool NearTorch(double actual, double expected, double rtol = 1.3e-6, double atol = 1e-5) {
  return std::abs(actual - expected) <= atol + rtol * std::abs(expected);
}

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_ADAMW_REFERENCE_H_
