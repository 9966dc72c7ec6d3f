#include "server/ingest/staging_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace fusedps {
namespace {

using Reservation = StagingPool::Reservation;

bool Never() { return false; }

// A `cancelled` for Reserve that turns true after `wait`, so a test fails instead of hanging.
std::function<bool()> GiveUpAfter(absl::Duration wait) {
  const absl::Time deadline = absl::Now() + wait;
  return [deadline] { return absl::Now() > deadline; };
}

// Records what ReserveAsync calls back with and keeps the granted reservations until dropped.
// Checks as it goes that no request is called back twice and that held regions are disjoint.
class Calls {
 public:
  // The callback of the request this test calls `id`.
  StagingPool::Done For(int id) {
    return [this, id](absl::StatusOr<Reservation> result) { Record(id, std::move(result)); };
  }

  // Waits until `n` callbacks in all have run; false after 10 s.
  bool WaitForCount(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(10), [&] { return order_.size() >= n; });
  }

  std::vector<int> Order() const {
    std::lock_guard<std::mutex> lock(mu_);
    return order_;
  }
  absl::Status StatusOf(int id) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = calls_.find(id);
    return it == calls_.end() ? absl::NotFoundError("not called back") : it->second.status;
  }
  std::thread::id ThreadOf(int id) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = calls_.find(id);
    return it == calls_.end() ? std::thread::id() : it->second.thread;
  }
  int CountWith(absl::StatusCode code) const {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int>(std::count_if(calls_.begin(), calls_.end(), [&](const auto& c) {
      return c.second.status.code() == code;
    }));
  }
  std::vector<int> Held() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int> ids;
    for (const auto& [id, reservation] : held_) ids.push_back(id);
    return ids;
  }
  // Problems seen so far; empty when none.
  std::string Errors() const {
    std::lock_guard<std::mutex> lock(mu_);
    return errors_;
  }

  // Gives back request `id`'s reservation, on the calling thread.
  void Drop(int id) {
    Reservation dropped;  // Destroyed after the lock.
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = held_.find(id); it != held_.end()) {
      dropped = std::move(it->second);
      held_.erase(it);
    }
  }

  // Gives back every reservation held, and from now on each one granted as it arrives.
  void Close() {
    std::map<int, Reservation> dropped;
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    dropped.swap(held_);
  }

 private:
  struct Call {
    absl::Status status;
    std::thread::id thread;
  };

  void Record(int id, absl::StatusOr<Reservation> result) {
    Reservation dropped;  // Destroyed after the lock.
    std::lock_guard<std::mutex> lock(mu_);
    if (calls_.count(id) != 0) absl::StrAppend(&errors_, "request ", id, " called back twice; ");
    calls_[id] = {result.status(), std::this_thread::get_id()};
    order_.push_back(id);
    if (result.ok() && closed_) {
      dropped = *std::move(result);
    } else if (result.ok()) {
      for (const auto& [other, r] : held_) {
        if (r.bytes() > 0 && result->bytes() > 0 &&
            r.offset() < result->offset() + result->bytes() &&
            result->offset() < r.offset() + r.bytes()) {
          absl::StrAppend(&errors_, "requests ", id, " and ", other, " overlap; ");
        }
      }
      held_.emplace(id, *std::move(result));
    }
    cv_.notify_all();
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<int, Call> calls_;
  std::vector<int> order_;
  std::map<int, Reservation> held_;
  bool closed_ = false;
  std::string errors_;
};

class StagingPoolTest : public ::testing::Test {
 protected:
  ~StagingPoolTest() override {
    calls_.Close();  // No reservation may outlive the pool;
    pool_.reset();   // whoever still waits is called back (CANCELLED) into calls_.
  }

  StagingPool& Pool(uint64_t capacity, char* arena = nullptr,
                    std::string limit_flag = "--staging-pool-bytes") {
    pool_ = std::make_unique<StagingPool>(capacity, arena, std::move(limit_flag));
    return *pool_;
  }

  Calls calls_;  // Outlives pool_.
  std::unique_ptr<StagingPool> pool_;
};

