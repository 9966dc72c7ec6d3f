#include "server/engine/shard_fault.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace fusedps {

void ShardFault::Report(const absl::Status& cause) {
  std::vector<Observer> observers;
  {
    MutexLock lock(&mu_);
    if (faulted_.load(std::memory_order_relaxed)) {
      LOG(ERROR) << "a further fault after the shard stopped: " << cause;
      return;
    }
    cause_ = cause;
    faulted_.store(true, std::memory_order_release);
    observers = observers_;
  }
  LOG(ERROR) << "FAULT, the shard stops: " << cause;
  for (const Observer& observer : observers) observer(cause);
}

void ShardFault::OnFault(Observer observer) {
  absl::Status cause;
  {
    MutexLock lock(&mu_);
    if (!faulted_.load(std::memory_order_relaxed)) {
      observers_.push_back(std::move(observer));
      return;
    }
    cause = cause_;
  }
  observer(cause);
}

absl::Status ShardFault::status() const {
  if (!faulted()) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("the shard stopped after a fault (",
                                             cause().ToString(),
                                             "); the server exits to be restarted"));
}

absl::Status ShardFault::cause() const {
  MutexLock lock(&mu_);
  return cause_;
}

}  // namespace fusedps
