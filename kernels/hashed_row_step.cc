#include "kernels/hashed_row_step.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/row_init.h"

namespace fusedps {

absl::StatusOr<bool> ApplyHashedRowStep(RowSparseTable& table, HashedRowIndex& index,
                                        const AdamWHyperparameters& hyper,
                                        absl::Span<const int64_t> keys,
                                        absl::Span<const float> grads, float grad_scale,
                                        uint64_t seed, float init_std) {
  if (absl::Status s = CheckRowSparseStep(table, hyper, grad_scale); !s.ok()) return s;
  if (table.rows != index.capacity()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "table.rows = ", table.rows, " is not the index's capacity ", index.capacity()));
  }
  if (!std::isfinite(init_std) || init_std < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("init_std = ", init_std, " is not a finite value >= 0"));
  }
  const auto dim = static_cast<size_t>(table.dim);
  if (grads.size() % dim != 0 || grads.size() / dim != keys.size()) {
    return absl::InvalidArgumentError(absl::StrCat("grads has ", grads.size(),
                                                   " floats, not keys.size() * dim = ", keys.size(),
                                                   " * ", table.dim));
  }

  CoalescedRows rows = CoalesceRows(keys, grads, table.dim);
  absl::StatusOr<HashedRowIndex::SlotPlan> plan = index.PlanSlots(rows.keys);
  if (!plan.ok()) return plan.status();
  const AdamWStepScalars s = MakeStepScalars(hyper, table.step + 1, grad_scale);
  // All or nothing: every gradient is checked before the index or the table is written.
  if (!UnscaleRowGrads(s, absl::MakeSpan(rows.grads))) return false;

  ++table.step;
  index.Commit(*plan, table.step);
  for (const int64_t i : plan->created) {
    const size_t offset = static_cast<size_t>(plan->slots[i]) * dim;
    InitRow(seed, plan->keys[i], init_std, table.dim, table.params.data() + offset);
    ZeroRowMoments(table, plan->slots[i]);
  }
  UpdateTableRows(table, s, plan->slots, rows.grads);
  return true;
}

void InitRows(uint64_t seed, float init_std, int64_t dim, absl::Span<const int64_t> keys,
              float* out) {
  for (size_t i = 0; i < keys.size(); ++i) {
    InitRow(seed, keys[i], init_std, dim, out + i * static_cast<size_t>(dim));
  }
}

}  // namespace fusedps
