// tensor_table.h: the host-side table of a shard's tensors and param groups that every backend
// keeps: each tensor's arena offset, numel, group and step, and each group's hyperparameters.
//
// Offsets are in elements and multiples of 8 (AlignedNumel), so every tensor starts on a
// 16-byte boundary in arenas of 2- and 4-byte elements. Tensors are appended; only the newest
// can be removed (Truncate, to undo a registration that failed).
//
// Usage:
//   TensorTable table;
//   RETURN_IF_ERROR(table.SetGroup(0, AdamWHyperparameters{}));
//   absl::StatusOr<uint64_t> arena_numel = table.ArenaNumelWith(new_tensors);
//   ... grow the arenas to *arena_numel ...
//   table.Append(new_tensors);
#ifndef FUSEDPS_KERNELS_TENSOR_TABLE_H_
#define FUSEDPS_KERNELS_TENSOR_TABLE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/adamw_math.h"
#include "kernels/backend.h"

namespace fusedps {

// A backend's four fp32 arenas, for picking one by TensorField.
struct FieldArenas {
  const float* params;
  const float* exp_avg;
  const float* exp_avg_sq;
  const float* max_exp_avg_sq;
};

class TensorTable {
 public:
  // Creates (group == group count) or replaces group `group`.
  // Errors: INVALID_ARGUMENT when `group` would leave a gap.
  absl::Status SetGroup(uint32_t group, const AdamWHyperparameters& hyper);

  // The arena size, in elements, once `tensors` are appended. Changes nothing.
  // Errors: INVALID_ARGUMENT for a tensor of an unknown group.
  absl::StatusOr<uint64_t> ArenaNumelWith(absl::Span<const NewTensor> tensors) const;

  // Appends the tensors at the end of the arenas, with step 0.
  // REQUIRES: ArenaNumelWith(tensors) succeeded.
  void Append(absl::Span<const NewTensor> tensors);

  // Removes tensors [count, size()), the newest ones. REQUIRES: count <= size().
  void Truncate(uint32_t count);

  // One more step for each of the tensors.
  void AdvanceSteps(absl::Span<const uint32_t> tensors);
  // A restored tensor's step. REQUIRES: tensor < size().
  void SetStep(uint32_t tensor, int64_t step) { steps_[tensor] = step; }

  // Checks a Write (backend.h) against the table: the tensor, the range, the param copy
  // (FieldOf checks max_exp_avg_sq). Errors as Write's.
  absl::Status CheckWrite(const WriteRequest& request, ParamCopyDType copy) const;
  // INVALID_ARGUMENT unless `step` may be SetStep's for `tensor` (backend.h).
  absl::Status CheckStep(uint32_t tensor, int64_t step) const;

  uint32_t size() const { return static_cast<uint32_t>(offsets_.size()); }
  uint64_t arena_numel() const { return arena_numel_; }
  uint64_t offset(uint32_t tensor) const { return offsets_[tensor]; }
  uint64_t numel(uint32_t tensor) const { return numels_[tensor]; }
  uint32_t group_of(uint32_t tensor) const { return groups_of_[tensor]; }
  int64_t step(uint32_t tensor) const { return steps_[tensor]; }
  const AdamWHyperparameters& hyper_of(uint32_t tensor) const {
    return groups_[groups_of_[tensor]];
  }
  const std::vector<AdamWHyperparameters>& groups() const { return groups_; }
  const std::vector<int64_t>& steps() const { return steps_; }
  bool any_amsgrad() const;

  // The arena that holds `field` of `tensor`, shifted to the tensor's first element.
  // Errors: FAILED_PRECONDITION for max_exp_avg_sq of a tensor whose group has no amsgrad.
  absl::StatusOr<const float*> FieldOf(const FieldArenas& arenas, TensorField field,
                                       uint32_t tensor) const;

 private:
  std::vector<AdamWHyperparameters> groups_;
  std::vector<uint64_t> offsets_;
  std::vector<uint64_t> numels_;
  std::vector<uint32_t> groups_of_;
  std::vector<int64_t> steps_;
  uint64_t arena_numel_ = 0;
};

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_TENSOR_TABLE_H_
