#include "server/ingest/staging_pool.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace fusedps {
namespace {

TEST(StagingPoolTest, ReservesReleasesAndRefusesWhatCanNeverFit) {
  StagingPool pool(128, nullptr);
  {
    auto a = pool.Reserve(64, [] { return false; });
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(pool.in_use(), 64u);
    auto b = pool.Reserve(64, [] { return false; });
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(pool.in_use(), 128u);
  }
  EXPECT_EQ(pool.in_use(), 0u);
  auto too_big = pool.Reserve(129, [] { return false; });
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(too_big.status().message().find("--staging-pool-bytes"), std::string::npos);
}

TEST(StagingPoolTest, WaitsForReleaseInArrivalOrder) {
  StagingPool pool(640, nullptr);  // Ten 64-byte units.
  absl::StatusOr<StagingPool::Reservation> held = pool.Reserve(512, [] { return false; });
  ASSERT_TRUE(held.ok());
  StagingPool::Reservation first = *std::move(held);
  std::atomic<int> order{0};
  int big_turn = 0, small_turn = 0;
  std::thread big([&] {
    auto r = pool.Reserve(576, [] { return false; });  // Needs first's bytes back.
    big_turn = ++order;
  });
  while (pool.waiting() < 1) absl::SleepFor(absl::Milliseconds(1));
  std::thread small([&] {
    // Fits beside `first` now (512 + 128), but arrived after big; once big holds 576 it must
    // also wait for big's release, so the order below is deterministic.
    auto r = pool.Reserve(128, [] { return false; });
    small_turn = ++order;
  });
  while (pool.waiting() < 2) absl::SleepFor(absl::Milliseconds(1));
  absl::SleepFor(absl::Milliseconds(120));
  EXPECT_EQ(order.load(), 0);  // Neither got through while first holds 512 of 640.
  first = StagingPool::Reservation();
  big.join();
  small.join();
  EXPECT_EQ(big_turn, 1);
  EXPECT_EQ(small_turn, 2);
  EXPECT_EQ(pool.in_use(), 0u);
}

TEST(StagingPoolTest, HandsOutDisjointAlignedRegionsAndCoalescesThem) {
  std::vector<char> arena(256);
  StagingPool pool(256, arena.data());
  auto a = pool.Reserve(10, [] { return false; });
  auto b = pool.Reserve(64, [] { return false; });
  auto c = pool.Reserve(100, [] { return false; });
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->data(), arena.data());
  EXPECT_EQ(a->offset(), 0u);
  EXPECT_EQ(b->offset(), 64u);
  EXPECT_EQ(c->offset(), 128u);
  EXPECT_EQ(c->data(), arena.data() + 128);
  EXPECT_EQ(pool.in_use(), 256u);
  *a = StagingPool::Reservation();
  *b = StagingPool::Reservation();  // Merges with a's region: 128 contiguous bytes.
  auto d = pool.Reserve(128, [] { return false; });
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->offset(), 0u);
}

TEST(StagingPoolTest, CancelledWaiterLeavesTheLine) {
  StagingPool pool(128, nullptr);
  absl::StatusOr<StagingPool::Reservation> held = pool.Reserve(100, [] { return false; });
  ASSERT_TRUE(held.ok());
  StagingPool::Reservation first = *std::move(held);
  std::atomic<bool> cancel{false};
  absl::StatusCode code = absl::StatusCode::kOk;
  std::thread waiter([&] { code = pool.Reserve(50, [&] { return cancel.load(); }).status().code(); });
  while (pool.waiting() < 1) absl::SleepFor(absl::Milliseconds(1));
  cancel = true;
  waiter.join();
  EXPECT_EQ(code, absl::StatusCode::kCancelled);
  EXPECT_EQ(pool.waiting(), 0u);
  first = StagingPool::Reservation();
  EXPECT_TRUE(pool.Reserve(100, [] { return false; }).ok());  // The line moved on.
}

}  // namespace
}  // namespace fusedps
