#include "client/wire.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/dtype_names.h"
#include "common/half_float.h"
#include "grpcpp/support/status.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "fusedps's wire format is little-endian; this client assumes a little-endian host"
#endif

namespace fusedps::client {

// The names and sizes are common/dtype_names.h's: DType and StateDType have the proto's codes
// (static_asserts in wire.cc's tail).
size_t ElementBytes(DType dtype) { return dtypes::ElementBytes(static_cast<v1::DType>(dtype)); }

const char* DTypeName(DType dtype) { return dtypes::ShortName(static_cast<v1::DType>(dtype)); }

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  absl::StatusOr<v1::DType> dtype = dtypes::ParseDType(name);
  if (!dtype.ok()) return dtype.status();
  return static_cast<DType>(*dtype);
}

const char* StateDTypeName(StateDType dtype) {
  return dtypes::ShortName(static_cast<v1::StateDType>(dtype));
}

namespace internal {

absl::StatusOr<std::vector<MessagePlan>> PlanChunks(absl::Span<const TensorExtent> tensors,
                                                    size_t element_bytes, size_t max_chunk_bytes) {
  if (element_bytes == 0 || max_chunk_bytes < element_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_chunk_bytes ", max_chunk_bytes, " holds no element of ", element_bytes, " bytes"));
  }
  const uint64_t elements_per_message = max_chunk_bytes / element_bytes;
  std::vector<MessagePlan> plan;
  MessagePlan message;
  uint64_t message_numel = 0;
  size_t message_metadata = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const size_t chunk_metadata = tensors[t].name_bytes + kChunkFramingBytes;
    for (uint64_t offset = 0; offset < tensors[t].numel;) {
      const bool payload_full = message_numel == elements_per_message;
      const bool metadata_full = message_metadata + chunk_metadata > kMaxChunkMetadataBytes;
      if (!message.empty() && (payload_full || metadata_full)) {
        plan.push_back(std::move(message));
        message.clear();
        message_numel = 0;
        message_metadata = 0;
      }
      const uint64_t numel =
          std::min(tensors[t].numel - offset, elements_per_message - message_numel);
      message.push_back({t, offset, numel});
      message_numel += numel;
      message_metadata += chunk_metadata;
      offset += numel;
    }
  }
  if (!message.empty()) plan.push_back(std::move(message));
  return plan;
}

std::vector<std::vector<size_t>> PartitionTensors(absl::Span<const uint64_t> numels, int parts) {
  const size_t group_count = std::min(numels.size(), static_cast<size_t>(std::max(parts, 1)));
  std::vector<std::vector<size_t>> groups(group_count);
  if (group_count == 0) return groups;
  std::vector<size_t> by_size(numels.size());
  std::iota(by_size.begin(), by_size.end(), 0);
  std::stable_sort(by_size.begin(), by_size.end(),
                   [&](size_t a, size_t b) { return numels[a] > numels[b]; });
  std::vector<uint64_t> load(group_count, 0);
  for (size_t index : by_size) {
    const size_t lightest = std::min_element(load.begin(), load.end()) - load.begin();
    groups[lightest].push_back(index);
    load[lightest] += std::max<uint64_t>(numels[index], 1);
  }
  for (std::vector<size_t>& group : groups) std::sort(group.begin(), group.end());
  std::sort(groups.begin(), groups.end(),
            [](const std::vector<size_t>& a, const std::vector<size_t>& b) { return a[0] < b[0]; });
  return groups;
}

absl::StatusOr<uint64_t> NumElements(absl::Span<const int64_t> shape) {
  uint64_t numel = 1;
  for (int64_t dim : shape) {
    if (dim < 0) return absl::InvalidArgumentError(absl::StrCat("negative dim ", dim));
    if (dim != 0 && numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) /
                                static_cast<uint64_t>(dim)) {
      return absl::InvalidArgumentError("shape has more than 2^63 - 1 elements");
    }
    numel *= static_cast<uint64_t>(dim);
  }
  return numel;
}