TEST_F(StagingPoolTest, ReservesReleasesAndRefusesWhatCanNeverFit) {
  StagingPool& pool = Pool(128);
  {
    auto a = pool.Reserve(64, Never);
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(pool.in_use(), 64u);
    auto b = pool.Reserve(64, Never);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(pool.in_use(), 128u);
    EXPECT_EQ(pool.CheckInvariants(), absl::OkStatus());
  }
  EXPECT_EQ(pool.in_use(), 0u);
  EXPECT_EQ(pool.CheckInvariants(), absl::OkStatus());
  auto too_big = pool.Reserve(129, Never);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST_F(StagingPoolTest, RefusalNamesTheCallsNeedThePoolAndItsFlag) {
  StagingPool& pool = Pool(128, nullptr, "--my-pool-bytes");
  EXPECT_EQ(pool.Reserve(129, Never).status(),
            absl::ResourceExhaustedError("the call needs 129 bytes of staging at once, more than "
                                         "the whole pool of 128 bytes (--my-pool-bytes)"));
  StagingPool two_arguments(128, nullptr);
  EXPECT_EQ(two_arguments.Reserve(200, Never).status(),
            absl::ResourceExhaustedError("the call needs 200 bytes of staging at once, more than "
                                         "the whole pool of 128 bytes (--staging-pool-bytes)"));
}

// Rounding such a size up to the 64-byte alignment wraps around to 0.
TEST_F(StagingPoolTest, RefusesARequestTooLargeToRoundUp) {
  StagingPool& pool = Pool(128);
  for (uint64_t bytes : {std::numeric_limits<uint64_t>::max(), ~uint64_t{0} - 62}) {
    absl::StatusOr<Reservation> r = pool.Reserve(bytes, GiveUpAfter(absl::Seconds(1)));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << bytes;
  }
  EXPECT_EQ(pool.CheckInvariants(), absl::OkStatus());
}

TEST_F(StagingPoolTest, HandsOutDisjointAlignedRegionsAndCoalescesThem) {
  std::vector<char> arena(256);
  StagingPool& pool = Pool(256, arena.data());
  auto a = pool.Reserve(10, Never);
  auto b = pool.Reserve(64, Never);
  auto c = pool.Reserve(100, Never);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->data(), arena.data());
  EXPECT_EQ(a->offset(), 0u);
  EXPECT_EQ(b->offset(), 64u);
  EXPECT_EQ(c->offset(), 128u);
  EXPECT_EQ(c->data(), arena.data() + 128);
  EXPECT_EQ(pool.in_use(), 256u);
  *a = Reservation();
  *b = Reservation();  // Merges with a's region: 128 contiguous bytes.
  EXPECT_EQ(pool.CheckInvariants(), absl::OkStatus());
  auto d = pool.Reserve(128, Never);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->offset(), 0u);
  EXPECT_EQ(pool.CheckInvariants(), absl::OkStatus());
}

// The production bug: a zero-byte reservation shared its offset with the next real one, and
// releasing both lost the real one's bytes for good.
TEST_F(StagingPoolTest, ZeroByteReservationDoesNotLoseBytes) {
  StagingPool& pool = Pool(256);
  absl::StatusOr<Reservation> held = pool.Reserve(64, Never);  // [0, 64)
  absl::StatusOr<Reservation> empty = pool.Reserve(0, Never);
  absl::StatusOr<Reservation> b = pool.Reserve(64, Never);  // [64, 128)
  ASSERT_TRUE(held.ok() && empty.ok() && b.ok());
  EXPECT_EQ(b->offset(), 64u);
  *empty = Reservation();
  EXPECT_EQ(pool.CheckInvariants(), absl::OkStatus());
  *b = Reservation();
  EXPECT_EQ(pool.CheckInvariants(), absl::OkStatus());
  *held = Reservation();
  EXPECT_EQ(pool.in_use(), 0u);
  EXPECT_EQ(pool.CheckInvariants(), absl::OkStatus());
  // Every byte is back, so a request for the whole pool is granted at once.
  const uint64_t ticket = pool.ReserveAsync(256, calls_.For(1));
  EXPECT_EQ(ticket, 0u) << "a request for the whole pool waits, yet no one holds any of it";
  EXPECT_TRUE(calls_.StatusOf(1).ok());
  pool.Cancel(ticket);
}

