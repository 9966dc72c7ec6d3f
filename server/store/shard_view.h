// shard_view.h: the immutable picture of a shard's names, specs and param groups, shared by
// every reader.
//
// The update engine (server/engine) is the only writer of a shard. When a registration or a
// hyperparameter change commits, it builds a new ShardView and swaps it in; readers (pulls,
// GetInfo, ListTensors, metrics scrapes, the push-header check on gRPC's threads) take a
// std::shared_ptr to the current one and read it without any lock and without waiting for the
// device. A view never changes after it is built. Values that change at every step (steps, the
// version) are not here: see UpdateEngine::version() and Steps().
//
// This file also holds the checks of names and shapes that registration and
// SetHyperparameters share. Their errors (absl::Status) name the field and the limit:
//   INVALID_ARGUMENT  a bad name or shape
//   NOT_FOUND         a tensor or param group that is not registered
//   ALREADY_EXISTS    a spec that conflicts with a registered one
//
// Usage:
//   std::shared_ptr<const ShardView> view = ShardView::Initial();
//   std::vector<bool> is_new;
//   RETURN_IF_ERROR(view->CheckTensorSpecs(specs, &is_new));
//   view = view->WithTensors(new_metas);
//   absl::StatusOr<std::vector<uint32_t>> indices = view->Resolve({"w", "b"});
#ifndef FUSEDPS_SERVER_STORE_SHARD_VIEW_H_
#define FUSEDPS_SERVER_STORE_SHARD_VIEW_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/adamw_math.h"
#include "kernels/tensor_layout.h"

namespace fusedps {

inline constexpr char kDefaultParamGroup[] = "default";
inline constexpr size_t kMaxTensorNameBytes = 256;
inline constexpr size_t kMaxGroupNameBytes = 128;
inline constexpr uint64_t kMaxTensorNumel = uint64_t{1} << 36;

struct ParamGroupSpec {
  std::string name;
  AdamWHyperparameters hyperparameters;
};

// A hashed embedding table's keys (proto TableOptions): any int64 names a row, created from
// row_init.h's initializer on first use in one of the table's [capacity, dim] slots.
struct HashedKeys {
  uint64_t seed = 0;
  float init_std = 0.0f;  // Finite, >= 0.
  bool operator==(const HashedKeys& o) const { return seed == o.seed && init_std == o.init_std; }
  bool operator!=(const HashedKeys& o) const { return !(*this == o); }
};

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;  // Empty: a 0-dim tensor of one element.
  std::string param_group;     // Empty means "default".
  // An embedding table (docs/dev/embedding-tables.md): shape [rows, dim], stepped by the rows
  // a push names (TableRows), never as a dense tensor.
  bool table = false;
  // Set (a table only): its keys are hashed; shape [capacity, dim]. Unset: dense ids.
  std::optional<HashedKeys> hashed = std::nullopt;
};

// A registered tensor. Its index is its position in the view (and the backend's index).
struct TensorMeta {
  std::string name;
  std::vector<int64_t> shape;
  uint32_t group = 0;  // Index into ShardView::groups().
  uint64_t numel = 0;
  bool table = false;  // An embedding table of shape [rows, dim] (TensorSpec::table).
  std::optional<HashedKeys> hashed =
      std::nullopt;  // A table with hashed keys (TensorSpec::hashed).
  // A table's row width, shape[1]; 0 for a dense tensor.
  uint64_t table_dim() const { return table ? static_cast<uint64_t>(shape[1]) : 0; }
};

class ShardView {
 public:
  // The empty shard: no tensors, and the group "default" with torch.optim.AdamW's defaults.
  static std::shared_ptr<const ShardView> Initial();

  // A copy of this view with `added` appended (indices tensor_count() onwards), or with group
  // `index` created (index == groups().size()) or replaced.
  // REQUIRES: added names are new and distinct, their groups exist; index <= groups().size().
  std::shared_ptr<const ShardView> WithTensors(std::vector<TensorMeta> added) const;
  std::shared_ptr<const ShardView> WithGroup(uint32_t index, ParamGroupSpec group) const;
  std::shared_ptr<const ShardView> WithPlanHash(std::string plan_hash) const;

