#include "bench/load_stats.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <numeric>

namespace fusedps {

double NearestRankPercentile(const std::vector<double>& sorted_ms, double p) {
  assert(!sorted_ms.empty() && "NearestRankPercentile needs at least one sample");
  const double n = static_cast<double>(sorted_ms.size());
  // The small slack keeps p = 90 of 10 samples at rank 9, not 10, despite rounding in p / 100.
  const double rank = std::ceil(p / 100.0 * n - 1e-9);
  const size_t index = static_cast<size_t>(std::clamp(rank, 1.0, n)) - 1;
  return sorted_ms[index];
}

LatencySummary SummarizeLatencies(std::vector<double> latencies_ms) {
  LatencySummary summary;
  if (latencies_ms.empty()) return summary;
  std::sort(latencies_ms.begin(), latencies_ms.end());
  summary.count = latencies_ms.size();
  summary.min_ms = latencies_ms.front();
  summary.max_ms = latencies_ms.back();
  summary.mean_ms = std::accumulate(latencies_ms.begin(), latencies_ms.end(), 0.0) /
                    static_cast<double>(latencies_ms.size());
  summary.p50_ms = NearestRankPercentile(latencies_ms, 50.0);
  summary.p90_ms = NearestRankPercentile(latencies_ms, 90.0);
  summary.p99_ms = NearestRankPercentile(latencies_ms, 99.0);
  return summary;
}

double PerSecond(double amount, double seconds) { return seconds > 0.0 ? amount / seconds : 0.0; }

}  // namespace fusedps
