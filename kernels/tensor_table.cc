#include "kernels/tensor_table.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace fusedps {

absl::Status TensorTable::SetGroup(uint32_t group, const AdamWHyperparameters& hyper) {
  if (group > groups_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("param group index ", group, " skips ", groups_.size()));
  }
  if (group == groups_.size()) {
    groups_.push_back(hyper);
  } else {
    groups_[group] = hyper;
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> TensorTable::ArenaNumelWith(absl::Span<const NewTensor> tensors) const {
  uint64_t total = arena_numel_;
  for (const NewTensor& t : tensors) {
    if (t.param_group >= groups_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("param group index ", t.param_group, " is not registered"));
    }
    total += AlignedNumel(t.numel);
  }
  return total;
}

void TensorTable::Append(absl::Span<const NewTensor> tensors) {
  for (const NewTensor& t : tensors) {
    offsets_.push_back(arena_numel_);
    numels_.push_back(t.numel);
    groups_of_.push_back(t.param_group);
    steps_.push_back(0);
    arena_numel_ += AlignedNumel(t.numel);
  }
}

void TensorTable::Truncate(uint32_t count) {
  if (count >= size()) return;
  arena_numel_ = offsets_[count];
  offsets_.resize(count);
  numels_.resize(count);
  groups_of_.resize(count);
  steps_.resize(count);
}

void TensorTable::AdvanceSteps(absl::Span<const uint32_t> tensors) {
  for (uint32_t t : tensors) ++steps_[t];
}

absl::Status TensorTable::CheckRestore(uint32_t tensor, const TensorState& state) const {
  if (tensor >= size()) {
    return absl::InvalidArgumentError(absl::StrCat("restore of tensor ", tensor, " of ", size()));
  }
  if (state.step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", tensor, " step ", state.step, " < 0"));
  }
  if (state.params == nullptr || state.exp_avg == nullptr || state.exp_avg_sq == nullptr ||
      (hyper_of(tensor).amsgrad && state.max_exp_avg_sq == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("restore of tensor ", tensor, " lacks an array of its state"));
  }
  return absl::OkStatus();
}

bool TensorTable::any_amsgrad() const {
  return std::any_of(groups_.begin(), groups_.end(),
                     [](const AdamWHyperparameters& h) { return h.amsgrad; });
}

absl::StatusOr<const float*> TensorTable::FieldOf(const FieldArenas& arenas, TensorField field,
                                                  uint32_t tensor) const {
  const float* arena = arenas.params;
  switch (field) {
    case TensorField::kParam:
      break;
    case TensorField::kExpAvg:
      arena = arenas.exp_avg;
      break;
    case TensorField::kExpAvgSq:
      arena = arenas.exp_avg_sq;
      break;
    case TensorField::kMaxExpAvgSq:
      if (!hyper_of(tensor).amsgrad) {
        return absl::FailedPreconditionError("max_exp_avg_sq exists only with amsgrad");
      }
      arena = arenas.max_exp_avg_sq;
      break;
  }
  return arena + offset(tensor);
}

}  // namespace fusedps
