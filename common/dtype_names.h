// dtype_names.h: every dtype's names and element size, and the tensor fields' names, built from
// the proto's enums.
//
// The one dtype table of the C++ code: the kernels' (StateDTypeName, ParamsDTypeName,
// ParamCopyDTypeName), the client's (DTypeName, ParseDType, StateDTypeName, ElementBytes) and the
// benchmarks' name functions are views of it, as client/python/fusedps/_dtypes.py is the
// Python client's table. Both follow the same rules over fusedps.v1.DType and
// fusedps.v1.StateDType (proto/fusedps/v1/parameter_service.proto):
//   - name: the member's name without its enum's prefix, in lower case (DTYPE_BFLOAT16 ->
//     "bfloat16", STATE_DTYPE_INT8 -> "int8"). UNSPECIFIED is no dtype.
//   - short name: "bfloat" becomes "bf" and "float" "fp" ("fp32", "bf16", "fp16", "int8"): the
//     spelling of flags, metrics, the server's messages and checkpoint manifests before
//     format 4.
//   - element size: the name's bit count over 8, in bytes.
// A member added to either enum gets its names and size here with nothing written; which
// arguments take it is each caller's rule. fusedps.v1.TensorField's names follow the same rule
// ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq").
//
// Thread safety: the table is built once, on first use, and read-only after; every function is
// safe to call from any thread. Returned strings live as long as the process.
#ifndef FUSEDPS_COMMON_DTYPE_NAMES_H_
#define FUSEDPS_COMMON_DTYPE_NAMES_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "fusedps/v1/parameter_service.pb.h"

namespace fusedps::dtypes {

// "float32", "bfloat16", "float16"; "int8" for StateDType. "?" for UNSPECIFIED or a code the
// enum does not have.
const char* Name(v1::DType dtype);
const char* Name(v1::StateDType dtype);

// "fp32", "bf16", "fp16"; "int8" for StateDType. "?" as Name.
const char* ShortName(v1::DType dtype);
const char* ShortName(v1::StateDType dtype);

// Bytes per element: 4 for FLOAT32, 2 for BFLOAT16 and FLOAT16, 1 for INT8; 0 for UNSPECIFIED
// or an unknown code.
int ElementBytes(v1::DType dtype);
int ElementBytes(v1::StateDType dtype);

// The dtype a spelling names: either spelling ("bf16" or "bfloat16"), in any case.
// Errors: INVALID_ARGUMENT "must be fp32, bf16 or fp16, not NAME" (the enum's short names).
absl::StatusOr<v1::DType> ParseDType(absl::string_view spelling);
absl::StatusOr<v1::StateDType> ParseStateDType(absl::string_view spelling);

// "param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq": the fields as clients spell them (fusedps
// pull --field, Client.pull_state); "?" for UNSPECIFIED or an unknown code.
const char* TensorFieldName(v1::TensorField field);
// The field a name names, in any case. Errors: INVALID_ARGUMENT "must be param, exp_avg,
// exp_avg_sq or max_exp_avg_sq, not NAME".
absl::StatusOr<v1::TensorField> ParseTensorField(absl::string_view name);

}  // namespace fusedps::dtypes

#endif  // FUSEDPS_COMMON_DTYPE_NAMES_H_
