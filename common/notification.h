// notification.h: a one-shot event one thread waits for and another signals, on the standard
// library's mutex and condition variable (common/mutex.h; absl::Notification's interface). Use it
// instead of absl::Notification in our code and tests: Debian's abseil is not built with
// ThreadSanitizer, which therefore cannot see absl's happens-before edges (docs/architecture.md).
#ifndef FUSEDPS_COMMON_NOTIFICATION_H_
#define FUSEDPS_COMMON_NOTIFICATION_H_

#include <chrono>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "common/mutex.h"

namespace fusedps {

class Notification {
 public:
  // Wakes every waiter; later waits return at once. Once.
  void Notify() ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    notified_ = true;
    cv_.SignalAll();
  }
  bool HasBeenNotified() const ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    return notified_;
  }
  void WaitForNotification() const ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    while (!notified_) cv_.Wait(&mu_);
  }
  // True when notified within `timeout`.
  bool WaitForNotificationWithTimeout(absl::Duration timeout) const ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(timeout);
    while (!notified_) {
      if (cv_.WaitWithDeadline(&mu_, deadline)) return notified_;
    }
    return true;
  }

 private:
  mutable Mutex mu_;
  mutable CondVar cv_;
  bool notified_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace fusedps

#endif  // FUSEDPS_COMMON_NOTIFICATION_H_
