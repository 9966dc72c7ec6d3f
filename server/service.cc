#include "server/service.h"

#include <algorithm>
#include <optional>
#include <cmath>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/grad_check.h"
#include "server/chunk_assembler.h"

#ifndef FUSEDPS_VERSION
#define FUSEDPS_VERSION "dev"
#endif

namespace fusedps {
namespace {

constexpr uint32_t kDefaultPullChunkBytes = 1 << 20;
constexpr uint32_t kMaxPullChunkBytes = 4 << 20;
constexpr uint32_t kMinPullChunkBytes = 16;
constexpr char kSkipNonFiniteGrad[] = "non_finite_grad";

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

AdamWHyperparameters FromProto(const v1::Hyperparameters& p) {
  AdamWHyperparameters h;  // torch.optim.AdamW's defaults.
  if (p.has_lr()) h.lr = p.lr();
  if (p.has_beta1()) h.beta1 = p.beta1();
  if (p.has_beta2()) h.beta2 = p.beta2();
  if (p.has_eps()) h.eps = p.eps();
  if (p.has_weight_decay()) h.weight_decay = p.weight_decay();
  if (p.has_amsgrad()) h.amsgrad = p.amsgrad();
  if (p.has_maximize()) h.maximize = p.maximize();
  if (p.has_weight_decay_mode()) {
    h.decoupled_weight_decay = p.weight_decay_mode() != v1::WEIGHT_DECAY_MODE_L2;
  }
  return h;
}

HyperparameterUpdate UpdateFromProto(const v1::Hyperparameters& p) {
  HyperparameterUpdate u;
  if (p.has_lr()) u.lr = p.lr();
  if (p.has_beta1()) u.beta1 = p.beta1();
  if (p.has_beta2()) u.beta2 = p.beta2();
  if (p.has_eps()) u.eps = p.eps();
  if (p.has_weight_decay()) u.weight_decay = p.weight_decay();
  if (p.has_amsgrad()) u.amsgrad = p.amsgrad();
  if (p.has_maximize()) u.maximize = p.maximize();
  if (p.has_weight_decay_mode()) {
    u.decoupled_weight_decay = p.weight_decay_mode() != v1::WEIGHT_DECAY_MODE_L2;
  }
  return u;
}

void ToProto(const ParamGroupSpec& g, v1::ParamGroup* p) {
  p->set_name(g.name);
  v1::Hyperparameters* h = p->mutable_hyperparameters();
  const AdamWHyperparameters& a = g.hyperparameters;
  h->set_lr(a.lr);
  h->set_beta1(a.beta1);
  h->set_beta2(a.beta2);
  h->set_eps(a.eps);
  h->set_weight_decay(a.weight_decay);
  h->set_amsgrad(a.amsgrad);
  h->set_maximize(a.maximize);
  h->set_weight_decay_mode(a.decoupled_weight_decay ? v1::WEIGHT_DECAY_MODE_DECOUPLED
                                                    : v1::WEIGHT_DECAY_MODE_L2);
}

void ToProto(const TensorInfo& t, v1::TensorInfo* p) {
  p->set_name(t.spec.name);
  for (int64_t d : t.spec.shape) p->add_shape(d);
  p->set_param_group(t.spec.param_group.empty() ? kDefaultParamGroup : t.spec.param_group);
  p->set_step(t.step);
  p->set_numel(t.numel);
}

absl::StatusOr<GradDType> GradDTypeFromProto(v1::DType d, absl::string_view field) {
  switch (d) {
    case v1::DTYPE_FLOAT32:
      return GradDType::kFloat32;
    case v1::DTYPE_BFLOAT16:
      return GradDType::kBFloat16;
    case v1::DTYPE_FLOAT16:
      return GradDType::kFloat16;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          field, " = ", static_cast<int>(d), " must be FLOAT32, BFLOAT16 or FLOAT16"));
  }
}

