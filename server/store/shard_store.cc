#include "server/store/shard_store.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace fusedps {
namespace {

const std::string& GroupName(const TensorSpec& spec) {
  static const std::string* const kDefault = new std::string(kDefaultParamGroup);
  return spec.param_group.empty() ? *kDefault : spec.param_group;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

bool SameHyperparameters(const AdamWHyperparameters& a, const AdamWHyperparameters& b) {
  return a.lr == b.lr && a.beta1 == b.beta1 && a.beta2 == b.beta2 && a.eps == b.eps &&
         a.weight_decay == b.weight_decay && a.amsgrad == b.amsgrad && a.maximize == b.maximize &&
         a.decoupled_weight_decay == b.decoupled_weight_decay;
}

absl::Status CheckName(const std::string& name, size_t max_length, absl::string_view field) {
  if (name.empty() || name.size() > max_length) {
    return absl::InvalidArgumentError(absl::StrCat(field, " must have 1 to ", max_length,
                                                   " characters, has ", name.size()));
  }
  return absl::OkStatus();
}

}  // namespace

ShardStore::ShardStore(std::unique_ptr<OptimizerBackend> backend)
    : backend_name_(backend->name()),
      device_(backend->device()),
      param_copy_dtype_(backend->param_copy_dtype()),
      backend_(std::move(backend)) {
  // "default" exists from the start, with torch.optim.AdamW's defaults.
  const absl::Status s = backend_->SetParamGroup(0, AdamWHyperparameters{});
  if (!s.ok()) {
    std::fprintf(stderr, "fusedps: cannot create the default param group: %s\n",
                 s.ToString().c_str());
    std::abort();
  }
  groups_.push_back({kDefaultParamGroup, AdamWHyperparameters{}});
  group_index_.emplace(kDefaultParamGroup, 0);
}

absl::StatusOr<uint64_t> ShardStore::NumelOf(const std::vector<int64_t>& shape) {
  uint64_t numel = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape[", d, "] = ", shape[d], " must be >= 0"));
    }
    if (shape[d] != 0 && numel > kMaxTensorNumel / static_cast<uint64_t>(shape[d])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shape ", ShapeString(shape), " has more than ", kMaxTensorNumel, " elements"));
    }
    numel *= static_cast<uint64_t>(shape[d]);
  }
  return numel;
}

