// shard_store.h: the tensors, param groups and version of one shard, over an optimizer backend.
//
// The store is the only owner of a shard's state. It maps tensor and group names to the
// backend's dense indices, validates specs and hyperparameters, and serializes access: pushes
// and registrations are writers, pulls and listings are readers (absl::Mutex, reader/writer).
//
// Errors (absl::Status codes, which the service passes to gRPC unchanged):
//   NOT_FOUND         a tensor or param group that is not registered
//   INVALID_ARGUMENT  a bad spec or hyperparameter; the message names the field and the limit
//   ALREADY_EXISTS    a spec or group that conflicts with a registered one
//   RESOURCE_EXHAUSTED  the backend could not allocate
// A call that fails changes nothing.
//
// Usage:
//   ShardStore store(MakeCpuBackend({}));
//   store.RegisterParamGroup({"default", AdamWHyperparameters{}});
//   store.RegisterTensors({{"w", {4, 4}, "default"}}, values);
//   PushOutcome outcome = store.ApplyPush(push).value();
#ifndef FUSEDPS_SERVER_STORE_SHARD_STORE_H_
#define FUSEDPS_SERVER_STORE_SHARD_STORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kernels/backend.h"

namespace fusedps {

inline constexpr char kDefaultParamGroup[] = "default";
inline constexpr size_t kMaxTensorNameLength = 256;
inline constexpr size_t kMaxGroupNameLength = 128;
inline constexpr uint64_t kMaxTensorNumel = uint64_t{1} << 36;

struct ParamGroupSpec {
  std::string name;
  AdamWHyperparameters hyperparameters;
};

// Hyperparameters to change; unset fields keep their value.
struct HyperparameterUpdate {
  std::optional<double> lr, beta1, beta2, eps, weight_decay;
  std::optional<bool> amsgrad, maximize, decoupled_weight_decay;
};

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;  // Empty: a 0-dim tensor of one element.
  std::string param_group;     // Empty means "default".
};

struct TensorInfo {
  uint32_t index;
  TensorSpec spec;
  uint64_t numel;
  int64_t step;
};

// A push whose chunks have all arrived and passed their checks.
struct ReadyPush {
  std::string client_id;
  uint64_t sequence_number = 0;
  std::vector<uint32_t> tensors;       // Backend indices.
  std::vector<uint64_t> grad_offsets;  // Into grads, in elements.
  const void* grads = nullptr;         // Owned by the caller until ApplyPush returns.
  GradDType grad_dtype = GradDType::kFloat32;
  float grad_scale = 0.0f;             // <= 0: none.
  bool grads_checked = false;          // Checked for non-finite values as they arrived...
  bool grads_finite = true;            // ...with this result.
};

struct PushOutcome {
  uint64_t version = 0;
  bool skipped = false;
  uint32_t tensors_updated = 0;
  bool duplicate = false;
  // The backend step's wall time, and the part of it its kernels ran on the device (the CPU
  // backend: all of it; a skipped step: none). Both 0 for a duplicate.
  double step_seconds = 0;
  double device_seconds = 0;
};

struct RegisterOutcome {
  uint32_t created = 0;
  uint32_t existing = 0;
};

// A consistent read of some tensors' data at one version.
struct Snapshot {
  uint64_t version = 0;
  std::vector<TensorInfo> tensors;
  std::vector<const char*> data;  // Per tensor, numel elements of the requested dtype.
};

class ShardStore {
 public:
  // The param group "default" exists from the start, with torch.optim.AdamW's defaults.
  explicit ShardStore(std::unique_ptr<OptimizerBackend> backend);

  // Number of elements of a shape; INVALID_ARGUMENT for a negative dim or over kMaxTensorNumel.
  static absl::StatusOr<uint64_t> NumelOf(const std::vector<int64_t>& shape);
  static absl::Status ValidateHyperparameters(const AdamWHyperparameters& h);

