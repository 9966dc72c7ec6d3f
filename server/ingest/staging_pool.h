// staging_pool.h: the bounded budget of host staging memory shared by the calls in flight.
//
// Every push, registration and pull reserves the staging its data will occupy before the server
// reads (or writes) any of it. When the budget is spent, the call waits for another to release
// its reservation, and its stream is not read meanwhile, so gRPC's flow control stops the
// sender: back-pressure, never unbounded memory.
//
// The pool hands out regions of one arena, allocated once by the backend (page-locked on a GPU,
// with a device mirror at the same offsets), so that each chunk can start its copy to the device
// as soon as it is written. Regions are 64-byte aligned, first fit, coalesced on release.
//
// Who goes first. Waiters are considered in arrival order, and each one that fits in a free
// region is served; one that does not fit does not hold up later ones that do (first fit over
// the waiting line). So after every operation no waiter fits, and a new request that fits now is
// granted at once without passing anyone who could have been served. The trade-off: a large
// request may wait while smaller ones keep passing it, and a steady stream of them can keep it
// waiting; the pool itself sets no bound. The server bounds how long any call holds staging,
// so room does come back, and oldest_wait() shows how long the longest waiter has waited.
//
// Where callbacks run. A request granted (or refused) at once inside ReserveAsync is called
// back inline, on the calling thread, saving a thread hop on the hot path. Every other callback,
// for a waiter served when a release frees room or ended by Cancel or by the pool's destruction,
// runs on the pool's own grant thread, one at a time in the order they were decided: never on
// the thread that released or cancelled (which may be the optimizer engine's), never inside a
// release, and never while the pool's lock is held. A callback may release and reserve again;
// as the callbacks share one thread, each should be short and must never wait for another grant.
//
// Usage (a callback-API reactor):
//   uint64_t ticket = pool.ReserveAsync(bytes, [this](absl::StatusOr<Reservation> r) {...});
//   ... on cancellation: pool.Cancel(ticket);
// or (a blocking handler):
//   absl::StatusOr<Reservation> r = pool.Reserve(bytes, [&] { return ctx->IsCancelled(); });
//
// Synchronization uses std::mutex and std::condition_variable (through common/mutex.h, which
// annotates them for clang's -Wthread-safety) and std::thread, which ThreadSanitizer sees
// through pthreads (Debian's absl synchronization is not built for it).
#ifndef FUSEDPS_SERVER_INGEST_STAGING_POOL_H_
#define FUSEDPS_SERVER_INGEST_STAGING_POOL_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/mutex.h"

namespace fusedps {

class StagingPool {
 public:
  // Holds a region of the pool until destroyed (or moved from, or assigned over), then gives it
  // back. A reservation of 0 bytes owns no region: data() is null and giving it back changes
  // nothing.
  class Reservation {
   public:
    Reservation() = default;
    Reservation(Reservation&& other) noexcept { *this = std::move(other); }
    Reservation& operator=(Reservation&& other) noexcept;
    ~Reservation();
    uint64_t bytes() const { return bytes_; }    // The request rounded up to 64 bytes.
    uint64_t offset() const { return offset_; }  // In the arena.
    // Null for 0 bytes, or when the pool has no arena.
    char* data() const {
      return pool_ != nullptr && pool_->arena_ != nullptr ? pool_->arena_ + offset_ : nullptr;
    }

   private:
    friend class StagingPool;
    Reservation(StagingPool* pool, uint64_t offset, uint64_t bytes)
        : pool_(pool), offset_(offset), bytes_(bytes) {}
    StagingPool* pool_ = nullptr;  // Null when no region is owned.
    uint64_t offset_ = 0;
    uint64_t bytes_ = 0;
  };
  using Done = std::function<void(absl::StatusOr<Reservation>)>;

  // `arena` (capacity_bytes long, not owned) backs the reservations; null: accounting only. The
  // capacity is capacity_bytes rounded down to 64. `limit_flag` names the setting of the
  // capacity in the message of a request larger than all of it. Starts the grant thread.
  StagingPool(uint64_t capacity_bytes, char* arena,
              std::string limit_flag = "--staging-pool-bytes");