// Resolves a chunk error: a chunk of a tensor the shard does not have is NOT_FOUND.
absl::Status AddChunk(ChunkAssembler& assembler, const ShardStore& store,
                      const v1::TensorChunk& chunk,
                      std::optional<uint64_t>* staged_at = nullptr) {
  if (!assembler.Expects(chunk.tensor()) && !store.Lookup({chunk.tensor()}).ok()) {
    return absl::NotFoundError(absl::StrCat("chunks.tensor '", chunk.tensor(),
                                            "' is not registered"));
  }
  return assembler.AddChunk(chunk.tensor(), chunk.offset(), chunk.data(), staged_at);
}

// Adds one message's chunks. Fails on a header in any message but the first.
template <typename Request>
absl::Status AddChunks(ChunkAssembler& assembler, const ShardStore& store, const Request& request,
                       bool first) {
  if (!first && request.has_header()) {
    return absl::InvalidArgumentError("header may appear only in the first message");
  }
  for (const v1::TensorChunk& chunk : request.chunks()) {
    if (absl::Status s = AddChunk(assembler, store, chunk); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// Reads the rest of a client stream into the assembler.
template <typename Request>
absl::Status ReadChunks(grpc::ServerReader<Request>* reader, const ShardStore& store,
                        const Request& first, ChunkAssembler& assembler) {
  if (absl::Status s = AddChunks(assembler, store, first, /*first=*/true); !s.ok()) return s;
  Request request;
  while (reader->Read(&request)) {
    if (absl::Status s = AddChunks(assembler, store, request, /*first=*/false); !s.ok()) return s;
  }
  return assembler.Finish();
}

// Checks a push header and returns its tensors (all of the shard's when it names none).
absl::StatusOr<std::vector<TensorInfo>> CheckPushHeader(const v1::PushHeader& header,
                                                        const ShardStore& store) {
  absl::StatusOr<GradDType> dtype = GradDTypeFromProto(header.grad_dtype(), "header.grad_dtype");
  if (!dtype.ok()) return dtype.status();
  if (header.has_grad_scale() &&
      !(std::isfinite(header.grad_scale()) && header.grad_scale() > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("header.grad_scale = ", header.grad_scale(),
                                                   " must be finite and > 0"));
  }
  if (header.worker_count() > 1) {
    return absl::UnimplementedError(absl::StrCat(
        "header.worker_count = ", header.worker_count(),
        ": synchronous aggregation is not implemented; use 0 or 1"));
  }
  absl::flat_hash_set<absl::string_view> seen;
  for (int i = 0; i < header.tensors_size(); ++i) {
    if (!seen.insert(header.tensors(i)).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header.tensors[", i, "] names tensor '", header.tensors(i), "' a second time"));
    }
  }
  return store.Lookup({header.tensors().begin(), header.tensors().end()});
}

// One PushGradients call on gRPC's callback API. Nothing here blocks: the header's staging is
// reserved asynchronously (the stream is not read until the pool grants it: back-pressure),
// each message's chunks are checked and copied into staging as it arrives, and the update
// engine's thread acknowledges the call once the step is back (the completion path).
class PushReactor final : public grpc::ServerReadReactor<v1::PushGradientsRequest> {
 public:
  PushReactor(grpc::CallbackServerContext* context, v1::PushGradientsResponse* response,
              ShardStore* store, UpdateEngine* engine, Metrics* metrics, StagingPool* staging)
      : context_(context),
        response_(response),
        store_(store),
        engine_(engine),
        metrics_(metrics),
        staging_(staging) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) return OnStreamEnd();
    if (!header_read_) return OnHeader();
    if (absl::Status s = AddMessage(request_, /*first=*/false); !s.ok()) return Reply(s);
    StartRead(&request_);
  }

  void OnCancel() override {
    uint64_t ticket;
    {
      absl::MutexLock lock(&mu_);
      ticket = waiting_ticket_;
    }
    if (ticket != 0) staging_->Cancel(ticket);  // Its callback replies CANCELLED.
  }

  void OnDone() override { delete this; }

 private:
  void OnHeader() {
    header_read_ = true;
    if (!request_.has_header()) {
      return Reply(absl::InvalidArgumentError("the first PushGradientsRequest must carry header"));
    }
    absl::StatusOr<std::vector<TensorInfo>> tensors = CheckPushHeader(request_.header(), *store_);
    if (!tensors.ok()) return Reply(tensors.status());
    tensors_ = *std::move(tensors);
    dtype_ = *GradDTypeFromProto(request_.header().grad_dtype(), "header.grad_dtype");
    first_ = std::move(request_);
    std::vector<ChunkAssembler::Expected> expected;
    for (const TensorInfo& t : tensors_) expected.push_back({t.spec.name, t.numel});
    const uint64_t bytes = ChunkAssembler::StagingBytes(expected, DTypeSize(dtype_));
    absl::MutexLock lock(&mu_);
    waiting_ticket_ = staging_->ReserveAsync(
        bytes, [this, expected = std::move(expected)](
                   absl::StatusOr<StagingPool::Reservation> reservation) mutable {
          OnReserved(std::move(reservation), std::move(expected));
        });
  }

  // Runs inline from ReserveAsync (mu_ held by OnHeader) or from the thread of the call whose
  // release freed the bytes. It leaves waiting_ticket_ alone: cancelling a served ticket is a
  // no-op.
  void OnReserved(absl::StatusOr<StagingPool::Reservation> reservation,
                  std::vector<ChunkAssembler::Expected> expected) {
    if (!reservation.ok()) return Reply(reservation.status());
    reservation_ = *std::move(reservation);
    absl::StatusOr<ChunkAssembler> assembler =
        ChunkAssembler::Create(std::move(expected), DTypeSize(dtype_), reservation_.data());
    if (!assembler.ok()) return Reply(assembler.status());
    assembler_.emplace(*std::move(assembler));
    if (absl::Status s = AddMessage(first_, /*first=*/true); !s.ok()) return Reply(s);
    StartRead(&request_);
  }

  // Checks one message's chunks and copies each into staging, from where it starts on its way
  // to the device at once; checks the gradients for non-finite values on the way.
  absl::Status AddMessage(const v1::PushGradientsRequest& message, bool first) {
    if (!first && message.has_header()) {
      return absl::InvalidArgumentError("header may appear only in the first message");
    }
    const float grad_scale = first_.header().has_grad_scale() ? first_.header().grad_scale() : 0;
    for (const v1::TensorChunk& chunk : message.chunks()) {
      std::optional<uint64_t> staged_at;
      if (absl::Status s = AddChunk(*assembler_, *store_, chunk, &staged_at); !s.ok()) return s;
      if (!staged_at.has_value()) continue;
      if (absl::Status s = store_->CopyStagingToDevice(reservation_.offset() + *staged_at,
                                                       chunk.data().size());
          !s.ok()) {
        return s;
      }
      grads_finite_ = grads_finite_ &&
                      GradsAllFinite(chunk.data().data(), dtype_,
                                     chunk.data().size() / DTypeSize(dtype_), grad_scale,
                                     /*parallel=*/false);
    }
    return absl::OkStatus();
  }

  void OnStreamEnd() {
    // A client that cancels mid-push ends the stream early, or is cancelled after its last
    // chunk: either way nothing is applied.
    if (context_->IsCancelled()) return Reply(absl::CancelledError("cancelled"));
    if (!header_read_) {
      return Reply(absl::InvalidArgumentError("the first PushGradientsRequest must carry header"));
    }
    if (absl::Status s = assembler_->Finish(); !s.ok()) return Reply(s);
    received_ = absl::Now();
    const v1::PushHeader& header = first_.header();
    push_.client_id = header.client_id();
    push_.sequence_number = header.sequence_number();
    for (const TensorInfo& t : tensors_) push_.tensors.push_back(t.index);
    push_.grad_offsets = assembler_->staging_offsets();
    push_.grads = assembler_->staging();
    push_.grad_dtype = dtype_;
    push_.grad_scale = header.has_grad_scale() ? header.grad_scale() : 0.0f;
    push_.grads_checked = true;
    push_.grads_finite = grads_finite_;
    engine_->Submit(&push_, [this](absl::StatusOr<PushOutcome> outcome) { OnApplied(outcome); });
  }

  void OnApplied(const absl::StatusOr<PushOutcome>& outcome) {
    if (!outcome.ok()) return Reply(outcome.status());
    const absl::Time stepped = absl::Now();
    if (!outcome->duplicate) metrics_->RecordStep(outcome->skipped, kSkipNonFiniteGrad);
    response_->set_version(outcome->version);
    response_->set_step_skipped(outcome->skipped);
    if (outcome->skipped) response_->set_skip_reason(kSkipNonFiniteGrad);
    response_->set_tensors_updated(outcome->tensors_updated);
    response_->set_grad_bytes(assembler_->bytes_received());
    response_->set_duplicate(outcome->duplicate);
    // h2d is what the backend step spent outside its kernels (checking and copying the grads);
    // apply is the rest until the outcome was back: the engine's queue and the kernels.
    stages_.receive = absl::ToDoubleSeconds(received_ - arrived_);
    stages_.h2d = std::max(0.0, outcome->step_seconds - outcome->device_seconds);
    stages_.apply = std::max(0.0, absl::ToDoubleSeconds(stepped - received_) - stages_.h2d);
    stages_.ack = absl::ToDoubleSeconds(absl::Now() - stepped);
    Reply(absl::OkStatus());
  }

  // The one place a push ends: metrics, then the status to the client. The staging is
  // released when the reactor is deleted (OnDone), after gRPC is done with the call.
  void Reply(const absl::Status& status) {
    metrics_->RecordPush(static_cast<grpc::StatusCode>(status.code()),
                         assembler_ ? assembler_->bytes_received() : 0, stages_);
    Finish(ToGrpc(status));
  }

  grpc::CallbackServerContext* const context_;
  v1::PushGradientsResponse* const response_;
  ShardStore* const store_;
  UpdateEngine* const engine_;
  Metrics* const metrics_;
  StagingPool* const staging_;
  const absl::Time arrived_ = absl::Now();
  absl::Time received_;
  v1::PushGradientsRequest request_;  // The message being read.
  v1::PushGradientsRequest first_;    // The header's message, kept for its header and chunks.
  bool header_read_ = false;
  std::vector<TensorInfo> tensors_;
  GradDType dtype_ = GradDType::kFloat32;
  absl::Mutex mu_;
  uint64_t waiting_ticket_ ABSL_GUARDED_BY(mu_) = 0;  // The staging wait, for OnCancel.
  StagingPool::Reservation reservation_;
  std::optional<ChunkAssembler> assembler_;
  bool grads_finite_ = true;
  ReadyPush push_;
  PushStageSeconds stages_;
};

}  // namespace

