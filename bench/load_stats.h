// load_stats.h: latency percentiles and throughput of a load run (bench/load_generator.cc).
//
// Percentiles are nearest-rank: the p-th percentile of n samples is the ceil(p / 100 * n)-th
// smallest, so it is always a latency that some push really had (p100 is the max).
//
// Usage:
//   LatencySummary s = SummarizeLatencies({1.5, 2.0, 9.0});  // milliseconds
//   absl::PrintF("p50 %.2f ms, p99 %.2f ms\n", s.p50_ms, s.p99_ms);
#ifndef FUSEDPS_BENCH_LOAD_STATS_H_
#define FUSEDPS_BENCH_LOAD_STATS_H_

#include <cstdint>
#include <vector>

namespace fusedps {

struct LatencySummary {
  uint64_t count = 0;  // Samples summarized; every other field is 0 when count is 0.
  double min_ms = 0.0;
  double mean_ms = 0.0;
  double p50_ms = 0.0;
  double p90_ms = 0.0;
  double p99_ms = 0.0;
  double max_ms = 0.0;
};

// The nearest-rank percentile p (in (0, 100]) of sorted_ms, which must be sorted ascending.
// REQUIRES: !sorted_ms.empty().
double NearestRankPercentile(const std::vector<double>& sorted_ms, double p);

// Summarizes latencies in milliseconds, in any order.
LatencySummary SummarizeLatencies(std::vector<double> latencies_ms);

// Throughput of `amount` (bytes, pushes) over `seconds`; 0 when seconds is not positive.
double PerSecond(double amount, double seconds);

}  // namespace fusedps

#endif  // FUSEDPS_BENCH_LOAD_STATS_H_
