#include "server/service/service.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/logging.h"
#include "server/checkpoint/checkpointer.h"
#include "server/ingest/registration.h"
#include "server/ingest/state_loader.h"
#include "server/service/convert.h"
#include "server/service/pull_reactor.h"
#include "server/service/push_reactor.h"
#include "server/service/workspace_reactor.h"

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
    return absl::InvalidArgumentError(absl::StrCat("the first ", Request::descriptor()->name(),
                                                   " must carry header (", header_holds, ")"));
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

grpc::Status ParameterServiceImpl::RegisterParamGroup(grpc::ServerContext* context,
                                                      const v1::RegisterParamGroupRequest* request,
                                                      v1::RegisterParamGroupResponse* response) {
  absl::StatusOr<std::shared_ptr<Model>> model =
      services_.AdmitModel(*context, Rpc::kRegisterParamGroup, request->model());
  if (!model.ok()) return ToGrpc(model.status());
  absl::StatusOr<AdamWHyperparameters> h =
      HyperparametersFromProto(request->param_group().hyperparameters());
  if (!h.ok()) return ToGrpc(h.status());
  const ParamGroupSpec group{request->param_group().name(), *h};
  absl::StatusOr<bool> created = UpdateEngine::Wait<bool>(
      [&](UpdateEngine::Done<bool> done) { (*model)->engine().RegisterParamGroup(group, done); });
  if (!created.ok()) return ToGrpc(created.status());
  response->set_created(*created);
  ToProto(group, response->mutable_param_group());
  return grpc::Status::OK;
}

grpc::Status ParameterServiceImpl::SetHyperparameters(grpc::ServerContext* context,
                                                      const v1::SetHyperparametersRequest* request,
                                                      v1::SetHyperparametersResponse* response) {
  absl::StatusOr<std::shared_ptr<Model>> model =
      services_.AdmitModel(*context, Rpc::kSetHyperparameters, request->model());
  if (!model.ok()) return ToGrpc(model.status());
  absl::StatusOr<ParamGroupSpec> group =
      UpdateEngine::Wait<ParamGroupSpec>([&](UpdateEngine::Done<ParamGroupSpec> done) {
        (*model)->engine().SetHyperparameters(request->param_group(), request->hyperparameters(),
                                              done);
      });
  if (!group.ok()) return ToGrpc(group.status());
  ToProto(*group, response->mutable_param_group());
  return grpc::Status::OK;
}

grpc::Status ParameterServiceImpl::WriteBuffers(grpc::ServerContext* context,
                                                const v1::WriteBuffersRequest* request,
                                                v1::WriteBuffersResponse* response) {
  absl::StatusOr<std::shared_ptr<Model>> model =
      services_.AdmitModel(*context, Rpc::kWriteBuffers, request->model());
  if (!model.ok()) return ToGrpc(model.status());
  std::vector<BufferValue> writes;
  for (const v1::Buffer& b : request->buffers()) {
    absl::StatusOr<BufferValue> buffer = BufferFromProto(b);
    if (!buffer.ok()) return ToGrpc(buffer.status());
    writes.push_back(*std::move(buffer));
  }
  UpdateEngine& engine = (*model)->engine();
  absl::StatusOr<uint64_t> version = UpdateEngine::Wait<uint64_t>(
      [&](UpdateEngine::Done<uint64_t> done) { engine.WriteBuffers(std::move(writes), done); });
  if (!version.ok()) return ToGrpc(version.status());
  response->set_version(*version);
  response->set_buffer_count(static_cast<uint32_t>(engine.buffers()->size()));
  return grpc::Status::OK;
}