ParameterServiceImpl::ParameterServiceImpl(ShardStore* store, UpdateEngine* engine,
                                           Metrics* metrics, StagingPool* staging,
                                           uint64_t max_message_bytes)
    : store_(store),
      engine_(engine),
      metrics_(metrics),
      staging_(staging),
      max_message_bytes_(max_message_bytes) {}

grpc::Status ParameterServiceImpl::RegisterParamGroup(grpc::ServerContext*,
                                                      const v1::RegisterParamGroupRequest* request,
                                                      v1::RegisterParamGroupResponse* response) {
  ParamGroupSpec group{request->param_group().name(),
                       FromProto(request->param_group().hyperparameters())};
  absl::StatusOr<bool> created = store_->RegisterParamGroup(group);
  if (!created.ok()) return ToGrpc(created.status());
  response->set_created(*created);
  ToProto(group, response->mutable_param_group());
  return grpc::Status::OK;
}

grpc::Status ParameterServiceImpl::RegisterTensors(
    grpc::ServerContext* context, grpc::ServerReader<v1::RegisterTensorsRequest>* reader,
    v1::RegisterTensorsResponse* response) {
  v1::RegisterTensorsRequest first;
  if (!reader->Read(&first) || !first.has_header()) {
    return ToGrpc(absl::InvalidArgumentError(
        "the first RegisterTensorsRequest must carry header (the tensor specs)"));
  }
  std::vector<TensorSpec> specs;
  for (const v1::TensorSpec& p : first.header().tensors()) {
    specs.push_back({p.name(), {p.shape().begin(), p.shape().end()}, p.param_group()});
  }
  std::vector<bool> is_new;
  if (absl::Status s = store_->CheckTensorSpecs(specs, &is_new); !s.ok()) return ToGrpc(s);
  // Values are required for new tensors only; those of registered ones are checked, then
  // ignored.
  std::vector<ChunkAssembler::Expected> expected;
  for (size_t i = 0; i < specs.size(); ++i) {
    expected.push_back({specs[i].name, *ShardStore::NumelOf(specs[i].shape), is_new[i]});
  }
  absl::StatusOr<StagingPool::Reservation> reservation = staging_->Reserve(
      ChunkAssembler::StagingBytes(expected, 4), [context] { return context->IsCancelled(); });
  if (!reservation.ok()) return ToGrpc(reservation.status());
  absl::StatusOr<ChunkAssembler> assembler = ChunkAssembler::Create(std::move(expected), 4);
  if (!assembler.ok()) return ToGrpc(assembler.status());
  if (absl::Status s = ReadChunks(reader, *store_, first, *assembler); !s.ok()) return ToGrpc(s);
  if (context->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
  std::vector<const float*> values;
  for (uint64_t offset : assembler->staging_offsets()) {
    values.push_back(static_cast<const float*>(assembler->staging()) + offset);
  }
  absl::StatusOr<RegisterOutcome> outcome = store_->RegisterTensors(specs, values);
  if (!outcome.ok()) return ToGrpc(outcome.status());
  response->set_tensors_created(outcome->created);
  response->set_tensors_existing(outcome->existing);
  response->set_version(store_->version());
  return grpc::Status::OK;
}

grpc::ServerReadReactor<v1::PushGradientsRequest>* ParameterServiceImpl::PushGradients(
    grpc::CallbackServerContext* context, v1::PushGradientsResponse* response) {
  return new PushReactor(context, response, store_, engine_, metrics_, staging_);
}

grpc::Status ParameterServiceImpl::PullParameters(
    grpc::ServerContext* context, const v1::PullParametersRequest* request,
    grpc::ServerWriter<v1::PullParametersResponse>* writer) {
  uint64_t bytes_sent = 0;
  const grpc::Status status = Pull(context, request, writer, &bytes_sent);
  metrics_->RecordPull(status.error_code(), bytes_sent);
  return status;
}

grpc::Status ParameterServiceImpl::Pull(grpc::ServerContext* context,
                                        const v1::PullParametersRequest* request,
                                        grpc::ServerWriter<v1::PullParametersResponse>* writer,
                                        uint64_t* bytes_sent) {
  const v1::DType wire_dtype =
      request->dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_FLOAT32 : request->dtype();
  absl::StatusOr<GradDType> dtype = GradDTypeFromProto(wire_dtype, "dtype");
  if (!dtype.ok()) return ToGrpc(dtype.status());
  const uint32_t chunk_bytes =
      request->max_chunk_bytes() == 0 ? kDefaultPullChunkBytes : request->max_chunk_bytes();
  if (chunk_bytes < kMinPullChunkBytes || chunk_bytes > kMaxPullChunkBytes) {
    return ToGrpc(absl::InvalidArgumentError(absl::StrCat(
        "max_chunk_bytes = ", chunk_bytes, " must be 0 or in [", kMinPullChunkBytes, ", ",
        kMaxPullChunkBytes, "]")));
  }
  TensorField field = TensorField::kParam;
  if (request->field() != v1::TENSOR_FIELD_UNSPECIFIED) {
    if (request->field() < v1::TENSOR_FIELD_PARAM ||
        request->field() > v1::TENSOR_FIELD_MAX_EXP_AVG_SQ) {
      return ToGrpc(absl::InvalidArgumentError(
          absl::StrCat("field = ", static_cast<int>(request->field()), " is not a TensorField")));
    }
    field = static_cast<TensorField>(request->field());
  }
  absl::flat_hash_set<absl::string_view> seen;
  for (int i = 0; i < request->tensors_size(); ++i) {
    if (!seen.insert(request->tensors(i)).second) {
      return ToGrpc(absl::InvalidArgumentError(absl::StrCat(
          "tensors[", i, "] names tensor '", request->tensors(i), "' a second time")));
    }
  }
  absl::StatusOr<Snapshot> snapshot =
      store_->Read({request->tensors().begin(), request->tensors().end()}, field, *dtype);
  if (!snapshot.ok()) return ToGrpc(snapshot.status());

  v1::PullParametersResponse message;
  v1::PullHeader* header = message.mutable_header();
  header->set_version(snapshot->version);
  header->set_dtype(wire_dtype);
  for (const TensorInfo& t : snapshot->tensors) ToProto(t, header->add_tensors());
  if (!writer->Write(message)) return grpc::Status(grpc::StatusCode::CANCELLED, "client left");
  message.Clear();
  // Pack chunks into messages of at most chunk_bytes of payload, splitting large tensors.
  const uint32_t element_size = DTypeSize(*dtype);
  const uint64_t elements_per_message = chunk_bytes / element_size;
  uint64_t room = elements_per_message;
  uint64_t message_bytes = 0;  // Payload in `message`, added to *bytes_sent once written.
  for (size_t i = 0; i < snapshot->tensors.size(); ++i) {
    const uint64_t numel = snapshot->tensors[i].numel;
    for (uint64_t offset = 0; offset < numel;) {
      const uint64_t count = std::min(room, numel - offset);
      v1::TensorChunk* chunk = message.add_chunks();
      chunk->set_tensor(snapshot->tensors[i].spec.name);
      chunk->set_offset(offset);
      chunk->set_data(snapshot->data[i].data() + offset * element_size, count * element_size);
      offset += count;
      room -= count;
      message_bytes += count * element_size;
      if (room == 0) {
        if (context->IsCancelled() || !writer->Write(message)) {
          return grpc::Status(grpc::StatusCode::CANCELLED, "client left");
        }
        *bytes_sent += message_bytes;
        message_bytes = 0;
        message.Clear();
        room = elements_per_message;
      }
    }
  }
  if (message.chunks_size() > 0 && !writer->Write(message)) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "client left");
  }
  *bytes_sent += message_bytes;
  return grpc::Status::OK;
}

