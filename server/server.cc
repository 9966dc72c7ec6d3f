#include "server/server.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_args.h"
#include "common/logging.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "kernels/backend_factory.h"

#ifndef FUSEDPS_VERSION
#define FUSEDPS_VERSION "dev"
#endif

namespace fusedps {
namespace {

int Millis(absl::Duration d) { return static_cast<int>(absl::ToInt64Milliseconds(d)); }

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  // Copies what it needs: models are made after Start returns too.
  BackendMaker make_backend =
      [factory = options.backend_factory, device = options.device,
       backend_options = options.backend]() -> absl::StatusOr<std::unique_ptr<OptimizerBackend>> {
    return factory ? factory() : MakeBackend(device, backend_options);
  };
  absl::StatusOr<std::unique_ptr<OptimizerBackend>> backend = make_backend();
  if (!backend.ok()) return backend.status();
  if (absl::Status s = ValidateConsistency(options.consistency); !s.ok()) return s;
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      ServerCredentials(options.tls);
  if (!credentials.ok()) return credentials.status();

  std::unique_ptr<Server> server(new Server());
  server->fault_ = std::make_unique<ShardFault>();
  server->arena_owner_ = *std::move(backend);
  server->InitMetrics(options);  // First: the destructor stops serving them.
  if (absl::Status s = server->InitStaging(options); !s.ok()) return s;
  server->InitWatchdog(options);
  server->InitModels(options, std::move(make_backend));
  if (absl::Status s = server->fault_->status(); !s.ok()) return s;
  if (!options.metrics_listen.empty()) {
    if (absl::Status s = server->metrics_->Serve(options.metrics_listen); !s.ok()) return s;
  }
  if (absl::Status s = server->InitAuthorizer(options); !s.ok()) return s;
  server->InitService(options);
  if (absl::Status s = server->StartGrpc(options, *std::move(credentials)); !s.ok()) return s;
  if (absl::Status s = server->OpenModels(options); !s.ok()) return s;
  return server;
}

void Server::InitMetrics(const ServerOptions& options) {
  // They read the models only on a scrape, once serving.
  metrics_ = std::make_unique<Metrics>(
      Metrics::BuildInfo{FUSEDPS_VERSION, arena_owner_->name(), arena_owner_->device()},
      [this, cert_file = options.tls.cert_file] { return ScrapeShard(cert_file); });
}

absl::Status Server::InitStaging(const ServerOptions& options) {
  absl::StatusOr<char*> arena = arena_owner_->AllocateStagingArena(options.staging_pool_bytes);
  if (!arena.ok()) return arena.status();
  staging_ =
      std::make_unique<StagingPool>(options.staging_pool_bytes, *arena, "--staging-pool-bytes");
  snapshot_budget_ =
      std::make_unique<StagingPool>(options.pull_snapshot_bytes, nullptr, "--pull-snapshot-bytes");
  workspaces_ = std::make_unique<WorkspaceTable>(options.workspaces, arena_owner_.get());
  return absl::OkStatus();
}

void Server::InitWatchdog(const ServerOptions& options) {
  // A line that stops moving leaves a line in the log (and the oldest-wait gauge shows it).
  watchdog_ = std::make_unique<CallWatchdog>(options.call_idle, [this] {
    const absl::Duration waited = staging_->oldest_wait();
    if (waited > absl::Seconds(10)) {
      FUSEDPS_LOG_EVERY_SECONDS(WARNING, 30)
          << staging_->waiting() << " calls wait for staging, the oldest for "
          << absl::FormatDuration(waited) << "; " << staging_->in_use() << " of "
          << staging_->capacity() << " bytes are held (--staging-pool-bytes)";
    }
  });
}

void Server::InitModels(const ServerOptions& options, BackendMaker make_backend) {
  ModelOptions models;
  models.make_backend = std::move(make_backend);
  models.arena = arena_owner_->staging_arena();
  models.fault = fault_.get();
  models.metrics = metrics_.get();
  models.push_part_wait = options.push_part_wait;
  models.retry_table_clients = options.retry_table_clients;
  if (!options.checkpoint.root.empty()) {
    models.checkpoint = options.checkpoint;
    if (models.checkpoint.server_version.empty()) {
      models.checkpoint.server_version = FUSEDPS_VERSION;
    }
  }
  models_ = std::make_unique<ModelRegistry>(std::move(models), options.consistency);
}

absl::Status Server::InitAuthorizer(const ServerOptions& options) {
  AuthOptions auth;
  auth.tokens_file = options.auth_tokens_file;
  auth.client_certificates = !options.tls.client_ca_file.empty();
  auth.reload_interval = options.auth_tokens_reload;
  auth.on_failure = [metrics = metrics_.get()](const std::string& reason) {
    metrics->RecordAuthFailure(reason);
  };
  absl::StatusOr<std::unique_ptr<Authorizer>> authorizer = Authorizer::Create(std::move(auth));
  if (!authorizer.ok()) return authorizer.status();
  authorizer_ = *std::move(authorizer);
  if (!authorizer_->enabled()) {
    LOG(WARNING) << "no authentication (--auth-tokens, --tls-client-ca): anyone who reaches "
                 << options.listen << " may push, pull, register and load state";
  } else if (options.tls.cert_file.empty()) {
    LOG(WARNING) << "--auth-tokens without --tls-cert: tokens travel in plaintext";
  }
  return absl::OkStatus();
}

void Server::InitService(const ServerOptions& options) {
  ServiceContext context;
  context.workspaces = workspaces_.get();
  context.models = models_.get();
  context.arena_owner = arena_owner_.get();
  context.authorizer = authorizer_.get();
  context.fault = fault_.get();
  context.staging = staging_.get();
  context.snapshot_budget = snapshot_budget_.get();
  context.metrics = metrics_.get();
  context.watchdog = watchdog_.get();
  context.restoring = &restoring_;
  testing_before_push_join_ = options.testing_before_push_join;
  if (testing_before_push_join_) {
    context.testing_before_push_join = &testing_before_push_join_;
  }
  context.limits.max_message_bytes = options.max_message_bytes;
  context.limits.window_bytes = options.window_bytes;
  service_ = std::make_unique<ParameterServiceImpl>(context);
}

absl::Status Server::StartGrpc(const ServerOptions& options,
                               std::shared_ptr<grpc::ServerCredentials> credentials) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, std::move(credentials), &port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  // A peer that vanishes (a dead host, a cut network) is noticed within keepalive +
  // keepalive_timeout instead of TCP's two hours; clients may ping every 10 s.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, Millis(options.keepalive));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, Millis(options.keepalive_timeout));
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  ForEachTransportArg(
      [&](const std::string& name, int value) { builder.AddChannelArgument(name, value); });
  // One port, one server. gRPC sets SO_REUSEPORT by default: a second server on a port in use
  // would then start beside the first, and the kernel would split new connections between two
  // independent shards (a restart overlapping a draining process did this silently).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.RegisterService(service_.get());
  grpc_server_ = builder.BuildAndStart();
  if (grpc_server_ == nullptr || port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on '", options.listen,
                     "': the address is in use (another server?) or cannot be bound here"));
  }
  return absl::OkStatus();
}