grpc::Status ParameterServiceImpl::PullBuffers(
    grpc::ServerContext* context, const v1::PullBuffersRequest* request,
    grpc::ServerWriter<v1::PullBuffersResponse>* writer) {
  absl::StatusOr<std::shared_ptr<Model>> model =
      services_.AdmitModel(*context, Rpc::kPullBuffers, request->model());
  if (!model.ok()) return ToGrpc(model.status());
  const std::shared_ptr<const BufferSet> set = (*model)->engine().buffers();
  std::vector<const BufferValue*> buffers;
  for (const std::string& name : request->names()) {
    const BufferValue* b = set->Find(name);
    if (b == nullptr) {
      return ToGrpc(
          absl::NotFoundError(absl::StrCat("buffer ", QuoteName(name), ": model ",
                                           QuoteName((*model)->name()), " has no such buffer")));
    }
    buffers.push_back(b);
  }
  if (request->names().empty()) {
    for (const auto& [name, b] : set->buffers()) buffers.push_back(b.get());
  }
  for (const BufferValue* b : buffers) {
    v1::PullBuffersResponse message;
    ToProto(*b, message.mutable_buffer());
    if (!writer->Write(message)) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
  }
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
  Caller caller;
  if (absl::Status s = services_.Admit(*context, Rpc::kRegisterTensors, &caller); !s.ok()) {
    return s;
  }
  const auto cancelled = [context] { return context->IsCancelled(); };
  std::shared_ptr<Model> model;
  std::unique_ptr<Registration> registration;
  const auto first = [&](const v1::RegisterTensorsRequest& message) {
    absl::StatusOr<std::shared_ptr<Model>> found =
        services_.FindModel(caller, message.header().model(), *context);
    if (!found.ok()) return found.status();
    model = *std::move(found);
    std::vector<TensorSpec> specs;
    for (const v1::TensorSpec& p : message.header().tensors()) {
      specs.push_back(
          {p.name(), {p.shape().begin(), p.shape().end()}, p.param_group(), p.has_table()});
      if (p.has_table() && p.table().hashed()) {
        specs.back().hashed =
            HashedKeys{p.table().seed(), static_cast<float>(p.table().init_std())};
      }
    }
    absl::StatusOr<std::unique_ptr<Registration>> begun =
        Registration::Begin(&model->engine(), services_.staging, &model->registration_gate(), specs,
                            services_.window_bytes(), cancelled, message.header().plan_hash());
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
  if (model->deleted()) return model->DeletedError();
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
  Caller caller;
  if (absl::Status s = services_.Admit(*context, Rpc::kLoadState, &caller); !s.ok()) return s;
  const auto cancelled = [context] { return context->IsCancelled(); };
  std::shared_ptr<Model> model;
  std::unique_ptr<StateLoader> loader;
  const auto first = [&](const v1::LoadStateRequest& message) {
    absl::StatusOr<std::shared_ptr<Model>> found =
        services_.FindModel(caller, message.header().model(), *context);
    if (!found.ok()) return found.status();
    model = *std::move(found);
    absl::StatusOr<std::unique_ptr<StateLoader>> begun =
        StateLoader::Begin(&model->engine(), services_.staging, message.header(), cancelled);
    if (!begun.ok()) return begun.status();
    loader = *std::move(begun);
    return loader->AddChunks(message.chunks());
  };
  const auto more = [&](const v1::LoadStateRequest& message) {
    return loader->AddChunks(message.chunks());
  };
  if (absl::Status s = ReadHeaderedStream<v1::LoadStateRequest>(context, reader, services_.watchdog,
                                                                "the tensors to load", first, more);
      !s.ok()) {
    return s;
  }
  if (model->deleted()) return model->DeletedError();
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
                                           const v1::GetInfoRequest* request,
                                           v1::GetInfoResponse* response) {
  absl::StatusOr<std::shared_ptr<Model>> found =
      services_.AdmitModel(*context, Rpc::kGetInfo, request->model());
  if (!found.ok()) return ToGrpc(found.status());
  const Model& model = **found;
  const UpdateEngine& engine = model.engine();
  std::shared_ptr<const ShardView> view = engine.view();
  response->set_version(engine.version());
  response->set_backend(engine.backend_name());
  response->set_device(engine.device());
  response->set_tensor_count(view->tensor_count());
  response->set_parameter_count(view->parameter_count());
  for (const ParamGroupSpec& g : view->groups()) ToProto(g, response->add_param_groups());
  response->set_server_version(FUSEDPS_VERSION);
  response->set_max_message_bytes(services_.limits.max_message_bytes);
  response->set_param_copy_dtype(static_cast<v1::DType>(engine.param_copy_dtype()));
  ToProto(engine.consistency(), response->mutable_consistency());
  response->set_plan_hash(view->plan_hash());
  response->set_model(model.name());
  response->set_memory_bytes(model.memory_bytes());
  uint64_t server_bytes = services_.staging_memory_bytes();
  const std::vector<std::shared_ptr<Model>> models = services_.models->List();
  for (const std::shared_ptr<Model>& m : models) server_bytes += m->memory_bytes();
  response->set_server_memory_bytes(server_bytes);
  response->set_model_count(static_cast<uint32_t>(models.size()));
  const std::shared_ptr<const BufferSet> buffers = engine.buffers();
  response->set_buffer_count(static_cast<uint32_t>(buffers->size()));
  response->set_buffer_bytes(buffers->bytes());
  return grpc::Status::OK;
}

grpc::Status ParameterServiceImpl::Checkpoint(grpc::ServerContext* context,
                                              const v1::CheckpointRequest* request,
                                              v1::CheckpointResponse* response) {
  absl::StatusOr<std::shared_ptr<Model>> model =
      services_.AdmitModel(*context, Rpc::kCheckpoint, request->model());
  if (!model.ok()) return ToGrpc(model.status());
  absl::StatusOr<checkpoint::CheckpointResult> result = (*model)->CheckpointNow();
  if (!result.ok()) return ToGrpc(result.status());
  response->set_version(result->version);
  response->set_path(result->path);
  return grpc::Status::OK;
}

grpc::Status ParameterServiceImpl::ListTensors(grpc::ServerContext* context,
                                               const v1::ListTensorsRequest* request,
                                               v1::ListTensorsResponse* response) {
  absl::StatusOr<std::shared_ptr<Model>> model =
      services_.AdmitModel(*context, Rpc::kListTensors, request->model());
  if (!model.ok()) return ToGrpc(model.status());
  std::shared_ptr<const ShardView> view = (*model)->engine().view();
  uint32_t first = 0;
  if (!request->page_token().empty()) {
    absl::string_view token = request->page_token();
    if (!absl::ConsumePrefix(&token, "t") || !absl::SimpleAtoi(token, &first) ||
        first > view->tensor_count()) {
      return ToGrpc(
          absl::InvalidArgumentError(absl::StrCat("page_token ", QuoteName(request->page_token()),
                                                  " is not a next_page_token of this server")));
    }
  }
  const uint32_t page_size =
      request->page_size() == 0 ? view->tensor_count() : request->page_size();
  const uint32_t end = first + std::min(page_size, view->tensor_count() - first);
  std::vector<uint32_t> indices;
  for (uint32_t t = first; t < end; ++t) indices.push_back(t);
  std::vector<int64_t> steps;
  response->set_version((*model)->engine().Steps(indices, &steps));
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

grpc::Status ParameterServiceImpl::CreateModel(grpc::ServerContext* context,
                                               const v1::CreateModelRequest* request,
                                               v1::CreateModelResponse* response) {
  if (absl::Status s = services_.AdmitNamed(*context, Rpc::kCreateModel, request->name());
      !s.ok()) {
    return ToGrpc(s);
  }
  std::optional<ConsistencyOptions> consistency;
  if (request->has_consistency()) {
    absl::StatusOr<ConsistencyOptions> c = ConsistencyFromProto(request->consistency());
    if (!c.ok()) return ToGrpc(c.status());
    consistency = *c;
  }
  absl::StatusOr<ModelRegistry::Created> created =
      services_.models->Create(request->name(), consistency);
  if (!created.ok()) return ToGrpc(created.status());
  response->set_created(created->created);
  ToProto(*created->model, response->mutable_model());
  return grpc::Status::OK;
}

grpc::Status ParameterServiceImpl::ListModels(grpc::ServerContext* context,
                                              const v1::ListModelsRequest*,
                                              v1::ListModelsResponse* response) {
  Caller caller;
  if (absl::Status s = services_.Admit(*context, Rpc::kListModels, &caller); !s.ok()) {
    return ToGrpc(s);
  }
  for (const std::shared_ptr<Model>& model : services_.models->List()) {
    if (caller.MayReach(model->name())) ToProto(*model, response->add_models());
  }
  return grpc::Status::OK;
}

grpc::Status ParameterServiceImpl::DeleteModel(grpc::ServerContext* context,
                                               const v1::DeleteModelRequest* request,
                                               v1::DeleteModelResponse* response) {
  if (absl::Status s = services_.AdmitNamed(*context, Rpc::kDeleteModel, request->name());
      !s.ok()) {
    return ToGrpc(s);
  }
  const absl::Time deadline =
      std::min(absl::FromChrono(context->deadline()), absl::Now() + absl::Seconds(10));
  absl::StatusOr<ModelRegistry::Deleted> deleted =
      services_.models->Delete(request->name(), deadline);
  if (!deleted.ok()) return ToGrpc(deleted.status());
  response->set_freed_bytes(deleted->freed_bytes);
  response->set_memory_freed(deleted->memory_freed);
  return grpc::Status::OK;
}

grpc::ServerWriteReactor<v1::OpenWorkspaceResponse>* ParameterServiceImpl::OpenWorkspace(
    grpc::CallbackServerContext* context, const v1::OpenWorkspaceRequest* request) {
  return NewWorkspaceReactor(context, request, services_);
}

}  // namespace fusedps
