// row_table_test_util.h: what the row-sparse tests (row_sparse_test.cc, hashed_row_step_test.cc,
// and the backends' cpu_table_rows_test.cc and cuda_backend_tables_test.cc) share: an independent
// float64 SparseAdam, written from the formulas in sparse_adam_math.h's comment
// (torch.optim.SparseAdam, plus our decoupled weight decay of pushed rows) rather than from the
// code under test; SparseAdam's defaults; a byte-for-byte copy of a table's arrays.
#ifndef FUSEDPS_KERNELS_ROW_TABLE_TEST_UTIL_H_
#define FUSEDPS_KERNELS_ROW_TABLE_TEST_UTIL_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/adamw_math.h"
#include "kernels/row_sparse.h"

namespace fusedps {
namespace row_table_test {

// torch.optim.SparseAdam's defaults, lr 0.01 (AdamWHyperparameters' weight_decay default is
// AdamW's 1e-2; SparseAdam has none).
inline AdamWHyperparameters SparseAdamDefaults() {
  AdamWHyperparameters h;
  h.lr = 0.01;
  h.weight_decay = 0;
  return h;
}

// Large eps and small betas, where Adam's order (eps added to sqrt(exp_avg_sq) unscaled)
// differs visibly from AdamW's.
inline AdamWHyperparameters OddSparseAdam() {
  AdamWHyperparameters h = SparseAdamDefaults();
  h.lr = 0.05;
  h.beta1 = 0.5;
  h.beta2 = 0.9;
  h.eps = 1e-2;
  return h;
}

// Odd betas and eps with decoupled weight decay (of the pushed rows only, sparse_adam_math.h):
// the backends' table tests (cpu_table_rows_test.cc, cuda_backend_tables_test.cc).
inline AdamWHyperparameters DecayedSparseAdam() {
  AdamWHyperparameters h;
  h.lr = 0.02;
  h.beta1 = 0.8;
  h.beta2 = 0.95;
  h.eps = 1e-6;
  h.weight_decay = 0.05;
  return h;
}

// n standard normal floats.
template <typename Rng>
std::vector<float> NormalFloats(Rng& rng, size_t n) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// Row i of grads ([keys.size(), dim]) summed per key in float64: the coalesced push, by key.
inline std::map<int64_t, std::vector<double>> SumRows(const std::vector<int64_t>& keys,
                                                      const std::vector<float>& grads,
                                                      int64_t dim) {
  std::map<int64_t, std::vector<double>> sums;
  for (size_t i = 0; i < keys.size(); ++i) {
    std::vector<double>& sum = sums[keys[i]];
    sum.resize(dim, 0.0);
    for (int64_t j = 0; j < dim; ++j) sum[j] += grads[i * dim + j];
  }
  return sums;
}

// SparseAdam's step size at the table's step (already incremented), in float64.
inline double ReferenceStepSize(const AdamWHyperparameters& h, int64_t step) {
  const double bias_correction1 = 1 - std::pow(h.beta1, static_cast<double>(step));
  const double bias_correction2 = 1 - std::pow(h.beta2, static_cast<double>(step));
  return h.lr * std::sqrt(bias_correction2) / bias_correction1;
}

// One row's update in float64: g is its summed gradient divided by any grad_scale (maximize
// negates it here); params, exp_avg and exp_avg_sq point at the row's dim elements.
inline void ReferenceRowUpdate(const AdamWHyperparameters& h, double step_size,
                               const std::vector<double>& g, double* params, double* exp_avg,
                               double* exp_avg_sq) {
  for (size_t j = 0; j < g.size(); ++j) {
    const double grad = h.maximize ? -g[j] : g[j];
    params[j] -= h.lr * h.weight_decay * params[j];
    exp_avg[j] = h.beta1 * exp_avg[j] + (1 - h.beta1) * grad;
    exp_avg_sq[j] = h.beta2 * exp_avg_sq[j] + (1 - h.beta2) * grad * grad;
    params[j] -= step_size * exp_avg[j] / (std::sqrt(exp_avg_sq[j]) + h.eps);
  }
}

inline bool SameBytes(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// A copy of everything a step may change in a table: its three arrays and its step count.
struct TableBytes {
  explicit TableBytes(const RowSparseTable& t)
      : params(t.params.begin(), t.params.end()),
        exp_avg(t.exp_avg.begin(), t.exp_avg.end()),
        exp_avg_sq(t.exp_avg_sq.begin(), t.exp_avg_sq.end()),
        step(t.step) {}
  std::vector<float> params, exp_avg, exp_avg_sq;
  int64_t step;
};

inline void ExpectSameBytes(const TableBytes& a, const TableBytes& b) {
  EXPECT_TRUE(SameBytes(a.params, b.params));
  EXPECT_TRUE(SameBytes(a.exp_avg, b.exp_avg));
  EXPECT_TRUE(SameBytes(a.exp_avg_sq, b.exp_avg_sq));
  EXPECT_EQ(a.step, b.step);
}

}  // namespace row_table_test
}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_ROW_TABLE_TEST_UTIL_H_
