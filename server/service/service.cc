#include "server/service/service.h"

#include <algorithm>
#include <optional>
#include <cmath>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/ingest/chunk_assembler.h"
#include "server/service/push_reactor.h"
#include "server/service/wire_checks.h"

#ifndef FUSEDPS_VERSION
#define FUSEDPS_VERSION "dev"
#endif

namespace fusedps {
namespace {

constexpr uint32_t kDefaultPullChunkBytes = 1 << 20;
constexpr uint32_t kMaxPullChunkBytes = 4 << 20;
constexpr uint32_t kMinPullChunkBytes = 16;

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

// Reads a registration's chunks, the first message's and the rest of the stream's, into the
// assembler. A header after the first message is INVALID_ARGUMENT.
absl::Status ReadChunks(grpc::ServerReader<v1::RegisterTensorsRequest>* reader,
                        const ShardStore& store, const v1::RegisterTensorsRequest& first,
                        ChunkAssembler& assembler) {
  const auto add = [&](const v1::RegisterTensorsRequest& message) {
    for (const v1::TensorChunk& chunk : message.chunks()) {
      if (absl::Status s = AddChunk(assembler, store, chunk); !s.ok()) return s;
    }
    return absl::OkStatus();
  };
  if (absl::Status s = add(first); !s.ok()) return s;
  v1::RegisterTensorsRequest request;
  while (reader->Read(&request)) {
    if (request.has_header()) {
      return absl::InvalidArgumentError("header may appear only in the first message");
    }
    if (absl::Status s = add(request); !s.ok()) return s;
  }
  return assembler.Finish();
}

}  // namespace

ParameterServiceImpl::ParameterServiceImpl(ShardStore* store, UpdateEngine* engine,
                                           Metrics* metrics, StagingPool* staging,
                                           uint64_t max_message_bytes,
                                           absl::Duration push_part_wait)
    : store_(store),
      engine_(engine),
      metrics_(metrics),
      staging_(staging),
      assemblies_(push_part_wait),
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

grpc::ServerReadReactor<grpc::ByteBuffer>* ParameterServiceImpl::PushGradients(
    grpc::CallbackServerContext* context, grpc::ByteBuffer* response) {
  return NewPushReactor(context, response,
                        PushServices{store_, engine_, metrics_, staging_, &assemblies_});
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
  // Device -> staging -> chunks: the read lands in the staging pool (page-locked on a GPU, so
  // it is one DMA per tensor), reserved outside the store's lock, as pushes reserve theirs; a
  // pull larger than the whole pool reads into ordinary memory instead. The tensors are fixed
  // here, so that tensors registered meanwhile cannot outgrow the reservation; Read looks them
  // up again under its lock for their steps at the version it reads.
  absl::StatusOr<std::vector<TensorInfo>> tensors =
      store_->Lookup({request->tensors().begin(), request->tensors().end()});
  if (!tensors.ok()) return ToGrpc(tensors.status());
  std::vector<std::string> names;
  names.reserve(tensors->size());
  for (const TensorInfo& t : *tensors) names.push_back(t.spec.name);
  const uint64_t bytes = ShardStore::ReadBytes(*tensors, *dtype);
  StagingPool::Reservation staging;
  std::vector<char> heap;
  absl::Span<char> out;
  if (bytes > 0 && bytes <= staging_->capacity()) {
    absl::StatusOr<StagingPool::Reservation> reserved =
        staging_->Reserve(bytes, [context] { return context->IsCancelled(); });
    if (!reserved.ok()) return ToGrpc(reserved.status());
    staging = *std::move(reserved);
    out = absl::MakeSpan(staging.data(), bytes);
  } else {
    heap.resize(bytes);
    out = absl::MakeSpan(heap);
  }
  absl::StatusOr<Snapshot> snapshot = store_->Read(names, field, *dtype, out);
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
      chunk->set_data(snapshot->data[i] + offset * element_size, count * element_size);
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
