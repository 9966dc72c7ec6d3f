#include "server/checkpoint/manifest.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/stubs/common.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"
#include "server/checkpoint/manifest_legacy.h"

namespace fusedps::checkpoint {
namespace {

using nlohmann::json;

std::string StatusText(const google::protobuf::util::Status& status) {
  return std::string(status.message().data(), status.message().size());
}

}  // namespace

absl::StatusOr<v1::CheckpointManifest> ParseManifest(absl::string_view text,
                                                     const std::string& path) {
  // Any format's "format" and "format_version" first, from a lenient parse: a newer format
  // must be FAILED_PRECONDITION, whatever else it holds.
  const json m = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  const auto has = [&](const char* key) { return m.is_object() && m.contains(key); };
  if (!has("format") || m["format"] != kManifestFormat || !has("serial") || !has("version") ||
      !has("files")) {
    return absl::DataLossError(absl::StrCat(path, " is not a complete manifest"));
  }
  const int64_t format_version = has("format_version") && m["format_version"].is_number_integer()
                                     ? m["format_version"].get<int64_t>()
                                     : 0;
  if (format_version < kOldestFormatVersionRead || format_version > kFormatVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " has format_version ", format_version, "; this server reads ",
                     kOldestFormatVersionRead, " to ", kFormatVersion));
  }
  if (format_version < 4) return LegacyManifestToProto(m, path);
  v1::CheckpointManifest manifest;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;  // A key the message lacks is damage, or a misreading.
  const std::string input(text);
  const auto status = google::protobuf::util::JsonStringToMessage(input, &manifest, options);
  if (!status.ok()) return absl::DataLossError(absl::StrCat(path, ": ", StatusText(status)));
  return manifest;
}

absl::StatusOr<std::string> ManifestToJson(const v1::CheckpointManifest& manifest) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
#if GOOGLE_PROTOBUF_VERSION >= 5026000
  options.always_print_fields_with_no_presence = true;  // The name since protobuf 26.
#else
  options.always_print_primitive_fields = true;
#endif
  std::string out;
  const auto status = google::protobuf::util::MessageToJsonString(manifest, &out, options);
  if (!status.ok()) {
    return absl::InternalError(absl::StrCat("cannot print the manifest: ", StatusText(status)));
  }
  return out;
}

}  // namespace fusedps::checkpoint
