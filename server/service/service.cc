#include "server/service/service.h"

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "server/checkpoint/checkpointer.h"
#include "common/logging.h"
#include "server/ingest/registration.h"
#include "server/ingest/state_loader.h"
#include "server/service/convert.h"
#include "server/service/pull_reactor.h"
#include "server/service/push_reactor.h"

#ifndef FUSEDPS_VERSION
#define FUSEDPS_VERSION "dev"
#endif

namespace fusedps {
namespace {

// Room left in a reply message for its framing.
constexpr uint64_t kReplyMarginBytes = 64 << 10;

// Reads a client stream whose first message, and only that one, carries the header
// (RegisterTensors, LoadState): `first` takes the first message, `more` each later one. A
// client that stops sending is cancelled after the idle limit (Read then returns false).
// `header_holds` says what the header holds, for the error of a stream without one.
template <typename Request>
absl::Status ReadHeaderedStream(grpc::ServerContext* context, grpc::ServerReader<Request>* reader,
                                CallWatchdog* watchdog, absl::string_view header_holds,
                                const std::function<absl::Status(const Request&)>& first,
                                const std::function<absl::Status(const Request&)>& more) {
  std::shared_ptr<CallWatchdog::Handle> watch =
      watchdog->Watch([context] { context->TryCancel(); });
  struct StopWatch {
    CallWatchdog::Handle* watch;
    ~StopWatch() { watch->Stop(); }
  } stop_watch{watch.get()};

  Request message;
  watch->Arm();
  if (!reader->Read(&message) || !message.has_header()) {
    if (context->IsCancelled()) return absl::CancelledError("cancelled");
    return absl::InvalidArgumentError(absl::StrCat(
        "the first ", Request::descriptor()->name(), " must carry header (", header_holds, ")"));
  }
  watch->Disarm();
  if (absl::Status s = first(message); !s.ok()) return s;
  for (;;) {
    message.Clear();
    watch->Arm();
    const bool read = reader->Read(&message);
    watch->Disarm();
    if (!read) break;
    if (message.has_header()) {
      return absl::InvalidArgumentError("header may appear only in the first message");
    }
    if (absl::Status s = more(message); !s.ok()) return s;
  }
  if (context->IsCancelled()) return absl::CancelledError("cancelled");
  return absl::OkStatus();
}

}  // namespace

grpc::Status ParameterServiceImpl::RegisterParamGroup(
    grpc::ServerContext* context, const v1::RegisterParamGroupRequest* request,
    v1::RegisterParamGroupResponse* response) {
  if (absl::Status s = services_.Admit(*context, Rpc::kRegisterParamGroup); !s.ok()) {
    return ToGrpc(s);
  }
  absl::StatusOr<AdamWHyperparameters> h =
      HyperparametersFromProto(request->param_group().hyperparameters());
  if (!h.ok()) return ToGrpc(h.status());
  const ParamGroupSpec group{request->param_group().name(), *h};
  absl::StatusOr<bool> created = UpdateEngine::Wait<bool>(
      [&](UpdateEngine::Done<bool> done) { services_.engine->RegisterParamGroup(group, done); });
  if (!created.ok()) return ToGrpc(created.status());
  response->set_created(*created);
  ToProto(group, response->mutable_param_group());
  return grpc::Status::OK;
}

grpc::Status ParameterServiceImpl::SetHyperparameters(
    grpc::ServerContext* context, const v1::SetHyperparametersRequest* request,
    v1::SetHyperparametersResponse* response) {
  if (absl::Status s = services_.Admit(*context, Rpc::kSetHyperparameters); !s.ok()) {
    return ToGrpc(s);
  }
  absl::StatusOr<HyperparameterUpdate> update = UpdateFromProto(request->hyperparameters());
  if (!update.ok()) return ToGrpc(update.status());
  absl::StatusOr<ParamGroupSpec> group = UpdateEngine::Wait<ParamGroupSpec>(
      [&](UpdateEngine::Done<ParamGroupSpec> done) {
        services_.engine->SetHyperparameters(request->param_group(), *update, done);
      });
  if (!group.ok()) return ToGrpc(group.status());
  ToProto(*group, response->mutable_param_group());
  return grpc::Status::OK;
}

grpc::Status ParameterServiceImpl::RegisterTensors(
    grpc::ServerContext* context, grpc::ServerReader<v1::RegisterTensorsRequest>* reader,
    v1::RegisterTensorsResponse* response) {
  const absl::Status status = RegisterTensorsStatus(context, reader, response);
  if (!status.ok() && !absl::IsCancelled(status)) {
    FUSEDPS_LOG_EVERY_SECONDS(WARNING, 1)
        << "registration from " << context->peer() << " failed: " << status;
  }
  return ToGrpc(status);
}

absl::Status ParameterServiceImpl::RegisterTensorsStatus(
    grpc::ServerContext* context, grpc::ServerReader<v1::RegisterTensorsRequest>* reader,
    v1::RegisterTensorsResponse* response) {
  if (absl::Status s = services_.Admit(*context, Rpc::kRegisterTensors); !s.ok()) return s;
  const auto cancelled = [context] { return context->IsCancelled(); };
  std::unique_ptr<Registration> registration;
  const auto first = [&](const v1::RegisterTensorsRequest& message) {
    std::vector<TensorSpec> specs;
    for (const v1::TensorSpec& p : message.header().tensors()) {
      specs.push_back({p.name(), {p.shape().begin(), p.shape().end()}, p.param_group()});
    }
    absl::StatusOr<std::unique_ptr<Registration>> begun =
        Registration::Begin(services_.engine, services_.staging, services_.registration_gate,
                            specs, services_.window_bytes(), cancelled,
                            message.header().plan_hash());
    if (!begun.ok()) return begun.status();
    registration = *std::move(begun);
    return registration->AddChunks(message.chunks());
  };
  const auto more = [&](const v1::RegisterTensorsRequest& message) {
    return registration->AddChunks(message.chunks());
  };
  if (absl::Status s = ReadHeaderedStream<v1::RegisterTensorsRequest>(
          context, reader, services_.watchdog, "the tensor specs", first, more);
      !s.ok()) {
    return s;
  }
  absl::StatusOr<RegistrationOutcome> outcome = registration->Commit();
  if (!outcome.ok()) return outcome.status();
  response->set_tensors_created(outcome->created);
  response->set_tensors_existing(outcome->existing);
  response->set_version(outcome->version);
  return absl::OkStatus();
}

grpc::Status ParameterServiceImpl::LoadState(grpc::ServerContext* context,
                                             grpc::ServerReader<v1::LoadStateRequest>* reader,
                                             v1::LoadStateResponse* response) {
  const absl::Status status = LoadStateStatus(context, reader, response);
  if (!status.ok() && !absl::IsCancelled(status)) {
    FUSEDPS_LOG_EVERY_SECONDS(WARNING, 1)
        << "state load from " << context->peer() << " failed: " << status;
  }
  return ToGrpc(status);
}

absl::Status ParameterServiceImpl::LoadStateStatus(grpc::ServerContext* context,
                                                   grpc::ServerReader<v1::LoadStateRequest>* reader,
                                                   v1::LoadStateResponse* response) {
  if (absl::Status s = services_.Admit(*context, Rpc::kLoadState); !s.ok()) return s;
  const auto cancelled = [context] { return context->IsCancelled(); };
  std::unique_ptr<StateLoader> loader;
  const auto first = [&](const v1::LoadStateRequest& message) {
    absl::StatusOr<std::unique_ptr<StateLoader>> begun =
        StateLoader::Begin(services_.engine, services_.staging, message.header(), cancelled);
    if (!begun.ok()) return begun.status();
    loader = *std::move(begun);
    return loader->AddChunks(message.chunks());
  };
  const auto more = [&](const v1::LoadStateRequest& message) {
    return loader->AddChunks(message.chunks());
  };
  if (absl::Status s = ReadHeaderedStream<v1::LoadStateRequest>(
          context, reader, services_.watchdog, "the tensors to load", first, more);
      !s.ok()) {
    return s;
  }
  absl::StatusOr<uint64_t> version = loader->Commit();
  if (!version.ok()) return version.status();
  response->set_version(*version);
  response->set_tensors_loaded(loader->tensors_loaded());
  return absl::OkStatus();
}

grpc::ServerReadReactor<grpc::ByteBuffer>* ParameterServiceImpl::PushGradients(
    grpc::CallbackServerContext* context, grpc::ByteBuffer* response) {
  return NewPushReactor(context, response, services_);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* ParameterServiceImpl::PullParameters(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  return NewPullReactor(context, request, services_);
}

grpc::Status ParameterServiceImpl::GetInfo(grpc::ServerContext* context,
                                           const v1::GetInfoRequest*,
                                           v1::GetInfoResponse* response) {
  if (absl::Status s = services_.Admit(*context, Rpc::kGetInfo); !s.ok()) return ToGrpc(s);
  std::shared_ptr<const ShardView> view = services_.engine->view();
  response->set_version(services_.engine->version());
  response->set_backend(services_.engine->backend_name());
  response->set_device(services_.engine->device());
  response->set_tensor_count(view->tensor_count());
  response->set_parameter_count(view->parameter_count());
  for (const ParamGroupSpec& g : view->groups()) ToProto(g, response->add_param_groups());
  response->set_server_version(FUSEDPS_VERSION);
  response->set_max_message_bytes(services_.limits.max_message_bytes);
  response->set_param_copy_dtype(static_cast<v1::DType>(services_.engine->param_copy_dtype()));
  const ConsistencyOptions& c = services_.engine->consistency();
  v1::Consistency* consistency = response->mutable_consistency();
  consistency->set_mode(static_cast<v1::ConsistencyMode>(c.mode));
  if (c.mode == ConsistencyMode::kSync) {
    consistency->set_replicas_to_aggregate(c.replicas_to_aggregate);
    consistency->set_total_replicas(c.total_replicas);
    consistency->set_round_timeout_seconds(absl::ToDoubleSeconds(c.round_timeout));
  }
  if (c.mode == ConsistencyMode::kBounded) {
    consistency->set_max_staleness(c.max_staleness);
    consistency->set_staleness_lr_scaling(c.staleness_lr_scaling);
  }
  response->set_plan_hash(view->plan_hash());
  return grpc::Status::OK;
}

grpc::Status ParameterServiceImpl::Checkpoint(grpc::ServerContext* context,
                                              const v1::CheckpointRequest*,
                                              v1::CheckpointResponse* response) {
  if (absl::Status s = services_.Admit(*context, Rpc::kCheckpoint); !s.ok()) return ToGrpc(s);
  if (services_.checkpointer == nullptr) {
    return ToGrpc(absl::FailedPreconditionError(
        "the server has no --checkpoint-dir, so it cannot write a checkpoint"));
  }
  absl::StatusOr<checkpoint::CheckpointResult> result = services_.checkpointer->CheckpointNow();
  if (!result.ok()) return ToGrpc(result.status());
  response->set_version(result->version);
  response->set_path(result->path);
  return grpc::Status::OK;
}

grpc::Status ParameterServiceImpl::ListTensors(grpc::ServerContext* context,
                                               const v1::ListTensorsRequest* request,
                                               v1::ListTensorsResponse* response) {
  if (absl::Status s = services_.Admit(*context, Rpc::kListTensors); !s.ok()) return ToGrpc(s);
  std::shared_ptr<const ShardView> view = services_.engine->view();
  uint32_t first = 0;
  if (!request->page_token().empty()) {
    absl::string_view token = request->page_token();
    if (!absl::ConsumePrefix(&token, "t") || !absl::SimpleAtoi(token, &first) ||
        first > view->tensor_count()) {
      return ToGrpc(absl::InvalidArgumentError(absl::StrCat(
          "page_token ", QuoteName(request->page_token()),
          " is not a next_page_token of this server")));
    }
  }
  const uint32_t page_size = request->page_size() == 0 ? view->tensor_count()
                                                       : request->page_size();
  const uint32_t end = first + std::min(page_size, view->tensor_count() - first);
  std::vector<uint32_t> indices;
  for (uint32_t t = first; t < end; ++t) indices.push_back(t);
  std::vector<int64_t> steps;
  response->set_version(services_.engine->Steps(indices, &steps));
  const uint64_t budget = services_.limits.max_message_bytes - kReplyMarginBytes;
  uint64_t bytes = 0;
  uint32_t next = first;
  for (size_t i = 0; i < indices.size(); ++i) {
    v1::TensorInfo info;
    ToProto(*view, indices[i], steps[i], &info);
    bytes += info.ByteSizeLong() + 8;
    if (bytes > budget && i > 0) break;  // The rest on the next page.
    *response->add_tensors() = std::move(info);
    next = indices[i] + 1;
  }
  if (next < view->tensor_count()) response->set_next_page_token(absl::StrCat("t", next));
  return grpc::Status::OK;
}

}  // namespace fusedps
