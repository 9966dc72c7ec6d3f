// service_context.h (server internal): what the gRPC handlers and reactors share. Everything
// here is owned by the Server and outlives every call; a call's model (models/model.h) is found
// in the registry and held by the call until it is done.
#ifndef FUSEDPS_SERVER_SERVICE_SERVICE_CONTEXT_H_
#define FUSEDPS_SERVER_SERVICE_SERVICE_CONTEXT_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"
#include "kernels/backend.h"
#include "server/auth/authorizer.h"
#include "server/engine/shard_fault.h"
#include "server/ingest/push_assembly.h"
#include "server/ingest/staging_pool.h"
#include "server/metrics/metrics.h"
#include "server/models/model_registry.h"
#include "server/service/call_watchdog.h"
#include "server/workspace/workspace.h"

namespace fusedps {

struct ServiceLimits {
  uint64_t max_message_bytes = 8 << 20;  // gRPC's max send and receive message size.
  // The most staging one pull, or one registration, holds at a time (its window).
  uint64_t window_bytes = 32 << 20;
};

// Who owns the workspaces a caller opens (WorkspaceTable's owner): its principals; empty
// without authentication.
inline std::string WorkspaceOwner(const Caller& caller) {
  return absl::StrJoin(caller.principals, ",");
}

struct ServiceContext {
  ModelRegistry* models;
  // The backend that owns the staging arena (and holds no model), for the server's memory.
  const OptimizerBackend* arena_owner = nullptr;
  ShardFault* fault;
  StagingPool* staging;
  // The budget of snapshot memory (device memory on a GPU) that pulls larger than one window
  // read into, so that they are consistent at one version while steps go on.
  StagingPool* snapshot_budget;
  Metrics* metrics;
  CallWatchdog* watchdog;
  // True while the server restores its checkpoints at start: every call is UNAVAILABLE.
  const std::atomic<bool>* restoring = nullptr;
  // Who may call what (server/auth/authorizer.h); it admits anyone when authentication is off.
  const Authorizer* authorizer;
  // Same-host workspaces (server/workspace/workspace.h); off, it opens none and finds none.
  WorkspaceTable* workspaces;
  // ServerOptions::testing_before_push_join, or null.
  const std::function<void()>* testing_before_push_join = nullptr;
  ServiceLimits limits;

  // The ingest services of a call about `model` (which the pushes then hold).
  IngestServices ingest(const std::shared_ptr<Model>& model) const {
    return {&model->engine(), staging, metrics, &model->assemblies(), model, model->name()};
  }

  // OK when a call of `rpc` may proceed. First who calls: UNAUTHENTICATED or
  // PERMISSION_DENIED (Authorizer::Authorize); then the shard: UNAVAILABLE while restoring,
  // or after a fault. `caller`, when given, receives who is calling.
  absl::Status Admit(const grpc::ServerContextBase& context, Rpc rpc,
                     Caller* caller = nullptr) const {
    absl::StatusOr<Caller> who = authorizer->Authorize(context, rpc);
    if (!who.ok()) return who.status();
    if (caller != nullptr) *caller = *std::move(who);
    if (restoring != nullptr && restoring->load(std::memory_order_acquire)) {
      return absl::UnavailableError("the server is restoring its checkpoint; try again soon");
    }
    return fault->status();
  }

  // The model a call names (empty: "default"), once `caller` may reach it. Errors:
  // PERMISSION_DENIED (Authorizer::CheckModel), INVALID_ARGUMENT for a malformed name,
  // NOT_FOUND for a model that does not exist (ModelRegistry::Find).
  absl::StatusOr<std::shared_ptr<Model>> FindModel(const Caller& caller, absl::string_view name,
                                                   const grpc::ServerContextBase& context) const {
    if (absl::Status s =
            authorizer->CheckModel(caller, name.empty() ? kDefaultModel : name, context);
        !s.ok()) {
      return s;
    }
    return models->Find(name);
  }

  // Admit, then whether `caller` may reach model `name` (Authorizer::CheckModel): the checks
  // of the calls that name a model that need not exist (CreateModel, DeleteModel).
  absl::Status AdmitNamed(const grpc::ServerContextBase& context, Rpc rpc,
                          absl::string_view name) const {
    Caller caller;
    if (absl::Status s = Admit(context, rpc, &caller); !s.ok()) return s;
    return authorizer->CheckModel(caller, name, context);
  }

  // Admit, then FindModel: the checks every call about one model begins with.
  absl::StatusOr<std::shared_ptr<Model>> AdmitModel(const grpc::ServerContextBase& context, Rpc rpc,
                                                    absl::string_view name,
                                                    Caller* caller = nullptr) const {
    Caller who;
    if (absl::Status s = Admit(context, rpc, &who); !s.ok()) return s;
    absl::StatusOr<std::shared_ptr<Model>> model = FindModel(who, name, context);
    if (caller != nullptr) *caller = std::move(who);
    return model;
  }

  // The memory the server holds beside its models' (the staging arena's device mirror).
  uint64_t staging_memory_bytes() const {
    uint64_t bytes = 0;
    if (arena_owner != nullptr) {
      for (const auto& [kind, b] : arena_owner->memory_bytes()) bytes += b;
    }
    return bytes;
  }

  // The staging one pull or registration may hold at a time: the configured window, but never
  // more than a quarter of the pool, so that a few slow readers cannot starve pushes.
  uint64_t window_bytes() const {
    return std::max<uint64_t>(64, std::min(limits.window_bytes, staging->capacity() / 4));
  }
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_SERVICE_SERVICE_CONTEXT_H_
