#include "server/ingest/staging_pool.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fusedps {

namespace {

constexpr uint64_t kAlignment = 64;

// REQUIRES: bytes <= the capacity, so that rounding up cannot wrap around.
uint64_t Aligned(uint64_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

// A broken invariant or precondition: says which on stderr and aborts. A local stand-in until
// the project has its logging library.
[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "fusedps: StagingPool: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

absl::Status ShuttingDown() { return absl::CancelledError("the staging pool is shutting down"); }

}  // namespace

StagingPool::StagingPool(uint64_t capacity_bytes, char* arena, std::string limit_flag)
    : capacity_(capacity_bytes / kAlignment * kAlignment),
      arena_(arena),
      limit_flag_(std::move(limit_flag)) {
  if (capacity_ > 0) free_.emplace(0, capacity_);
  grant_thread_ = std::thread([this] { RunGrants(); });
}

StagingPool::~StagingPool() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& [ticket, waiter] : waiters_) QueueLocked(std::move(waiter.done), ShuttingDown());
    waiters_.clear();
    grants_ready_.Signal();
  }
  grant_thread_.join();
  MutexLock lock(&mu_);
  if (in_use_ != 0) {
    Die(absl::StrCat("destroyed while ", in_use_,
                     " bytes of its staging are still held; every reservation must be given "
                     "back before the pool goes"));
  }
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

uint64_t StagingPool::ReserveAsync(uint64_t requested, Done done) {
  if (requested == 0) {  // Owns no region, so takes no one's turn.
    done(Reservation());
    return 0;
  }
  if (requested > capacity_) {
    done(absl::ResourceExhaustedError(absl::StrCat(
        "the call needs ", requested, " bytes of staging at once, more than the whole pool of ",
        capacity_, " bytes (", limit_flag_, ")")));
    return 0;
  }
  const uint64_t bytes = Aligned(requested);
  std::optional<uint64_t> region;
  {
    MutexLock lock(&mu_);
    // No waiter fits (ServeLocked leaves none that does), so one that fits passes no one who
    // could be served.
    region = AllocateLocked(bytes);
    if (!region.has_value()) {
      if (stopping_) {  // From a callback run during shutdown: no one waits on a dying pool.
        QueueLocked(std::move(done), ShuttingDown());
        return 0;
      }
      waiters_.emplace(++last_ticket_, Waiter{bytes, Clock::now(), std::move(done)});
      return last_ticket_;
    }
    in_use_ += bytes;
  }
  done(Reservation(this, *region, bytes));
  return 0;
}

void StagingPool::Cancel(uint64_t ticket) {
  MutexLock lock(&mu_);
  auto it = waiters_.find(ticket);
  if (it == waiters_.end()) return;
  // Leaving the line frees nothing, so no one else can be served now.
  QueueLocked(std::move(it->second.done),
              absl::CancelledError("the call was cancelled while waiting for staging"));
  waiters_.erase(it);
}

absl::StatusOr<StagingPool::Reservation> StagingPool::Reserve(
    uint64_t bytes, const std::function<bool()>& cancelled) {
  if (std::this_thread::get_id() == grant_thread_.get_id()) {
    Die("Reserve called from a staging callback, on the grant thread that would have to deliver "
        "its grant; use ReserveAsync there");
  }
  // Shared with the callback, which may still be returning when this returns.
  struct Result {
    Mutex mu;
    CondVar ready_cv;
    bool ready ABSL_GUARDED_BY(mu) = false;
    absl::StatusOr<Reservation> value ABSL_GUARDED_BY(mu);
  };
  auto result = std::make_shared<Result>();
  const uint64_t ticket = ReserveAsync(bytes, [result](absl::StatusOr<Reservation> r) {
    MutexLock lock(&result->mu);
    result->value = std::move(r);
    result->ready = true;
    result->ready_cv.Signal();
  });
  result->mu.Lock();
  bool cancel_sent = false;
  while (true) {
    const auto due = Clock::now() + std::chrono::milliseconds(50);
    while (!result->ready && !result->ready_cv.WaitWithDeadline(&result->mu, due)) {
    }
    if (result->ready) break;
    if (cancel_sent) continue;
    // `cancelled` and Cancel may take their time; the callback needs this lock.
    result->mu.Unlock();
    if (cancelled()) {
      Cancel(ticket);
      cancel_sent = true;
    }
    result->mu.Lock();
  }
  absl::StatusOr<Reservation> value = std::move(result->value);
  result->mu.Unlock();
  return value;
}

uint64_t StagingPool::in_use() const {
  MutexLock lock(&mu_);
  return in_use_;
}

uint32_t StagingPool::waiting() const {
  MutexLock lock(&mu_);
  return static_cast<uint32_t>(waiters_.size());
}

absl::Duration StagingPool::oldest_wait() const {
  MutexLock lock(&mu_);
  if (waiters_.empty()) return absl::ZeroDuration();
  return absl::FromChrono(Clock::now() - waiters_.begin()->second.since);
}

