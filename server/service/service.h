// service.h: the gRPC ParameterService (proto/fusedps/v1) over one shard's UpdateEngine.
//
// Each RPC checks its input, converts the wire types into the server's (service/convert.h: the
// one place absl::Status becomes grpc::Status, same code and message), and hands the work to
// ingest/ and the engine. A call that fails leaves the shard unchanged. Once the shard has
// faulted (engine/shard_fault.h) every RPC fails with UNAVAILABLE.
//
// Which thread does what:
//   - PushGradients (raw) and PullParameters run on gRPC's callback API (push_reactor.h,
//     pull_reactor.h): no gRPC thread waits for staging or for the device.
//   - Every call about a shard first finds its model (models/model_registry.h; the request's
//     `model`, empty for "default") and holds it until it is done.
//   - GetInfo and ListTensors read the engine's view and progress: they never wait for a job or
//     a kernel. They are synchronous, on gRPC's sync thread pool, so that they do not queue
//     behind the pushes and pulls that the callback threads are busy copying.
//   - RegisterParamGroup, SetHyperparameters, RegisterTensors and LoadState are synchronous:
//     they wait for their engine jobs (which do not wait for queued steps' kernels, except a
//     registration's writes and a load's) on gRPC's sync thread pool.
#ifndef FUSEDPS_SERVER_SERVICE_SERVICE_H_
#define FUSEDPS_SERVER_SERVICE_SERVICE_H_

#include "fusedps/v1/parameter_service.grpc.pb.h"
#include "server/service/service_context.h"

namespace fusedps {

// Pushes and pulls are raw (grpc::ByteBuffer): a push is read from gRPC's slices straight into
// staging, and a pull's chunks are gRPC slices of the staging that holds them (no copies).
// OpenWorkspace is a callback too: its call stays open as long as the workspace, on no thread.
using ParameterServiceBase = v1::ParameterService::WithRawCallbackMethod_PushGradients<
    v1::ParameterService::WithRawCallbackMethod_PullParameters<
        v1::ParameterService::WithCallbackMethod_OpenWorkspace<v1::ParameterService::Service>>>;

class ParameterServiceImpl final : public ParameterServiceBase {
 public:
  explicit ParameterServiceImpl(const ServiceContext& services) : services_(services) {}

  grpc::Status RegisterParamGroup(grpc::ServerContext* context,
                                  const v1::RegisterParamGroupRequest* request,
                                  v1::RegisterParamGroupResponse* response) override;
  grpc::Status RegisterTensors(grpc::ServerContext* context,
                               grpc::ServerReader<v1::RegisterTensorsRequest>* reader,
                               v1::RegisterTensorsResponse* response) override;
  grpc::ServerReadReactor<grpc::ByteBuffer>* PushGradients(grpc::CallbackServerContext* context,
                                                           grpc::ByteBuffer* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* PullParameters(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) override;
  grpc::Status GetInfo(grpc::ServerContext* context, const v1::GetInfoRequest* request,
                       v1::GetInfoResponse* response) override;
  // Rows of an embedding table by key (lookup_rows.cc): one engine job in stream order, on
  // gRPC's sync thread pool (it waits for the read), then messages of max_chunk_bytes of rows.
  grpc::Status LookupRows(grpc::ServerContext* context, const v1::LookupRowsRequest* request,
                          grpc::ServerWriter<v1::LookupRowsResponse>* writer) override;
  // Blocks this handler's thread until the checkpoint is durable (Checkpointer::CheckpointNow).
  grpc::Status Checkpoint(grpc::ServerContext* context, const v1::CheckpointRequest* request,
                          v1::CheckpointResponse* response) override;
  // Pages of at most page_size tensors (0: as many as fit in a reply message); the page token
  // is opaque ("t" and the next tensor's index). INVALID_ARGUMENT for a bad page_token.
  grpc::Status ListTensors(grpc::ServerContext* context, const v1::ListTensorsRequest* request,
                           v1::ListTensorsResponse* response) override;
  grpc::Status SetHyperparameters(grpc::ServerContext* context,
                                  const v1::SetHyperparametersRequest* request,
                                  v1::SetHyperparametersResponse* response) override;
  // Holds the whole load in staging until it is checked, then has the engine apply it
  // (ingest/state_loader.h).
  grpc::Status LoadState(grpc::ServerContext* context,
                         grpc::ServerReader<v1::LoadStateRequest>* reader,
                         v1::LoadStateResponse* response) override;
  // The model's buffers (store/buffer_set.h): a write waits for its engine job (which waits
  // for no kernel); a pull reads the engine's current set.
  grpc::Status WriteBuffers(grpc::ServerContext* context, const v1::WriteBuffersRequest* request,
                            v1::WriteBuffersResponse* response) override;
  grpc::Status PullBuffers(grpc::ServerContext* context, const v1::PullBuffersRequest* request,
                           grpc::ServerWriter<v1::PullBuffersResponse>* writer) override;
  // Models (models/model_registry.h). Create and delete block their handler's thread for the
  // model's files (and a delete, for the calls that still hold the model, up to the call's
  // deadline, or 10 s without one).
  grpc::Status CreateModel(grpc::ServerContext* context, const v1::CreateModelRequest* request,
                           v1::CreateModelResponse* response) override;
  grpc::Status ListModels(grpc::ServerContext* context, const v1::ListModelsRequest* request,
                          v1::ListModelsResponse* response) override;
  grpc::Status DeleteModel(grpc::ServerContext* context, const v1::DeleteModelRequest* request,
                           v1::DeleteModelResponse* response) override;
  // A same-host workspace, held while the call is open (workspace_reactor.h).
  grpc::ServerWriteReactor<v1::OpenWorkspaceResponse>* OpenWorkspace(
      grpc::CallbackServerContext* context, const v1::OpenWorkspaceRequest* request) override;

 private:
  absl::Status RegisterTensorsStatus(grpc::ServerContext* context,
                                     grpc::ServerReader<v1::RegisterTensorsRequest>* reader,
                                     v1::RegisterTensorsResponse* response);
  absl::Status LoadStateStatus(grpc::ServerContext* context,
                               grpc::ServerReader<v1::LoadStateRequest>* reader,
                               v1::LoadStateResponse* response);

  const ServiceContext services_;
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_SERVICE_SERVICE_H_
