// staging_pool.h: the bounded budget of host staging memory shared by the calls in flight.
//
// Every push (and registration) reserves the staging its data will occupy, the size of its
// named tensors in the wire dtype, before the server reads any of its chunks. When the budget is
// spent, the call waits for another to release its reservation, and its stream is not read
// meanwhile, so gRPC's flow control stops the sender: back-pressure, never unbounded memory.
// Waiters are served in arrival order.
//
// Usage:
//   StagingPool pool(2ull << 30);
//   absl::StatusOr<StagingPool::Reservation> r =
//       pool.Reserve(bytes, [&] { return context->IsCancelled(); });
//   ... read chunks into staging ...   // r releases its bytes when it goes out of scope.
#ifndef FUSEDPS_SERVER_STAGING_POOL_H_
#define FUSEDPS_SERVER_STAGING_POOL_H_

#include <cstdint>
#include <functional>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace fusedps {

class StagingPool {
 public:
  // Holds `bytes` of the pool until destroyed (or moved from).
  class Reservation {
   public:
    Reservation() = default;
    Reservation(Reservation&& other) noexcept { *this = std::move(other); }
    Reservation& operator=(Reservation&& other) noexcept;
    ~Reservation();
    uint64_t bytes() const { return bytes_; }

   private:
    friend class StagingPool;
    Reservation(StagingPool* pool, uint64_t bytes) : pool_(pool), bytes_(bytes) {}
    StagingPool* pool_ = nullptr;
    uint64_t bytes_ = 0;
  };

  explicit StagingPool(uint64_t capacity_bytes) : capacity_(capacity_bytes) {}

  // Waits until `bytes` are free and every earlier waiter was served, then reserves them.
  // `cancelled` is polled while waiting (every 50 ms). Errors: RESOURCE_EXHAUSTED at once when
  // bytes exceed the whole capacity (the message names the limit and its flag); CANCELLED when
  // `cancelled` returns true before the bytes are free.
  absl::StatusOr<Reservation> Reserve(uint64_t bytes, const std::function<bool()>& cancelled);

  uint64_t capacity() const { return capacity_; }
  uint64_t in_use() const ABSL_LOCKS_EXCLUDED(mu_);
  uint32_t waiting() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Release(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  void SkipAbandonedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t capacity_;
  mutable absl::Mutex mu_;
  uint64_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 0;  // Arrival order of waiters.
  uint64_t serving_ ABSL_GUARDED_BY(mu_) = 0;      // The ticket whose turn it is.
  absl::flat_hash_set<uint64_t> abandoned_ ABSL_GUARDED_BY(mu_);  // Cancelled tickets.
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_STAGING_POOL_H_