TEST_F(StagingPoolTest, ZeroByteRequestIsGrantedAtOnceAndOwnsNothing) {
  std::vector<char> arena(128);
  StagingPool& pool = Pool(128, arena.data());
  absl::StatusOr<Reservation> full = pool.Reserve(128, Never);
  ASSERT_TRUE(full.ok());
  ASSERT_NE(pool.ReserveAsync(64, calls_.For(1)), 0u);
  // Granted although the pool is full and someone waits.
  absl::StatusOr<Reservation> empty = pool.Reserve(0, GiveUpAfter(absl::Milliseconds(500)));
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->bytes(), 0u);
  EXPECT_EQ(empty->data(), nullptr);
  EXPECT_EQ(pool.in_use(), 128u);
  *empty = Reservation();  // Changes nothing.
  EXPECT_EQ(pool.in_use(), 128u);
  EXPECT_EQ(pool.waiting(), 1u);
  EXPECT_EQ(pool.CheckInvariants(), absl::OkStatus());
  *full = Reservation();
  ASSERT_TRUE(calls_.WaitForCount(1));
  EXPECT_TRUE(calls_.StatusOf(1).ok());
  EXPECT_EQ(pool.CheckInvariants(), absl::OkStatus());

  StagingPool none(63, nullptr);  // Rounds down to a capacity of 0.
  EXPECT_EQ(none.capacity(), 0u);
  EXPECT_TRUE(none.Reserve(0, GiveUpAfter(absl::Milliseconds(500))).ok());
  EXPECT_EQ(none.Reserve(1, Never).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(none.CheckInvariants(), absl::OkStatus());
}

// Sizes from 0 to beyond the pool, releases in random order, cancels and waiters, with the
// free list checked after every step.
TEST_F(StagingPoolTest, RandomMixKeepsTheFreeListWhole) {
  constexpr uint64_t kUnit = 64, kCapacity = 32 * kUnit;
  std::vector<char> arena(kCapacity);
  StagingPool& pool = Pool(kCapacity, arena.data());
  std::mt19937 rng(20240611);
  auto uniform = [&](uint64_t lo, uint64_t hi) {
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
  };
  std::map<int, uint64_t> tickets;  // Of those that waited; some since served.
  int requests = 0;
  for (int step = 0; step < 4000; ++step) {
    const uint64_t op = uniform(0, 9);
    if (op < 5) {
      const uint64_t kind = uniform(0, 3);
      const uint64_t bytes = kind == 0   ? 0
                             : kind == 1 ? uniform(1, 2 * kUnit)
                                         : uniform(0, kCapacity + kUnit);
      const int id = ++requests;
      const uint64_t ticket = pool.ReserveAsync(bytes, calls_.For(id));
      if (ticket != 0) tickets[id] = ticket;
    } else if (op < 8) {
      std::vector<int> held = calls_.Held();
      if (!held.empty()) calls_.Drop(held[uniform(0, held.size() - 1)]);
    } else if (!tickets.empty()) {
      auto it =
          std::next(tickets.begin(), static_cast<std::ptrdiff_t>(uniform(0, tickets.size() - 1)));
      pool.Cancel(it->second);
      tickets.erase(it);
    }
    ASSERT_EQ(pool.CheckInvariants(), absl::OkStatus()) << "after step " << step;
    ASSERT_EQ(calls_.Errors(), "") << "after step " << step;
  }
  for (const auto& [id, ticket] : tickets) pool.Cancel(ticket);
  ASSERT_TRUE(calls_.WaitForCount(static_cast<size_t>(requests)));
  EXPECT_EQ(calls_.Errors(), "");
  EXPECT_GT(calls_.CountWith(absl::StatusCode::kOk), 100);
  EXPECT_GT(calls_.CountWith(absl::StatusCode::kCancelled), 10);
  EXPECT_GT(calls_.CountWith(absl::StatusCode::kResourceExhausted), 10);
  calls_.Close();
  EXPECT_EQ(pool.waiting(), 0u);
  EXPECT_EQ(pool.in_use(), 0u);
  EXPECT_EQ(pool.CheckInvariants(), absl::OkStatus());
  EXPECT_EQ(pool.ReserveAsync(kCapacity, calls_.For(++requests)), 0u);
}

