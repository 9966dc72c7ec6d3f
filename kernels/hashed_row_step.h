// hashed_row_step.h: one SparseAdam step of a hashed embedding table, on the CPU, fp32 state.
//
// A hashed table is a RowSparseTable (row_sparse.h) of `capacity` rows whose rows are slots,
// with a HashedRowIndex (hashed_rows.h) saying which int64 key holds which slot. A push names
// rows by key (any int64, duplicates allowed) with one gradient row each. The step:
//   1. checks everything (errors below), sums duplicate keys' gradients (CoalesceRows), plans
//      the keys' slots (HashedRowIndex::PlanSlots) and checks that every summed gradient,
//      divided by grad_scale, is finite;
//   2. only then: increments the table's step, commits the plan (new keys take free slots, then
//      the least recently updated rows not named by the push; every pushed key is stamped with
//      the new step), writes each created row (params = row_init.h's InitRow(seed, key,
//      init_std), exp_avg = exp_avg_sq = 0), and updates every pushed row with
//      sparse_adam_math.h's math, as ApplyRowSparseStep does.
// An evicted row's state is gone: if its key comes back, its row restarts from the initializer
// with zero moments. A refused (error) or skipped (non-finite) push changes nothing: no table
// byte, not the step, not the index, not its counters. A push counts no lookups.
//
// Thread safety: none; one thread at a time per table and index (the engine's single writer).
//
// Usage:
//   std::vector<float> params(capacity * dim), exp_avg(capacity * dim), exp_avg_sq(...);
//   RowSparseTable table{..., /*rows=*/capacity, dim, /*step=*/0};
//   HashedRowIndex index(capacity);
//   absl::StatusOr<bool> applied =
//       ApplyHashedRowStep(table, index, hyper, keys, grads, 0.0f, seed, init_std);
#ifndef FUSEDPS_KERNELS_HASHED_ROW_STEP_H_
#define FUSEDPS_KERNELS_HASHED_ROW_STEP_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/adamw_math.h"
#include "kernels/hashed_rows.h"
#include "kernels/row_sparse.h"

namespace fusedps {

// One SparseAdam step of the hashed table (table, index): row i of `grads` ([keys.size(), dim]
// fp32, row-major) is the gradient of the row of keys[i]. grad_scale and hyper as in
// ApplyRowSparseStep; seed and init_std are the table's initializer's (row_init.h).
// Returns true when applied (an empty push only increments step), false when skipped for a
// non-finite gradient. Errors (INVALID_ARGUMENT, nothing changed):
//   - table, hyper, grad_scale: as ApplyRowSparseStep's;
//   - table.rows: not index.capacity();
//   - init_std: NaN, infinite or below 0;
//   - grads: not keys.size() * table.dim floats;
//   - keys: more unique keys than the capacity ("keys: 17 unique keys exceed the table's
//     capacity of 16 rows").
absl::StatusOr<bool> ApplyHashedRowStep(RowSparseTable& table, HashedRowIndex& index,
                                        const AdamWHyperparameters& hyper,
                                        absl::Span<const int64_t> keys,
                                        absl::Span<const float> grads, float grad_scale,
                                        uint64_t seed, float init_std);

// The initial params of the rows of `keys` (row_init.h's InitRow(seed, key, init_std)), row i
// (keys[i]'s) at out[i * dim, (i + 1) * dim). Compiled without contracted multiply-adds, so the
// bits are row_init.h's on any host. REQUIRES: dim >= 1; out holds keys.size() * dim floats.
void InitRows(uint64_t seed, float init_std, int64_t dim, absl::Span<const int64_t> keys,
              float* out);

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_HASHED_ROW_STEP_H_