void EncodeElements(absl::Span<const float> values, DType dtype, std::string* out) {
  out->resize(values.size() * ElementBytes(dtype));
  char* bytes = out->data();
  switch (dtype) {
    case DType::kFloat32:
      if (!values.empty()) std::memcpy(bytes, values.data(), out->size());
      return;
    case DType::kBFloat16:
      for (size_t i = 0; i < values.size(); ++i) {
        const uint16_t element = FloatToBFloat16(values[i]);
        std::memcpy(bytes + 2 * i, &element, 2);
      }
      return;
    case DType::kFloat16:
      for (size_t i = 0; i < values.size(); ++i) {
        const uint16_t element = FloatToFloat16(values[i]);
        std::memcpy(bytes + 2 * i, &element, 2);
      }
      return;
  }
}

void DecodeElements(absl::string_view data, DType dtype, absl::Span<float> out) {
  const char* bytes = data.data();
  switch (dtype) {
    case DType::kFloat32:
      if (!out.empty()) std::memcpy(out.data(), bytes, out.size() * 4);
      return;
    case DType::kBFloat16:
    case DType::kFloat16:
      for (size_t i = 0; i < out.size(); ++i) {
        uint16_t element;
        std::memcpy(&element, bytes + 2 * i, 2);
        out[i] = dtype == DType::kBFloat16 ? BFloat16ToFloat(element) : Float16ToFloat(element);
      }
      return;
  }
}

uint32_t PullChunkBytes(size_t max_chunk_bytes) {
  return static_cast<uint32_t>(std::clamp(max_chunk_bytes, kMinPullChunkBytes, kMaxPullChunkBytes));
}

absl::Duration CallTimeout(const ClientOptions& options, uint64_t payload_bytes) {
  if (options.timeout == absl::InfiniteDuration() || options.min_bytes_per_second == 0) {
    return options.timeout;
  }
  return options.timeout + absl::Seconds(static_cast<double>(payload_bytes) /
                                         static_cast<double>(options.min_bytes_per_second));
}

namespace {

absl::Status Malformed(absl::string_view what) {
  return absl::InternalError(absl::StrCat("malformed pull reply: ", what));
}

// UNSPECIFIED (a server from before the field) means fp32; other values pass as they are.
StateDType StateDTypeFromProto(v1::StateDType dtype) {
  return dtype == v1::STATE_DTYPE_UNSPECIFIED ? StateDType::kFloat32
                                              : static_cast<StateDType>(dtype);
}
DType ParamsDTypeFromProto(v1::DType dtype) {
  return dtype == v1::DTYPE_UNSPECIFIED ? DType::kFloat32 : static_cast<DType>(dtype);
}

}  // namespace

absl::Status PullAssembler::Add(const v1::PullParametersResponse& response) {
  if (response.has_header()) {
    if (absl::Status status = AddHeader(response.header()); !status.ok()) return status;
  }
  if (!has_header_ && (response.tensors_size() > 0 || response.chunks_size() > 0)) {
    return Malformed("data before its header");
  }
  if (response.tensors_size() > 0 && tensor_count_ == 0) {
    return Malformed("TensorInfo past the header, whose tensor_count of 0 says it holds them all");
  }
  for (const v1::TensorInfo& info : response.tensors()) {
    if (absl::Status status = AddInfo(info); !status.ok()) return status;
  }
  for (const v1::TensorChunk& chunk : response.chunks()) {
    if (absl::Status status = AddChunk(chunk); !status.ok()) return status;
  }
  return absl::OkStatus();
}

absl::Status PullAssembler::AddHeader(const v1::PullHeader& header) {
  if (has_header_) return Malformed("a second header");
  has_header_ = true;
  result_.version = header.version();
  tensor_count_ = header.tensor_count();
  if (header.dtype() != v1::DTYPE_UNSPECIFIED) {
    absl::StatusOr<DType> dtype = FromProtoDType(header.dtype());
    if (!dtype.ok()) return Malformed(dtype.status().message());
    dtype_ = *dtype;
  }
  for (const v1::TensorInfo& info : header.tensors()) {
    if (absl::Status status = AddInfo(info); !status.ok()) return status;
  }
  return absl::OkStatus();
}

