// manifest.h: a checkpoint's manifest.json and the message it is (fusedps.v1.CheckpointManifest,
// proto/fusedps/v1/checkpoint.proto; docs/checkpoints.md). Format 4 is that message in
// protobuf's JSON mapping: written with MessageToJsonString (proto field names, every field
// printed, 64-bit integers as JSON strings) and read with JsonStringToMessage, which refuses a
// key the message lacks. Formats 2 and 3 (older servers') are read through one converter
// (manifest_legacy.h), so that everything past ParseManifest deals with the message alone.
//
// Usage:
//   absl::StatusOr<v1::CheckpointManifest> m = ParseManifest(text, path);  // any format read
//   std::string text = ManifestToJson(*m);                                  // format 4's JSON
#ifndef FUSEDPS_SERVER_CHECKPOINT_MANIFEST_H_
#define FUSEDPS_SERVER_CHECKPOINT_MANIFEST_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "fusedps/v1/checkpoint.pb.h"

namespace fusedps::checkpoint {

inline constexpr char kManifestFormat[] = "fusedps-checkpoint";  // The manifest's "format".
// The format written. 4: the manifest is fusedps.v1.CheckpointManifest in protobuf's JSON
// mapping. 3 (still read): a group's hyperparameters in that mapping, the rest by hand, dtypes by
// name. 2 (still read): each hyperparameter a key of the group. 1: sha256 checksums (no longer
// read).
inline constexpr int kFormatVersion = 4;
inline constexpr int kOldestFormatVersionRead = 2;

// The manifest that `text` (manifest.json's contents, from `path`, which messages name) holds,
// as format 4's message, whatever its format: 4 parsed as the message's JSON mapping, 2 and 3
// converted (LegacyManifestToProto). Only the JSON's shape is checked here (keys, types, the
// dtype names of formats 2 and 3); what the values mean is the reader's (ShardReader::Open).
// Errors: DATA_LOSS naming `path` for text that is not JSON, a manifest without "format"
// "fusedps-checkpoint", "format_version", "serial", "version" or "files", a key the message
// lacks (format 4; protobuf's message names it) or a value of the wrong type (naming the key);
// FAILED_PRECONDITION "<path> has format_version N; this server reads 2 to 4" for another
// format_version (a newer server's: the caller must not pass it over for an older checkpoint).
absl::StatusOr<v1::CheckpointManifest> ParseManifest(absl::string_view text,
                                                     const std::string& path);

// Format 4's JSON of `manifest`: protobuf's JSON mapping with the proto's field names, every
// field printed (defaults too; int8_codebooks only when set), one key per line.
// Errors: INTERNAL when protobuf cannot print it (a string that is not UTF-8).
absl::StatusOr<std::string> ManifestToJson(const v1::CheckpointManifest& manifest);

}  // namespace fusedps::checkpoint

#endif  // FUSEDPS_SERVER_CHECKPOINT_MANIFEST_H_
