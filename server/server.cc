#include "server/server.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "kernels/backend_factory.h"

#ifndef FUSEDPS_VERSION
#define FUSEDPS_VERSION "dev"
#endif

namespace fusedps {

absl::StatusOr<ParamCopyDType> ParseParamCopyDType(absl::string_view name) {
  if (name == "none") return ParamCopyDType::kNone;
  if (name == "bf16") return ParamCopyDType::kBFloat16;
  if (name == "fp16") return ParamCopyDType::kFloat16;
  return absl::InvalidArgumentError(
      absl::StrCat("--param-copy-dtype = '", name, "' must be none, bf16 or fp16"));
}

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  absl::StatusOr<std::unique_ptr<OptimizerBackend>> backend =
      MakeBackend(options.device, options.backend);
  if (!backend.ok()) return backend.status();
  std::unique_ptr<Server> server(new Server());
  server->store_ = std::make_unique<ShardStore>(*std::move(backend));
  server->engine_ = std::make_unique<UpdateEngine>(server->store_.get());
  ShardStore* store = server->store_.get();
  Server* self = server.get();
  server->metrics_ = std::make_unique<Metrics>(
      Metrics::BuildInfo{FUSEDPS_VERSION, store->backend_name(), store->device()}, [store, self] {
        ShardMetrics shard{store->parameter_count(), store->version(), store->launch_counts(),
                           store->memory_bytes()};
        if (const StagingPool* pool = self->staging_.get()) {  // Set once, before serving.
          shard.staging_capacity_bytes = pool->capacity();
          shard.staging_in_use_bytes = pool->in_use();
          shard.staging_waiters = pool->waiting();
        }
        return shard;
      });
  absl::StatusOr<char*> arena = server->store_->AllocateStagingArena(options.staging_pool_bytes);
  if (!arena.ok()) return arena.status();
  server->staging_ = std::make_unique<StagingPool>(options.staging_pool_bytes, *arena);
  if (!options.metrics_listen.empty()) {
    if (absl::Status s = server->metrics_->Serve(options.metrics_listen); !s.ok()) return s;
  }
  server->service_ =
      std::make_unique<ParameterServiceImpl>(server->store_.get(), server->engine_.get(),
                                             server->metrics_.get(), server->staging_.get(),
                                             options.max_message_bytes,
                                             options.push_part_wait);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &server->port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  builder.RegisterService(server->service_.get());
  server->grpc_server_ = builder.BuildAndStart();
  if (server->grpc_server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on '", options.listen, "'"));
  }
  grpc::HealthCheckServiceInterface* health = server->grpc_server_->GetHealthCheckService();
  health->SetServingStatus(true);
  health->SetServingStatus(v1::ParameterService::service_full_name(), true);
  return server;
}

void Server::Shutdown(absl::Duration grace) {
  if (grpc_server_ == nullptr) return;
  grpc_server_->GetHealthCheckService()->SetServingStatus(false);
  grpc_server_->Shutdown(std::chrono::system_clock::now() + absl::ToChronoSeconds(grace));
}

void Server::Wait() {
  if (grpc_server_ != nullptr) grpc_server_->Wait();
}

Server::~Server() {
  Shutdown(absl::ZeroDuration());
  Wait();
  // The engine's destructor applies any push already submitted before the store goes.
  engine_.reset();
}

}  // namespace fusedps