  // Returns true when created, false when an identical group already existed.
  absl::StatusOr<bool> RegisterParamGroup(const ParamGroupSpec& group) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<ParamGroupSpec> SetHyperparameters(const std::string& group,
                                                    const HyperparameterUpdate& update)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Checks specs against each other and the registered tensors, without registering.
  // `is_new[i]` tells whether specs[i] would be created (false: an identical spec exists).
  absl::Status CheckTensorSpecs(const std::vector<TensorSpec>& specs, std::vector<bool>* is_new)
      const ABSL_LOCKS_EXCLUDED(mu_);

  // Registers the new specs; values[i] holds specs[i]'s numel initial fp32 values (ignored for
  // specs already registered). All or nothing.
  absl::StatusOr<RegisterOutcome> RegisterTensors(const std::vector<TensorSpec>& specs,
                                                  const std::vector<const float*>& values)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Resolves names to tensors; empty names means every tensor in registration order.
  // NOT_FOUND names the first unknown tensor.
  absl::StatusOr<std::vector<TensorInfo>> Lookup(const std::vector<std::string>& names) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // One optimizer step of the push's tensors (all or nothing), or a detected retry.
  absl::StatusOr<PushOutcome> ApplyPush(const ReadyPush& push) ABSL_LOCKS_EXCLUDED(mu_);

  // The bytes Read needs for these tensors in this dtype.
  static uint64_t ReadBytes(const std::vector<TensorInfo>& tensors, GradDType dtype);

  // Reads a field of the named tensors as fp32 or bf16, at one version, into `out` (ReadBytes
  // long; page-locked memory lets a device copy into it directly), tensor after tensor; the
  // snapshot's data points into `out`. The bf16 copy of params is served as it is, when the
  // backend keeps one. Errors: NOT_FOUND for an unknown name; FAILED_PRECONDITION as
  // OptimizerBackend::Read. REQUIRES: out.size() >= ReadBytes of the named tensors.
  absl::StatusOr<Snapshot> Read(const std::vector<std::string>& names, TensorField field,
                                GradDType dtype, absl::Span<char> out) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // The backend's staging arena and its device copies (kernels/backend.h). Thread-safe.
  absl::StatusOr<char*> AllocateStagingArena(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status CopyStagingToDevice(uint64_t offset, uint64_t bytes) const
      ABSL_NO_THREAD_SAFETY_ANALYSIS;

  uint64_t version() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t parameter_count() const ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<ParamGroupSpec> param_groups() const ABSL_LOCKS_EXCLUDED(mu_);
  // The backend's kernel launches by name and memory by arena (see OptimizerBackend).
  std::map<std::string, uint64_t> launch_counts() const ABSL_LOCKS_EXCLUDED(mu_);
  std::map<std::string, uint64_t> memory_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  std::string backend_name() const { return backend_name_; }
  std::string device() const { return device_; }
  ParamCopyDType param_copy_dtype() const { return param_copy_dtype_; }

 private:
  absl::StatusOr<std::vector<TensorInfo>> LookupLocked(const std::vector<std::string>& names) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::Status CheckTensorSpecsLocked(const std::vector<TensorSpec>& specs,
                                      std::vector<bool>* is_new) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  TensorInfo InfoLocked(uint32_t index) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  struct ClientProgress {
    uint64_t sequence_number;
    PushOutcome outcome;
  };

  const std::string backend_name_;
  const std::string device_;
  const ParamCopyDType param_copy_dtype_;
  mutable absl::Mutex mu_;
  std::unique_ptr<OptimizerBackend> backend_ ABSL_GUARDED_BY(mu_);
  std::vector<TensorSpec> specs_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, uint32_t> tensor_index_ ABSL_GUARDED_BY(mu_);
  std::vector<ParamGroupSpec> groups_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, uint32_t> group_index_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, ClientProgress> clients_ ABSL_GUARDED_BY(mu_);
  uint64_t version_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t parameter_count_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_STORE_SHARD_STORE_H_