absl::Status PullAssembler::AddInfo(const v1::TensorInfo& info) {
  ++infos_received_;
  if (tensor_count_ != 0 && infos_received_ > tensor_count_) {
    return Malformed(absl::StrCat("more TensorInfo than its tensor_count of ", tensor_count_));
  }
  // numel is redundant with the shape; a server may leave it 0.
  absl::StatusOr<uint64_t> numel = NumElements(info.shape());
  if (!numel.ok() || (info.numel() != 0 && *numel != info.numel())) {
    return Malformed(absl::StrCat("tensor ", info.name(), " has numel ", info.numel(),
                                  " that does not match its shape"));
  }
  auto [it, inserted] = result_.tensors.try_emplace(info.name());
  if (!inserted) return Malformed(absl::StrCat("tensor ", info.name(), " is described twice"));
  PulledTensor& tensor = it->second;
  tensor.shape.assign(info.shape().begin(), info.shape().end());
  tensor.param_group = info.param_group();
  tensor.step = info.step();
  tensor.values.resize(*numel);
  pending_[info.name()] = Pending{&tensor.values, 0};
  announced_bytes_ += *numel * ElementBytes(dtype_);
  return absl::OkStatus();
}

absl::Status PullAssembler::AddChunk(const v1::TensorChunk& chunk) {
  auto it = pending_.find(chunk.tensor());
  if (it == pending_.end()) {
    return Malformed(absl::StrCat("a chunk of ", chunk.tensor(), " before its TensorInfo"));
  }
  const size_t element_bytes = ElementBytes(dtype_);
  const uint64_t numel = chunk.data().size() / element_bytes;
  std::vector<float>& values = *it->second.values;
  if (chunk.data().size() % element_bytes != 0 || chunk.offset() > values.size() ||
      numel > values.size() - chunk.offset()) {
    return Malformed(absl::StrCat("a chunk of ", chunk.tensor(), " at offset ", chunk.offset(),
                                  " of ", chunk.data().size(), " bytes, outside its ",
                                  values.size(), " elements"));
  }
  DecodeElements(chunk.data(), dtype_, absl::MakeSpan(values).subspan(chunk.offset(), numel));
  it->second.received += numel;
  return absl::OkStatus();
}

absl::Status PullAssembler::Finish(absl::Span<const std::string> requested) const {
  if (!has_header_) return Malformed("no header");
  if (tensor_count_ != 0 && infos_received_ != tensor_count_) {
    return Malformed(
        absl::StrCat(infos_received_, " TensorInfo, not its tensor_count of ", tensor_count_));
  }
  for (const auto& [name, pending] : pending_) {
    if (pending.received != pending.values->size()) {
      return Malformed(
          absl::StrCat(pending.received, " elements of ", name, ", not ", pending.values->size()));
    }
  }
  for (const std::string& name : requested) {
    if (result_.tensors.count(name) == 0) {
      return Malformed(absl::StrCat("requested tensor ", name, " is missing"));
    }
  }
  return absl::OkStatus();
}

absl::Status ToAbslStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  // gRPC's and absl's codes are both google.rpc.Code.
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

v1::DType ToProtoDType(DType dtype) { return static_cast<v1::DType>(dtype); }

absl::StatusOr<DType> FromProtoDType(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32:
      return DType::kFloat32;
    case v1::DTYPE_BFLOAT16:
      return DType::kBFloat16;
    case v1::DTYPE_FLOAT16:
      return DType::kFloat16;
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown wire dtype ", dtype));
  }
}

v1::TensorField ToProtoField(TensorField field) { return static_cast<v1::TensorField>(field); }

