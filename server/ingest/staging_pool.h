// staging_pool.h: the bounded budget of host staging memory shared by the calls in flight.
//
// Every push (and registration) reserves the staging its data will occupy, the size of its
// named tensors in the wire dtype, before the server reads any of its chunks. When the budget is
// spent, the call waits for another to release its reservation, and its stream is not read
// meanwhile, so gRPC's flow control stops the sender: back-pressure, never unbounded memory.
// Waiters are served in arrival order.
//
// The pool hands out regions of one arena, allocated once by the backend (page-locked on a GPU,
// with a device mirror at the same offsets), so that each chunk can start its copy to the device
// as soon as it is written. Regions are 64-byte aligned, first fit, coalesced on release.
//
// Usage (a callback-API reactor):
//   uint64_t ticket = pool.ReserveAsync(bytes, [this](absl::StatusOr<Reservation> r) {...});
//   ... on cancellation: pool.Cancel(ticket);
// or (a blocking handler):
//   absl::StatusOr<Reservation> r = pool.Reserve(bytes, [&] { return ctx->IsCancelled(); });
#ifndef FUSEDPS_SERVER_INGEST_STAGING_POOL_H_
#define FUSEDPS_SERVER_INGEST_STAGING_POOL_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <vector>

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
    uint64_t offset() const { return offset_; }  // In the arena.
    char* data() const { return pool_ != nullptr && pool_->arena_ != nullptr
                                    ? pool_->arena_ + offset_ : nullptr; }

   private:
    friend class StagingPool;
    Reservation(StagingPool* pool, uint64_t offset, uint64_t bytes)
        : pool_(pool), offset_(offset), bytes_(bytes) {}
    StagingPool* pool_ = nullptr;
    uint64_t offset_ = 0;
    uint64_t bytes_ = 0;
  };
  using Done = std::function<void(absl::StatusOr<Reservation>)>;

  // `arena` (capacity_bytes long, not owned) backs the reservations; null: accounting only.
  StagingPool(uint64_t capacity_bytes, char* arena);

  // Calls `done` exactly once: with a reservation of `bytes` as soon as they are free and every
  // earlier waiter was served (inline when that is now; else from the thread whose release
  // freed them), or with RESOURCE_EXHAUSTED at once when bytes exceed the whole capacity (the
  // message names the limit and its flag), or with CANCELLED after Cancel. Returns a ticket for
  // Cancel (0 when `done` already ran).
  uint64_t ReserveAsync(uint64_t bytes, Done done) ABSL_LOCKS_EXCLUDED(mu_);

  // Ends a wait: its `done` runs with CANCELLED. A no-op for a ticket already served.
  void Cancel(uint64_t ticket) ABSL_LOCKS_EXCLUDED(mu_);

  // Blocks until ReserveAsync's `done` runs; polls `cancelled` every 50 ms meanwhile.
  absl::StatusOr<Reservation> Reserve(uint64_t bytes, const std::function<bool()>& cancelled);

  uint64_t capacity() const { return capacity_; }
  uint64_t in_use() const ABSL_LOCKS_EXCLUDED(mu_);
  uint32_t waiting() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Waiter {
    uint64_t ticket;
    uint64_t bytes;
    Done done;
  };
  struct Served {
    Waiter waiter;
    uint64_t offset;
  };
  void Release(uint64_t offset, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // The offset of a free region of `bytes` (first fit), taken from the free list; or none.
  std::optional<uint64_t> AllocateLocked(uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the waiters at the front that now fit, reserving their regions.
  std::vector<Served> ServeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t capacity_;
  char* const arena_;
  mutable absl::Mutex mu_;
  uint64_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t last_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<Waiter> waiters_ ABSL_GUARDED_BY(mu_);  // In arrival order.
  std::map<uint64_t, uint64_t> free_ ABSL_GUARDED_BY(mu_);  // Offset -> size, disjoint.
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_INGEST_STAGING_POOL_H_
