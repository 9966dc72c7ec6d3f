// service.h: the gRPC ParameterService (proto/fusedps/v1) over a ShardStore and UpdateEngine.
//
// This is the one place where absl::Status becomes grpc::Status (same code, same message) and
// where proto messages become the store's types. Every RPC checks its input first; a call that
// fails leaves the shard unchanged. Pushes and pulls are counted in Metrics by the status code
// they end with, in one place each (PushGradients, PullParameters).
#ifndef FUSEDPS_SERVER_SERVICE_SERVICE_H_
#define FUSEDPS_SERVER_SERVICE_SERVICE_H_

#include <string>

#include "fusedps/v1/parameter_service.grpc.pb.h"
#include "server/metrics/metrics.h"
#include "server/service/push_reactor.h"
#include "server/store/shard_store.h"
#include "server/ingest/staging_pool.h"
#include "server/engine/update_engine.h"

namespace fusedps {

// PushGradients runs on gRPC's callback API (no gRPC thread waits for the device) as a raw
// method, so that chunk payloads are copied once, from gRPC's buffer into staging; the other
// RPCs are synchronous.
class ParameterServiceImpl final
    : public v1::ParameterService::WithRawCallbackMethod_PushGradients<
          v1::ParameterService::Service> {
 public:
  // REQUIRES: store, engine and metrics outlive the service.
  // Pushes and registrations reserve their staging in `staging` before reading their chunks.
  // A push in parts fails when its parts have not all arrived within push_part_wait.
  ParameterServiceImpl(ShardStore* store, UpdateEngine* engine, Metrics* metrics,
                       StagingPool* staging, uint64_t max_message_bytes,
                       absl::Duration push_part_wait);

  grpc::Status RegisterParamGroup(grpc::ServerContext* context,
                                  const v1::RegisterParamGroupRequest* request,
                                  v1::RegisterParamGroupResponse* response) override;
  grpc::Status RegisterTensors(grpc::ServerContext* context,
                               grpc::ServerReader<v1::RegisterTensorsRequest>* reader,
                               v1::RegisterTensorsResponse* response) override;
  grpc::ServerReadReactor<grpc::ByteBuffer>* PushGradients(
      grpc::CallbackServerContext* context, grpc::ByteBuffer* response) override;
  grpc::Status PullParameters(grpc::ServerContext* context,
                              const v1::PullParametersRequest* request,
                              grpc::ServerWriter<v1::PullParametersResponse>* writer) override;
  grpc::Status GetInfo(grpc::ServerContext* context, const v1::GetInfoRequest* request,
                       v1::GetInfoResponse* response) override;
  grpc::Status ListTensors(grpc::ServerContext* context, const v1::ListTensorsRequest* request,
                           v1::ListTensorsResponse* response) override;
  grpc::Status SetHyperparameters(grpc::ServerContext* context,
                                  const v1::SetHyperparametersRequest* request,
                                  v1::SetHyperparametersResponse* response) override;

 private:
  // The RPCs' work; the public methods above record what these did in metrics_.
  grpc::Status Pull(grpc::ServerContext* context, const v1::PullParametersRequest* request,
                    grpc::ServerWriter<v1::PullParametersResponse>* writer, uint64_t* bytes_sent);

  ShardStore* const store_;
  UpdateEngine* const engine_;
  Metrics* const metrics_;
  StagingPool* const staging_;
  PushAssemblies assemblies_;  // Pushes that travel in parts, while they are assembled.
  const uint64_t max_message_bytes_;
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_SERVICE_SERVICE_H_
