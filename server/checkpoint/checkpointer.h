// checkpointer.h: when a shard is checkpointed, and the thread that writes checkpoints.
//
// One thread of its own takes every checkpoint, so at most one is in flight. It starts one when
// --checkpoint-interval-seconds have passed since the last, when the version has advanced by
// --checkpoint-every-versions, or when CheckpointNow asks (the Checkpoint RPC, SIGTERM). Each
// checkpoint is a job in the update engine's queue (UpdateEngine::Snapshot):
//   - full snapshot (the default): the device copies the whole shard into a page-locked host
//     buffer on the apply stream between two steps, and steps go on while this thread writes the
//     files. The buffer is allocated once and reused (grown when the shard grows).
//   - fenced snapshot, when the shard needs more than --checkpoint-host-buffer-bytes (or the
//     host cannot give that much page-locked memory): no step runs while this thread reads the
//     shard a buffer at a time and writes it, so steps stall for the whole write (docs/
//     checkpoints.md says what that costs).
// A checkpoint whose shard has not changed since the last one (UpdateEngine::generation) is not
// written again: the timer skips it, and CheckpointNow answers with the last one.
//
// Lifetime: the engine and metrics outlive the checkpointer. The destructor lets the checkpoint
// in progress finish, then stops; CheckpointNow calls after that (or waiting then) fail with
// UNAVAILABLE.
//
// Thread-safe.
#ifndef FUSEDPS_SERVER_CHECKPOINT_CHECKPOINTER_H_
#define FUSEDPS_SERVER_CHECKPOINT_CHECKPOINTER_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "server/engine/update_engine.h"
#include "server/metrics/metrics.h"

namespace fusedps::checkpoint {

struct CheckpointerOptions {
  std::string root;                                // --checkpoint-dir; required.
  int keep = 3;                                    // --checkpoint-keep, >= 1.
  absl::Duration interval = absl::ZeroDuration();  // Zero: no timer.
  uint64_t every_versions = 0;                     // 0: no version trigger.
  uint64_t host_buffer_bytes = 0;                  // 0: as much as the shard needs.
  std::string server_version;                      // For the manifest.
  std::string model = "default";                   // The `model` label of its metrics.
};

struct CheckpointResult {
  uint64_t version = 0;
  std::string path;  // The checkpoint's directory.
};

class Checkpointer {
 public:
  // REQUIRES: engine and metrics outlive this. Nothing runs before Start.
  Checkpointer(UpdateEngine* engine, Metrics* metrics, CheckpointerOptions options);
  // Starts the thread (the triggers and CheckpointNow's work), once the shard is restored.
  void Start();
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Blocks until a checkpoint that holds every push acknowledged before this call is durable
  // (one started after the call; calls that wait together share it). Errors: the write's
  // (RESOURCE_EXHAUSTED for a full disk, ...), UNAVAILABLE when stopping or after a fault.
  absl::StatusOr<CheckpointResult> CheckpointNow() ABSL_LOCKS_EXCLUDED(mu_);

  // The shard was restored from `result` (of this root): it counts as the last checkpoint.
  void Restored(const CheckpointResult& result) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Request;

  void Run() ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<CheckpointResult> TakeOne() ABSL_LOCKS_EXCLUDED(mu_);
  // The snapshot, and in *started when its job was submitted (after any allocation).
  absl::StatusOr<CheckpointSnapshot> Snapshot(bool* fenced,
                                              std::chrono::steady_clock::time_point* started);
  void RecordFailure(const absl::Status& status, bool snapshot);

  UpdateEngine* const engine_;
  Metrics* const metrics_;
  const CheckpointerOptions options_;

  // The checkpoint thread's.
  void* buffer_ = nullptr;  // Page-locked host memory (UpdateEngine::AllocateHostBuffer).
  uint64_t buffer_bytes_ = 0;
  bool full_failed_ = false;  // The full buffer could not be had: fenced from now on.

  Mutex mu_;
  CondVar cv_;
  std::vector<std::shared_ptr<Request>> requests_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // The last checkpoint taken (by the checkpoint thread) or restored from (Restored).
  std::optional<CheckpointResult> last_ ABSL_GUARDED_BY(mu_);
  uint64_t last_generation_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;  // Last: starts once the rest exists.
};

}  // namespace fusedps::checkpoint

#endif  // FUSEDPS_SERVER_CHECKPOINT_CHECKPOINTER_H_
