// shard_fault.h: the one place a shard records that it can no longer be trusted.
//
// Expected errors (bad input, a lost peer, a deadline) are answered with a status and the shard
// goes on. A device fault (a failed CUDA call or kernel) or a broken invariant is different: the
// shard's state may be half-written, and serving it would hand out wrong parameters. Then the
// component that saw it calls Report, and from that moment the shard stops (docs/errors.md):
// every call fails with UNAVAILABLE naming the cause, health turns NOT_SERVING (an observer the
// server installs), and the process exits non-zero so that its orchestrator restarts it.
//
// Thread-safe.
//
// Usage:
//   ShardFault fault;
//   fault.OnFault([&](const absl::Status& cause) { health->SetServingStatus(false); });
//   if (absl::Status s = fault.status(); !s.ok()) return s;   // at the start of every call
//   fault.Report(absl::InternalError("cudaEventSynchronize: an illegal memory access"));
#ifndef FUSEDPS_SERVER_ENGINE_SHARD_FAULT_H_
#define FUSEDPS_SERVER_ENGINE_SHARD_FAULT_H_

#include <atomic>
#include <functional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "common/mutex.h"

namespace fusedps {

class ShardFault {
 public:
  using Observer = std::function<void(const absl::Status& cause)>;

  // Records the first fault; later ones are logged and otherwise ignored. Runs the observers
  // once, on the calling thread, after the fault is recorded. REQUIRES: !cause.ok().
  void Report(const absl::Status& cause) ABSL_LOCKS_EXCLUDED(mu_);

  // Runs `observer` when the shard faults (at once, if it has).
  void OnFault(Observer observer) ABSL_LOCKS_EXCLUDED(mu_);

  bool faulted() const { return faulted_.load(std::memory_order_acquire); }
  // OK while the shard is sound; afterwards UNAVAILABLE: "the shard stopped after a fault
  // (<cause>); the server exits to be restarted".
  absl::Status status() const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status cause() const ABSL_LOCKS_EXCLUDED(mu_);  // The first fault reported; OK when none.

 private:
  std::atomic<bool> faulted_{false};
  mutable Mutex mu_;
  absl::Status cause_ ABSL_GUARDED_BY(mu_);
  std::vector<Observer> observers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_ENGINE_SHARD_FAULT_H_
