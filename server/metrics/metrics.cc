#include "server/metrics/metrics.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <iterator>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "prometheus/text_serializer.h"
#include "server/metrics/consistency_metrics.h"

namespace fusedps {
namespace {

// Opens and closes a TCP connection to host:port (a wildcard host means this machine).
void KnockOnce(std::string host, int port) {
  if (host.empty() || host == "0.0.0.0" || host == "*") host = "127.0.0.1";
  if (host == "[::]" || host == "::") host = "::1";
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    const bool connected = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
    close(fd);
    if (connected) break;
  }
  freeaddrinfo(found);
}

constexpr const char* kStageNames[] = {"receive", "h2d", "apply", "ack"};
// The skip reason of a step with a non-finite gradient (ingest's kSkipNonFiniteGrad).
constexpr char kNonFiniteGrad[] = "non_finite_grad";
// Metrics::RecordCheckpointFailure's reasons.
constexpr const char* kCheckpointFailureReasons[] = {"disk_full", "io", "snapshot", "stopping"};

// Checkpoint phases run from milliseconds to minutes: DurationBuckets' range, and beyond.
const std::vector<double>& CheckpointBuckets() {
  static const std::vector<double> buckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                              0.25,  0.5,    1,     2.5,  5,     10,   25,
                                              50,    100,    250,   500,  1000};
  return buckets;
}

prometheus::Family<prometheus::Counter>& CounterFamily(prometheus::Registry& registry,
                                                       const std::string& name,
                                                       const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(registry);
}

prometheus::Family<prometheus::Gauge>& GaugeFamily(prometheus::Registry& registry,
                                                   const std::string& name,
                                                   const std::string& help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(registry);
}

prometheus::Family<prometheus::Histogram>& HistogramFamily(prometheus::Registry& registry,
                                                           const std::string& name,
                                                           const std::string& help) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(registry);
}

}  // namespace

// What the HTTP endpoint collects: the registry, after refreshing the shard's values.
class Metrics::Collector final : public prometheus::Collectable {
 public:
  explicit Collector(const Metrics* metrics) : metrics_(metrics) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    metrics_->SyncShard();
    return metrics_->registry_->Collect();
  }

 private:
  const Metrics* const metrics_;
};

std::string StatusCodeName(grpc::StatusCode code) {
  static constexpr const char* kNames[] = {"OK",
                                           "CANCELLED",
                                           "UNKNOWN",
                                           "INVALID_ARGUMENT",
                                           "DEADLINE_EXCEEDED",
                                           "NOT_FOUND",
                                           "ALREADY_EXISTS",
                                           "PERMISSION_DENIED",
                                           "RESOURCE_EXHAUSTED",
                                           "FAILED_PRECONDITION",
                                           "ABORTED",
                                           "OUT_OF_RANGE",
                                           "UNIMPLEMENTED",
                                           "INTERNAL",
                                           "UNAVAILABLE",
                                           "DATA_LOSS",
                                           "UNAUTHENTICATED"};
  const int index = static_cast<int>(code);
  if (index < 0 || index >= static_cast<int>(std::size(kNames))) return "UNKNOWN";
  return kNames[index];
}

const std::vector<double>& Metrics::DurationBuckets() {
  static const std::vector<double>* const kBuckets = new std::vector<double>{
      50e-6,  100e-6, 250e-6, 500e-6,  // Kernels.
      1e-3,   2.5e-3, 5e-3,   10e-3,  25e-3, 50e-3, 100e-3,
      250e-3, 500e-3, 1,      2.5,    5,     10};  // Large pushes over slow links.
  return *kBuckets;
}

