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
#include "server/checkpoint/shard_files.h"

#ifndef FUSEDPS_VERSION
#define FUSEDPS_VERSION "dev"
#endif

namespace fusedps {
namespace {

int Millis(absl::Duration d) { return static_cast<int>(absl::ToInt64Milliseconds(d)); }

}  // namespace

absl::StatusOr<ParamCopyDType> ParseParamCopyDType(absl::string_view name) {
  for (ParamCopyDType copy :
       {ParamCopyDType::kNone, ParamCopyDType::kBFloat16, ParamCopyDType::kFloat16}) {
    if (name == ParamCopyDTypeName(copy)) return copy;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--param-copy-dtype = '", name, "' must be none, bf16 or fp16"));
}

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  absl::StatusOr<std::unique_ptr<OptimizerBackend>> backend =
      options.backend_factory ? options.backend_factory()
                              : MakeBackend(options.device, options.backend);
  if (!backend.ok()) return backend.status();
  if (absl::Status s = ValidateConsistency(options.consistency); !s.ok()) return s;
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      ServerCredentials(options.tls);
  if (!credentials.ok()) return credentials.status();
  std::unique_ptr<Server> server(new Server());
  Server* self = server.get();
  server->fault_ = std::make_unique<ShardFault>();
  server->retries_ = std::make_unique<RetryTable>(options.retry_table_clients);
  // The metrics before the engine, which reports to them; they read the engine only on a
  // scrape, once serving.
  server->metrics_ = std::make_unique<Metrics>(
      Metrics::BuildInfo{FUSEDPS_VERSION, (*backend)->name(), (*backend)->device()},
      [self, cert_file = options.tls.cert_file] {
        ShardMetrics shard;
        shard.parameters = self->engine_->view()->parameter_count();
        shard.version = self->engine_->version();
        shard.kernel_launches = self->engine_->launch_counts();
        shard.memory_bytes = self->engine_->memory_bytes();
        shard.staging_capacity_bytes = self->staging_->capacity();
        shard.staging_in_use_bytes = self->staging_->in_use();
        shard.staging_waiters = self->staging_->waiting();
        shard.staging_oldest_wait_seconds =
            absl::ToDoubleSeconds(self->staging_->oldest_wait());
        shard.retry_table_clients = self->retries_->clients();
        shard.retry_table_evictions = self->retries_->evictions();
        if (!cert_file.empty()) {
          // Read again at each scrape: the file is what a rotation replaces.
          absl::StatusOr<double> expiry = CertificateNotAfter(cert_file);
          if (expiry.ok()) shard.tls_certificate_expiry_seconds = *expiry;
        }
        return shard;
      });
  server->engine_ = std::make_unique<UpdateEngine>(*std::move(backend), server->fault_.get(),
                                                   server->retries_.get(), options.consistency,
                                                   server->metrics_->consistency());
  if (absl::Status s = server->fault_->status(); !s.ok()) return s;
  absl::StatusOr<char*> arena = server->engine_->AllocateStagingArena(options.staging_pool_bytes);
  if (!arena.ok()) return arena.status();
  server->staging_ =
      std::make_unique<StagingPool>(options.staging_pool_bytes, *arena, "--staging-pool-bytes");
  server->snapshot_budget_ = std::make_unique<StagingPool>(options.pull_snapshot_bytes, nullptr,
                                                           "--pull-snapshot-bytes");
  server->assemblies_ = std::make_unique<PushAssemblies>(options.push_part_wait);
  // A line that stops moving leaves a line in the log (and the oldest-wait gauge shows it).
  server->watchdog_ = std::make_unique<CallWatchdog>(options.call_idle, [self] {
    const absl::Duration waited = self->staging_->oldest_wait();
    if (waited > absl::Seconds(10)) {
      FUSEDPS_LOG_EVERY_SECONDS(WARNING, 30)
          << self->staging_->waiting() << " calls wait for staging, the oldest for "
          << absl::FormatDuration(waited) << "; " << self->staging_->in_use() << " of "
          << self->staging_->capacity() << " bytes are held (--staging-pool-bytes)";
    }
  });

  UpdateEngine* engine = server->engine_.get();
  if (!options.metrics_listen.empty()) {
    if (absl::Status s = server->metrics_->Serve(options.metrics_listen); !s.ok()) return s;
  }

  if (!options.checkpoint.root.empty()) {
    checkpoint::CheckpointerOptions checkpoint = options.checkpoint;
    if (checkpoint.server_version.empty()) checkpoint.server_version = FUSEDPS_VERSION;
    server->checkpointer_ =
        std::make_unique<checkpoint::Checkpointer>(engine, server->metrics_.get(), checkpoint);
  }

  AuthOptions auth;
  auth.tokens_file = options.auth_tokens_file;
  auth.client_certificates = !options.tls.client_ca_file.empty();
  auth.reload_interval = options.auth_tokens_reload;
  auth.on_failure = [metrics = server->metrics_.get()](const std::string& reason) {
    metrics->RecordAuthFailure(reason);
  };
  absl::StatusOr<std::unique_ptr<Authorizer>> authorizer = Authorizer::Create(std::move(auth));
  if (!authorizer.ok()) return authorizer.status();
  server->authorizer_ = *std::move(authorizer);
  if (!server->authorizer_->enabled()) {
    LOG(WARNING) << "no authentication (--auth-tokens, --tls-client-ca): anyone who reaches "
                 << options.listen << " may push, pull, register and load state";
  } else if (options.tls.cert_file.empty()) {
    LOG(WARNING) << "--auth-tokens without --tls-cert: tokens travel in plaintext";
  }

  ServiceContext context;
  context.engine = engine;
  context.authorizer = server->authorizer_.get();
  context.fault = server->fault_.get();
  context.retries = server->retries_.get();
  context.staging = server->staging_.get();
  context.snapshot_budget = server->snapshot_budget_.get();
  context.metrics = server->metrics_.get();
  context.assemblies = server->assemblies_.get();
  context.watchdog = server->watchdog_.get();
  context.registration_gate = &server->registration_gate_;
  context.checkpointer = server->checkpointer_.get();
  context.restoring = &server->restoring_;
  server->testing_before_push_join_ = options.testing_before_push_join;
  if (server->testing_before_push_join_) {
    context.testing_before_push_join = &server->testing_before_push_join_;
  }
  context.limits.max_message_bytes = options.max_message_bytes;
  context.limits.window_bytes = options.window_bytes;
  server->service_ = std::make_unique<ParameterServiceImpl>(context);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, *credentials, &server->port_);
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
  builder.RegisterService(server->service_.get());
  server->grpc_server_ = builder.BuildAndStart();
  if (server->grpc_server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on '", options.listen,
        "': the address is in use (another server?) or cannot be bound here"));
  }
  server->SetServing(false);  // Until the restore is done.
  if (absl::Status s = server->Restore(options); !s.ok()) return s;
  server->restoring_.store(false, std::memory_order_release);
  if (server->checkpointer_ != nullptr) server->checkpointer_->Start();
  server->SetServing(true);
  server->fault_->OnFault([self, on_fault = options.on_fault](const absl::Status& cause) {
    self->SetServing(false);
    if (on_fault) on_fault(cause);
  });
  return server;
}

