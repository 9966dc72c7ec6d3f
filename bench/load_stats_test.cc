#include "bench/load_stats.h"

#include <vector>

#include "gtest/gtest.h"

namespace fusedps {
namespace {

TEST(LoadStatsTest, EmptyIsAllZero) {
  const LatencySummary s = SummarizeLatencies({});
  EXPECT_EQ(s.count, 0u);
  EXPECT_EQ(s.max_ms, 0.0);
  EXPECT_EQ(s.p99_ms, 0.0);
}

TEST(LoadStatsTest, OneSampleIsEveryPercentile) {
  const LatencySummary s = SummarizeLatencies({4.0});
  EXPECT_EQ(s.count, 1u);
  EXPECT_EQ(s.min_ms, 4.0);
  EXPECT_EQ(s.p50_ms, 4.0);
  EXPECT_EQ(s.p90_ms, 4.0);
  EXPECT_EQ(s.p99_ms, 4.0);
  EXPECT_EQ(s.max_ms, 4.0);
}

TEST(LoadStatsTest, NearestRankOnUnsortedInput) {
  // 1..10 shuffled: p50 is the 5th smallest, p90 the 9th, p99 the 10th.
  const LatencySummary s = SummarizeLatencies({7, 3, 10, 1, 9, 2, 8, 5, 4, 6});
  EXPECT_EQ(s.count, 10u);
  EXPECT_EQ(s.min_ms, 1.0);
  EXPECT_DOUBLE_EQ(s.mean_ms, 5.5);
  EXPECT_EQ(s.p50_ms, 5.0);
  EXPECT_EQ(s.p90_ms, 9.0);
  EXPECT_EQ(s.p99_ms, 10.0);
  EXPECT_EQ(s.max_ms, 10.0);
}

TEST(LoadStatsTest, HundredSamples) {
  std::vector<double> ms;
  for (int i = 100; i >= 1; --i) ms.push_back(i);
  const LatencySummary s = SummarizeLatencies(ms);
  EXPECT_EQ(s.p50_ms, 50.0);
  EXPECT_EQ(s.p90_ms, 90.0);
  EXPECT_EQ(s.p99_ms, 99.0);
  EXPECT_EQ(NearestRankPercentile({1, 2, 3}, 100.0), 3.0);
  EXPECT_EQ(NearestRankPercentile({1, 2, 3}, 0.001), 1.0);
}

TEST(LoadStatsTest, PerSecond) {
  EXPECT_DOUBLE_EQ(PerSecond(10.0, 2.0), 5.0);
  EXPECT_EQ(PerSecond(10.0, 0.0), 0.0);
}

}  // namespace
}  // namespace fusedps