Metrics::Metrics(const BuildInfo& build, std::function<ShardMetrics()> shard)
    : shard_(std::move(shard)),
      registry_(std::make_shared<prometheus::Registry>()),
      push_requests_(CounterFamily(*registry_, "fusedps_push_requests_total",
                                   "PushGradients calls, by gRPC status code.")),
      push_bytes_(CounterFamily(*registry_, "fusedps_push_bytes_total",
                                "Gradient payload bytes received in PushGradients chunks.")
                      .Add({})),
      push_duration_(HistogramFamily(*registry_, "fusedps_push_duration_seconds",
                                     "Successful pushes: from the call's arrival until the "
                                     "acknowledgement, in seconds.")
                         .Add({}, DurationBuckets())),
      stage_duration_(HistogramFamily(*registry_, "fusedps_stage_duration_seconds",
                                      "Successful pushes: time in each stage (receive, h2d, "
                                      "apply, ack), in seconds.")),
      push_ingest_(HistogramFamily(*registry_, "fusedps_push_ingest_seconds",
                                   "Successful pushes: thread time spent reading the push's "
                                   "messages into staging (parse, copy, non-finite check, start "
                                   "of the device copies), summed over its messages and parts, "
                                   "in seconds.")
                       .Add({}, DurationBuckets())),
      kernel_launches_(CounterFamily(*registry_, "fusedps_kernel_launches_total",
                                     "Optimizer kernel launches (CUDA) or parallel passes (CPU), "
                                     "by kernel name, counted where they are launched.")),
      steps_(CounterFamily(*registry_, "fusedps_optimizer_steps_total",
                           "Optimizer steps applied, by model (one per push that changed the "
                           "model, one per sync round).")),
      steps_skipped_(CounterFamily(*registry_, "fusedps_optimizer_steps_skipped_total",
                                   "Optimizer steps skipped, leaving the model unchanged, by "
                                   "model and reason.")),
      pull_requests_(CounterFamily(*registry_, "fusedps_pull_requests_total",
                                   "PullParameters calls, by gRPC status code.")),
      pull_bytes_(CounterFamily(*registry_, "fusedps_pull_bytes_total",
                                "Tensor payload bytes pulled: sent in PullParameters chunks, or "
                                "written into a workspace (by a pull or a push's commit).")
                      .Add({})),
      parameters_(GaugeFamily(*registry_, "fusedps_parameters",
                              "Parameters (elements of every registered tensor) of each model.")),
      memory_bytes_(GaugeFamily(*registry_, "fusedps_device_memory_bytes",
                                "Bytes the optimizer backend holds, by arena (device memory "
                                "on CUDA, host memory on the CPU backend).")),
      model_version_(GaugeFamily(*registry_, "fusedps_model_version",
                                 "Each model's version: steps applied since it was created.")),
      model_memory_bytes_(GaugeFamily(*registry_, "fusedps_model_memory_bytes",
                                      "Bytes each model's optimizer backend holds (every arena; "
                                      "device memory on CUDA).")),
      models_(GaugeFamily(*registry_, "fusedps_models", "Models the server holds.").Add({})),
      staging_capacity_(GaugeFamily(*registry_, "fusedps_staging_pool_capacity_bytes",
                                    "Bytes of host staging (page-locked on CUDA) that pushes "
                                    "and pulls reserve from (--staging-pool-bytes).")
                            .Add({})),
      staging_in_use_(GaugeFamily(*registry_, "fusedps_staging_pool_in_use_bytes",
                                  "Bytes of the staging pool reserved by pushes and pulls in "
                                  "flight.")
                          .Add({})),
      staging_waiters_(GaugeFamily(*registry_, "fusedps_staging_pool_waiters",
                                   "Pushes and pulls waiting for their share of the staging "
                                   "pool (back-pressure: their streams are not read meanwhile).")
                           .Add({})),
      staging_oldest_wait_(GaugeFamily(*registry_, "fusedps_staging_pool_oldest_wait_seconds",
                                       "How long the call that has waited longest for its share "
                                       "of the staging pool has waited, in seconds (0: none "
                                       "waits).")
                               .Add({})),
      push_duplicates_(CounterFamily(*registry_, "fusedps_push_duplicates_total",
                                     "PushGradients calls answered as retries of an earlier "
                                     "push (duplicate = true): nothing applied.")
                           .Add({})),
      retry_table_clients_(GaugeFamily(*registry_, "fusedps_retry_table_clients",
                                       "Clients whose recent pushes the retry table remembers "
                                       "(at most --retry-table-clients).")
                               .Add({})),
      workspaces_(GaugeFamily(*registry_, "fusedps_workspaces",
                              "Same-host workspaces open (trainers on this host pushing and "
                              "pulling through shared memory).")
                      .Add({})),
      workspace_bytes_(GaugeFamily(*registry_, "fusedps_workspace_bytes",
                                   "Bytes of shared memory the open same-host workspaces hold "
                                   "(at most --workspace-budget-bytes).")
                           .Add({})),
      retry_table_evictions_(CounterFamily(*registry_, "fusedps_retry_table_evictions_total",
                                           "Clients the retry table forgot to stay within "
                                           "--retry-table-clients (least recently used first).")
                                 .Add({})),
      checkpoint_duration_(HistogramFamily(*registry_, "fusedps_checkpoint_duration_seconds",
                                           "Checkpoint phases, in seconds: snapshot (the cut "
                                           "that steps wait for), write (files and commit), "
                                           "restore (at start).")),
      checkpoint_bytes_(CounterFamily(*registry_, "fusedps_checkpoint_written_bytes_total",
                                      "Bytes of committed checkpoints (data files and "
                                      "manifests), by model.")),
      checkpoint_last_success_(GaugeFamily(*registry_,
                                           "fusedps_checkpoint_last_success_timestamp_seconds",
                                           "When each model was last known to be checkpointed, "
                                           "in Unix seconds: the last commit, or a checkpoint "
                                           "skipped because nothing changed.")),
      checkpoint_interval_(GaugeFamily(*registry_, "fusedps_checkpoint_interval_seconds",
                                       "--checkpoint-interval-seconds (0: no timer).")
                               .Add({})),
      checkpoint_failures_(CounterFamily(*registry_, "fusedps_checkpoint_failures_total",
                                         "Checkpoints that failed, by model and reason: "
                                         "disk_full, io, snapshot, stopping.")),
      auth_failures_(CounterFamily(*registry_, "fusedps_auth_failures_total",
                                   "Calls refused by authentication or authorization, by "
                                   "reason: missing_credentials, invalid_token "
                                   "(UNAUTHENTICATED), wrong_role, wrong_model, client_id_mismatch "
                                   "(PERMISSION_DENIED).")),
      tls_certificate_expiry_(GaugeFamily(
          *registry_, "fusedps_tls_certificate_expiry_timestamp_seconds",
          "When the certificate in the gRPC port's --tls-cert file expires, in Unix seconds "
          "(read at each scrape; absent without TLS).")),
      table_rows_(GaugeFamily(*registry_, "fusedps_table_rows",
                              "Rows each embedding table holds, by model and table.")),
      table_pushed_keys_(CounterFamily(*registry_, "fusedps_table_pushed_keys_total",
                                       "Keys of embedding-table rows in applied steps, by "
                                       "model and table (a key named twice in a push counts "
                                       "twice; its row is updated once).")),
      table_lookup_keys_(CounterFamily(*registry_, "fusedps_table_lookup_keys_total",
                                       "Keys read by successful LookupRows calls, by model and "
                                       "table.")),
      table_lookup_misses_(CounterFamily(
          *registry_, "fusedps_table_lookup_misses_total",
          "Keys of successful LookupRows calls that a hashed table did not hold (read as its "
          "initializer's rows), by model and table; 0 for dense-id tables.")),
      table_evictions_(CounterFamily(*registry_, "fusedps_table_evictions_total",
                                     "Rows a hashed table evicted for new keys in applied steps "
                                     "(least recently updated first), by model and table.")),
      consistency_(std::make_unique<ConsistencyMetrics>(*registry_, DurationBuckets())),
      collector_(std::make_shared<Collector>(this)) {
  for (int i = 0; i < 4; ++i) {
    stage_[i] = &stage_duration_.Add({{"stage", kStageNames[i]}}, DurationBuckets());
  }
  // The series that dashboards and alerts read exist from the start, at zero.
  push_requests_.Add({{"code", "OK"}});
  pull_requests_.Add({{"code", "OK"}});
  for (const char* reason : {"missing_credentials", "invalid_token", "wrong_role", "wrong_model",
                             "client_id_mismatch"}) {
    auth_failures_.Add({{"reason", reason}});
  }
  for (const char* phase : {"snapshot", "write", "restore"}) {
    checkpoint_duration_.Add({{"phase", phase}}, CheckpointBuckets());
  }
  GaugeFamily(*registry_, "fusedps_build_info",
              "Always 1; the labels say which fusedps build serves, on which backend and device.")
      .Add({{"version", build.version}, {"backend", build.backend}, {"device", build.device}})
      .Set(1);
}

