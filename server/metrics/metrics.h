// metrics.h: fusedps's Prometheus metrics, kept in a prometheus::Registry and served as text at
// /metrics by an HTTP endpoint of their own (apart from gRPC). The names, types, units and
// labels are a contract, documented in docs/metrics.md; dashboards and alerts depend on them.
//
// The service records each call (Record*); values owned by the shard (parameter count, model
// version, kernel launches by name, memory by arena) are read from it on every scrape, so they
// are never stale and nothing on the push path has to copy them.
//
// Usage:
//   Metrics metrics({"0.1.0", "cpu", "cpu (8 threads)"}, [&] {
//     ShardMetrics shard;
//     shard.models.push_back({"default", parameters, version, memory_bytes});
//     return shard;  // ... as server.cc fills it
//   });
//   absl::Status serving = metrics.Serve("0.0.0.0:9464");  // then metrics.port()
//   metrics.RecordPush(grpc::StatusCode::OK, grad_bytes, stage_seconds);
//
// Thread safety: every method may be called from any thread.
#ifndef FUSEDPS_SERVER_METRICS_METRICS_H_
#define FUSEDPS_SERVER_METRICS_METRICS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "common/mutex.h"
#include "grpcpp/support/status_code_enum.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace fusedps {

class ConsistencyMetrics;
class ConsistencyObserver;

// One embedding table of a model (docs/dev/embedding-tables.md), labelled `model` and `table`.
struct TableMetrics {
  std::string name;   // The table's tensor name.
  uint64_t rows = 0;  // The rows it holds (a dense-id table: all of them; hashed: in use).
};

// The values of one model (server/models/model.h) that metrics export, labelled `model`.
struct ModelMetrics {
  std::string name;
  uint64_t parameters = 0;
  uint64_t version = 0;
  uint64_t memory_bytes = 0;         // Every arena of its backend.
  std::vector<TableMetrics> tables;  // Its embedding tables; the series of one gone are removed.
};

// The values of the server that metrics export, read on each scrape.
struct ShardMetrics {
  std::vector<ModelMetrics> models;  // Every model; the series of a model gone are removed.
  // Summed over the models (and the staging arena's owner for memory), those deleted included
  // for the monotonic counts.
  std::map<std::string, uint64_t> kernel_launches;  // By kernel name; monotonic.
  std::map<std::string, uint64_t> memory_bytes;     // By arena ("params", "exp_avg", ...).
  // The staging pool (server/ingest/staging_pool.h) that pushes and pulls reserve from.
  uint64_t staging_capacity_bytes = 0;
  uint64_t staging_in_use_bytes = 0;
  uint32_t staging_waiters = 0;            // Calls waiting for their share (back-pressure).
  double staging_oldest_wait_seconds = 0;  // How long the longest waiter has waited.
  // The retry table (server/store/retry_table.h): clients remembered, and forgotten so far.
  uint64_t retry_table_clients = 0;
  uint64_t retry_table_evictions = 0;  // Monotonic.
  // Same-host workspaces (server/workspace/workspace.h) open, and the bytes they hold.
  uint64_t workspaces = 0;
  uint64_t workspace_bytes = 0;
  // When the gRPC port's certificate file expires (Unix seconds); unset without TLS.
  std::optional<double> tls_certificate_expiry_seconds = std::nullopt;
};

// How long each stage of one push took, in seconds. The four add up to the push's duration.
struct PushStageSeconds {
  // From the call's arrival until every chunk was in and checked.
  double receive = 0;
  // How long the device waited for the push's gradient copies once it reached the step (from
  // CUDA events; 0 on the CPU backend).
  double h2d = 0;
  // From the push being complete until its step's kernels are done: the engine's queue, the
  // steps queued before it, the kernels; less h2d.
  double apply = 0;
  // From the outcome until the acknowledgement is handed to gRPC.
  double ack = 0;
  // Not a stage: the time gRPC's threads spent reading the push's messages into staging
  // (parse, copy, non-finite check, start of each device copy), summed over its messages and
  // parts. Part of receive; with parts (concurrent threads) it may exceed it.
  double ingest = 0;
};

