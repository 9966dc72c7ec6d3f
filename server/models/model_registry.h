// model_registry.h: the models of a server (model.h), by name: create, find, list, delete.
//
// Every call about a shard finds its model here first (Find: one mutex, a map lookup and a
// shared_ptr copy) and holds it until the call is done. "default" always exists: a fresh
// server has it empty, and deleting it empties it (it is made again, empty).
//
// Deleting a model (Delete):
//   1. it leaves the map and is marked deleted: calls that look for it get NOT_FOUND, and
//      calls in flight that check it (the push's header, the pull's start, the synchronous
//      handlers) fail with NOT_FOUND; work already handed to its engine is done and answered;
//   2. its checkpointer stops (a checkpoint being written finishes first), and its files are
//      removed durably (model_files.h): a restart does not bring it back;
//   3. it is destroyed (its engine drains, its backend frees the device memory) as soon as no
//      call holds it; Delete waits for that until its deadline. A model still held then is
//      kept aside and destroyed by a later Delete or Create call that finds it free, or by
//      the registry's destructor.
// Create and Delete are serialized (one at a time); Find and List never wait for them but for
// the map's mutex.
//
// With a checkpoint root, Open makes every model the root lists (model_files.h) and restores
// each; models made later are recorded there before Create returns.
//
// Thread-safe. Lifetime: the Server owns it; it outlives the gRPC server's calls.
#ifndef FUSEDPS_SERVER_MODELS_MODEL_REGISTRY_H_
#define FUSEDPS_SERVER_MODELS_MODEL_REGISTRY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "server/models/model.h"

namespace fusedps {

class ModelRegistry {
 public:
  // `default_consistency` is the default model's, and that of models created without one (the
  // server's flags). Nothing is made before Open.
  ModelRegistry(ModelOptions options, ConsistencyOptions default_consistency);
  ~ModelRegistry();
  ModelRegistry(const ModelRegistry&) = delete;
  ModelRegistry& operator=(const ModelRegistry&) = delete;

  // Makes "default" and the models the checkpoint root lists, and restores each
  // (RestoreModel): `restore` "latest" or "none" applies to every model, a checkpoint
  // directory's path to the default model only (the others restore their latest). Errors: a
  // model's (the backend's, ReadModelFiles', RestoreModel's), naming the model.
  absl::Status Open(const std::string& restore) ABSL_LOCKS_EXCLUDED(admin_mu_, mu_);
  // Starts every model's checkpoints (after Open, once serving).
  void StartCheckpoints();

  // The model named `name` ("" is "default"). NOT_FOUND naming it, and how to create it.
  absl::StatusOr<std::shared_ptr<Model>> Find(absl::string_view name) const
      ABSL_LOCKS_EXCLUDED(mu_);

  struct Created {
    std::shared_ptr<Model> model;
    bool created = false;  // False: it existed with the same consistency.
  };
  // Makes an empty model (with `consistency`, or default_consistency), records it under the
  // checkpoint root and starts its checkpoints. Idempotent for an existing model of the same
  // consistency, or any when `consistency` is unset (a trainer joining a job).
  // Errors: INVALID_ARGUMENT (ValidateModelName, ValidateConsistency);
  // ALREADY_EXISTS for a model of another consistency than the one given; the backend's
  // (RESOURCE_EXHAUSTED, UNAVAILABLE) and the file's (the errno's status).
  absl::StatusOr<Created> Create(const std::string& name,
                                 std::optional<ConsistencyOptions> consistency)
      ABSL_LOCKS_EXCLUDED(admin_mu_, mu_);

  // Every model, by name.
  std::vector<std::shared_ptr<Model>> List() const ABSL_LOCKS_EXCLUDED(mu_);

  struct Deleted {
    uint64_t freed_bytes = 0;   // Its memory_bytes when it was deleted.
    bool memory_freed = false;  // Destroyed before `deadline`.
  };
  // Deletes model `name` (above); for "default", makes a fresh empty one. Errors: NOT_FOUND;
  // the files' (the model is then deleted from the running server all the same, but a restart
  // may bring it back: the error says so).
  absl::StatusOr<Deleted> Delete(const std::string& name, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(admin_mu_, mu_);

  // What the models destroyed so far had counted, for the metrics' monotonic counters.
  struct Retired {
    std::map<std::string, uint64_t> kernel_launches;
    uint64_t retry_table_evictions = 0;
  };
  Retired retired() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // Destroys `model` (the registry's reference must be the last), adding its counts to
  // retired_.
  void Destroy(std::shared_ptr<Model> model) ABSL_EXCLUSIVE_LOCKS_REQUIRED(admin_mu_)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Destroys the models kept aside that no call holds any more.
  void ReapHeld() ABSL_EXCLUSIVE_LOCKS_REQUIRED(admin_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::shared_ptr<Model>> Make(const std::string& name,
                                              const ConsistencyOptions& consistency,
                                              const std::string& restore)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(admin_mu_) ABSL_LOCKS_EXCLUDED(mu_);

  const ModelOptions options_;
  const ConsistencyOptions default_consistency_;

  Mutex admin_mu_;  // Serializes Open, Create and Delete (and their file operations).
  mutable Mutex mu_ ABSL_ACQUIRED_AFTER(admin_mu_);
  std::map<std::string, std::shared_ptr<Model>, std::less<>> models_ ABSL_GUARDED_BY(mu_);
  // Deleted models that calls still held at their Delete's deadline.
  mutable std::vector<std::shared_ptr<Model>> held_ ABSL_GUARDED_BY(mu_);
  Retired retired_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_MODELS_MODEL_REGISTRY_H_