absl::Status StagingPool::CheckInvariants() const {
  MutexLock lock(&mu_);
  uint64_t free_bytes = 0, largest = 0;
  std::optional<uint64_t> previous_end;
  for (const auto& [offset, size] : free_) {
    const std::string region = absl::StrCat("free region [", offset, ", +", size, ")");
    if (size == 0) return absl::InternalError(absl::StrCat(region, " is empty"));
    if (offset > capacity_ || size > capacity_ - offset) {
      return absl::InternalError(absl::StrCat(region, " ends past the capacity ", capacity_));
    }
    if (previous_end.has_value() && offset < *previous_end) {
      return absl::InternalError(absl::StrCat(region, " overlaps the one before it"));
    }
    if (previous_end.has_value() && offset == *previous_end) {
      return absl::InternalError(absl::StrCat(region, " is not merged with the one before it"));
    }
    previous_end = offset + size;
    free_bytes += size;
    largest = std::max(largest, size);
  }
  if (in_use_ > capacity_ || free_bytes != capacity_ - in_use_) {
    return absl::InternalError(absl::StrCat("the free regions hold ", free_bytes,
                                            " bytes, not the capacity ", capacity_, " less the ",
                                            in_use_, " in use"));
  }
  for (const auto& [ticket, waiter] : waiters_) {
    if (waiter.bytes <= largest) {
      return absl::InternalError(absl::StrCat("request ", ticket, " waits for ", waiter.bytes,
                                              " bytes, but a free region has ", largest));
    }
  }
  return absl::OkStatus();
}

void StagingPool::Release(uint64_t offset, uint64_t bytes) {
  MutexLock lock(&mu_);
  if (bytes > in_use_) {
    Die(absl::StrCat("region [", offset, ", +", bytes, ") given back with only ", in_use_,
                     " bytes in use"));
  }
  in_use_ -= bytes;
  FreeLocked(offset, bytes);
  ServeLocked();
}

std::optional<uint64_t> StagingPool::AllocateLocked(uint64_t bytes) {
  if (bytes > capacity_ - in_use_) return std::nullopt;  // Saves the walk when it cannot fit.
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < bytes) continue;
    const uint64_t offset = it->first, size = it->second;
    free_.erase(it);
    if (size > bytes) free_.emplace(offset + bytes, size - bytes);
    return offset;
  }
  return std::nullopt;
}

void StagingPool::FreeLocked(uint64_t offset, uint64_t bytes) {
  // Only for the messages of broken invariants: this runs at every release.
  const auto region = [&] { return absl::StrCat("region [", offset, ", +", bytes, ")"); };
  if (bytes == 0 || offset > capacity_ || bytes > capacity_ - offset) {
    Die(absl::StrCat(region(), " given back lies outside the arena of ", capacity_, " bytes"));
  }
  auto [it, inserted] = free_.emplace(offset, bytes);
  if (!inserted) {
    Die(absl::StrCat(region(), " given back, but a free region already starts at ", offset,
                     " (given back twice?); its bytes would be lost"));
  }
  auto next = std::next(it);
  if (next != free_.end() && next->first < offset + bytes) {
    Die(absl::StrCat(region(), " given back overlaps the free region at ", next->first));
  }
  if (it != free_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second > offset) {
      Die(absl::StrCat(region(), " given back overlaps the free region at ", prev->first));
    }
  }
  // Merge with the free neighbours.
  if (next != free_.end() && offset + bytes == next->first) {
    it->second += next->second;
    free_.erase(next);
  }
  if (it != free_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == offset) {
      prev->second += it->second;
      free_.erase(it);
    }
  }
}

void StagingPool::ServeLocked() {
  for (auto it = waiters_.begin(); it != waiters_.end() && in_use_ < capacity_;) {
    std::optional<uint64_t> region = AllocateLocked(it->second.bytes);
    if (!region.has_value()) {
      ++it;
      continue;
    }
    in_use_ += it->second.bytes;
    QueueLocked(std::move(it->second.done), Reservation(this, *region, it->second.bytes));
    it = waiters_.erase(it);
  }
}

void StagingPool::QueueLocked(Done done, absl::StatusOr<Reservation> result) {
  grants_.push_back({std::move(done), std::move(result)});
  grants_ready_.Signal();
}

void StagingPool::RunGrants() {
  mu_.Lock();
  while (true) {
    while (grants_.empty() && !stopping_) grants_ready_.Wait(&mu_);
    if (grants_.empty()) break;  // Stopping, and every grant delivered.
    std::deque<Grant> batch;
    batch.swap(grants_);
    mu_.Unlock();
    for (Grant& grant : batch) grant.done(std::move(grant.result));
    batch.clear();  // Reservations a callback did not take go back here, outside the lock.
    mu_.Lock();
  }
  mu_.Unlock();
}

}  // namespace fusedps
