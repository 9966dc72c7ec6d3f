// update_engine.h: applies complete pushes to the shard, one optimizer step each, in the order
// in which they became complete (their arrival order), on one thread of its own.
//
// Usage:
//   UpdateEngine engine(&store);
//   std::future<absl::StatusOr<PushOutcome>> done = engine.Submit(&push);
//   ... done.get() once the push is applied (push must outlive that).
// The destructor applies every push already submitted, then stops.
#ifndef FUSEDPS_SERVER_UPDATE_ENGINE_H_
#define FUSEDPS_SERVER_UPDATE_ENGINE_H_

#include <deque>
#include <future>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/shard_store.h"

namespace fusedps {

class UpdateEngine {
 public:
  explicit UpdateEngine(ShardStore* store);
  ~UpdateEngine();
  UpdateEngine(const UpdateEngine&) = delete;
  UpdateEngine& operator=(const UpdateEngine&) = delete;

  // REQUIRES: *push stays alive and unchanged until the future is ready.
  std::future<absl::StatusOr<PushOutcome>> Submit(const ReadyPush* push) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Job {
    const ReadyPush* push;
    std::promise<absl::StatusOr<PushOutcome>> done;
  };
  void Run();

  ShardStore* const store_;
  absl::Mutex mu_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_UPDATE_ENGINE_H_