absl::Status ShardStore::ValidateHyperparameters(const AdamWHyperparameters& h) {
  auto out_of_range = [](absl::string_view field, double value, absl::string_view range) {
    return absl::InvalidArgumentError(
        absl::StrCat("hyperparameters.", field, " = ", value, " must be ", range));
  };
  if (!std::isfinite(h.lr) || h.lr < 0) return out_of_range("lr", h.lr, "finite and >= 0");
  if (!(h.beta1 >= 0 && h.beta1 < 1)) return out_of_range("beta1", h.beta1, "in [0, 1)");
  if (!(h.beta2 >= 0 && h.beta2 < 1)) return out_of_range("beta2", h.beta2, "in [0, 1)");
  if (!std::isfinite(h.eps) || h.eps < 0) return out_of_range("eps", h.eps, "finite and >= 0");
  if (!std::isfinite(h.weight_decay) || h.weight_decay < 0) {
    return out_of_range("weight_decay", h.weight_decay, "finite and >= 0");
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> ShardStore::RegisterParamGroup(const ParamGroupSpec& group) {
  if (absl::Status s = CheckName(group.name, kMaxGroupNameLength, "param_group.name"); !s.ok()) {
    return s;
  }
  if (absl::Status s = ValidateHyperparameters(group.hyperparameters); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (auto it = group_index_.find(group.name); it != group_index_.end()) {
    if (SameHyperparameters(groups_[it->second].hyperparameters, group.hyperparameters)) {
      return false;
    }
    return absl::AlreadyExistsError(absl::StrCat(
        "param group '", group.name,
        "' is registered with other hyperparameters; change them with SetHyperparameters"));
  }
  const uint32_t index = static_cast<uint32_t>(groups_.size());
  if (absl::Status s = backend_->SetParamGroup(index, group.hyperparameters); !s.ok()) return s;
  groups_.push_back(group);
  group_index_.emplace(group.name, index);
  return true;
}

absl::StatusOr<ParamGroupSpec> ShardStore::SetHyperparameters(const std::string& group,
                                                              const HyperparameterUpdate& update) {
  absl::MutexLock lock(&mu_);
  auto it = group_index_.find(group.empty() ? std::string(kDefaultParamGroup) : group);
  if (it == group_index_.end()) {
    return absl::NotFoundError(absl::StrCat("param group '", group, "' is not registered"));
  }
  ParamGroupSpec changed = groups_[it->second];
  AdamWHyperparameters& h = changed.hyperparameters;
  if (update.amsgrad.has_value() && *update.amsgrad != h.amsgrad) {
    return absl::InvalidArgumentError(
        "hyperparameters.amsgrad is fixed at registration (max_exp_avg_sq would be missing)");
  }
  h.lr = update.lr.value_or(h.lr);
  h.beta1 = update.beta1.value_or(h.beta1);
  h.beta2 = update.beta2.value_or(h.beta2);
  h.eps = update.eps.value_or(h.eps);
  h.weight_decay = update.weight_decay.value_or(h.weight_decay);
  h.maximize = update.maximize.value_or(h.maximize);
  h.decoupled_weight_decay = update.decoupled_weight_decay.value_or(h.decoupled_weight_decay);
  if (absl::Status s = ValidateHyperparameters(h); !s.ok()) return s;
  if (absl::Status s = backend_->SetParamGroup(it->second, h); !s.ok()) return s;
  groups_[it->second] = changed;
  return changed;
}

absl::Status ShardStore::CheckTensorSpecs(const std::vector<TensorSpec>& specs,
                                          std::vector<bool>* is_new) const {
  absl::ReaderMutexLock lock(&mu_);
  return CheckTensorSpecsLocked(specs, is_new);
}

absl::Status ShardStore::CheckTensorSpecsLocked(const std::vector<TensorSpec>& specs,
                                                std::vector<bool>* is_new) const {
  is_new->assign(specs.size(), false);
  absl::flat_hash_set<absl::string_view> seen;
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& spec = specs[i];
    const std::string field = absl::StrCat("header.tensors[", i, "]");
    if (absl::Status s = CheckName(spec.name, kMaxTensorNameLength, field + ".name"); !s.ok()) {
      return s;
    }
    if (!seen.insert(spec.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " names tensor '", spec.name, "' a second time"));
    }
    if (absl::StatusOr<uint64_t> numel = NumelOf(spec.shape); !numel.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " ('", spec.name, "'): ", numel.status().message()));
    }
    const std::string& group = GroupName(spec);
    if (!group_index_.contains(group)) {
      return absl::NotFoundError(absl::StrCat(field, ".param_group '", group,
                                              "' is not registered (RegisterParamGroup first)"));
    }
    auto it = tensor_index_.find(spec.name);
    if (it == tensor_index_.end()) {
      (*is_new)[i] = true;
      continue;
    }
    const TensorSpec& old = specs_[it->second];
    if (old.shape != spec.shape || GroupName(old) != group) {
      return absl::AlreadyExistsError(absl::StrCat(
          "tensor '", spec.name, "' is registered with shape ", ShapeString(old.shape),
          " in group '", GroupName(old), "'; this spec has shape ", ShapeString(spec.shape),
          " in group '", group, "'"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<RegisterOutcome> ShardStore::RegisterTensors(
    const std::vector<TensorSpec>& specs, const std::vector<const float*>& values) {
  absl::MutexLock lock(&mu_);
  std::vector<bool> is_new;
  if (absl::Status s = CheckTensorSpecsLocked(specs, &is_new); !s.ok()) return s;
  std::vector<NewTensor> added;
  RegisterOutcome outcome;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (!is_new[i]) {
      ++outcome.existing;
      continue;
    }
    added.push_back({*NumelOf(specs[i].shape), group_index_.at(GroupName(specs[i]))});
  }
  if (absl::Status s = backend_->AddTensors(added); !s.ok()) return s;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (!is_new[i]) continue;
    const uint32_t index = static_cast<uint32_t>(specs_.size());
    const uint64_t numel = backend_->numel(index);
    if (absl::Status s = backend_->WriteParams(index, 0, {values[i], numel}); !s.ok()) return s;
    specs_.push_back(specs[i]);
    tensor_index_.emplace(specs[i].name, index);
    parameter_count_ += numel;
    ++outcome.created;
  }
  return outcome;
}

TensorInfo ShardStore::InfoLocked(uint32_t index) const {
  return TensorInfo{index, specs_[index], backend_->numel(index), backend_->step(index)};
}

absl::StatusOr<std::vector<TensorInfo>> ShardStore::Lookup(
    const std::vector<std::string>& names) const {
  absl::ReaderMutexLock lock(&mu_);
  return LookupLocked(names);
}

absl::StatusOr<std::vector<TensorInfo>> ShardStore::LookupLocked(
    const std::vector<std::string>& names) const {
  std::vector<TensorInfo> infos;
  if (names.empty()) {
    infos.reserve(specs_.size());
    for (uint32_t i = 0; i < specs_.size(); ++i) infos.push_back(InfoLocked(i));
    return infos;
  }
  infos.reserve(names.size());
  for (const std::string& name : names) {
    auto it = tensor_index_.find(name);
    if (it == tensor_index_.end()) {
      return absl::NotFoundError(absl::StrCat("tensor '", name, "' is not registered"));
    }
    infos.push_back(InfoLocked(it->second));
  }
  return infos;
}

absl::StatusOr<PushOutcome> ShardStore::ApplyPush(const ReadyPush& push) {
  absl::MutexLock lock(&mu_);
  const bool tracked = !push.client_id.empty() && push.sequence_number != 0;
  if (tracked) {
    auto it = clients_.find(push.client_id);
    if (it != clients_.end() && push.sequence_number <= it->second.sequence_number) {
      PushOutcome retry = it->second.outcome;
      retry.duplicate = true;
      retry.step_seconds = retry.device_seconds = 0;
      return retry;
    }
  }
  StepRequest request{push.tensors,    push.grad_offsets,  push.grads,       push.grad_dtype,
                      push.grad_scale, push.grads_checked, push.grads_finite};
  const absl::Time start = absl::Now();
  absl::StatusOr<StepOutcome> step = backend_->Step(request);
  if (!step.ok()) return step.status();
  if (!step->skipped) ++version_;
  PushOutcome outcome{version_, step->skipped, step->tensors_updated, false};
  outcome.step_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  // A skipped step ran no kernel: its device time is 0, whatever the backend last reported.
  outcome.device_seconds = step->skipped ? 0.0 : backend_->last_step_device_seconds();
  if (tracked) clients_[push.client_id] = {push.sequence_number, outcome};
  return outcome;
}

uint64_t ShardStore::ReadBytes(const std::vector<TensorInfo>& tensors, GradDType dtype) {
  uint64_t bytes = 0;
  for (const TensorInfo& t : tensors) bytes += t.numel * DTypeSize(dtype);
  return bytes;
}

absl::StatusOr<Snapshot> ShardStore::Read(const std::vector<std::string>& names,
                                          TensorField field, GradDType dtype,
                                          absl::Span<char> out) const {
  absl::ReaderMutexLock lock(&mu_);
  absl::StatusOr<std::vector<TensorInfo>> infos = LookupLocked(names);
  if (!infos.ok()) return infos.status();
  if (ReadBytes(*infos, dtype) > out.size()) {
    return absl::InternalError(absl::StrCat("a read of ", ReadBytes(*infos, dtype),
                                            " bytes into ", out.size()));
  }
  Snapshot snapshot;
  snapshot.version = version_;
  snapshot.data.reserve(infos->size());
  char* at = out.data();
  for (const TensorInfo& info : *infos) {
    absl::Status s = backend_->Read(field, info.index, 0, info.numel, dtype, at);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("tensor '", info.spec.name, "': ", s.message()));
    }
    snapshot.data.push_back(at);
    at += info.numel * DTypeSize(dtype);
  }
  snapshot.tensors = *std::move(infos);
  return snapshot;
}

absl::StatusOr<char*> ShardStore::AllocateStagingArena(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  return backend_->AllocateStagingArena(bytes);
}

// The backend documents CopyStagingToDevice as thread-safe, and backend_ never changes.
absl::Status ShardStore::CopyStagingToDevice(uint64_t offset, uint64_t bytes) const {
  return backend_->CopyStagingToDevice(offset, bytes);
}

uint64_t ShardStore::version() const {
  absl::ReaderMutexLock lock(&mu_);
  return version_;
}

uint64_t ShardStore::parameter_count() const {
  absl::ReaderMutexLock lock(&mu_);
  return parameter_count_;
}

std::vector<ParamGroupSpec> ShardStore::param_groups() const {
  absl::ReaderMutexLock lock(&mu_);
  return groups_;
}

std::map<std::string, uint64_t> ShardStore::launch_counts() const {
  absl::ReaderMutexLock lock(&mu_);
  return backend_->launch_counts();
}

std::map<std::string, uint64_t> ShardStore::memory_bytes() const {
  absl::ReaderMutexLock lock(&mu_);
  return backend_->memory_bytes();
}

}  // namespace fusedps
