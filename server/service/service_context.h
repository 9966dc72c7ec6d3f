// service_context.h (server internal): what the gRPC handlers and reactors share. Everything
// here is owned by the Server and outlives every call.
#ifndef FUSEDPS_SERVER_SERVICE_SERVICE_CONTEXT_H_
#define FUSEDPS_SERVER_SERVICE_SERVICE_CONTEXT_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>

#include "grpcpp/grpcpp.h"
#include "server/auth/authorizer.h"
#include "server/engine/shard_fault.h"
#include "server/engine/update_engine.h"
#include "server/ingest/push_assembly.h"
#include "server/ingest/staging_pool.h"
#include "server/metrics/metrics.h"
#include "server/service/call_watchdog.h"
#include "server/store/retry_table.h"

namespace fusedps {
namespace checkpoint {
class Checkpointer;
}  // namespace checkpoint

struct ServiceLimits {
  uint64_t max_message_bytes = 8 << 20;  // gRPC's max send and receive message size.
  // The most staging one pull, or one registration, holds at a time (its window).
  uint64_t window_bytes = 32 << 20;
};

struct ServiceContext {
  UpdateEngine* engine;
  ShardFault* fault;
  RetryTable* retries;
  StagingPool* staging;
  // The budget of snapshot memory (device memory on a GPU) that pulls larger than one window
  // read into, so that they are consistent at one version while steps go on.
  StagingPool* snapshot_budget;
  Metrics* metrics;
  PushAssemblies* assemblies;
  CallWatchdog* watchdog;
  std::timed_mutex* registration_gate;  // One registration at a time.
  // Checkpoints on demand (the Checkpoint RPC); null without --checkpoint-dir.
  checkpoint::Checkpointer* checkpointer = nullptr;
  // True while the server restores a checkpoint at start: every call is UNAVAILABLE.
  const std::atomic<bool>* restoring = nullptr;
  // Who may call what (server/auth/authorizer.h); it admits anyone when authentication is off.
  const Authorizer* authorizer;
  // ServerOptions::testing_before_push_join, or null.
  const std::function<void()>* testing_before_push_join = nullptr;
  ServiceLimits limits;

  IngestServices ingest() const { return {engine, staging, metrics, assemblies}; }

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

  // The staging one pull or registration may hold at a time: the configured window, but never
  // more than a quarter of the pool, so that a few slow readers cannot starve pushes.
  uint64_t window_bytes() const {
    return std::max<uint64_t>(64, std::min(limits.window_bytes, staging->capacity() / 4));
  }
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_SERVICE_SERVICE_CONTEXT_H_
