// notification.h: a one-shot event one thread waits for and another signals, on the standard
// library's mutex and condition variable (absl::Notification's interface). Use it instead of
// absl::Notification in our code and tests: Debian's abseil is not built with ThreadSanitizer,
// which therefore cannot see absl's happens-before edges (docs/architecture.md).
#ifndef FUSEDPS_COMMON_NOTIFICATION_H_
#define FUSEDPS_COMMON_NOTIFICATION_H_

#include <condition_variable>
#include <mutex>

#include "absl/time/time.h"

namespace fusedps {

class Notification {
 public:
  // Wakes every waiter; later waits return at once. Once.
  void Notify() {
    std::lock_guard<std::mutex> lock(mu_);
    notified_ = true;
    cv_.notify_all();
  }
  bool HasBeenNotified() const {
    std::lock_guard<std::mutex> lock(mu_);
    return notified_;
  }
  void WaitForNotification() const {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return notified_; });
  }
  // True when notified within `timeout`.
  bool WaitForNotificationWithTimeout(absl::Duration timeout) const {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout), [this] { return notified_; });
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool notified_ = false;  // Guarded by mu_.
};

}  // namespace fusedps

#endif  // FUSEDPS_COMMON_NOTIFICATION_H_
