#include "server/metrics/consistency_metrics.h"

#include <string>

namespace fusedps {
namespace {

constexpr const char* kRoundStages[4] = {"receive", "accumulate", "apply", "ack"};

prometheus::Histogram::BucketBoundaries StalenessBuckets() {
  return {0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128};
}

prometheus::Histogram::BucketBoundaries WorkerBuckets() {
  return {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64};
}

}  // namespace

ConsistencyMetrics::ConsistencyMetrics(prometheus::Registry& registry,
                                       const std::vector<double>& duration_buckets)
    : staleness_(prometheus::BuildHistogram()
                     .Name("fusedps_push_staleness")
                     .Help("Pushes as the shard took or refused them: tau = the shard's version "
                           "- the push's base_version, in versions.")
                     .Register(registry)
                     .Add({}, StalenessBuckets())),
      dropped_(prometheus::BuildCounter()
                   .Name("fusedps_pushes_dropped_total")
                   .Help("Pushes refused (ABORTED) for their base_version, by reason: "
                         "stale_version, client_in_round (sync), staleness_exceeded (bounded).")
                   .Register(registry)),
      round_duration_(prometheus::BuildHistogram()
                          .Name("fusedps_round_duration_seconds")
                          .Help("Sync rounds: from the first push's arrival until every pusher "
                                "was answered, in seconds.")
                          .Register(registry)
                          .Add({}, duration_buckets)),
      round_stage_(prometheus::BuildHistogram()
                       .Name("fusedps_round_stage_duration_seconds")
                       .Help("Sync rounds: time in each stage (receive, accumulate, apply, ack), "
                             "in seconds.")
                       .Register(registry)),
      round_workers_(prometheus::BuildHistogram()
                         .Name("fusedps_round_workers")
                         .Help("Sync rounds: the pushes (distinct client_ids) averaged.")
                         .Register(registry)
                         .Add({}, WorkerBuckets())) {
  for (const char* reason : {kDropStaleVersion, kDropClientInRound, kDropStalenessExceeded}) {
    dropped_.Add({{"reason", reason}});
  }
  for (int i = 0; i < 4; ++i) {
    stage_[i] = &round_stage_.Add({{"stage", kRoundStages[i]}}, duration_buckets);
  }
  auto& rounds = prometheus::BuildCounter()
                     .Name("fusedps_rounds_total")
                     .Help("Sync rounds applied, by what closed them: quorum (K pushes) or "
                           "timeout (--round-timeout-seconds).")
                     .Register(registry);
  rounds_[0] = &rounds.Add({{"closed_by", "quorum"}});
  rounds_[1] = &rounds.Add({{"closed_by", "timeout"}});
}

void ConsistencyMetrics::OnStaleness(uint64_t tau) {
  staleness_.Observe(static_cast<double>(tau));
}

void ConsistencyMetrics::OnDropped(absl::string_view reason) {
  dropped_.Add({{"reason", std::string(reason)}}).Increment();
}

void ConsistencyMetrics::OnRound(const RoundStats& round) {
  round_duration_.Observe(round.duration);
  const double stages[4] = {round.receive, round.accumulate, round.apply, round.ack};
  for (int i = 0; i < 4; ++i) stage_[i]->Observe(stages[i]);
  round_workers_.Observe(round.workers);
  rounds_[round.timed_out ? 1 : 0]->Increment();
}

}  // namespace fusedps
