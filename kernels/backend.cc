#include "kernels/backend.h"

#include <initializer_list>

#include "absl/strings/str_cat.h"
#include "common/dtype_names.h"

namespace fusedps {

// The names are dtype_names.h's: the kernels' enums have the proto's codes
// (static_asserts in server/schema/hyperparameters.cc).
const char* ParamCopyDTypeName(ParamCopyDType copy) {
  if (copy == ParamCopyDType::kNone) return "none";
  return dtypes::ShortName(static_cast<v1::DType>(copy));
}

absl::StatusOr<ParamCopyDType> ParseParamCopyDType(absl::string_view name) {
  for (ParamCopyDType copy :
       {ParamCopyDType::kNone, ParamCopyDType::kBFloat16, ParamCopyDType::kFloat16}) {
    if (name == ParamCopyDTypeName(copy)) return copy;
  }
  return absl::InvalidArgumentError(absl::StrCat("'", name, "' must be none, bf16 or fp16"));
}

const char* StateDTypeName(StateDType dtype) {
  return dtypes::ShortName(static_cast<v1::StateDType>(dtype));
}

const char* ParamsDTypeName(ParamsDType dtype) {
  return dtypes::ShortName(static_cast<v1::DType>(dtype));
}

const char* TensorFieldName(TensorField field) {
  switch (field) {  // The two fields the proto lacks: an int8 tensor's block scales.
    case TensorField::kExpAvgAbsmax:
      return "exp_avg_absmax";
    case TensorField::kExpAvgSqAbsmax:
      return "exp_avg_sq_absmax";
    default:  // The proto's fields, with its codes (server/schema's static_asserts).
      return dtypes::TensorFieldName(static_cast<v1::TensorField>(field));
  }
}

TensorField ScalesField(TensorField moment) {
  return moment == TensorField::kExpAvg ? TensorField::kExpAvgAbsmax : TensorField::kExpAvgSqAbsmax;
}

int StoredElementBytes(TensorLayout layout, TensorField field) {
  switch (field) {
    case TensorField::kParam:
      return ParamsBytes(layout.params);
    case TensorField::kExpAvg:
    case TensorField::kExpAvgSq:
      return StateBytes(layout.state);
    case TensorField::kMaxExpAvgSq:
    case TensorField::kExpAvgAbsmax:
    case TensorField::kExpAvgSqAbsmax:
      break;
  }
  return 4;
}

uint64_t StoredCount(TensorLayout layout, TensorField field, uint64_t numel) {
  if (field == TensorField::kExpAvgAbsmax || field == TensorField::kExpAvgSqAbsmax) {
    return ScaleCount(layout, numel);
  }
  return numel;
}

absl::Status ReadNow(OptimizerBackend& backend, const ReadRequest& request) {
  if (absl::Status s = backend.Read(request); !s.ok()) return s;
  absl::StatusOr<Marker> marker = backend.Mark();
  if (!marker.ok()) return marker.status();
  return backend.Wait(*marker).status();
}

absl::StatusOr<StepOutcome> StepNow(OptimizerBackend& backend, const StepRequest& request) {
  absl::StatusOr<StepOutcome> outcome = backend.Step(request);
  if (!outcome.ok()) return outcome;
  if (absl::StatusOr<WorkDone> done = backend.Wait(outcome->marker); !done.ok()) {
    return done.status();
  }
  return outcome;
}

namespace {

absl::Status ReadOne(OptimizerBackend& backend, TensorField field, bool param_copy, bool stored,
                     uint32_t tensor, void* out) {
  const uint64_t offset = 0;
  ReadRequest request;
  request.field = field;
  request.param_copy = param_copy;
  request.stored = stored;
  request.tensors = absl::MakeConstSpan(&tensor, 1);
  request.dst_offsets = absl::MakeConstSpan(&offset, 1);
  request.dst = out;
  return ReadNow(backend, request);
}

}  // namespace

absl::Status ReadTensor(OptimizerBackend& backend, TensorField field, uint32_t tensor, float* out) {
  return ReadOne(backend, field, /*param_copy=*/false, /*stored=*/false, tensor, out);
}

absl::Status ReadStored(OptimizerBackend& backend, TensorField field, uint32_t tensor, void* out) {
  return ReadOne(backend, field, /*param_copy=*/false, /*stored=*/true, tensor, out);
}

absl::Status ReadParamCopy(OptimizerBackend& backend, uint32_t tensor, uint16_t* out) {
  return ReadOne(backend, TensorField::kParam, /*param_copy=*/true, /*stored=*/false, tensor, out);
}

}  // namespace fusedps
