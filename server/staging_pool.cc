#include "server/staging_pool.h"

#include <utility>

#include "absl/strings/str_cat.h"
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

absl::StatusOr<StagingPool::Reservation> StagingPool::Reserve(
    uint64_t bytes, const std::function<bool()>& cancelled) {
  if (bytes > capacity_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the call needs ", bytes, " bytes of staging, more than the whole pool of ", capacity_,
        " (--staging-pool-bytes); split it into smaller pushes"));
  }
  absl::MutexLock lock(&mu_);
  const uint64_t ticket = next_ticket_++;
  const auto my_turn = [this, ticket, bytes]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return serving_ == ticket && in_use_ + bytes <= capacity_;
  };
  while (!mu_.AwaitWithTimeout(absl::Condition(&my_turn), absl::Milliseconds(50))) {
    if (cancelled()) {
      // Give up the place in line: the queue skips this ticket when its turn comes.
      abandoned_.insert(ticket);
      SkipAbandonedLocked();
      return absl::CancelledError("the call was cancelled while waiting for staging");
    }
  }
  in_use_ += bytes;
  ++serving_;
  SkipAbandonedLocked();
  return Reservation(this, bytes);
}

void StagingPool::SkipAbandonedLocked() {
  while (abandoned_.erase(serving_) > 0) ++serving_;
}

void StagingPool::Release(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  in_use_ -= bytes;
}

uint64_t StagingPool::in_use() const {
  absl::MutexLock lock(&mu_);
  return in_use_;
}

uint32_t StagingPool::waiting() const {
  absl::MutexLock lock(&mu_);
  return static_cast<uint32_t>(next_ticket_ - serving_ - abandoned_.size());
}

}  // namespace fusedps