class Metrics {
 public:
  struct BuildInfo {
    std::string version;
    std::string backend;  // "cpu" or "cuda".
    std::string device;
  };

  // The buckets of every duration histogram, in seconds: 50 µs to 10 s in 1-2.5-5 steps, so
  // that a 100 µs kernel and a 1 s push both fall between two close boundaries.
  static const std::vector<double>& DurationBuckets();

  // `shard` is called on every scrape, from the HTTP server's threads.
  Metrics(const BuildInfo& build, std::function<ShardMetrics()> shard);
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // Serves the metrics at http://HOST:PORT/metrics (port 0 picks a free port).
  // Errors: UNAVAILABLE when the address cannot be bound; FAILED_PRECONDITION when already
  // serving.
  absl::Status Serve(const std::string& listen);
  // Stops serving /metrics (and so calling `shard`); the metrics still record. Idempotent.
  void StopServing();
  // The bound HTTP port, or 0 when not serving.
  int port() const;

  // One PushGradients call that ended with `code`, having received `grad_bytes` of gradient
  // payload. `stages` is observed only for a push that succeeded (code OK) and was not a
  // `duplicate` (a retry answered with an earlier push's reply, counted apart).
  void RecordPush(grpc::StatusCode code, uint64_t grad_bytes, const PushStageSeconds& stages,
                  bool duplicate = false);
  // One optimizer step of `model`: applied, or skipped for `skip_reason` (e.g.
  // "non_finite_grad").
  void RecordStep(const std::string& model, bool skipped, const std::string& skip_reason);
  // One PullParameters call that ended with `code`, having sent `bytes` of tensor payload.
  void RecordPull(grpc::StatusCode code, uint64_t bytes);
  // The bytes a push's commit pull (PushCommit.pull) wrote into its workspace: counted in
  // fusedps_pull_bytes_total, as a PullParameters call into a workspace counts its own; not a
  // call, so not in fusedps_pull_requests_total.
  void RecordCommitPull(uint64_t bytes);

  // Embedding tables. `keys` keys of table `table` of `model` in one applied (not skipped)
  // step, each key as often as the push named it (duplicates are summed into one row update),
  // and the rows that step evicted (a hashed table; 0 for dense ids).
  void RecordTablePush(const std::string& model, const std::string& table, uint64_t keys,
                       uint64_t evictions);
  // `keys` keys of table `table` of `model` read by one successful LookupRows call, `misses`
  // of them keys a hashed table did not hold (0 for dense ids).
  void RecordTableLookup(const std::string& model, const std::string& table, uint64_t keys,
                         uint64_t misses);

  // Checkpoints (server/checkpoint). `phase` is "snapshot" (the cut: the device's copy into
  // host memory, or for a fenced snapshot the whole write), "write" (files and commit) or
  // "restore" (read, check and load at start).
  void RecordCheckpointPhase(const std::string& phase, double seconds);
  // A checkpoint of `model` committed: its bytes, and when (Unix seconds). bytes = 0: the shard
  // was found checkpointed already (nothing changed since the last one, or it was just restored
  // or started empty); the timestamp moves all the same: it says when the shard was last known
  // to be durable. The first call for a model also makes its failure series, at zero.
  void RecordCheckpointSuccess(const std::string& model, uint64_t bytes, double unix_seconds);
  // --checkpoint-interval-seconds (0: none), for the staleness alert.
  void SetCheckpointInterval(double seconds);
  // A model with checkpoints: its byte and failure counters exist from now on, at zero (so that
  // an alert sees its first failure as an increase). Its series go with the model (SyncShard).
  void AddCheckpointedModel(const std::string& model);
  // A checkpoint of `model` that failed: "disk_full", "io", "snapshot" (the shard could not be
  // read) or "stopping".
  void RecordCheckpointFailure(const std::string& model, const std::string& reason);

  // A call that authentication or authorization refused (server/auth/authorizer.h), by reason:
  // "missing_credentials", "invalid_token", "wrong_role" or "client_id_mismatch".
  void RecordAuthFailure(const std::string& reason);

