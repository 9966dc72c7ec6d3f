#include "server/server_options.h"

#include "absl/strings/str_cat.h"

namespace fusedps {

absl::Status ValidateServerOptions(const ServerOptions& options) {
  if (!(options.push_part_wait > absl::ZeroDuration())) {
    return absl::InvalidArgumentError("--push-part-wait-seconds must be > 0");
  }
  if (options.call_idle < absl::ZeroDuration() || !(options.keepalive > absl::ZeroDuration()) ||
      options.window_bytes < 4096) {
    return absl::InvalidArgumentError(
        "--call-idle-seconds must be >= 0, --keepalive-seconds > 0 and --window-bytes >= 4096");
  }
  const checkpoint::CheckpointerOptions& checkpoint = options.checkpoint;
  if (checkpoint.interval < absl::ZeroDuration() || checkpoint.keep < 1 ||
      options.restore.empty()) {
    return absl::InvalidArgumentError(
        "--checkpoint-interval-seconds must be >= 0, --checkpoint-keep >= 1, and --restore "
        "latest, none or a path");
  }
  if (checkpoint.root.empty() &&
      (checkpoint.interval > absl::ZeroDuration() || checkpoint.every_versions > 0)) {
    return absl::InvalidArgumentError(
        "--checkpoint-interval-seconds and --checkpoint-every-versions need --checkpoint-dir");
  }
  if (!(options.tls.reload_interval > absl::ZeroDuration()) ||
      !(options.auth_tokens_reload > absl::ZeroDuration())) {
    return absl::InvalidArgumentError("--credentials-reload-seconds must be > 0");
  }
  return ValidateConsistency(options.consistency);
}

bool AbslParseFlag(absl::string_view text, ParamCopyDType* copy, std::string* error) {
  absl::StatusOr<ParamCopyDType> parsed = ParseParamCopyDType(text);  // kernels/backend.h
  if (!parsed.ok()) {
    *error = absl::StrCat("--param-copy-dtype = ", parsed.status().message());
    return false;
  }
  *copy = *parsed;
  return true;
}

std::string AbslUnparseFlag(ParamCopyDType copy) { return ParamCopyDTypeName(copy); }

bool AbslParseFlag(absl::string_view text, ConsistencyMode* mode, std::string* error) {
  absl::StatusOr<ConsistencyMode> parsed = ParseConsistencyMode(text);
  if (!parsed.ok()) {
    *error = std::string(parsed.status().message());
    return false;
  }
  *mode = *parsed;
  return true;
}

std::string AbslUnparseFlag(ConsistencyMode mode) { return ConsistencyModeName(mode); }

}  // namespace fusedps