  // The sharding plan's hash the shard was registered with (docs/sharding.md); empty when
  // unsharded.
  const std::string& plan_hash() const { return plan_hash_; }

  uint32_t tensor_count() const { return static_cast<uint32_t>(tensors_->size()); }
  const TensorMeta& tensor(uint32_t index) const { return (*tensors_)[index]; }
  std::optional<uint32_t> FindTensor(absl::string_view name) const;
  // Resolves names to indices, in the given order; no names means every tensor in registration
  // order. NOT_FOUND names the first unknown tensor (QuoteName).
  absl::StatusOr<std::vector<uint32_t>> Resolve(absl::Span<const std::string> names) const;

  const std::vector<ParamGroupSpec>& groups() const { return groups_; }
  std::optional<uint32_t> FindGroup(absl::string_view name) const;
  const std::string& group_name_of(uint32_t index) const {
    return groups_[tensor(index).group].name;
  }
  // How tensor `index` is stored (its group's dtypes and its size: LayoutOf), as the backend
  // stores it.
  TensorLayout layout(uint32_t index) const {
    return LayoutOf(groups_[tensor(index).group].hyperparameters, tensor(index).numel,
                    tensor(index).table_dim());
  }

  uint64_t parameter_count() const { return parameter_count_; }

  // Checks registration specs against each other and this view, without registering.
  // `is_new[i]` tells whether specs[i] would be created (false: an identical spec exists, which
  // registration leaves as it is). Errors: INVALID_ARGUMENT for a bad name or shape or a name
  // given twice, and for a table whose shape is not [rows, dim >= 1] or whose group the row
  // step refuses (CheckTableGroup); NOT_FOUND for an unregistered group; ALREADY_EXISTS for a
  // spec that conflicts with a registered one (another shape or group, a table or not).
  absl::Status CheckTensorSpecs(const std::vector<TensorSpec>& specs,
                                std::vector<bool>* is_new) const;

 private:
  ShardView() = default;
  void IndexTensorsFrom(uint32_t first);

  // Shared with earlier views when only groups changed.
  std::shared_ptr<const std::vector<TensorMeta>> tensors_;
  // Keys point into *tensors_, which this view keeps alive.
  std::shared_ptr<const absl::flat_hash_map<absl::string_view, uint32_t>> tensor_index_;
  std::vector<ParamGroupSpec> groups_;
  absl::flat_hash_map<std::string, uint32_t> group_index_;
  uint64_t parameter_count_ = 0;
  std::string plan_hash_;
};

inline constexpr size_t kMaxPlanHashBytes = 64;

// Checks a registration's or a push's plan_hash (`field`) against the shard's: OK when equal,
// or for a registration (`registering`) of a shard with no tensors and no plan yet.
// Errors: INVALID_ARGUMENT over kMaxPlanHashBytes; FAILED_PRECONDITION naming both hashes.
absl::Status CheckPlanHash(const ShardView& view, absl::string_view plan_hash,
                           absl::string_view field, bool registering);

// OK when a param group can hold embedding tables: fp32 params (any state_dtype), no amsgrad,
// decoupled weight decay (kernels/row_sparse.h's step). Else INVALID_ARGUMENT naming `field` and
// what the group has.
absl::Status CheckTableGroup(const ParamGroupSpec& group, absl::string_view field);

// Number of elements of a shape; INVALID_ARGUMENT for a negative dim or over kMaxTensorNumel.
absl::StatusOr<uint64_t> NumelOf(const std::vector<int64_t>& shape);

// INVALID_ARGUMENT unless `name` has 1 to max_bytes bytes; the message names `field`.
absl::Status CheckName(absl::string_view name, size_t max_bytes, absl::string_view field);

// A name for an error message: quoted, and cut to its first 64 bytes (with its length) when
// longer, so that a hostile 20 KB name cannot make the status too large for gRPC's metadata.
std::string QuoteName(absl::string_view name);

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_STORE_SHARD_VIEW_H_
