// consistency_metrics.h: the metrics of the consistency modes and sync rounds
// (server/engine/consistency.h; docs/metrics.md), in the registry of Metrics, by model:
//
//   fusedps_push_staleness{model}                      histogram of tau = version - base_version
//   fusedps_pushes_dropped_total{model,reason}         stale_version, client_in_round,
//                                                      staleness_exceeded
//   fusedps_round_duration_seconds{model}              a sync round, first arrival to answers
//   fusedps_round_stage_duration_seconds{model,stage}  receive, accumulate, apply, ack
//   fusedps_round_workers{model}                       pushes averaged per round
//   fusedps_rounds_total{model,closed_by}              quorum, timeout
//
// Each model's engine reports to its own observer (ForModel), whose series exist from then on,
// at zero. RemoveModel removes a deleted model's series; its observer stays (engines may still
// report while their last calls finish) and drops what it is told from then on, until a model
// of the same name is made again.
//
// Thread-safe (prometheus-cpp's metrics are; the observers lock their own series).
#ifndef FUSEDPS_SERVER_METRICS_CONSISTENCY_METRICS_H_
#define FUSEDPS_SERVER_METRICS_CONSISTENCY_METRICS_H_

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "server/engine/consistency.h"

namespace fusedps {

class ConsistencyMetrics {
 public:
  // Registers the metrics in `registry`. `duration_buckets` in seconds
  // (Metrics::DurationBuckets()).
  ConsistencyMetrics(prometheus::Registry& registry, std::vector<double> duration_buckets);
  ~ConsistencyMetrics();

  // The observer of `model`'s engine, which lives as long as this. Makes its series.
  ConsistencyObserver* ForModel(const std::string& model) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes `model`'s series.
  void RemoveModel(const std::string& model) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  class ModelSeries;
  friend class ModelSeries;

  const std::vector<double> duration_buckets_;
  prometheus::Family<prometheus::Histogram>& staleness_;
  prometheus::Family<prometheus::Counter>& dropped_;
  prometheus::Family<prometheus::Histogram>& round_duration_;
  prometheus::Family<prometheus::Histogram>& round_stage_;
  prometheus::Family<prometheus::Histogram>& round_workers_;
  prometheus::Family<prometheus::Counter>& rounds_;

  Mutex mu_;
  // Never erased.
  std::map<std::string, std::unique_ptr<ModelSeries>> models_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_METRICS_CONSISTENCY_METRICS_H_
