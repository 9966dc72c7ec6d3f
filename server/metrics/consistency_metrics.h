// consistency_metrics.h: the metrics of the consistency modes and sync rounds
// (server/engine/consistency.h; docs/metrics.md), in the registry of Metrics.
//
//   fusedps_push_staleness                      histogram of tau = version - base_version
//   fusedps_pushes_dropped_total{reason}        stale_version, client_in_round,
//                                               staleness_exceeded
//   fusedps_round_duration_seconds              a sync round, first arrival to answers
//   fusedps_round_stage_duration_seconds{stage} receive, accumulate, apply, ack
//   fusedps_round_workers                       pushes averaged per round
//   fusedps_rounds_total{closed_by}             quorum, timeout
//
// Thread-safe (prometheus-cpp's metrics are).
#ifndef FUSEDPS_SERVER_METRICS_CONSISTENCY_METRICS_H_
#define FUSEDPS_SERVER_METRICS_CONSISTENCY_METRICS_H_

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "server/engine/consistency.h"

namespace fusedps {

class ConsistencyMetrics final : public ConsistencyObserver {
 public:
  // Registers the metrics in `registry`, every labelled series at zero.
  // `duration_buckets` in seconds (Metrics::DurationBuckets()).
  ConsistencyMetrics(prometheus::Registry& registry,
                     const std::vector<double>& duration_buckets);

  void OnStaleness(uint64_t tau) override;
  void OnDropped(absl::string_view reason) override;
  void OnRound(const RoundStats& round) override;

 private:
  prometheus::Histogram& staleness_;
  prometheus::Family<prometheus::Counter>& dropped_;
  prometheus::Histogram& round_duration_;
  prometheus::Family<prometheus::Histogram>& round_stage_;
  prometheus::Histogram* stage_[4];  // receive, accumulate, apply, ack.
  prometheus::Histogram& round_workers_;
  prometheus::Counter* rounds_[2];  // quorum, timeout.
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_METRICS_CONSISTENCY_METRICS_H_
