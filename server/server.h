// server.h: a running fusedps server: gRPC ParameterService, health and reflection, over its
// models (each a shard: models/model.h), and its Prometheus metrics (served over HTTP when
// options.metrics_listen is set). Used by main.cc and by tests that start servers in-process
// on port 0.
//
// The pieces, along the data path (docs/architecture.md): service/ (gRPC adapters) -> models/
// (the namespaces: which shard a call is about) -> ingest/ (push assembly, staging,
// registration windows) -> engine/ (each model's single writer, over its optimizer backend) ->
// store/ (the view readers share, the retry table). The device, its fault state, the staging
// pool and the metrics are the server's, shared by every model.
//
// Faults (engine/shard_fault.h): when the device fails, health turns NOT_SERVING at once, every
// call fails with UNAVAILABLE, and options.on_fault runs (main.cc exits non-zero after a short
// drain, so that the orchestrator restarts the server).
//
// Usage:
//   ServerOptions options;
//   options.listen = "127.0.0.1:0";
//   absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(options);
//   int port = (*server)->port();
//   (*server)->Shutdown(absl::Seconds(30));
#ifndef FUSEDPS_SERVER_SERVER_H_
#define FUSEDPS_SERVER_SERVER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "kernels/backend.h"
#include "server/auth/authorizer.h"
#include "server/auth/tls.h"
#include "server/checkpoint/checkpointer.h"
#include "server/engine/shard_fault.h"
#include "server/engine/update_engine.h"
#include "server/ingest/staging_pool.h"
#include "server/metrics/metrics.h"
#include "server/models/model_registry.h"
#include "server/service/call_watchdog.h"
#include "server/service/service.h"
#include "server/workspace/workspace.h"

namespace fusedps {

struct ServerOptions {
  std::string listen = "0.0.0.0:50051";  // Port 0 picks a free port.
  std::string device = "auto";           // auto | cpu | cuda | cuda:N
  BackendOptions backend;
  uint64_t max_message_bytes = 8 << 20;  // gRPC max receive and send message size.
  // Host staging shared by the pushes, pulls and registrations in flight; a call waits for its
  // share (back-pressure), and a push that needs more than all of it is RESOURCE_EXHAUSTED.
  uint64_t staging_pool_bytes = uint64_t{2} << 30;
  // The most staging one pull or one registration holds at a time.
  uint64_t window_bytes = 32 << 20;
  // Snapshot memory (device memory on a GPU) for pulls larger than one window; a pull larger
  // than all of it is RESOURCE_EXHAUSTED.
  uint64_t pull_snapshot_bytes = uint64_t{4} << 30;
  // Same-host workspaces (proto OpenWorkspace, server/workspace/workspace.h): where their
  // files go (empty: off) and the most they hold in all.
  WorkspaceOptions workspaces;
  // A push sent in parts fails (DEADLINE_EXCEEDED) when its parts have not all arrived within
  // this long of its first; the parts that came give their staging back.
  absl::Duration push_part_wait = absl::Seconds(30);
  // A call whose peer sends (or, for a pull, reads) nothing for this long ends with
  // DEADLINE_EXCEEDED and gives back what it holds. InfiniteDuration: no limit.
  absl::Duration call_idle = absl::Seconds(60);
  // HTTP/2 keepalive pings on idle connections, and how long to wait for their answer.
  absl::Duration keepalive = absl::Seconds(30);
  absl::Duration keepalive_timeout = absl::Seconds(10);
  // How pushes become steps: async, sync rounds or bounded staleness (server/engine/
  // consistency.h): the default model's, and that of models created without their own. Start
  // fails with INVALID_ARGUMENT for options ValidateConsistency refuses.
  ConsistencyOptions consistency;
  // Clients whose recent pushes each model's retry table remembers (LRU).
  size_t retry_table_clients = 10000;
  // HTTP address of /metrics, HOST:PORT (port 0 picks a free port); empty: not served (the
  // metrics are still kept, see Server::metrics()).
  std::string metrics_listen;
  // Checkpoints (docs/checkpoints.md); checkpoint.root empty: none are written.
  checkpoint::CheckpointerOptions checkpoint;
  // What the models start from: "latest" (each its newest good checkpoint under checkpoint.root,
  // or empty when there is none), "none" (empty), or a checkpoint directory's path (which must
  // load) for the default model (the others then restore their latest). The models the root
  // lists are made again either way (models/model_files.h). Health is NOT_SERVING and every
  // call UNAVAILABLE until the restore is done.
  std::string restore = "latest";
  // Transport security of the gRPC port (auth/tls.h): TLS with tls.cert_file, mutual TLS with
  // tls.client_ca_file; plaintext without. /metrics stays plain HTTP (docs/operations.md,
  // "Security": keep it on a private network).
  TlsOptions tls;
  // The bearer tokens (auth/token_table.h), read again every auth_tokens_reload; empty: none.
  // With tokens or with client certificates, callers are authenticated and a push's client_id
  // must be the caller's principal (auth/authorizer.h).
  std::string auth_tokens_file;
  absl::Duration auth_tokens_reload = absl::Seconds(10);
  // Tests: makes the backends instead of `device` (e.g. one that injects faults): one that owns
  // the staging arena, then one per model.
  std::function<absl::StatusOr<std::unique_ptr<OptimizerBackend>>()> backend_factory;
  // Runs once if the shard faults, after health has turned NOT_SERVING (on the thread that
  // saw the fault; it must not block).
  std::function<void(const absl::Status& cause)> on_fault;
  // Tests: runs in each push call after its header is checked, just before the call joins its
  // push (on a gRPC thread; it may block that call).
  std::function<void()> testing_before_push_join;
};

class Server {
 public:
  // Errors: INVALID_ARGUMENT for a bad option (including a TLS file or token file that cannot
  // be read or parsed), UNAVAILABLE when the device, the address or the
  // metrics address cannot be had.
  static absl::StatusOr<std::unique_ptr<Server>> Start(const ServerOptions& options);
  ~Server();

