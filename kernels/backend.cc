#include "kernels/backend.h"

namespace fusedps {

const char* ParamCopyDTypeName(ParamCopyDType copy) {
  switch (copy) {
    case ParamCopyDType::kBFloat16:
      return "bf16";
    case ParamCopyDType::kFloat16:
      return "fp16";
    case ParamCopyDType::kNone:
      break;
  }
  return "none";
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

absl::Status ReadOne(OptimizerBackend& backend, TensorField field, bool param_copy,
                     uint32_t tensor, void* out) {
  const uint64_t offset = 0;
  ReadRequest request;
  request.field = field;
  request.param_copy = param_copy;
  request.tensors = absl::MakeConstSpan(&tensor, 1);
  request.dst_offsets = absl::MakeConstSpan(&offset, 1);
  request.dst = out;
  return ReadNow(backend, request);
}

}  // namespace

absl::Status ReadTensor(OptimizerBackend& backend, TensorField field, uint32_t tensor,
                        float* out) {
  return ReadOne(backend, field, /*param_copy=*/false, tensor, out);
}

absl::Status ReadParamCopy(OptimizerBackend& backend, uint32_t tensor, uint16_t* out) {
  return ReadOne(backend, TensorField::kParam, /*param_copy=*/true, tensor, out);
}

}  // namespace fusedps