  // Ends the wait of every request still in line with CANCELLED ("the staging pool is shutting
  // down"), lets the grant thread deliver every callback already decided, and joins it.
  // REQUIRES: by then every reservation has been given back (none may outlive the pool); one
  // still held crashes the process with a message.
  ~StagingPool();

  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  // Calls `done` exactly once, with:
  // - a reservation of `bytes` (rounded up to 64), inline when one fits now (see the policy
  //   above), else from the grant thread once a release frees room and it is its turn;
  // - an empty reservation (bytes() == 0), inline, when `bytes` is 0, even with others waiting;
  // - RESOURCE_EXHAUSTED, inline, when `bytes` exceed the whole capacity (the message names the
  //   request, the capacity and limit_flag);
  // - CANCELLED, from the grant thread, after Cancel(ticket) or when the pool is destroyed.
  // Returns a ticket for Cancel while the request waits, or 0 when `done` already ran.
  uint64_t ReserveAsync(uint64_t bytes, Done done) ABSL_LOCKS_EXCLUDED(mu_);

  // Ends a wait: its `done` runs with CANCELLED on the grant thread, possibly after Cancel has
  // returned. A no-op for a ticket already served or ended, and for 0.
  void Cancel(uint64_t ticket) ABSL_LOCKS_EXCLUDED(mu_);

  // ReserveAsync, blocking until `done` runs; polls `cancelled` every 50 ms meanwhile and
  // cancels the wait the first time it returns true.
  // REQUIRES: not called from a `done` callback, whose thread would have to deliver this one's
  // grant; doing so crashes the process with a message.
  absl::StatusOr<Reservation> Reserve(uint64_t bytes, const std::function<bool()>& cancelled)
      ABSL_LOCKS_EXCLUDED(mu_);

  uint64_t capacity() const { return capacity_; }
  uint64_t in_use() const ABSL_LOCKS_EXCLUDED(mu_);   // Held, counting grants not yet delivered.
  uint32_t waiting() const ABSL_LOCKS_EXCLUDED(mu_);  // Requests in line.
  // How long the request longest in line has waited; zero when none waits. Feeds the gauge
  // fusedps_staging_pool_oldest_wait_seconds.
  absl::Duration oldest_wait() const ABSL_LOCKS_EXCLUDED(mu_);

  // INTERNAL naming the first violation, else OK: the free regions are sorted, non-empty,
  // disjoint, within the capacity and coalesced (no two adjacent), their sizes sum to
  // capacity - in_use, and no request in line fits in one of them. For tests and debugging.
  absl::Status CheckInvariants() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Clock = std::chrono::steady_clock;
  struct Waiter {
    uint64_t bytes;
    Clock::time_point since;
    Done done;
  };
  // A callback decided under the lock, to be run by the grant thread.
  struct Grant {
    Done done;
    absl::StatusOr<Reservation> result;
  };

  void Release(uint64_t offset, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // The offset of a free region of `bytes` > 0 (first fit), taken from the free list; or none.
  std::optional<uint64_t> AllocateLocked(uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Returns [offset, offset + bytes) to the free list, merged with its free neighbours; crashes
  // if it overlaps a free region or lies outside the arena (a region given back twice).
  void FreeLocked(uint64_t offset, uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Serves, in arrival order, every waiter that now fits, queueing their grants.
  void ServeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void QueueLocked(Done done, absl::StatusOr<Reservation> result)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The grant thread's loop: runs queued grants, outside the lock, until shutdown drains them.
  void RunGrants() ABSL_LOCKS_EXCLUDED(mu_);

  const uint64_t capacity_;
  char* const arena_;
  const std::string limit_flag_;
  mutable Mutex mu_;
  CondVar grants_ready_;  // Signalled when grants_ gains one, or on shutdown.
  uint64_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t last_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, Waiter> waiters_ ABSL_GUARDED_BY(mu_);  // By ticket: in arrival order.
  std::map<uint64_t, uint64_t> free_ ABSL_GUARDED_BY(mu_);   // Offset -> size; see CheckInvariants.
  std::deque<Grant> grants_ ABSL_GUARDED_BY(mu_);            // FIFO, for the grant thread.
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread grant_thread_;  // Last: starts once everything above is ready.
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_INGEST_STAGING_POOL_H_