  int port() const { return port_; }
  // The bound /metrics port, or 0 when metrics are not served.
  int metrics_port() const { return metrics_->port(); }
  ModelRegistry& models() { return *models_; }
  // The default model's engine (tests; a reference that deleting "default" invalidates).
  UpdateEngine& engine();
  // The device's backend name ("cpu", "cuda") and description.
  std::string backend_name() const { return arena_owner_->name(); }
  std::string device() const { return arena_owner_->device(); }
  Metrics& metrics() { return *metrics_; }
  StagingPool& staging_pool() { return *staging_; }
  const ShardFault& fault() const { return *fault_; }

  // A checkpoint of `model` holding every push acknowledged so far (Model::CheckpointNow),
  // e.g. after Shutdown's drain. FAILED_PRECONDITION without checkpoint.root; NOT_FOUND.
  absl::StatusOr<checkpoint::CheckpointResult> Checkpoint(absl::string_view model = kDefaultModel);
  // Checkpoints every model (each is tried): each model's name and result, by name.
  std::vector<std::pair<std::string, absl::StatusOr<checkpoint::CheckpointResult>>> CheckpointAll();

  // Stops accepting calls, lets calls in flight finish until the deadline (then cancels
  // them), and applies every push already complete. Idempotent.
  void Shutdown(absl::Duration grace);

  // Blocks until Shutdown has finished.
  void Wait();

 private:
  Server() = default;
  void SetServing(bool serving);
  // The values the metrics export, read on each scrape.
  ShardMetrics ScrapeShard(const std::string& cert_file);

  std::unique_ptr<ShardFault> fault_;
  // The backend that owns the staging arena (and holds no tensors); each model's backend
  // shares its arena.
  std::unique_ptr<OptimizerBackend> arena_owner_;
  std::unique_ptr<StagingPool> staging_;
  std::unique_ptr<StagingPool> snapshot_budget_;
  // Pinned by arena_owner_, held by pushes and pulls: after models_, before arena_owner_.
  std::unique_ptr<WorkspaceTable> workspaces_;
  std::unique_ptr<CallWatchdog> watchdog_;
  std::function<void()> testing_before_push_join_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<ModelRegistry> models_;
  std::atomic<bool> restoring_{true};
  std::unique_ptr<Authorizer> authorizer_;  // Outlives service_ and grpc_server_.
  std::unique_ptr<ParameterServiceImpl> service_;
  std::unique_ptr<grpc::Server> grpc_server_;
  int port_ = 0;
  std::mutex health_mu_;  // Orders health changes from the fault path and Shutdown.
};

// Parses "none", "bf16" or "fp16".
absl::StatusOr<ParamCopyDType> ParseParamCopyDType(absl::string_view name);

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_SERVER_H_
