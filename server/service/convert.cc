#include "server/service/convert.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "server/ingest/push_assembly.h"

namespace fusedps {
namespace {

v1::StateDType ToProto(StateDType dtype) { return static_cast<v1::StateDType>(dtype); }
v1::DType ToProto(ParamsDType dtype) { return static_cast<v1::DType>(dtype); }

}  // namespace

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

void ToProto(const ParamGroupSpec& g, v1::ParamGroup* p) {
  p->set_name(g.name);
  *p->mutable_hyperparameters() = HyperparametersToProto(g.hyperparameters);
}

void ToProto(const ShardView& view, uint32_t tensor, int64_t step, v1::TensorInfo* p) {
  const TensorMeta& t = view.tensor(tensor);
  p->set_name(t.name);
  for (int64_t d : t.shape) p->add_shape(d);
  p->set_param_group(view.group_name_of(tensor));
  p->set_step(step);
  p->set_numel(t.numel);
  const TensorLayout layout = view.layout(tensor);
  p->set_params_dtype(ToProto(layout.params));
  p->set_state_dtype(ToProto(layout.state));
  p->set_table(t.table);
  if (t.table) {
    v1::TableOptions* options = p->mutable_table_options();
    if (t.hashed.has_value()) {
      options->set_hashed(true);
      options->set_seed(t.hashed->seed);
      options->set_init_std(t.hashed->init_std);
    }
  }
}

void ToProto(const PushReply& reply, v1::PushGradientsResponse* p) {
  p->set_version(reply.version);
  p->set_step_skipped(reply.skipped);
  if (reply.skipped) p->set_skip_reason(kSkipNonFiniteGrad);
  p->set_tensors_updated(reply.tensors_updated);
  p->set_grad_bytes(reply.grad_bytes);
  p->set_duplicate(reply.duplicate);
  p->set_round_workers(reply.round_workers);
  p->set_round_timed_out(reply.round_timed_out);
  for (const std::string& id : reply.missing_replicas) p->add_missing_replicas(id);
  p->set_pulled_version(reply.pulled_version);
}

void ToProto(const ConsistencyOptions& c, v1::Consistency* p) {
  p->set_mode(static_cast<v1::ConsistencyMode>(c.mode));
  if (c.mode == ConsistencyMode::kSync) {
    p->set_replicas_to_aggregate(c.replicas_to_aggregate);
    p->set_total_replicas(c.total_replicas);
    p->set_round_timeout_seconds(absl::ToDoubleSeconds(c.round_timeout));
  }
  if (c.mode == ConsistencyMode::kBounded) {
    p->set_max_staleness(c.max_staleness);
    p->set_staleness_lr_scaling(c.staleness_lr_scaling);
  }
}

absl::StatusOr<ConsistencyOptions> ConsistencyFromProto(const v1::Consistency& p) {
  static_assert(static_cast<int>(ConsistencyMode::kAsync) == v1::CONSISTENCY_MODE_ASYNC &&
                static_cast<int>(ConsistencyMode::kSync) == v1::CONSISTENCY_MODE_SYNC &&
                static_cast<int>(ConsistencyMode::kBounded) == v1::CONSISTENCY_MODE_BOUNDED);
  ConsistencyOptions c;
  switch (p.mode()) {
    case v1::CONSISTENCY_MODE_UNSPECIFIED:
    case v1::CONSISTENCY_MODE_ASYNC:
      c.mode = ConsistencyMode::kAsync;
      break;
    case v1::CONSISTENCY_MODE_SYNC:
    case v1::CONSISTENCY_MODE_BOUNDED:
      c.mode = static_cast<ConsistencyMode>(p.mode());
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "consistency.mode = ", static_cast<int>(p.mode()), " is not a ConsistencyMode"));
  }
  if (c.mode == ConsistencyMode::kSync) {
    c.replicas_to_aggregate = p.replicas_to_aggregate();
    c.total_replicas = p.total_replicas();
    const double timeout = p.round_timeout_seconds();
    if (!(timeout >= 0) || timeout > 1e6) {
      return absl::InvalidArgumentError(
          absl::StrCat("consistency.round_timeout_seconds = ", timeout, " must be in [0, 1e6]"));
    }
    c.round_timeout = absl::Seconds(timeout);
  }
  if (c.mode == ConsistencyMode::kBounded) {
    c.max_staleness = p.max_staleness();
    c.staleness_lr_scaling = p.staleness_lr_scaling();
  }
  if (absl::Status s = ValidateConsistency(c); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("consistency: ", s.message()));
  }
  return c;
}

void ToProto(const Model& model, v1::ModelInfo* p) {
  const UpdateEngine& engine = model.engine();
  std::shared_ptr<const ShardView> view = engine.view();
  p->set_name(model.name());
  p->set_version(engine.version());
  p->set_tensor_count(view->tensor_count());
  p->set_parameter_count(view->parameter_count());
  ToProto(engine.consistency(), p->mutable_consistency());
  p->set_memory_bytes(model.memory_bytes());
  p->set_plan_hash(view->plan_hash());
}

absl::StatusOr<BufferValue> BufferFromProto(const v1::Buffer& p) {
  absl::StatusOr<safetensors::DType> dtype = safetensors::DTypeOfName(p.dtype());
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("buffer ", QuoteName(p.name()), ": ", dtype.status().message()));
  }
  return BufferValue{p.name(), *dtype, {p.shape().begin(), p.shape().end()}, p.data()};
}

void ToProto(const BufferValue& buffer, v1::Buffer* p) {
  p->set_name(buffer.name);
  p->set_dtype(safetensors::DTypeName(buffer.dtype));
  for (int64_t d : buffer.shape) p->add_shape(d);
  p->set_data(buffer.data);
}

}  // namespace fusedps
