// hyperparameters.h: a param group's AdamW hyperparameters as the wire API declares them (proto
// fusedps.v1.Hyperparameters, the one schema) and the one C++ struct the kernels take
// (AdamWHyperparameters, kernels/adamw_math.h), made from it here and nowhere else: one
// conversion each way, one validation and one comparison. (The checkpoint manifest stores the
// message itself: server/checkpoint/manifest.h.)
//
// The scalar fields convert by name through kDoubleHyperparameters and kBoolHyperparameters
// (kernels/adamw_math.h); weight_decay_mode, state_dtype, params_dtype and rounding_seed by
// name in hyperparameters.cc. An unset field of a registration takes torch.optim.AdamW's
// default, which AdamWHyperparameters' initializers hold (fp32 state and params, seed 0 for the
// storage fields).
//
// Errors are INVALID_ARGUMENT naming the field ("hyperparameters.<field>") and what it takes.
#ifndef FUSEDPS_SERVER_SCHEMA_HYPERPARAMETERS_H_
#define FUSEDPS_SERVER_SCHEMA_HYPERPARAMETERS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "fusedps/v1/parameter_service.pb.h"
#include "kernels/adamw_math.h"

namespace fusedps {

// A registration's hyperparameters: unset fields take the defaults. INVALID_ARGUMENT for a
// weight_decay_mode that is not a WeightDecayMode, a state_dtype that is not a StateDType, a
// params_dtype other than FLOAT32 and BFLOAT16 (UNSPECIFIED means FLOAT32 for both). Ranges are
// ValidateHyperparameters'.
absl::StatusOr<AdamWHyperparameters> HyperparametersFromProto(const v1::Hyperparameters& p);

// Every field set, the storage fields included.
v1::Hyperparameters HyperparametersToProto(const AdamWHyperparameters& h);

// INVALID_ARGUMENT naming the field and its range for a hyperparameter out of range, and for
// amsgrad with a state_dtype other than fp32 (max_exp_avg_sq is fp32 beside fp32 state).
absl::Status ValidateHyperparameters(const AdamWHyperparameters& h);

// `h` changed by the fields `update` sets (a SetHyperparameters request); INVALID_ARGUMENT as
// HyperparametersFromProto, when the result is out of range, or when amsgrad, state_dtype,
// params_dtype or rounding_seed would change (fixed at registration: the state's storage, and the
// bits of stochastic rounding, depend on them; repeating their value is allowed).
absl::StatusOr<AdamWHyperparameters> UpdatedHyperparameters(const AdamWHyperparameters& h,
                                                            const v1::Hyperparameters& update);

// Whether every field is equal (doubles compared with ==).
bool SameHyperparameters(const AdamWHyperparameters& a, const AdamWHyperparameters& b);

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_SCHEMA_HYPERPARAMETERS_H_
