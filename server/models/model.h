// model.h: one model of a server (a namespace): a shard of its own, with everything that is
// kept per model. The server holds any number of them (model_registry.h); every call names one.
//
// What a model owns, and what it shares with the server's other models:
//   own:    the optimizer backend (its device memory: tensors, state, pull snapshots), the
//           update engine (tensors, param groups, version, consistency mode, sync rounds,
//           sharding plan), the retry table, the pushes being assembled from parts, the
//           registration gate, and its checkpoints (a directory of its own, ModelDirectory).
//   shared: the device and its fault state (one device fault stops every model), the staging
//           pool and its page-locked arena (its backend shares the arena's owner's,
//           OptimizerBackend::ShareStagingArena), the metrics, authentication.
//
// Lifetime: a Model is held through std::shared_ptr by the registry and by every call that
// uses it, so that a deleted model lives until the last call that holds it is done. It is
// destroyed only by the registry (ModelRegistry::Delete or its destructor), never on the
// engine's own threads: the calls' references drop on gRPC threads, while the registry keeps
// one until it destroys the model itself. The destructor stops the checkpointer (letting a
// checkpoint in progress finish), then the part checks, then the engine (which runs every job
// already submitted and answers it), then frees the backend's memory.
#ifndef FUSEDPS_SERVER_MODELS_MODEL_H_
#define FUSEDPS_SERVER_MODELS_MODEL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "kernels/backend.h"
#include "server/checkpoint/checkpointer.h"
#include "server/engine/consistency.h"
#include "server/engine/shard_fault.h"
#include "server/engine/update_engine.h"
#include "server/ingest/push_assembly.h"
#include "server/metrics/metrics.h"
#include "server/store/retry_table.h"

namespace fusedps {

// The model every server has: calls that name no model are about it.
inline constexpr char kDefaultModel[] = "default";
inline constexpr size_t kMaxModelNameBytes = 64;

// OK for 1 to 64 characters of [a-z0-9._-] that start with a letter or a digit (a name is a
// directory under --checkpoint-dir and a metric label). INVALID_ARGUMENT naming `field`.
absl::Status ValidateModelName(absl::string_view name, absl::string_view field = "model");

// What every model of a server is made with.
struct ModelOptions {
  // Makes a model's backend (on the server's device).
  std::function<absl::StatusOr<std::unique_ptr<OptimizerBackend>>()> make_backend;
  StagingArena arena;           // The server's staging arena, shared by every model.
  ShardFault* fault = nullptr;  // The device's.
  Metrics* metrics = nullptr;   // Checkpoint metrics, and the consistency observer.
  absl::Duration push_part_wait = absl::Seconds(30);
  size_t retry_table_clients = 10000;
  // The server's checkpoint options; root empty: no checkpoints. A model's own checkpoints go
  // to ModelDirectory(root, name).
  checkpoint::CheckpointerOptions checkpoint;
};

// Where model `name`'s checkpoints live under the server's checkpoint root: the root itself
// for "default" (as before models existed), else <root>/models/<name>.
std::string ModelDirectory(const std::string& root, absl::string_view name);

class Model {
 public:
  // Makes the model's backend (sharing options.arena) and its engine. Errors: the backend's
  // (UNAVAILABLE, RESOURCE_EXHAUSTED), INVALID_ARGUMENT for a consistency that
  // ValidateConsistency refuses.
  static absl::StatusOr<std::unique_ptr<Model>> Make(std::string name,
                                                     ConsistencyOptions consistency,
                                                     const ModelOptions& options);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const std::string& name() const { return name_; }
  UpdateEngine& engine() { return *engine_; }
  const UpdateEngine& engine() const { return *engine_; }
  RetryTable& retries() { return *retries_; }
  PushAssemblies& assemblies() { return *assemblies_; }
  std::timed_mutex& registration_gate() { return registration_gate_; }
  // Checkpointer::CheckpointNow. FAILED_PRECONDITION without checkpoints; NOT_FOUND once
  // the model is being deleted (StopCheckpoints waits for a checkpoint in progress).
  absl::StatusOr<checkpoint::CheckpointResult> CheckpointNow()
      ABSL_LOCKS_EXCLUDED(checkpointer_mu_);
  // Checkpointer::Restored: the shard was restored from `result`. No-op without checkpoints.
  void Restored(const checkpoint::CheckpointResult& result) ABSL_LOCKS_EXCLUDED(checkpointer_mu_);
  // ModelDirectory of the server's root; empty without checkpoints.
  const std::string& checkpoint_root() const { return checkpoint_root_; }
  // The bytes of device memory (host memory on the CPU backend) its backend holds.
  uint64_t memory_bytes() const;

  // Deleted: calls that find it from here on fail with NOT_FOUND (DeletedError).
  bool deleted() const { return deleted_.load(std::memory_order_acquire); }
  void MarkDeleted() { deleted_.store(true, std::memory_order_release); }
  // NOT_FOUND naming the model, for a call that reached it after its deletion.
  absl::Status DeletedError() const;

  // Starts taking checkpoints (after the restore). No-op without them.
  void StartCheckpoints() ABSL_LOCKS_EXCLUDED(checkpointer_mu_);
  // Stops taking checkpoints: a checkpoint in progress finishes first. Idempotent.
  void StopCheckpoints() ABSL_LOCKS_EXCLUDED(checkpointer_mu_);

 private:
  Model() = default;

  std::string name_;
  std::string checkpoint_root_;
  std::atomic<bool> deleted_{false};
  std::unique_ptr<RetryTable> retries_;  // Outlives the engine, which writes it.
  std::unique_ptr<UpdateEngine> engine_;
  std::unique_ptr<PushAssemblies> assemblies_;
  std::timed_mutex registration_gate_;  // One registration at a time.
  // Held shared while a checkpoint is asked for, exclusively to stop taking them.
  SharedMutex checkpointer_mu_;
  std::unique_ptr<checkpoint::Checkpointer> checkpointer_ ABSL_GUARDED_BY(checkpointer_mu_);
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_MODELS_MODEL_H_