namespace {

// The client's mirror enums (fusedps/client_types.h) take the proto's values: conversions cast.
static_assert(static_cast<int>(DType::kFloat32) == v1::DTYPE_FLOAT32);
static_assert(static_cast<int>(DType::kBFloat16) == v1::DTYPE_BFLOAT16);
static_assert(static_cast<int>(DType::kFloat16) == v1::DTYPE_FLOAT16);
static_assert(static_cast<int>(StateDType::kFloat32) == v1::STATE_DTYPE_FLOAT32);
static_assert(static_cast<int>(StateDType::kBFloat16) == v1::STATE_DTYPE_BFLOAT16);
static_assert(static_cast<int>(StateDType::kInt8) == v1::STATE_DTYPE_INT8);
static_assert(static_cast<int>(WeightDecayMode::kDecoupled) == v1::WEIGHT_DECAY_MODE_DECOUPLED);
static_assert(static_cast<int>(WeightDecayMode::kL2) == v1::WEIGHT_DECAY_MODE_L2);
static_assert(static_cast<int>(TensorField::kParam) == v1::TENSOR_FIELD_PARAM);
static_assert(static_cast<int>(TensorField::kExpAvg) == v1::TENSOR_FIELD_EXP_AVG);
static_assert(static_cast<int>(TensorField::kExpAvgSq) == v1::TENSOR_FIELD_EXP_AVG_SQ);
static_assert(static_cast<int>(TensorField::kMaxExpAvgSq) == v1::TENSOR_FIELD_MAX_EXP_AVG_SQ);

// The proto's field of that name; a name the proto lacks is a build of mismatched sources.
const google::protobuf::FieldDescriptor* HyperparameterField(const char* name) {
  const google::protobuf::FieldDescriptor* f =
      v1::Hyperparameters::descriptor()->FindFieldByName(name);
  if (f == nullptr) {
    std::fprintf(stderr, "fusedps: proto fusedps.v1.Hyperparameters has no field %s\n", name);
    std::abort();
  }
  return f;
}

}  // namespace

v1::Hyperparameters ToProtoHyperparameters(const ParamGroupOptions& options) {
  v1::Hyperparameters hyper;
  const google::protobuf::Reflection* r = v1::Hyperparameters::GetReflection();
  for (const auto& [name, member] : kParamGroupDoubleFields) {
    if (const std::optional<double>& v = options.*member)
      r->SetDouble(&hyper, HyperparameterField(name), *v);
  }
  for (const auto& [name, member] : kParamGroupBoolFields) {
    if (const std::optional<bool>& v = options.*member)
      r->SetBool(&hyper, HyperparameterField(name), *v);
  }
  if (options.weight_decay_mode) {
    hyper.set_weight_decay_mode(static_cast<v1::WeightDecayMode>(*options.weight_decay_mode));
  }
  if (options.state_dtype) hyper.set_state_dtype(static_cast<v1::StateDType>(*options.state_dtype));
  if (options.params_dtype) hyper.set_params_dtype(static_cast<v1::DType>(*options.params_dtype));
  if (options.rounding_seed) hyper.set_rounding_seed(*options.rounding_seed);
  return hyper;
}

ParamGroupOptions FromProtoHyperparameters(const v1::Hyperparameters& hyper) {
  ParamGroupOptions options;
  const google::protobuf::Reflection* r = v1::Hyperparameters::GetReflection();
  for (const auto& [name, member] : kParamGroupDoubleFields) {
    const google::protobuf::FieldDescriptor* f = HyperparameterField(name);
    if (r->HasField(hyper, f)) options.*member = r->GetDouble(hyper, f);
  }
  for (const auto& [name, member] : kParamGroupBoolFields) {
    const google::protobuf::FieldDescriptor* f = HyperparameterField(name);
    if (r->HasField(hyper, f)) options.*member = r->GetBool(hyper, f);
  }
  if (hyper.has_weight_decay_mode()) {
    // UNSPECIFIED means decoupled (see the proto).
    options.weight_decay_mode = hyper.weight_decay_mode() == v1::WEIGHT_DECAY_MODE_L2
                                    ? WeightDecayMode::kL2
                                    : WeightDecayMode::kDecoupled;
  }
  // UNSPECIFIED means fp32 (see the proto).
  if (hyper.has_state_dtype()) options.state_dtype = StateDTypeFromProto(hyper.state_dtype());
  if (hyper.has_params_dtype()) options.params_dtype = ParamsDTypeFromProto(hyper.params_dtype());
  if (hyper.has_rounding_seed()) options.rounding_seed = hyper.rounding_seed();
  return options;
}