grpc::Status ParameterServiceImpl::GetInfo(grpc::ServerContext*, const v1::GetInfoRequest*,
                                           v1::GetInfoResponse* response) {
  absl::StatusOr<std::vector<TensorInfo>> tensors = store_->Lookup({});
  if (!tensors.ok()) return ToGrpc(tensors.status());
  response->set_version(store_->version());
  response->set_backend(store_->backend_name());
  response->set_device(store_->device());
  response->set_tensor_count(static_cast<uint32_t>(tensors->size()));
  response->set_parameter_count(store_->parameter_count());
  for (const ParamGroupSpec& g : store_->param_groups()) ToProto(g, response->add_param_groups());
  response->set_server_version(FUSEDPS_VERSION);
  response->set_max_message_bytes(max_message_bytes_);
  response->set_param_copy_dtype(static_cast<v1::DType>(store_->param_copy_dtype()));
  return grpc::Status::OK;
}

grpc::Status ParameterServiceImpl::ListTensors(grpc::ServerContext*, const v1::ListTensorsRequest*,
                                               v1::ListTensorsResponse* response) {
  absl::StatusOr<std::vector<TensorInfo>> tensors = store_->Lookup({});
  if (!tensors.ok()) return ToGrpc(tensors.status());
  response->set_version(store_->version());
  for (const TensorInfo& t : *tensors) ToProto(t, response->add_tensors());
  return grpc::Status::OK;
}

grpc::Status ParameterServiceImpl::SetHyperparameters(
    grpc::ServerContext*, const v1::SetHyperparametersRequest* request,
    v1::SetHyperparametersResponse* response) {
  absl::StatusOr<ParamGroupSpec> group = store_->SetHyperparameters(
      request->param_group(), UpdateFromProto(request->hyperparameters()));
  if (!group.ok()) return ToGrpc(group.status());
  ToProto(*group, response->mutable_param_group());
  return grpc::Status::OK;
}

}  // namespace fusedps