  // The consistency modes' metrics of `model` (consistency_metrics.h), for its engine to report
  // to; valid as long as this.
  ConsistencyObserver* consistency(const std::string& model);

  // Every metric in Prometheus's text format, exactly as /metrics serves it.
  std::string ScrapeText() const;

 private:
  class Collector;

  // Copies the shard's values into the gauges and counters that mirror them.
  void SyncShard() const ABSL_LOCKS_EXCLUDED(sync_mu_);

  const std::function<ShardMetrics()> shard_;
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& push_requests_;
  prometheus::Counter& push_bytes_;
  prometheus::Histogram& push_duration_;
  prometheus::Family<prometheus::Histogram>& stage_duration_;
  prometheus::Histogram& push_ingest_;
  prometheus::Histogram* stage_[4];  // receive, h2d, apply, ack.
  prometheus::Family<prometheus::Counter>& kernel_launches_;
  prometheus::Family<prometheus::Counter>& steps_;  // By model.
  prometheus::Family<prometheus::Counter>& steps_skipped_;
  prometheus::Family<prometheus::Counter>& pull_requests_;
  prometheus::Counter& pull_bytes_;
  prometheus::Family<prometheus::Gauge>& parameters_;
  prometheus::Family<prometheus::Gauge>& memory_bytes_;
  prometheus::Family<prometheus::Gauge>& model_version_;
  prometheus::Family<prometheus::Gauge>& model_memory_bytes_;
  prometheus::Gauge& models_;
  prometheus::Gauge& staging_capacity_;
  prometheus::Gauge& staging_in_use_;
  prometheus::Gauge& staging_waiters_;
  prometheus::Gauge& staging_oldest_wait_;
  prometheus::Counter& push_duplicates_;
  prometheus::Gauge& retry_table_clients_;
  prometheus::Gauge& workspaces_;
  prometheus::Gauge& workspace_bytes_;
  prometheus::Counter& retry_table_evictions_;
  prometheus::Family<prometheus::Histogram>& checkpoint_duration_;
  prometheus::Family<prometheus::Counter>& checkpoint_bytes_;       // By model.
  prometheus::Family<prometheus::Gauge>& checkpoint_last_success_;  // By model.
  prometheus::Gauge& checkpoint_interval_;
  prometheus::Family<prometheus::Counter>& checkpoint_failures_;
  prometheus::Family<prometheus::Counter>& auth_failures_;
  prometheus::Family<prometheus::Gauge>& tls_certificate_expiry_;
  prometheus::Family<prometheus::Gauge>& table_rows_;             // By model and table.
  prometheus::Family<prometheus::Counter>& table_pushed_keys_;    // By model and table.
  prometheus::Family<prometheus::Counter>& table_lookup_keys_;    // By model and table.
  prometheus::Family<prometheus::Counter>& table_lookup_misses_;  // By model and table.
  prometheus::Family<prometheus::Counter>& table_evictions_;      // By model and table.

  mutable Mutex sync_mu_;
  // Launch counts already added to kernel_launches_, by kernel name.
  mutable std::map<std::string, uint64_t> launches_synced_ ABSL_GUARDED_BY(sync_mu_);
  mutable uint64_t evictions_synced_ ABSL_GUARDED_BY(sync_mu_) = 0;
  // The models whose series exist (to remove those of a model deleted).
  mutable std::set<std::string> models_synced_ ABSL_GUARDED_BY(sync_mu_);
  // The (model, table) pairs whose series exist (to remove those of a model deleted).
  mutable std::set<std::pair<std::string, std::string>> tables_synced_ ABSL_GUARDED_BY(sync_mu_);

  std::unique_ptr<ConsistencyMetrics> consistency_;
  std::shared_ptr<Collector> collector_;  // What the HTTP endpoint collects.
  std::string listen_host_;               // The host part of Serve's address.
  // Last member: destroyed first, so no scrape runs while the rest goes away.
  std::unique_ptr<prometheus::Exposer> exposer_;
};

// The name of a gRPC status code as the code label spells it: "OK", "INVALID_ARGUMENT", ...
std::string StatusCodeName(grpc::StatusCode code);

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_METRICS_METRICS_H_