// civetweb (under prometheus-cpp's Exposer) notices that it should stop only when its accept
// loop's poll returns, which it does every 2 s when no connection comes: stopping took about
// 1.5 s more than the gRPC drain. So the stop runs on a thread of its own while this one knocks
// on the listening port (a connection that is closed at once) until the stop is done.
Metrics::~Metrics() { StopServing(); }

ConsistencyObserver* Metrics::consistency(const std::string& model) {
  return consistency_->ForModel(model);
}

void Metrics::StopServing() {
  if (exposer_ == nullptr) return;
  const int port = this->port();
  std::atomic<bool> stopped{false};
  std::thread stop([&] {
    exposer_.reset();
    stopped = true;
  });
  while (!stopped.load()) {
    KnockOnce(listen_host_, port);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  stop.join();
}

absl::Status Metrics::Serve(const std::string& listen) {
  if (exposer_ != nullptr) return absl::FailedPreconditionError("metrics are already served");
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(listen, /*num_threads=*/2);
  } catch (const std::exception& e) {
    // prometheus-cpp (civetweb) reports a bind failure by throwing; this is its one boundary.
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on '", listen, "': ", e.what()));
  }
  exposer_->RegisterCollectable(collector_);
  listen_host_ = listen.substr(0, listen.rfind(':'));
  return absl::OkStatus();
}

