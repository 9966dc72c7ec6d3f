#include "server/engine/update_engine.h"

#include <utility>

namespace fusedps {

UpdateEngine::UpdateEngine(ShardStore* store) : store_(store), thread_([this] { Run(); }) {}

UpdateEngine::~UpdateEngine() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void UpdateEngine::Submit(const ReadyPush* push, Done done) {
  absl::MutexLock lock(&mu_);
  queue_.push_back({push, std::move(done)});
}

void UpdateEngine::Run() {
  for (;;) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](UpdateEngine* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(e->mu_) {
            return e->stopping_ || !e->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // Stopping, and every submitted push is applied.
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    job.done(store_->ApplyPush(*job.push));
  }
}

}  // namespace fusedps