// Production, scaled down from MiB to KiB: a slow reader holds 64 of 96, a 48 waits; 8s must
// not wait behind it in the 32 that are free.
TEST_F(StagingPoolTest, SmallRequestsPassALargeWaiterThatCannotBeServed) {
  constexpr uint64_t kKiB = 1024;
  StagingPool& pool = Pool(96 * kKiB);
  absl::StatusOr<Reservation> slow_reader = pool.Reserve(64 * kKiB, Never);
  ASSERT_TRUE(slow_reader.ok());
  ASSERT_NE(pool.ReserveAsync(48 * kKiB, calls_.For(1)), 0u);
  for (int id = 2; id <= 4; ++id) {
    EXPECT_EQ(pool.ReserveAsync(8 * kKiB, calls_.For(id)), 0u)
        << "8 KiB waited behind a 48 KiB waiter with 32 KiB free";
    EXPECT_TRUE(calls_.StatusOf(id).ok());
  }
  EXPECT_EQ(pool.in_use(), 88 * kKiB);
  EXPECT_EQ(pool.waiting(), 1u);
  EXPECT_EQ(pool.CheckInvariants(), absl::OkStatus());
  *slow_reader = Reservation();  // [0, 64 KiB) is back: the 48 KiB waiter fits.
  EXPECT_EQ(pool.waiting(), 0u);
  ASSERT_TRUE(calls_.WaitForCount(4));
  EXPECT_TRUE(calls_.StatusOf(1).ok());
  EXPECT_EQ(pool.in_use(), 72 * kKiB);
  EXPECT_EQ(pool.CheckInvariants(), absl::OkStatus());
}

TEST_F(StagingPoolTest, WaitersThatFitAfterAReleaseAreServedInArrivalOrder) {
  StagingPool& pool = Pool(640);  // Ten 64-byte units.
  absl::StatusOr<Reservation> all = pool.Reserve(640, Never);
  ASSERT_TRUE(all.ok());
  const uint64_t bytes[] = {256, 512, 128, 256};
  for (int id = 1; id <= 4; ++id) ASSERT_NE(pool.ReserveAsync(bytes[id - 1], calls_.For(id)), 0u);
  // 1 takes [0, 256); 2 (512) no longer fits and waits; 3 and 4 take the rest, in that order.
  *all = Reservation();
  ASSERT_EQ(pool.waiting(), 1u);
  ASSERT_TRUE(calls_.WaitForCount(3));
  EXPECT_EQ(calls_.Order(), (std::vector<int>{1, 3, 4}));
  EXPECT_EQ(pool.CheckInvariants(), absl::OkStatus());
  calls_.Drop(1);
  calls_.Drop(4);  // 512 bytes free, but in two pieces of 256.
  EXPECT_EQ(pool.waiting(), 1u);
  EXPECT_EQ(pool.CheckInvariants(), absl::OkStatus());
  calls_.Drop(3);  // Coalesced: 640 contiguous.
  ASSERT_TRUE(calls_.WaitForCount(4));
  EXPECT_EQ(calls_.Order(), (std::vector<int>{1, 3, 4, 2}));
  EXPECT_EQ(pool.CheckInvariants(), absl::OkStatus());
}

TEST_F(StagingPoolTest, AnImmediateGrantRunsInlineOnTheCallingThread) {
  StagingPool& pool = Pool(128);
  EXPECT_EQ(pool.ReserveAsync(64, calls_.For(1)), 0u);
  EXPECT_EQ(pool.ReserveAsync(1000, calls_.For(2)), 0u);
  EXPECT_EQ(calls_.Order(), (std::vector<int>{1, 2}));  // Both before ReserveAsync returned.
  EXPECT_EQ(calls_.ThreadOf(1), std::this_thread::get_id());
  EXPECT_EQ(calls_.StatusOf(2).code(), absl::StatusCode::kResourceExhausted);
}

