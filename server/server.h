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
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/mutex.h"
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
#include "server/server_options.h"
#include "server/service/call_watchdog.h"
#include "server/service/service.h"
#include "server/workspace/workspace.h"

namespace fusedps {

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
  // Makes an optimizer backend for `device` (or with the options' backend_factory).
  using BackendMaker = std::function<absl::StatusOr<std::unique_ptr<OptimizerBackend>>()>;

  Server() = default;

  // Start's steps, in its order; each builds one part from the options. After the first, a
  // failure returns from Start, and the destructor takes down what was built.
  // The metrics (before anything that reports to them); arena_owner_ names the device.
  void InitMetrics(const ServerOptions& options);
  // The staging pool over the device's staging arena, the pull snapshots' budget and the
  // same-host workspaces.
  absl::Status InitStaging(const ServerOptions& options);
  // The watchdog that ends idle calls and logs a staging line that stops moving.
  void InitWatchdog(const ServerOptions& options);
  // The model registry, which makes each model's backend with make_backend (not yet opened).
  void InitModels(const ServerOptions& options, BackendMaker make_backend);
  // Who may call what: the bearer tokens and the client certificates (auth/authorizer.h).
  absl::Status InitAuthorizer(const ServerOptions& options);
  // The ParameterService over the parts built before it.
  void InitService(const ServerOptions& options);
  // The gRPC server (the service, health, reflection) listening on options.listen.
  absl::Status StartGrpc(const ServerOptions& options,
                         std::shared_ptr<grpc::ServerCredentials> credentials);
  // Opens the models (the restore), starts their checkpoints, turns health SERVING, and hooks
  // the fault path to health and options.on_fault.
  absl::Status OpenModels(const ServerOptions& options);

  void SetServing(bool serving) ABSL_LOCKS_EXCLUDED(health_mu_);
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
  Mutex health_mu_;  // Orders health changes from the fault path and Shutdown.
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_SERVER_H_
