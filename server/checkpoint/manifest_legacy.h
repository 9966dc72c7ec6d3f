// manifest_legacy.h: manifests of formats 2 and 3 (docs/checkpoints.md, "Formats 2 and 3"),
// written by servers before the manifest became the fusedps.v1.CheckpointManifest message;
// read-only. This is the one place that knows their JSON: it converts it to the message of
// format 4, so that the reader proper (ShardReader::Open) deals with the message alone and
// checks every format alike.
//
// What differs from format 4:
//   - numbers are JSON numbers (64-bit integers too), and "serial", "version", "files",
//     "param_copy_dtype", "param_groups", "tensors" and "retry_table" are required; a file's
//     "crc32" must fit 32 bits;
//   - a tensor's dtypes are names: "params_dtype" "fp32" or "bf16" and "state_dtype" "fp32",
//     "bf16" or "int8" (each optional);
//   - format 3: a group is {"name", "hyperparameters"} as in format 4 (a key the proto lacks is
//     refused there too); format 2: each hyperparameter is a key of the group (lr, beta1, beta2,
//     eps, weight_decay numbers; amsgrad, maximize, decoupled_weight_decay bools) and the
//     storage keys (state_dtype and params_dtype names, rounding_seed a number) are optional;
//   - a reply's round_workers and round_timed_out are optional (0 and false), missing_replicas
//     is required with round_timed_out;
//   - keys the converter does not know are ignored (format 4 refuses them).
#ifndef FUSEDPS_SERVER_CHECKPOINT_MANIFEST_LEGACY_H_
#define FUSEDPS_SERVER_CHECKPOINT_MANIFEST_LEGACY_H_

#include <string>

#include "absl/status/statusor.h"
#include "fusedps/v1/checkpoint.pb.h"
#include "nlohmann/json.hpp"

namespace fusedps::checkpoint {

// `manifest`, a format 2 or 3 manifest (its "format" and "format_version" checked by the
// caller), as the message; its format_version stays the one it has.
// Errors: DATA_LOSS "<path>: <where> lacks \"<key>\"", "<path>: <where>.<key> has the wrong
// type", "<path>: <where>.<key> is \"<name>\", not one of <names>" for a dtype name, or
// "<path>: a bad entry for <file>" for a file without an unsigned "bytes" and a 32-bit "crc32".
absl::StatusOr<v1::CheckpointManifest> LegacyManifestToProto(const nlohmann::json& manifest,
                                                             const std::string& path);

}  // namespace fusedps::checkpoint

#endif  // FUSEDPS_SERVER_CHECKPOINT_MANIFEST_LEGACY_H_