TEST_F(StagingPoolTest, WaitersEndedByReleaseOrCancelAreCalledBackOnThePoolsThread) {
  StagingPool& pool = Pool(128);
  absl::StatusOr<Reservation> held = pool.Reserve(128, Never);
  ASSERT_TRUE(held.ok());
  ASSERT_NE(pool.ReserveAsync(64, calls_.For(1)), 0u);
  std::thread::id releaser;
  std::thread([&] {
    releaser = std::this_thread::get_id();
    *held = Reservation();
  }).join();
  ASSERT_TRUE(calls_.WaitForCount(1));
  EXPECT_TRUE(calls_.StatusOf(1).ok());
  EXPECT_NE(calls_.ThreadOf(1), releaser);
  EXPECT_NE(calls_.ThreadOf(1), std::this_thread::get_id());

  const uint64_t ticket = pool.ReserveAsync(128, calls_.For(2));  // 1 holds 64.
  ASSERT_NE(ticket, 0u);
  std::thread::id canceller;
  std::thread([&] {
    canceller = std::this_thread::get_id();
    pool.Cancel(ticket);
  }).join();
  ASSERT_TRUE(calls_.WaitForCount(2));
  EXPECT_EQ(calls_.StatusOf(2).code(), absl::StatusCode::kCancelled);
  EXPECT_NE(calls_.ThreadOf(2), canceller);
  EXPECT_EQ(calls_.ThreadOf(2), calls_.ThreadOf(1));  // The pool's one grant thread.
}

// A callback that gives its staging back and asks again, as an ingest that fails and retries.
TEST_F(StagingPoolTest, ACallbackThatReleasesAndReservesAgainDoesNotRecurse) {
  StagingPool& pool = Pool(128);
  absl::StatusOr<Reservation> a = pool.Reserve(64, Never);
  absl::StatusOr<Reservation> b = pool.Reserve(64, Never);
  ASSERT_TRUE(a.ok() && b.ok());
  struct Depth {
    std::atomic<int> now{0}, deepest{0};
  };
  auto depth = std::make_shared<Depth>();  // Callbacks may outlive this body if it fails.
  auto tracked = [depth](StagingPool::Done then) -> StagingPool::Done {
    return [depth, then = std::move(then)](absl::StatusOr<Reservation> r) {
      const int now = ++depth->now;
      int deepest = depth->deepest.load();
      while (now > deepest && !depth->deepest.compare_exchange_weak(deepest, now)) {
      }
      then(std::move(r));
      --depth->now;
    };
  };
  Calls* calls = &calls_;
  StagingPool::Done first = [&pool, calls, tracked](absl::StatusOr<Reservation> r) {
    if (r.ok()) *r = Reservation();                 // Gives it back: 2 is served.
    pool.ReserveAsync(64, tracked(calls->For(3)));  // Full again (b and 2): waits.
    calls->For(1)(Reservation());                   // Reports 1 as called back, holding nothing.
  };
  ASSERT_NE(pool.ReserveAsync(64, tracked(first)), 0u);
  ASSERT_NE(pool.ReserveAsync(64, tracked(calls_.For(2))), 0u);
  *a = Reservation();  // 1 is served.
  ASSERT_TRUE(calls_.WaitForCount(2));
  EXPECT_EQ(calls_.Order(), (std::vector<int>{1, 2}));
  EXPECT_EQ(depth->deepest.load(), 1) << "a callback ran inside another one";
  EXPECT_EQ(calls_.ThreadOf(2), calls_.ThreadOf(1));
  EXPECT_EQ(pool.waiting(), 1u);
  *b = Reservation();  // 3 is served.
  ASSERT_TRUE(calls_.WaitForCount(3));
  EXPECT_TRUE(calls_.StatusOf(3).ok());
  EXPECT_EQ(depth->deepest.load(), 1);
  EXPECT_EQ(pool.CheckInvariants(), absl::OkStatus());
}

