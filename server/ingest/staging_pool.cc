#include "server/ingest/staging_pool.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace fusedps {

namespace {
constexpr uint64_t kAlignment = 64;
uint64_t Aligned(uint64_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }
}  // namespace

StagingPool::StagingPool(uint64_t capacity_bytes, char* arena)
    : capacity_(capacity_bytes / kAlignment * kAlignment), arena_(arena) {
  if (capacity_ > 0) free_.emplace(0, capacity_);
}

StagingPool::Reservation& StagingPool::Reservation::operator=(Reservation&& other) noexcept {
  if (this != &other) {
    if (pool_ != nullptr) pool_->Release(offset_, bytes_);
    pool_ = std::exchange(other.pool_, nullptr);
    offset_ = std::exchange(other.offset_, 0);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

StagingPool::Reservation::~Reservation() {
  if (pool_ != nullptr) pool_->Release(offset_, bytes_);
}

std::optional<uint64_t> StagingPool::AllocateLocked(uint64_t bytes) {
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < bytes) continue;
    const uint64_t offset = it->first, size = it->second;
    free_.erase(it);
    if (size > bytes) free_.emplace(offset + bytes, size - bytes);
    return offset;
  }
  return std::nullopt;
}

uint64_t StagingPool::ReserveAsync(uint64_t requested, Done done) {
  const uint64_t bytes = Aligned(requested);
  if (bytes > capacity_) {
    done(absl::ResourceExhaustedError(absl::StrCat(
        "the call needs ", bytes, " bytes of staging, more than the whole pool of ", capacity_,
        " (--staging-pool-bytes); split it into smaller pushes")));
    return 0;
  }
  uint64_t offset;
  {
    absl::MutexLock lock(&mu_);
    std::optional<uint64_t> region;
    if (waiters_.empty()) region = AllocateLocked(bytes);
    if (!region.has_value()) {
      waiters_.push_back({++last_ticket_, bytes, std::move(done)});
      return last_ticket_;
    }
    offset = *region;
    in_use_ += bytes;
  }
  done(Reservation(this, offset, bytes));
  return 0;
}

void StagingPool::Cancel(uint64_t ticket) {
  Done cancelled;
  std::vector<Served> served;
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
  for (Served& s : served) s.waiter.done(Reservation(this, s.offset, s.waiter.bytes));
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

std::vector<StagingPool::Served> StagingPool::ServeLocked() {
  std::vector<Served> served;
  while (!waiters_.empty()) {
    std::optional<uint64_t> region = AllocateLocked(waiters_.front().bytes);
    if (!region.has_value()) break;
    in_use_ += waiters_.front().bytes;
    served.push_back({std::move(waiters_.front()), *region});
    waiters_.pop_front();
  }
  return served;
}

void StagingPool::Release(uint64_t offset, uint64_t bytes) {
  std::vector<Served> served;
  {
    absl::MutexLock lock(&mu_);
    in_use_ -= bytes;
    // Return the region and merge it with free neighbours.
    auto it = free_.emplace(offset, bytes).first;
    if (auto next = std::next(it); next != free_.end() && it->first + it->second == next->first) {
      it->second += next->second;
      free_.erase(next);
    }
    if (it != free_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == it->first) {
        prev->second += it->second;
        free_.erase(it);
      }
    }
    served = ServeLocked();
  }
  for (Served& s : served) s.waiter.done(Reservation(this, s.offset, s.waiter.bytes));
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
