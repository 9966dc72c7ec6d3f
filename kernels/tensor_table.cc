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

absl::Status TensorTable::CheckWrite(const WriteRequest& request, ParamCopyDType copy) const {
  if (request.tensor >= size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("write of tensor ", request.tensor, " of ", size()));
  }
  if (request.offset > numel(request.tensor) ||
      request.count > numel(request.tensor) - request.offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "write of elements [", request.offset, ", +", request.count, ") of tensor ",
        request.tensor, ", which has ", numel(request.tensor)));
  }
  if (request.param_copy &&
      (request.field != TensorField::kParam || copy == ParamCopyDType::kNone)) {
    return absl::FailedPreconditionError(
        "a write of the param copy needs field param and a backend that keeps a copy");
  }
  return absl::OkStatus();
}

absl::Status TensorTable::CheckStep(uint32_t tensor, int64_t step) const {
  if (tensor >= size()) {
    return absl::InvalidArgumentError(absl::StrCat("step of tensor ", tensor, " of ", size()));
  }
  if (step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", tensor, " step ", step, " < 0"));
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