absl::Status Server::Restore(const ServerOptions& options) {
  const std::string& root = options.checkpoint.root;
  if (options.restore == "none" || (options.restore == "latest" && root.empty())) {
    return absl::OkStatus();
  }
  const auto start = std::chrono::steady_clock::now();
  uint64_t bytes = 0;
  const auto load = [&](const checkpoint::Loaded& c) -> absl::Status {
    absl::StatusOr<std::unique_ptr<checkpoint::ShardReader>> reader =
        checkpoint::ShardReader::Open(c, engine_.get());
    if (!reader.ok()) return reader.status();
    absl::StatusOr<uint64_t> version =
        UpdateEngine::Wait<uint64_t>([&](UpdateEngine::Done<uint64_t> done) {
          engine_->Restore(&(*reader)->shard(), reader->get(), done);
        });
    if (!version.ok()) {
      // A restore that failed is undone (DATA_LOSS: the next older checkpoint is tried), but
      // after a device fault, which stops the server.
      return absl::Status(version.status().code(), absl::StrCat("restoring ", c.directory, ": ",
                                                                version.status().message()));
    }
    bytes = (*reader)->bytes();
    return absl::OkStatus();
  };
  absl::StatusOr<checkpoint::Loaded> loaded;
  if (options.restore == "latest") {
    loaded = checkpoint::LoadLatestGood(
        root, load, [](const std::string& directory, const absl::Status& why) {
          LOG(ERROR) << "checkpoint " << directory << " is skipped: " << why;
        });
    if (absl::IsNotFound(loaded.status())) {
      LOG(INFO) << "no complete checkpoint under " << root << ": the shard starts empty";
      return absl::OkStatus();
    }
  } else {
    loaded = checkpoint::ReadManifest(options.restore);
    if (loaded.ok()) {
      if (absl::Status s = load(*loaded); !s.ok()) loaded = s;
    }
  }
  if (!loaded.ok()) {
    return absl::Status(loaded.status().code(),
                        absl::StrCat("--restore=", options.restore, ": ",
                                     loaded.status().message()));
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  metrics_->RecordCheckpointPhase("restore", seconds);
  LOG(INFO) << "restored version " << loaded->version << " from " << loaded->directory << ": "
            << bytes << " bytes in " << seconds << " s (" << bytes / std::max(seconds, 1e-9) / 1e9
            << " GB/s)";
  if (checkpointer_ != nullptr && options.restore == "latest") {
    checkpointer_->Restored({loaded->version, loaded->directory});
  }
  return absl::OkStatus();
}

absl::StatusOr<checkpoint::CheckpointResult> Server::Checkpoint() {
  if (checkpointer_ == nullptr) {
    return absl::FailedPreconditionError("the server has no --checkpoint-dir");
  }
  return checkpointer_->CheckpointNow();
}

void Server::SetServing(bool serving) {
  std::lock_guard<std::mutex> lock(health_mu_);
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
  // or part-wait callbacks, then the engine finishes what was submitted (its callbacks release
  // staging into the pools and report to the metrics), then the metrics and the pools.
  Shutdown(absl::ZeroDuration());
  Wait();
  {
    std::lock_guard<std::mutex> lock(health_mu_);
    grpc_server_.reset();
  }
  service_.reset();
  authorizer_.reset();
  checkpointer_.reset();  // Its checkpoint in progress finishes (the engine still runs).
  metrics_->StopServing();  // No scrape reads the engine from here on.
  watchdog_.reset();
  assemblies_.reset();
  engine_.reset();
  metrics_.reset();  // After the engine, which reports its last rounds to them.
  snapshot_budget_.reset();
  staging_.reset();
}

}  // namespace fusedps
