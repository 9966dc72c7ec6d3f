// update_engine.h: applies complete pushes to the shard, one optimizer step each, in the order
// in which they became complete (their arrival order), on one thread of its own. That thread
// is the completion path: it runs each push's `done` callback once the step is back, so no gRPC
// thread ever waits for the device.
//
// Usage:
//   UpdateEngine engine(&store);
//   engine.Submit(&push, [](absl::StatusOr<PushOutcome> outcome) { ... acknowledge ... });
// The destructor applies every push already submitted (running their callbacks), then stops.
#ifndef FUSEDPS_SERVER_ENGINE_UPDATE_ENGINE_H_
#define FUSEDPS_SERVER_ENGINE_UPDATE_ENGINE_H_

#include <deque>
#include <functional>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/store/shard_store.h"

namespace fusedps {

class UpdateEngine {
 public:
  using Done = std::function<void(absl::StatusOr<PushOutcome>)>;

  explicit UpdateEngine(ShardStore* store);
  ~UpdateEngine();
  UpdateEngine(const UpdateEngine&) = delete;
  UpdateEngine& operator=(const UpdateEngine&) = delete;

  // Queues a push; `done` runs on the engine's thread once it is applied (or skipped).
  // REQUIRES: *push stays alive and unchanged until `done` runs; `done` does not block.
  void Submit(const ReadyPush* push, Done done) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Job {
    const ReadyPush* push;
    Done done;
  };
  void Run();

  ShardStore* const store_;
  absl::Mutex mu_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_ENGINE_UPDATE_ENGINE_H_
