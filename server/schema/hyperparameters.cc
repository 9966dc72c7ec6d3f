#include "server/schema/hyperparameters.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/message_differencer.h"
#include "kernels/backend.h"
#include "kernels/tensor_layout.h"

namespace fusedps {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Reflection;

// The kernels' mirror enums (adamw_math.h, backend.h) take the proto's values, so a conversion
// is a cast (here and in server/service/convert.cc).
static_assert(static_cast<int>(GradDType::kFloat32) == v1::DTYPE_FLOAT32);
static_assert(static_cast<int>(GradDType::kBFloat16) == v1::DTYPE_BFLOAT16);
static_assert(static_cast<int>(GradDType::kFloat16) == v1::DTYPE_FLOAT16);
static_assert(static_cast<int>(ParamCopyDType::kBFloat16) == v1::DTYPE_BFLOAT16);
static_assert(static_cast<int>(ParamCopyDType::kFloat16) == v1::DTYPE_FLOAT16);
static_assert(static_cast<int>(TensorField::kParam) == v1::TENSOR_FIELD_PARAM);
static_assert(static_cast<int>(TensorField::kExpAvg) == v1::TENSOR_FIELD_EXP_AVG);
static_assert(static_cast<int>(TensorField::kExpAvgSq) == v1::TENSOR_FIELD_EXP_AVG_SQ);
static_assert(static_cast<int>(TensorField::kMaxExpAvgSq) == v1::TENSOR_FIELD_MAX_EXP_AVG_SQ);
static_assert(static_cast<int>(StateDType::kFloat32) == v1::STATE_DTYPE_FLOAT32);
static_assert(static_cast<int>(StateDType::kBFloat16) == v1::STATE_DTYPE_BFLOAT16);
static_assert(static_cast<int>(StateDType::kInt8) == v1::STATE_DTYPE_INT8);
static_assert(static_cast<int>(ParamsDType::kFloat32) == v1::DTYPE_FLOAT32);
static_assert(static_cast<int>(ParamsDType::kBFloat16) == v1::DTYPE_BFLOAT16);

// The proto's field of that name. A name of kernels/adamw_math.h's tables that the proto lacks
// is a build of mismatched sources: it stops the process at the first conversion (and the unit
// test).
const FieldDescriptor* Field(const char* name) {
  const FieldDescriptor* f = v1::Hyperparameters::descriptor()->FindFieldByName(name);
  if (f == nullptr) {
    std::fprintf(stderr, "fusedps: proto fusedps.v1.Hyperparameters has no field %s\n", name);
    std::abort();
  }
  return f;
}

absl::StatusOr<bool> DecoupledFromProto(v1::WeightDecayMode mode) {
  switch (mode) {
    case v1::WEIGHT_DECAY_MODE_UNSPECIFIED:
    case v1::WEIGHT_DECAY_MODE_DECOUPLED:
      return true;
    case v1::WEIGHT_DECAY_MODE_L2:
      return false;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("hyperparameters.weight_decay_mode = ", static_cast<int>(mode),
                       " must be DECOUPLED (1) or L2 (2)"));
  }
}

absl::StatusOr<StateDType> StateDTypeFromProto(v1::StateDType dtype) {
  switch (dtype) {
    case v1::STATE_DTYPE_UNSPECIFIED:
      return StateDType::kFloat32;
    case v1::STATE_DTYPE_FLOAT32:
    case v1::STATE_DTYPE_BFLOAT16:
    case v1::STATE_DTYPE_INT8:
      return static_cast<StateDType>(dtype);
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("hyperparameters.state_dtype = ", static_cast<int>(dtype),
                       " must be FLOAT32 (1), BFLOAT16 (2) or INT8 (3)"));
  }
}

absl::StatusOr<ParamsDType> ParamsDTypeFromProto(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_UNSPECIFIED:
      return ParamsDType::kFloat32;
    case v1::DTYPE_FLOAT32:
    case v1::DTYPE_BFLOAT16:
      return static_cast<ParamsDType>(dtype);
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("hyperparameters.params_dtype = ", static_cast<int>(dtype),
                       " must be FLOAT32 (1) or BFLOAT16 (2)"));
  }
}

