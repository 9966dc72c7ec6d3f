// server.h: a running fusedps server: gRPC ParameterService, health and reflection, over one
// shard, and its Prometheus metrics (served over HTTP when options.metrics_listen is set).
// Used by main.cc and by tests that start servers in-process on port 0.
//
// Usage:
//   ServerOptions options;
//   options.listen = "127.0.0.1:0";
//   absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(options);
//   int port = (*server)->port();
//   (*server)->Shutdown(absl::Seconds(30));
#ifndef FUSEDPS_SERVER_SERVER_H_
#define FUSEDPS_SERVER_SERVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "kernels/backend.h"
#include "server/metrics/metrics.h"
#include "server/service/service.h"
#include "server/store/shard_store.h"
#include "server/engine/update_engine.h"

namespace fusedps {

struct ServerOptions {
  std::string listen = "0.0.0.0:50051";  // Port 0 picks a free port.
  std::string device = "auto";           // auto | cpu | cuda | cuda:N
  BackendOptions backend;
  uint64_t max_message_bytes = 8 << 20;  // gRPC max receive message size.
  // Host staging shared by the pushes and registrations in flight; a call waits for its share
  // (back-pressure), and one that needs more than all of it is RESOURCE_EXHAUSTED.
  uint64_t staging_pool_bytes = uint64_t{2} << 30;
  // A push sent in parts fails (DEADLINE_EXCEEDED) when its parts have not all arrived within
  // this long of its first; the parts that came give their staging back.
  absl::Duration push_part_wait = absl::Seconds(30);
  // HTTP address of /metrics, HOST:PORT (port 0 picks a free port); empty: not served (the
  // metrics are still kept, see Server::metrics()).
  std::string metrics_listen;
};

class Server {
 public:
  // Errors: INVALID_ARGUMENT for a bad option, UNAVAILABLE when the device, the address or the
  // metrics address cannot be had.
  static absl::StatusOr<std::unique_ptr<Server>> Start(const ServerOptions& options);
  ~Server();

  int port() const { return port_; }
  // The bound /metrics port, or 0 when metrics are not served.
  int metrics_port() const { return metrics_->port(); }
  ShardStore& store() { return *store_; }
  Metrics& metrics() { return *metrics_; }
  StagingPool& staging_pool() { return *staging_; }

  // Stops accepting calls, lets calls in flight finish until the deadline (then cancels
  // them), and applies every push already complete. Idempotent.
  void Shutdown(absl::Duration grace);

  // Blocks until Shutdown has finished.
  void Wait();

 private:
  Server() = default;

  std::unique_ptr<ShardStore> store_;
  std::unique_ptr<UpdateEngine> engine_;
  std::unique_ptr<Metrics> metrics_;  // Destroyed (its HTTP endpoint stopped) before store_.
  std::unique_ptr<StagingPool> staging_;
  std::unique_ptr<ParameterServiceImpl> service_;
  std::unique_ptr<grpc::Server> grpc_server_;
  int port_ = 0;
};

// Parses "none", "bf16" or "fp16".
absl::StatusOr<ParamCopyDType> ParseParamCopyDType(absl::string_view name);

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_SERVER_H_