absl::Status Server::OpenModels(const ServerOptions& options) {
  SetServing(false);  // Until the restore is done.
  if (absl::Status s = models_->Open(options.restore); !s.ok()) return s;
  restoring_.store(false, std::memory_order_release);
  models_->StartCheckpoints();
  SetServing(true);
  fault_->OnFault([this, on_fault = options.on_fault](const absl::Status& cause) {
    SetServing(false);
    if (on_fault) on_fault(cause);
  });
  return absl::OkStatus();
}

ShardMetrics Server::ScrapeShard(const std::string& cert_file) {
  ShardMetrics shard;
  const ModelRegistry::Retired retired = models_->retired();
  shard.kernel_launches = retired.kernel_launches;
  shard.retry_table_evictions = retired.retry_table_evictions;
  shard.memory_bytes = arena_owner_->memory_bytes();
  for (const std::shared_ptr<Model>& model : models_->List()) {
    ModelMetrics m;
    m.name = model->name();
    m.parameters = model->engine().view()->parameter_count();
    m.version = model->engine().version();
    m.memory_bytes = model->memory_bytes();
    const std::shared_ptr<const ShardView> view = model->engine().view();
    for (uint32_t t = 0; t < view->tensor_count(); ++t) {
      const TensorMeta& meta = view->tensor(t);
      if (!meta.table) continue;
      m.tables.push_back({meta.name, meta.hashed.has_value()
                                         ? model->engine().HashedRowsInUse(t)
                                         : static_cast<uint64_t>(meta.shape[0])});
    }
    shard.models.push_back(std::move(m));
    for (const auto& [kernel, count] : model->engine().launch_counts()) {
      shard.kernel_launches[kernel] += count;
    }
    for (const auto& [kind, bytes] : model->engine().memory_bytes()) {
      shard.memory_bytes[kind] += bytes;
    }
    shard.retry_table_clients += model->retries().clients();
    shard.retry_table_evictions += model->retries().evictions();
  }
  shard.staging_capacity_bytes = staging_->capacity();
  shard.staging_in_use_bytes = staging_->in_use();
  shard.staging_waiters = staging_->waiting();
  shard.staging_oldest_wait_seconds = absl::ToDoubleSeconds(staging_->oldest_wait());
  shard.workspaces = workspaces_->open_count();
  shard.workspace_bytes = workspaces_->open_bytes();
  if (!cert_file.empty()) {
    // Read again at each scrape: the file is what a rotation replaces.
    absl::StatusOr<double> expiry = CertificateNotAfter(cert_file);
    if (expiry.ok()) shard.tls_certificate_expiry_seconds = *expiry;
  }
  return shard;
}