TEST(StagingPoolShutdownTest, DestroyingThePoolCancelsWhoeverStillWaits) {
  Calls calls;  // Outlives the pool.
  std::optional<Reservation> held;
  auto pool = std::make_unique<StagingPool>(128, nullptr);
  held = *pool->Reserve(128, Never);
  StagingPool::Done record = calls.For(1);
  // 1's call ends when it is told, and gives back what it held (as a reactor would).
  ASSERT_NE(pool->ReserveAsync(64,
                               [&held, record](absl::StatusOr<Reservation> r) {
                                 held.reset();
                                 record(std::move(r));
                               }),
            0u);
  ASSERT_NE(pool->ReserveAsync(64, calls.For(2)), 0u);
  pool.reset();
  EXPECT_EQ(calls.Order(), (std::vector<int>{1, 2}));
  EXPECT_EQ(calls.StatusOf(1), absl::CancelledError("the staging pool is shutting down"));
  EXPECT_EQ(calls.StatusOf(2), absl::CancelledError("the staging pool is shutting down"));
  if (held.has_value()) {
    ADD_FAILURE() << "1 was never called back to give its staging back";
    static_cast<void>(new Reservation(*std::move(held)));  // Never into the destroyed pool.
  }
}

TEST(StagingPoolDeathTest, DestroyingThePoolWithAReservationHeldCrashes) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        auto pool = std::make_unique<StagingPool>(128, nullptr);
        absl::StatusOr<Reservation> r = pool->Reserve(64, Never);
        pool.reset();
      },
      "destroyed while 64 bytes of its staging are still held");
}

TEST(StagingPoolDeathTest, BlockingReserveFromACallbackCrashes) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        StagingPool pool(128, nullptr);
        absl::StatusOr<Reservation> held = pool.Reserve(128, Never);
        pool.ReserveAsync(128, [&pool](absl::StatusOr<Reservation> r) {
          if (r.ok()) *r = Reservation();
          pool.Reserve(64, Never).IgnoreError();  // Could wait on the thread it runs on.
        });
        *held = Reservation();
      },
      "Reserve called from a staging callback");
}

TEST_F(StagingPoolTest, OldestWaitIsHowLongTheFirstInLineHasWaited) {
  StagingPool& pool = Pool(128);
  EXPECT_EQ(pool.oldest_wait(), absl::ZeroDuration());
  absl::StatusOr<Reservation> held = pool.Reserve(128, Never);
  ASSERT_TRUE(held.ok());
  EXPECT_EQ(pool.oldest_wait(), absl::ZeroDuration());
  ASSERT_NE(pool.ReserveAsync(64, calls_.For(1)), 0u);
  absl::SleepFor(absl::Milliseconds(60));
  ASSERT_NE(pool.ReserveAsync(64, calls_.For(2)), 0u);
  EXPECT_GE(pool.oldest_wait(), absl::Milliseconds(60));  // 1's wait, not 2's.
  *held = Reservation();
  EXPECT_EQ(pool.oldest_wait(), absl::ZeroDuration());
  EXPECT_TRUE(calls_.WaitForCount(2));
}

TEST_F(StagingPoolTest, CancelledWaiterLeavesTheLine) {
  StagingPool& pool = Pool(128);
  absl::StatusOr<Reservation> held = pool.Reserve(100, Never);
  ASSERT_TRUE(held.ok());
  std::atomic<bool> cancel{false};
  absl::StatusCode code = absl::StatusCode::kOk;
  std::thread waiter(
      [&] { code = pool.Reserve(50, [&] { return cancel.load(); }).status().code(); });
  while (pool.waiting() < 1) absl::SleepFor(absl::Milliseconds(1));
  cancel = true;
  waiter.join();
  EXPECT_EQ(code, absl::StatusCode::kCancelled);
  EXPECT_EQ(pool.waiting(), 0u);
  EXPECT_EQ(pool.CheckInvariants(), absl::OkStatus());
  *held = Reservation();
  EXPECT_TRUE(pool.Reserve(128, Never).ok());
}

}  // namespace
}  // namespace fusedps
