// row_sparse.h: one row-sparse optimizer step of an embedding table, on the CPU.
//
// An embedding table is a [rows, dim] matrix of params with its Adam state (exp_avg,
// exp_avg_sq, same shape). A push names some rows by key (the row's index, an int64 in
// [0, rows), duplicates allowed) with one gradient row each; the step sums the gradients of
// duplicate keys (as torch.Tensor.coalesce() does), then updates the pushed rows only, with
// torch.optim.SparseAdam's math (kernels/sparse_adam_math.h: its op order, its sources and our
// one extension, decoupled weight decay of the pushed rows). Rows not pushed keep every byte
// of their params and moments; the table's one step count advances at every applied step.
//
// Errors are absl::InvalidArgumentError naming the field and its limit, e.g.
// "keys[3] = 70 is outside [0, 64) (the table's rows)", and change nothing: every check runs
// before any write. A step whose gradients are not all finite (after summing duplicates and
// dividing by grad_scale) is skipped whole: nothing changes, the step count included, and the
// call returns false, as a dense push with a non-finite gradient is skipped.
//
// Thread safety: none; one thread at a time per table.
//
// Usage:
//   std::vector<float> params(rows * dim), exp_avg(rows * dim), exp_avg_sq(rows * dim);
//   RowSparseTable table{absl::MakeSpan(params), absl::MakeSpan(exp_avg),
//                        absl::MakeSpan(exp_avg_sq), rows, dim, /*step=*/0};
//   absl::StatusOr<bool> applied = ApplyRowSparseStep(table, hyper, keys, grads, 0.0f);
//   if (!applied.ok()) ...;    // bad input; nothing changed
//   if (!*applied) ...;        // non-finite gradients; skipped, nothing changed
#ifndef FUSEDPS_KERNELS_ROW_SPARSE_H_
#define FUSEDPS_KERNELS_ROW_SPARSE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/adamw_math.h"

namespace fusedps {

// One table's state, which the caller owns: params, exp_avg and exp_avg_sq are fp32 [rows, dim]
// row-major (row r is elements [r * dim, (r + 1) * dim)), each of exactly rows * dim floats; the
// moments start at zero, as torch's. step is the number of steps applied so far (0 before the
// first), one count for the whole table.
struct RowSparseTable {
  absl::Span<float> params;
  absl::Span<float> exp_avg;
  absl::Span<float> exp_avg_sq;
  int64_t rows = 0;  // >= 0
  int64_t dim = 0;   // >= 1
  int64_t step = 0;  // >= 0
  // How the moments are stored (the group's state_dtype; exp_avg and exp_avg_sq are empty
  // unless fp32):
  //   kBFloat16: exp_avg16 and exp_avg_sq16, bf16 bit patterns of rows * dim each, widened to
  //     fp32 for each update and stored rounded to nearest even (SparseAdamUpdateBFloat16State);
  //   kInt8: exp_avg8 and exp_avg_sq8, rows * dim codes each, with one fp32 scale per row in
  //     exp_avg_absmax and exp_avg_sq_absmax (rows each): a row's moments are dequantized, updated
  //     in fp32 (the params with the fp32 moments) and quantized against the row's new absmax,
  //     quant_math.h's block-wise int8 state with a block per row (SparseAdamUpdateInt8Row).
  StateDType state = StateDType::kFloat32;
  absl::Span<uint16_t> exp_avg16 = {};
  absl::Span<uint16_t> exp_avg_sq16 = {};
  absl::Span<uint8_t> exp_avg8 = {};
  absl::Span<uint8_t> exp_avg_sq8 = {};
  absl::Span<float> exp_avg_absmax = {};
  absl::Span<float> exp_avg_sq_absmax = {};
};

// A push's gradients with duplicate keys summed.
struct CoalescedRows {
  std::vector<int64_t> keys;  // Unique, ascending.
  std::vector<float> grads;   // [keys.size(), dim] row-major: row i belongs to keys[i].
};

// The unique keys of `keys`, ascending, each with the fp32 sum of its gradient rows; row i of
// `grads` (elements [i * dim, (i + 1) * dim)) belongs to keys[i]. Duplicates are summed in push
// order (first + second + ...); a key pushed once keeps its row's bits. Keys are not checked
// against any table.
// REQUIRES: dim >= 1 and grads.size() == keys.size() * dim.
CoalescedRows CoalesceRows(absl::Span<const int64_t> keys, absl::Span<const float> grads,
                           int64_t dim);

// One SparseAdam step (sparse_adam_math.h) of `table`: row i of `grads` ([keys.size(), dim]
// fp32, row-major) is the gradient of row keys[i] of the table. grad_scale <= 0 means none;
// otherwise the summed gradients are divided by it (a loss scale, as in adamw_math.h).
// hyper's lr, beta1, beta2, eps, weight_decay (decoupled, pushed rows only) and maximize apply.
// Returns true when the step was applied (step incremented, pushed rows updated; an empty push
// only increments step, as torch's), false when it was skipped for a non-finite gradient.
// Errors (INVALID_ARGUMENT, nothing changed):
//   - table: dim < 1, rows < 0, step < 0, or params / exp_avg / exp_avg_sq not rows * dim floats;
//   - hyper: amsgrad, L2 weight decay (decoupled_weight_decay false, weight_decay != 0), a
//     params_dtype other than fp32, or a state_dtype other than the table's moments (fp32,
//     bf16 or int8);
//   - grad_scale: NaN or infinite;
//   - keys: a key outside [0, table.rows);
//   - grads: not keys.size() * table.dim floats.
absl::StatusOr<bool> ApplyRowSparseStep(RowSparseTable& table, const AdamWHyperparameters& hyper,
                                        absl::Span<const int64_t> keys,
                                        absl::Span<const float> grads, float grad_scale);

// --- ApplyRowSparseStep's pieces, shared with the step of hashed tables (hashed_row_step.h). ---

// ApplyRowSparseStep's checks of table, hyper and grad_scale, in that order, with its errors.
absl::Status CheckRowSparseStep(const RowSparseTable& table, const AdamWHyperparameters& hyper,
                                float grad_scale);

// ApplyRowSparseStep's checks of keys and grads against `table`, with its errors (fields named
// "keys[i]" and "grads").
absl::Status CheckRowSparsePush(const RowSparseTable& table, absl::Span<const int64_t> keys,
                                absl::Span<const float> grads);

// Step 1 of sparse_adam_math.h on a push's coalesced gradients, in place: each g becomes
// SparseAdamGrad(s, g). Returns false at the first one that is not finite: the step must then be
// skipped whole (grads is then partly rewritten; no table was read or written).
bool UnscaleRowGrads(const AdamWStepScalars& s, absl::Span<float> grads);

// Steps 2 to 6 of sparse_adam_math.h: row rows[i] of the table's params and moments is updated
// with row i of grads (UnscaleRowGrads'). s is for the table's incremented step.
// REQUIRES: each row in [0, table.rows), none twice; grads.size() == rows.size() * table.dim.
void UpdateTableRows(RowSparseTable& table, const AdamWStepScalars& s,
                     absl::Span<const int64_t> rows, absl::Span<const float> grads);

// Sets row `row`'s moments to zero, as a created row's (int8: codes 0 and scales 0, the bytes
// of a registered table's rows). REQUIRES: row in [0, table.rows).
void ZeroRowMoments(RowSparseTable& table, int64_t row);

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_ROW_SPARSE_H_
