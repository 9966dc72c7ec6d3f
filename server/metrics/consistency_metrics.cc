#include "server/metrics/consistency_metrics.h"

#include <string>
#include <utility>

namespace fusedps {
namespace {

constexpr const char* kRoundStages[4] = {"receive", "accumulate", "apply", "ack"};
constexpr const char* kDropReasons[3] = {kDropStaleVersion, kDropClientInRound,
                                         kDropStalenessExceeded};
constexpr const char* kClosedBy[2] = {"quorum", "timeout"};

prometheus::Histogram::BucketBoundaries StalenessBuckets() {
  return {0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128};
}

prometheus::Histogram::BucketBoundaries WorkerBuckets() {
  return {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64};
}

template <typename T>
void RemoveSeries(prometheus::Family<T>& family, const prometheus::Labels& labels) {
  if (family.Has(labels)) family.Remove(&family.Add(labels, std::vector<double>{}));
}
template <>
void RemoveSeries(prometheus::Family<prometheus::Counter>& family,
                  const prometheus::Labels& labels) {
  if (family.Has(labels)) family.Remove(&family.Add(labels));
}

}  // namespace

// One model's series. The pointers are valid while `live`; RemoveModel and ForModel change
// them under mu.
class ConsistencyMetrics::ModelSeries final : public ConsistencyObserver {
 public:
  ModelSeries(ConsistencyMetrics* metrics, std::string model)
      : metrics_(metrics), model_(std::move(model)) {}

  void Make() {
    MutexLock lock(&mu_);
    ConsistencyMetrics& m = *metrics_;
    staleness_ = &m.staleness_.Add({{"model", model_}}, StalenessBuckets());
    for (int i = 0; i < 3; ++i) {
      dropped_[i] = &m.dropped_.Add({{"model", model_}, {"reason", kDropReasons[i]}});
    }
    duration_ = &m.round_duration_.Add({{"model", model_}}, m.duration_buckets_);
    for (int i = 0; i < 4; ++i) {
      stage_[i] =
          &m.round_stage_.Add({{"model", model_}, {"stage", kRoundStages[i]}}, m.duration_buckets_);
    }
    workers_ = &m.round_workers_.Add({{"model", model_}}, WorkerBuckets());
    for (int i = 0; i < 2; ++i) {
      rounds_[i] = &m.rounds_.Add({{"model", model_}, {"closed_by", kClosedBy[i]}});
    }
    live_ = true;
  }

  void Remove() {
    MutexLock lock(&mu_);
    if (!live_) return;
    live_ = false;
    ConsistencyMetrics& m = *metrics_;
    RemoveSeries(m.staleness_, {{"model", model_}});
    for (const char* reason : kDropReasons) {
      RemoveSeries(m.dropped_, {{"model", model_}, {"reason", reason}});
    }
    RemoveSeries(m.round_duration_, {{"model", model_}});
    for (const char* stage : kRoundStages) {
      RemoveSeries(m.round_stage_, {{"model", model_}, {"stage", stage}});
    }
    RemoveSeries(m.round_workers_, {{"model", model_}});
    for (const char* closed_by : kClosedBy) {
      RemoveSeries(m.rounds_, {{"model", model_}, {"closed_by", closed_by}});
    }
  }

  void OnStaleness(uint64_t tau) override {
    MutexLock lock(&mu_);
    if (live_) staleness_->Observe(static_cast<double>(tau));
  }

  void OnDropped(absl::string_view reason) override {
    MutexLock lock(&mu_);
    if (!live_) return;
    for (int i = 0; i < 3; ++i) {
      if (reason == kDropReasons[i]) dropped_[i]->Increment();
    }
  }

  void OnRound(const RoundStats& round) override {
    MutexLock lock(&mu_);
    if (!live_) return;
    duration_->Observe(round.duration);
    const double stages[4] = {round.receive, round.accumulate, round.apply, round.ack};
    for (int i = 0; i < 4; ++i) stage_[i]->Observe(stages[i]);
    workers_->Observe(round.workers);
    rounds_[round.timed_out ? 1 : 0]->Increment();
  }

 private:
  ConsistencyMetrics* const metrics_;
  const std::string model_;
  Mutex mu_;
  bool live_ ABSL_GUARDED_BY(mu_) = false;  // As the pointers below.
  prometheus::Histogram* staleness_ ABSL_GUARDED_BY(mu_) = nullptr;
  prometheus::Counter* dropped_[3] ABSL_GUARDED_BY(mu_) = {};
  prometheus::Histogram* duration_ ABSL_GUARDED_BY(mu_) = nullptr;
  prometheus::Histogram* stage_[4] ABSL_GUARDED_BY(mu_) = {};
  prometheus::Histogram* workers_ ABSL_GUARDED_BY(mu_) = nullptr;
  prometheus::Counter* rounds_[2] ABSL_GUARDED_BY(mu_) = {};
};

ConsistencyMetrics::ConsistencyMetrics(prometheus::Registry& registry,
                                       std::vector<double> duration_buckets)
    : duration_buckets_(std::move(duration_buckets)),
      staleness_(prometheus::BuildHistogram()
                     .Name("fusedps_push_staleness")
                     .Help("Pushes as the model took or refused them: tau = the model's version "
                           "- the push's base_version, in versions.")
                     .Register(registry)),
      dropped_(prometheus::BuildCounter()
                   .Name("fusedps_pushes_dropped_total")
                   .Help("Pushes refused (ABORTED) for their base_version, by model and reason: "
                         "stale_version, client_in_round (sync), staleness_exceeded (bounded).")
                   .Register(registry)),
      round_duration_(prometheus::BuildHistogram()
                          .Name("fusedps_round_duration_seconds")
                          .Help("Sync rounds: from the first push's arrival until every pusher "
                                "was answered, in seconds.")
                          .Register(registry)),
      round_stage_(prometheus::BuildHistogram()
                       .Name("fusedps_round_stage_duration_seconds")
                       .Help("Sync rounds: time in each stage (receive, accumulate, apply, ack), "
                             "in seconds.")
                       .Register(registry)),
      round_workers_(prometheus::BuildHistogram()
                         .Name("fusedps_round_workers")
                         .Help("Sync rounds: the pushes (distinct client_ids) averaged.")
                         .Register(registry)),
      rounds_(prometheus::BuildCounter()
                  .Name("fusedps_rounds_total")
                  .Help("Sync rounds applied, by model and what closed them: quorum (K pushes) "
                        "or timeout (--round-timeout-seconds).")
                  .Register(registry)) {}

ConsistencyMetrics::~ConsistencyMetrics() = default;

ConsistencyObserver* ConsistencyMetrics::ForModel(const std::string& model) {
  MutexLock lock(&mu_);
  std::unique_ptr<ModelSeries>& series = models_[model];
  if (series == nullptr) series = std::make_unique<ModelSeries>(this, model);
  series->Make();
  return series.get();
}

void ConsistencyMetrics::RemoveModel(const std::string& model) {
  MutexLock lock(&mu_);
  const auto it = models_.find(model);
  if (it != models_.end()) it->second->Remove();
}

}  // namespace fusedps
