#include "server/staging_pool.h"

#include <atomic>
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace fusedps {
namespace {

TEST(StagingPoolTest, ReservesReleasesAndRefusesWhatCanNeverFit) {
  StagingPool pool(100);
  {
    auto a = pool.Reserve(60, [] { return false; });
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(pool.in_use(), 60u);
    auto b = pool.Reserve(40, [] { return false; });
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(pool.in_use(), 100u);
  }
  EXPECT_EQ(pool.in_use(), 0u);
  auto too_big = pool.Reserve(101, [] { return false; });
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(too_big.status().message().find("--staging-pool-bytes"), std::string::npos);
}

TEST(StagingPoolTest, WaitsForReleaseInArrivalOrder) {
  StagingPool pool(100);
  absl::StatusOr<StagingPool::Reservation> held = pool.Reserve(80, [] { return false; });
  ASSERT_TRUE(held.ok());
  StagingPool::Reservation first = *std::move(held);
  std::atomic<int> order{0};
  int big_turn = 0, small_turn = 0;
  std::thread big([&] {
    auto r = pool.Reserve(90, [] { return false; });  // Needs first's bytes back.
    big_turn = ++order;
  });
  while (pool.waiting() < 1) absl::SleepFor(absl::Milliseconds(1));
  std::thread small([&] {
    // Fits beside `first` now (80 + 20), but arrived after big; once big holds 90 it must also
    // wait for big's release, so the order below is deterministic.
    auto r = pool.Reserve(20, [] { return false; });
    small_turn = ++order;
  });
  while (pool.waiting() < 2) absl::SleepFor(absl::Milliseconds(1));
  absl::SleepFor(absl::Milliseconds(120));
  EXPECT_EQ(order.load(), 0);  // Neither got through while first holds 80 of 100.
  first = StagingPool::Reservation();
  big.join();
  small.join();
  EXPECT_EQ(big_turn, 1);
  EXPECT_EQ(small_turn, 2);
  EXPECT_EQ(pool.in_use(), 0u);
}

TEST(StagingPoolTest, CancelledWaiterLeavesTheLine) {
  StagingPool pool(100);
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