ParamGroup FromProtoParamGroup(const v1::ParamGroup& group) {
  return ParamGroup{group.name(), FromProtoHyperparameters(group.hyperparameters())};
}

TensorInfo FromProtoTensorInfo(const v1::TensorInfo& info) {
  TensorInfo out;
  out.name = info.name();
  out.shape.assign(info.shape().begin(), info.shape().end());
  out.param_group = info.param_group();
  out.step = info.step();
  out.numel = info.numel();
  out.params_dtype = ParamsDTypeFromProto(info.params_dtype());
  out.state_dtype = StateDTypeFromProto(info.state_dtype());
  return out;
}

absl::Status PushPartsStatus(absl::Span<const absl::Status> statuses) {
  for (const absl::Status& status : statuses) {
    if (!status.ok() && !absl::IsAborted(status)) return status;
  }
  for (const absl::Status& status : statuses) {
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

Consistency FromProtoConsistency(const v1::Consistency& consistency) {
  static constexpr const char* kModes[] = {"", "async", "sync", "bounded"};
  Consistency c;
  const int mode = consistency.mode();
  c.mode = mode >= 0 && mode < 4 ? kModes[mode] : absl::StrCat("mode ", mode);
  c.replicas_to_aggregate = consistency.replicas_to_aggregate();
  c.total_replicas = consistency.total_replicas();
  c.round_timeout = absl::Seconds(consistency.round_timeout_seconds());
  c.max_staleness = consistency.max_staleness();
  c.staleness_lr_scaling = consistency.staleness_lr_scaling();
  return c;
}

absl::StatusOr<v1::Consistency> ToProtoConsistency(const Consistency& consistency) {
  static constexpr const char* kModes[] = {"async", "sync", "bounded"};
  v1::Consistency c;
  for (int m = 0; m < 3; ++m) {
    if (consistency.mode == kModes[m]) c.set_mode(static_cast<v1::ConsistencyMode>(m + 1));
  }
  if (c.mode() == v1::CONSISTENCY_MODE_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        absl::StrCat("consistency.mode '", consistency.mode, "' must be async, sync or bounded"));
  }
  c.set_replicas_to_aggregate(consistency.replicas_to_aggregate);
  c.set_total_replicas(consistency.total_replicas);
  c.set_round_timeout_seconds(absl::ToDoubleSeconds(consistency.round_timeout));
  c.set_max_staleness(consistency.max_staleness);
  c.set_staleness_lr_scaling(consistency.staleness_lr_scaling);
  return c;
}

ModelInfo FromProtoModel(const v1::ModelInfo& p) {
  ModelInfo m;
  m.name = p.name();
  m.version = p.version();
  m.tensor_count = p.tensor_count();
  m.parameter_count = p.parameter_count();
  m.consistency = FromProtoConsistency(p.consistency());
  m.memory_bytes = p.memory_bytes();
  m.plan_hash = p.plan_hash();
  return m;
}

PushResult FromProtoPushResult(const v1::PushGradientsResponse& response) {
  PushResult result;
  result.version = response.version();
  result.step_skipped = response.step_skipped();
  result.skip_reason = response.skip_reason();
  result.tensors_updated = response.tensors_updated();
  result.grad_bytes = response.grad_bytes();
  result.duplicate = response.duplicate();
  result.round_workers = response.round_workers();
  result.round_timed_out = response.round_timed_out();
  result.missing_replicas.assign(response.missing_replicas().begin(),
                                 response.missing_replicas().end());
  result.pulled_version = response.pulled_version();
  return result;
}

}  // namespace internal
}  // namespace fusedps::client