// The fields `p` sets, written over `h`.
absl::Status MergeFromProto(const v1::Hyperparameters& p, AdamWHyperparameters* h) {
  const Reflection* r = v1::Hyperparameters::GetReflection();
  for (const auto& [name, member] : kDoubleHyperparameters) {
    if (const FieldDescriptor* f = Field(name); r->HasField(p, f)) h->*member = r->GetDouble(p, f);
  }
  for (const auto& [name, member] : kBoolHyperparameters) {
    if (const FieldDescriptor* f = Field(name); r->HasField(p, f)) h->*member = r->GetBool(p, f);
  }
  if (p.has_weight_decay_mode()) {
    absl::StatusOr<bool> decoupled = DecoupledFromProto(p.weight_decay_mode());
    if (!decoupled.ok()) return decoupled.status();
    h->decoupled_weight_decay = *decoupled;
  }
  if (p.has_state_dtype()) {
    absl::StatusOr<StateDType> dtype = StateDTypeFromProto(p.state_dtype());
    if (!dtype.ok()) return dtype.status();
    h->state_dtype = *dtype;
  }
  if (p.has_params_dtype()) {
    absl::StatusOr<ParamsDType> dtype = ParamsDTypeFromProto(p.params_dtype());
    if (!dtype.ok()) return dtype.status();
    h->params_dtype = *dtype;
  }
  if (p.has_rounding_seed()) h->rounding_seed = p.rounding_seed();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<AdamWHyperparameters> HyperparametersFromProto(const v1::Hyperparameters& p) {
  AdamWHyperparameters h;  // The defaults.
  if (absl::Status s = MergeFromProto(p, &h); !s.ok()) return s;
  return h;
}

v1::Hyperparameters HyperparametersToProto(const AdamWHyperparameters& h) {
  v1::Hyperparameters p;
  const Reflection* r = v1::Hyperparameters::GetReflection();
  for (const auto& [name, member] : kDoubleHyperparameters)
    r->SetDouble(&p, Field(name), h.*member);
  for (const auto& [name, member] : kBoolHyperparameters) r->SetBool(&p, Field(name), h.*member);
  p.set_weight_decay_mode(h.decoupled_weight_decay ? v1::WEIGHT_DECAY_MODE_DECOUPLED
                                                   : v1::WEIGHT_DECAY_MODE_L2);
  p.set_state_dtype(static_cast<v1::StateDType>(h.state_dtype));
  p.set_params_dtype(static_cast<v1::DType>(h.params_dtype));
  p.set_rounding_seed(h.rounding_seed);
  return p;
}

absl::Status ValidateHyperparameters(const AdamWHyperparameters& h) {
  auto out_of_range = [](absl::string_view field, double value, absl::string_view range) {
    return absl::InvalidArgumentError(
        absl::StrCat("hyperparameters.", field, " = ", value, " must be ", range));
  };
  if (!std::isfinite(h.lr) || h.lr < 0) return out_of_range("lr", h.lr, "finite and >= 0");
  if (!(h.beta1 >= 0 && h.beta1 < 1)) return out_of_range("beta1", h.beta1, "in [0, 1)");
  if (!(h.beta2 >= 0 && h.beta2 < 1)) return out_of_range("beta2", h.beta2, "in [0, 1)");
  if (!std::isfinite(h.eps) || h.eps < 0) return out_of_range("eps", h.eps, "finite and >= 0");
  if (!std::isfinite(h.weight_decay) || h.weight_decay < 0) {
    return out_of_range("weight_decay", h.weight_decay, "finite and >= 0");
  }
  if (h.amsgrad && h.state_dtype != StateDType::kFloat32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hyperparameters.amsgrad needs state_dtype FLOAT32, not ", StateDTypeName(h.state_dtype)));
  }
  return absl::OkStatus();
}

absl::StatusOr<AdamWHyperparameters> UpdatedHyperparameters(const AdamWHyperparameters& old,
                                                            const v1::Hyperparameters& update) {
  AdamWHyperparameters h = old;
  if (absl::Status s = MergeFromProto(update, &h); !s.ok()) return s;
  if (h.amsgrad != old.amsgrad) {
    return absl::InvalidArgumentError(
        "hyperparameters.amsgrad is fixed at registration (max_exp_avg_sq would be missing)");
  }
  if (h.state_dtype != old.state_dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hyperparameters.state_dtype is fixed at registration (the group's state is stored in ",
        StateDTypeName(old.state_dtype), ")"));
  }
  if (h.params_dtype != old.params_dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("hyperparameters.params_dtype is fixed at registration (the group's params "
                     "are stored in ",
                     ParamsDTypeName(old.params_dtype), ")"));
  }
  if (h.rounding_seed != old.rounding_seed) {
    return absl::InvalidArgumentError(
        absl::StrCat("hyperparameters.rounding_seed is fixed at registration (it is ",
                     old.rounding_seed, "; a replay or restore must round the same)"));
  }
  if (absl::Status s = ValidateHyperparameters(h); !s.ok()) return s;
  return h;
}

bool SameHyperparameters(const AdamWHyperparameters& a, const AdamWHyperparameters& b) {
  return google::protobuf::util::MessageDifferencer::Equals(HyperparametersToProto(a),
                                                            HyperparametersToProto(b));
}

}  // namespace fusedps
