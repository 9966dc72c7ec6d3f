#include "server/staging_pool.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace fusedps {

StagingPool::Reservation& StagingPool::Reservation::operator=(Reservation&& other) noexcept {
  if (this != &other) {
    if (pool_ != nullptr) pool_->Release(bytes_);
    pool_ = std::exchange(other.pool_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

StagingPool::Reservation::~Reservation() {
  if (pool_ != nullptr) pool_->Release(bytes_);
}

uint64_t StagingPool::ReserveAsync(uint64_t bytes, Done done) {
  if (bytes > capacity_) {
    done(absl::ResourceExhaustedError(absl::StrCat(
        "the call needs ", bytes, " bytes of staging, more than the whole pool of ", capacity_,
        " (--staging-pool-bytes); split it into smaller pushes")));
    return 0;
  }
  {
    absl::MutexLock lock(&mu_);
    if (!waiters_.empty() || in_use_ + bytes > capacity_) {
      waiters_.push_back({++last_ticket_, bytes, std::move(done)});
      return last_ticket_;
    }
    in_use_ += bytes;
  }
  done(Reservation(this, bytes));
  return 0;
}

void StagingPool::Cancel(uint64_t ticket) {
  Done cancelled;
  std::vector<Waiter> served;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = waiters_.begin(); it != waiters_.end(); ++it) {
      if (it->ticket == ticket) {
        cancelled = std::move(it->done);
        waiters_.erase(it);
        break;
      }
    }
    served = ServeLocked();  // The line may have moved.
  }
  if (cancelled) cancelled(absl::CancelledError("the call was cancelled while waiting for staging"));
  for (Waiter& w : served) w.done(Reservation(this, w.bytes));
}

absl::StatusOr<StagingPool::Reservation> StagingPool::Reserve(
    uint64_t bytes, const std::function<bool()>& cancelled) {
  absl::Notification ready;
  absl::StatusOr<Reservation> result;
  const uint64_t ticket = ReserveAsync(bytes, [&](absl::StatusOr<Reservation> r) {
    result = std::move(r);
    ready.Notify();
  });
  bool cancel_sent = false;
  while (!ready.WaitForNotificationWithTimeout(absl::Milliseconds(50))) {
    if (!cancel_sent && cancelled()) {
      Cancel(ticket);
      cancel_sent = true;
    }
  }
  return result;
}

std::vector<StagingPool::Waiter> StagingPool::ServeLocked() {
  std::vector<Waiter> served;
  while (!waiters_.empty() && in_use_ + waiters_.front().bytes <= capacity_) {
    in_use_ += waiters_.front().bytes;
    served.push_back(std::move(waiters_.front()));
    waiters_.pop_front();
  }
  return served;
}

void StagingPool::Release(uint64_t bytes) {
  std::vector<Waiter> served;
  {
    absl::MutexLock lock(&mu_);
    in_use_ -= bytes;
    served = ServeLocked();
  }
  for (Waiter& w : served) w.done(Reservation(this, w.bytes));
}

uint64_t StagingPool::in_use() const {
  absl::MutexLock lock(&mu_);
  return in_use_;
}

uint32_t StagingPool::waiting() const {
  absl::MutexLock lock(&mu_);
  return static_cast<uint32_t>(waiters_.size());
}

}  // namespace fusedps