UpdateEngine& Server::engine() {
  absl::StatusOr<std::shared_ptr<Model>> model = models_->Find(kDefaultModel);
  return (*model)->engine();  // The registry keeps "default" alive.
}

absl::StatusOr<checkpoint::CheckpointResult> Server::Checkpoint(absl::string_view model) {
  absl::StatusOr<std::shared_ptr<Model>> found = models_->Find(model);
  if (!found.ok()) return found.status();
  return (*found)->CheckpointNow();
}

std::vector<std::pair<std::string, absl::StatusOr<checkpoint::CheckpointResult>>>
Server::CheckpointAll() {
  std::vector<std::pair<std::string, absl::StatusOr<checkpoint::CheckpointResult>>> results;
  for (const std::shared_ptr<Model>& model : models_->List()) {
    results.emplace_back(model->name(), model->CheckpointNow());
  }
  return results;
}

void Server::SetServing(bool serving) {
  MutexLock lock(&health_mu_);
  if (grpc_server_ == nullptr) return;
  grpc::HealthCheckServiceInterface* health = grpc_server_->GetHealthCheckService();
  serving = serving && !fault_->faulted();
  health->SetServingStatus(serving);
  health->SetServingStatus(v1::ParameterService::service_full_name(), serving);
}

void Server::Shutdown(absl::Duration grace) {
  if (grpc_server_ == nullptr) return;
  SetServing(false);
  grpc_server_->Shutdown(std::chrono::system_clock::now() + absl::ToChronoSeconds(grace));
}

void Server::Wait() {
  if (grpc_server_ != nullptr) grpc_server_->Wait();
}

Server::~Server() {
  // In the order that keeps every pointer valid: no calls, then no scrapes, then no watchdog
  // callbacks, then the models, then the metrics and the pools.
  Shutdown(absl::ZeroDuration());
  Wait();
  {
    MutexLock lock(&health_mu_);
    grpc_server_.reset();
  }
  service_.reset();
  authorizer_.reset();
  metrics_->StopServing();  // No scrape reads the models from here on.
  watchdog_.reset();
  // Each model stops its checkpoints (letting one in progress finish), its part checks and its
  // engine, which finishes what was submitted (its callbacks release staging into the pools
  // and report to the metrics).
  models_.reset();
  workspaces_.reset();  // No push or pull holds one now; arena_owner_ unpins them.
  metrics_.reset();     // After the engines, which report their last rounds to them.
  snapshot_budget_.reset();
  staging_.reset();
  arena_owner_.reset();  // Last: every model's backend shared its staging arena.
}

}  // namespace fusedps
