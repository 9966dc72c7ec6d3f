// The Client's calls about the server and its models rather than tensor data
// (fusedps/client.h): CheckHealth, GetInfo, CreateModel, ListModels, DeleteModel, ListTensors,
// SetHyperparameters and Checkpoint, each a unary call (ListTensors one per page).
#include <future>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/channel.h"
#include "client/connection.h"
#include "client/wire.h"
#include "common/tsan.h"
#include "fusedps/client.h"
#include "fusedps/v1/parameter_service.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

namespace fusedps::client {

using internal::ConfigureContext;
using internal::ToAbslStatus;

absl::StatusOr<bool> Client::CheckHealth(const std::string& service) {
  // grpc.health.v1 has no C++ stubs in Debian's packages: call it through the generic stub.
  // HealthCheckRequest is {string service = 1}; HealthCheckResponse is {ServingStatus status
  // = 1}, and SERVING is 1. Service names stay short (under 128 bytes, one length byte).
  if (service.size() >= 128) return absl::InvalidArgumentError("service name over 127 bytes");
  std::string request_bytes;
  if (!service.empty()) {
    request_bytes = std::string(1, '\x0a') + static_cast<char>(service.size()) + service;
  }
  grpc::Slice slice(request_bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::ClientContext context;
  ConfigureContext(options_, &context);
  std::promise<grpc::Status> done;
  grpc::GenericStub stub(connection(0).channel);
  // libgrpc runs the callback on its own thread: common/tsan.h says why TSan needs the edges.
  FUSEDPS_HAPPENS_BEFORE(&done);
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&done, &response](grpc::Status s) {
                   FUSEDPS_HAPPENS_AFTER(&done);
                   FUSEDPS_HAPPENS_BEFORE(&response);  // gRPC filled it before calling this.
                   done.set_value(std::move(s));
                 });
  const grpc::Status status = done.get_future().get();
  FUSEDPS_HAPPENS_AFTER(&response);
  if (!status.ok()) return internal::ToAbslStatus(status);
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (response.Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices)
      bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return bytes == std::string("\x08\x01", 2);
}

absl::StatusOr<ServerInfo> Client::GetInfo() {
  v1::GetInfoRequest request;
  request.set_model(options_.model);
  v1::GetInfoResponse response;
  grpc::ClientContext context;
  ConfigureContext(options_, &context);
  absl::Status status = ToAbslStatus(connection(0).stub->GetInfo(&context, request, &response));
  if (!status.ok()) return status;
  ServerInfo info;
  info.version = response.version();
  info.backend = response.backend();
  info.device = response.device();
  info.tensor_count = response.tensor_count();
  info.parameter_count = response.parameter_count();
  for (const v1::ParamGroup& group : response.param_groups()) {
    info.param_groups.push_back(internal::FromProtoParamGroup(group));
  }
  info.server_version = response.server_version();
  info.max_message_bytes = response.max_message_bytes();
  if (absl::StatusOr<DType> dtype = internal::FromProtoDType(response.param_copy_dtype());
      dtype.ok()) {
    info.param_copy_dtype = *dtype;
  }
  info.consistency = internal::FromProtoConsistency(response.consistency());
  info.plan_hash = response.plan_hash();
  info.model = response.model();
  info.memory_bytes = response.memory_bytes();
  info.server_memory_bytes = response.server_memory_bytes();
  info.model_count = response.model_count();
  return info;
}

absl::StatusOr<CreateModelResult> Client::CreateModel(const std::string& name,
                                                      const Consistency& consistency) {
  v1::CreateModelRequest request;
  request.set_name(name);
  if (!consistency.mode.empty()) {
    absl::StatusOr<v1::Consistency> c = internal::ToProtoConsistency(consistency);
    if (!c.ok()) return c.status();
    *request.mutable_consistency() = *std::move(c);
  }
  v1::CreateModelResponse response;
  grpc::ClientContext context;
  ConfigureContext(options_, &context);
  absl::Status status = ToAbslStatus(connection(0).stub->CreateModel(&context, request, &response));
  if (!status.ok()) return status;
  return CreateModelResult{response.created(), internal::FromProtoModel(response.model())};
}

absl::StatusOr<std::vector<ModelInfo>> Client::ListModels() {
  v1::ListModelsResponse response;
  grpc::ClientContext context;
  ConfigureContext(options_, &context);
  absl::Status status =
      ToAbslStatus(connection(0).stub->ListModels(&context, v1::ListModelsRequest(), &response));
  if (!status.ok()) return status;
  std::vector<ModelInfo> models;
  for (const v1::ModelInfo& m : response.models()) models.push_back(internal::FromProtoModel(m));
  return models;
}

absl::StatusOr<DeleteModelResult> Client::DeleteModel(const std::string& name) {
  v1::DeleteModelRequest request;
  request.set_name(name);
  v1::DeleteModelResponse response;
  grpc::ClientContext context;
  ConfigureContext(options_, &context);
  absl::Status status = ToAbslStatus(connection(0).stub->DeleteModel(&context, request, &response));
  if (!status.ok()) return status;
  return DeleteModelResult{response.freed_bytes(), response.memory_freed()};
}

absl::StatusOr<TensorList> Client::ListTensors() {
  TensorList list;
  v1::ListTensorsRequest request;  // page_size 0: as many as fit in one reply.
  request.set_model(options_.model);
  for (bool first = true;; first = false) {
    v1::ListTensorsResponse response;
    grpc::ClientContext context;
    ConfigureContext(options_, &context);
    absl::Status status =
        ToAbslStatus(connection(0).stub->ListTensors(&context, request, &response));
    if (!status.ok()) return status;
    if (first) list.version = response.version();
    for (const v1::TensorInfo& info : response.tensors()) {
      list.tensors.push_back(internal::FromProtoTensorInfo(info));
    }
    if (response.next_page_token().empty()) return list;
    if (response.next_page_token() == request.page_token()) {
      return absl::InternalError(absl::StrCat("ListTensors reply repeats its page token after ",
                                              list.tensors.size(), " tensors"));
    }
    request.set_page_token(response.next_page_token());
  }
}

absl::StatusOr<ParamGroup> Client::SetHyperparameters(const std::string& param_group,
                                                      const ParamGroupOptions& changes) {
  v1::SetHyperparametersRequest request;
  request.set_model(options_.model);
  request.set_param_group(param_group);
  *request.mutable_hyperparameters() = internal::ToProtoHyperparameters(changes);
  v1::SetHyperparametersResponse response;
  grpc::ClientContext context;
  ConfigureContext(options_, &context);
  absl::Status status =
      ToAbslStatus(connection(0).stub->SetHyperparameters(&context, request, &response));
  if (!status.ok()) return status;
  return internal::FromProtoParamGroup(response.param_group());
}

absl::StatusOr<Client::CheckpointWritten> Client::Checkpoint(absl::Duration timeout) {
  v1::CheckpointResponse response;
  grpc::ClientContext context;
  internal::ConfigureCall(options_, &context);
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  v1::CheckpointRequest request;
  request.set_model(options_.model);
  absl::Status status = ToAbslStatus(connection(0).stub->Checkpoint(&context, request, &response));
  if (!status.ok()) return status;
  return CheckpointWritten{response.version(), response.path()};
}

}  // namespace fusedps::client