int Metrics::port() const {
  if (exposer_ == nullptr) return 0;
  const std::vector<int> ports = exposer_->GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

void Metrics::RecordPush(grpc::StatusCode code, uint64_t grad_bytes, const PushStageSeconds& stages,
                         bool duplicate) {
  push_requests_.Add({{"code", StatusCodeName(code)}}).Increment();
  push_bytes_.Increment(static_cast<double>(grad_bytes));
  if (code != grpc::StatusCode::OK) return;
  if (duplicate) {
    push_duplicates_.Increment();
    return;
  }
  push_duration_.Observe(stages.receive + stages.h2d + stages.apply + stages.ack);
  const double seconds[4] = {stages.receive, stages.h2d, stages.apply, stages.ack};
  for (int i = 0; i < 4; ++i) stage_[i]->Observe(seconds[i]);
  push_ingest_.Observe(stages.ingest);
}

void Metrics::RecordStep(const std::string& model, bool skipped, const std::string& skip_reason) {
  if (skipped) {
    steps_skipped_.Add({{"model", model}, {"reason", skip_reason}}).Increment();
  } else {
    steps_.Add({{"model", model}}).Increment();
  }
}

void Metrics::RecordCheckpointPhase(const std::string& phase, double seconds) {
  checkpoint_duration_.Add({{"phase", phase}}, CheckpointBuckets()).Observe(seconds);
}

void Metrics::RecordCheckpointSuccess(const std::string& model, uint64_t bytes,
                                      double unix_seconds) {
  checkpoint_bytes_.Add({{"model", model}}).Increment(static_cast<double>(bytes));
  checkpoint_last_success_.Add({{"model", model}}).Set(unix_seconds);
}

void Metrics::SetCheckpointInterval(double seconds) { checkpoint_interval_.Set(seconds); }

void Metrics::AddCheckpointedModel(const std::string& model) {
  checkpoint_bytes_.Add({{"model", model}});
  for (const char* reason : kCheckpointFailureReasons) {
    checkpoint_failures_.Add({{"model", model}, {"reason", reason}});
  }
}

void Metrics::RecordCheckpointFailure(const std::string& model, const std::string& reason) {
  checkpoint_failures_.Add({{"model", model}, {"reason", reason}}).Increment();
}

void Metrics::RecordAuthFailure(const std::string& reason) {
  auth_failures_.Add({{"reason", reason}}).Increment();
}

void Metrics::RecordCommitPull(uint64_t bytes) {
  pull_bytes_.Increment(static_cast<double>(bytes));
}

void Metrics::RecordPull(grpc::StatusCode code, uint64_t bytes) {
  pull_requests_.Add({{"code", StatusCodeName(code)}}).Increment();
  pull_bytes_.Increment(static_cast<double>(bytes));
}

void Metrics::RecordTablePush(const std::string& model, const std::string& table, uint64_t keys,
                              uint64_t evictions) {
  const prometheus::Labels labels{{"model", model}, {"table", table}};
  table_pushed_keys_.Add(labels).Increment(static_cast<double>(keys));
  table_evictions_.Add(labels).Increment(static_cast<double>(evictions));
}

void Metrics::RecordTableLookup(const std::string& model, const std::string& table, uint64_t keys,
                                uint64_t misses) {
  const prometheus::Labels labels{{"model", model}, {"table", table}};
  table_lookup_keys_.Add(labels).Increment(static_cast<double>(keys));
  table_lookup_misses_.Add(labels).Increment(static_cast<double>(misses));
}

void Metrics::SyncShard() const {
  const ShardMetrics shard = shard_();
  MutexLock lock(&sync_mu_);
  std::set<std::string> models;
  std::set<std::pair<std::string, std::string>> tables;
  for (const ModelMetrics& model : shard.models) {
    const prometheus::Labels labels{{"model", model.name}};
    parameters_.Add(labels).Set(static_cast<double>(model.parameters));
    model_version_.Add(labels).Set(static_cast<double>(model.version));
    model_memory_bytes_.Add(labels).Set(static_cast<double>(model.memory_bytes));
    steps_.Add(labels);
    steps_skipped_.Add({{"model", model.name}, {"reason", kNonFiniteGrad}});
    models.insert(model.name);
    for (const TableMetrics& table : model.tables) {
      const prometheus::Labels table_labels{{"model", model.name}, {"table", table.name}};
      table_rows_.Add(table_labels).Set(static_cast<double>(table.rows));
      table_pushed_keys_.Add(table_labels);  // At zero from the start, for rate().
      table_lookup_keys_.Add(table_labels);
      table_lookup_misses_.Add(table_labels);
      table_evictions_.Add(table_labels);
      tables.emplace(model.name, table.name);
    }
  }
  for (const auto& [model, table] : tables_synced_) {
    if (tables.count({model, table}) != 0) continue;
    const prometheus::Labels labels{{"model", model}, {"table", table}};
    if (table_rows_.Has(labels)) table_rows_.Remove(&table_rows_.Add(labels));
    for (prometheus::Family<prometheus::Counter>* family :
         {&table_pushed_keys_, &table_lookup_keys_, &table_lookup_misses_, &table_evictions_}) {
      if (family->Has(labels)) family->Remove(&family->Add(labels));
    }
  }
  tables_synced_ = std::move(tables);
  for (const std::string& gone : models_synced_) {
    if (models.count(gone) != 0) continue;
    const prometheus::Labels labels{{"model", gone}};
    for (prometheus::Family<prometheus::Gauge>* family :
         {&parameters_, &model_version_, &model_memory_bytes_, &checkpoint_last_success_}) {
      if (family->Has(labels)) family->Remove(&family->Add(labels));
    }
    for (prometheus::Family<prometheus::Counter>* family : {&checkpoint_bytes_, &steps_}) {
      if (family->Has(labels)) family->Remove(&family->Add(labels));
    }
    const prometheus::Labels skipped{{"model", gone}, {"reason", kNonFiniteGrad}};
    if (steps_skipped_.Has(skipped)) steps_skipped_.Remove(&steps_skipped_.Add(skipped));
    consistency_->RemoveModel(gone);
    for (const char* reason : kCheckpointFailureReasons) {
      const prometheus::Labels failure{{"model", gone}, {"reason", reason}};
      if (checkpoint_failures_.Has(failure)) {
        checkpoint_failures_.Remove(&checkpoint_failures_.Add(failure));
      }
    }
  }
  models_synced_ = std::move(models);
  models_.Set(static_cast<double>(shard.models.size()));
  staging_capacity_.Set(static_cast<double>(shard.staging_capacity_bytes));
  staging_in_use_.Set(static_cast<double>(shard.staging_in_use_bytes));
  staging_waiters_.Set(static_cast<double>(shard.staging_waiters));
  staging_oldest_wait_.Set(shard.staging_oldest_wait_seconds);
  retry_table_clients_.Set(static_cast<double>(shard.retry_table_clients));
  workspaces_.Set(static_cast<double>(shard.workspaces));
  workspace_bytes_.Set(static_cast<double>(shard.workspace_bytes));
  if (shard.retry_table_evictions > evictions_synced_) {
    retry_table_evictions_.Increment(
        static_cast<double>(shard.retry_table_evictions - evictions_synced_));
    evictions_synced_ = shard.retry_table_evictions;
  }
  for (const auto& [kind, bytes] : shard.memory_bytes) {
    memory_bytes_.Add({{"kind", kind}}).Set(static_cast<double>(bytes));
  }
  if (shard.tls_certificate_expiry_seconds.has_value()) {
    tls_certificate_expiry_.Add({}).Set(*shard.tls_certificate_expiry_seconds);
  }
  // The backend's counts are absolute; the counters advance by what is new since the last sync.
  for (const auto& [kernel, count] : shard.kernel_launches) {
    prometheus::Counter& counter = kernel_launches_.Add({{"kernel", kernel}});
    uint64_t& synced = launches_synced_[kernel];
    if (count > synced) {
      counter.Increment(static_cast<double>(count - synced));
      synced = count;
    }
  }
}

std::string Metrics::ScrapeText() const {
  return prometheus::TextSerializer().Serialize(collector_->Collect());
}

}  // namespace fusedps
