#include "server/store/shard_view.h"

#include <cmath>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fusedps {
namespace {

constexpr size_t kQuotedNameBytes = 64;

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

std::string QuoteName(absl::string_view name) {
  if (name.size() <= kQuotedNameBytes) return absl::StrCat("'", name, "'");
  // Cut at a UTF-8 character boundary: never in front of a continuation byte.
  size_t cut = kQuotedNameBytes;
  while (cut > 0 && (static_cast<unsigned char>(name[cut]) & 0xC0) == 0x80) --cut;
  return absl::StrCat("'", name.substr(0, cut), "...' (", name.size(), " bytes)");
}

absl::Status CheckName(absl::string_view name, size_t max_bytes, absl::string_view field) {
  if (name.empty() || name.size() > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must have 1 to ", max_bytes, " bytes, has ", name.size()));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> NumelOf(const std::vector<int64_t>& shape) {
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

std::shared_ptr<const ShardView> ShardView::Initial() {
  std::shared_ptr<ShardView> view(new ShardView());
  view->tensors_ = std::make_shared<const std::vector<TensorMeta>>();
  view->tensor_index_ = std::make_shared<const absl::flat_hash_map<absl::string_view, uint32_t>>();
  view->groups_.push_back({kDefaultParamGroup, AdamWHyperparameters{}});
  view->group_index_.emplace(kDefaultParamGroup, 0);
  return view;
}

std::shared_ptr<const ShardView> ShardView::WithTensors(std::vector<TensorMeta> added) const {
  std::shared_ptr<ShardView> view(new ShardView(*this));
  auto tensors = std::make_shared<std::vector<TensorMeta>>();
  tensors->reserve(tensors_->size() + added.size());
  *tensors = *tensors_;
  for (TensorMeta& meta : added) {
    view->parameter_count_ += meta.numel;
    tensors->push_back(std::move(meta));
  }
  view->tensors_ = std::move(tensors);
  // Rebuilt, not copied: the keys must point into the new view's own names.
  auto index = std::make_shared<absl::flat_hash_map<absl::string_view, uint32_t>>();
  index->reserve(view->tensors_->size());
  for (uint32_t i = 0; i < view->tensors_->size(); ++i) {
    index->emplace((*view->tensors_)[i].name, i);
  }
  view->tensor_index_ = std::move(index);
  return view;
}

std::shared_ptr<const ShardView> ShardView::WithGroup(uint32_t index, ParamGroupSpec group) const {
  std::shared_ptr<ShardView> view(new ShardView(*this));
  if (index == view->groups_.size()) {
    view->group_index_.emplace(group.name, index);
    view->groups_.push_back(std::move(group));
  } else {
    view->groups_[index] = std::move(group);
  }
  return view;
}

std::shared_ptr<const ShardView> ShardView::WithPlanHash(std::string plan_hash) const {
  std::shared_ptr<ShardView> view(new ShardView(*this));
  view->plan_hash_ = std::move(plan_hash);
  return view;
}

absl::Status CheckPlanHash(const ShardView& view, absl::string_view plan_hash,
                           absl::string_view field, bool registering) {
  if (plan_hash.size() > kMaxPlanHashBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " has ", plan_hash.size(), " bytes; at most ", kMaxPlanHashBytes));
  }
  if (plan_hash == view.plan_hash()) return absl::OkStatus();
  if (registering && view.plan_hash().empty() && view.tensor_count() == 0) {
    return absl::OkStatus();
  }
  const auto name = [](absl::string_view h) {
    return h.empty() ? std::string("none") : absl::StrCat("\"", h, "\"");
  };
  return absl::FailedPreconditionError(absl::StrCat(
      field, " ", name(plan_hash), " is not the shard's sharding plan ", name(view.plan_hash()),
      ": the client computed another plan (docs/sharding.md)"));
}

std::optional<uint32_t> ShardView::FindTensor(absl::string_view name) const {
  auto it = tensor_index_->find(name);
  if (it == tensor_index_->end()) return std::nullopt;
  return it->second;
}

std::optional<uint32_t> ShardView::FindGroup(absl::string_view name) const {
  auto it = group_index_.find(name);
  if (it == group_index_.end()) return std::nullopt;
  return it->second;
}

absl::StatusOr<std::vector<uint32_t>> ShardView::Resolve(
    absl::Span<const std::string> names) const {
  std::vector<uint32_t> indices;
  if (names.empty()) {
    indices.resize(tensor_count());
    for (uint32_t i = 0; i < indices.size(); ++i) indices[i] = i;
    return indices;
  }
  indices.reserve(names.size());
  for (const std::string& name : names) {
    std::optional<uint32_t> index = FindTensor(name);
    if (!index.has_value()) {
      return absl::NotFoundError(absl::StrCat("tensor ", QuoteName(name), " is not registered"));
    }
    indices.push_back(*index);
  }
  return indices;
}

absl::Status ShardView::CheckTensorSpecs(const std::vector<TensorSpec>& specs,
                                         std::vector<bool>* is_new) const {
  is_new->assign(specs.size(), false);
  absl::flat_hash_set<absl::string_view> seen;
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& spec = specs[i];
    const std::string field = absl::StrCat("header.tensors[", i, "]");
    if (absl::Status s = CheckName(spec.name, kMaxTensorNameBytes, field + ".name"); !s.ok()) {
      return s;
    }
    if (!seen.insert(spec.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " names tensor ", QuoteName(spec.name), " a second time"));
    }
    if (absl::StatusOr<uint64_t> numel = NumelOf(spec.shape); !numel.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " (", QuoteName(spec.name), "): ", numel.status().message()));
    }
    const absl::string_view group =
        spec.param_group.empty() ? absl::string_view(kDefaultParamGroup) : spec.param_group;
    std::optional<uint32_t> group_index = FindGroup(group);
    if (!group_index.has_value()) {
      return absl::NotFoundError(absl::StrCat(field, ".param_group ", QuoteName(group),
                                              " is not registered (RegisterParamGroup first)"));
    }
    if (spec.table) {
      if (spec.shape.size() != 2 || spec.shape[1] < 1) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, " (", QuoteName(spec.name),
                         "): an embedding table has shape [rows, dim] with dim >= 1, not ",
                         ShapeString(spec.shape)));
      }
      if (absl::Status s = CheckTableGroup(groups_[*group_index], field + ".param_group");
          !s.ok()) {
        return s;
      }
      if (spec.hashed.has_value() &&
          !(std::isfinite(spec.hashed->init_std) && spec.hashed->init_std >= 0.0f)) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ".table.init_std (", QuoteName(spec.name), ") = ", spec.hashed->init_std,
            ": a hashed table's initializer needs a finite standard deviation >= 0"));
      }
    } else if (spec.hashed.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(field, " (", QuoteName(spec.name),
                                                     "): hashed keys without an embedding table"));
    }
    std::optional<uint32_t> existing = FindTensor(spec.name);
    if (!existing.has_value()) {
      (*is_new)[i] = true;
      continue;
    }
    const TensorMeta& old = tensor(*existing);
    if (old.shape != spec.shape || old.group != *group_index || old.table != spec.table ||
        old.hashed != spec.hashed) {
      const auto kind = [](bool table, const std::optional<HashedKeys>& hashed) {
        return !table   ? std::string("a tensor")
               : hashed ? absl::StrCat("a hashed embedding table (seed ", hashed->seed,
                                       ", init_std ", hashed->init_std, ")")
                        : std::string("an embedding table");
      };
      return absl::AlreadyExistsError(absl::StrCat(
          "tensor ", QuoteName(spec.name), " is registered as ", kind(old.table, old.hashed),
          " of shape ", ShapeString(old.shape), " in group ", QuoteName(groups_[old.group].name),
          "; this spec is ", kind(spec.table, spec.hashed), " of shape ", ShapeString(spec.shape),
          " in group ", QuoteName(group)));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckTableGroup(const ParamGroupSpec& group, absl::string_view field) {
  const AdamWHyperparameters& h = group.hyperparameters;
  std::string why;
  if (h.amsgrad) {
    why = "amsgrad";
  } else if (!h.decoupled_weight_decay && h.weight_decay != 0.0) {
    why = "L2 weight decay (weight_decay_mode L2)";
  } else if (h.params_dtype != ParamsDType::kFloat32) {
    why = absl::StrCat("params_dtype ", ParamsDTypeName(h.params_dtype));
  } else {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      field, " ", QuoteName(group.name),
      ": an embedding table's group needs fp32 params, no amsgrad and decoupled weight "
      "decay; it has ",
      why));
}

}  // namespace fusedps
