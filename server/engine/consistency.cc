#include "server/engine/consistency.h"

#include "absl/strings/str_cat.h"

namespace fusedps {

const char* ConsistencyModeName(ConsistencyMode mode) {
  switch (mode) {
    case ConsistencyMode::kSync:
      return "sync";
    case ConsistencyMode::kBounded:
      return "bounded";
    case ConsistencyMode::kAsync:
    default:
      return "async";
  }
}

absl::StatusOr<ConsistencyMode> ParseConsistencyMode(absl::string_view name) {
  for (ConsistencyMode mode :
       {ConsistencyMode::kAsync, ConsistencyMode::kSync, ConsistencyMode::kBounded}) {
    if (name == ConsistencyModeName(mode)) return mode;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--mode=", name, " must be async, sync or bounded"));
}

absl::Status ValidateConsistency(const ConsistencyOptions& options) {
  if (options.mode != ConsistencyMode::kSync) return absl::OkStatus();
  if (options.total_replicas < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--total-replicas=", options.total_replicas, " must be >= 1"));
  }
  if (options.replicas_to_aggregate < 1 || options.replicas_to_aggregate > options.total_replicas) {
    return absl::InvalidArgumentError(
        absl::StrCat("--replicas-to-aggregate=", options.replicas_to_aggregate,
                     " must be in 1..--total-replicas (", options.total_replicas, ")"));
  }
  if (options.round_timeout < absl::ZeroDuration() ||
      options.round_timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--round-timeout-seconds=", absl::ToDoubleSeconds(options.round_timeout),
                     " must be finite and >= 0 (0: no timeout)"));
  }
  return absl::OkStatus();
}

absl::Status StaleVersionError(absl::string_view why, uint64_t base_version, uint64_t version) {
  return absl::AbortedError(absl::StrCat(why, ": header.base_version ", base_version,
                                         ", shard version ", version,
                                         "; pull the parameters and push again"));
}

absl::Status CheckSyncPush(absl::string_view client_id) {
  if (client_id.empty()) {
    return absl::InvalidArgumentError(
        "header.client_id is empty: a sync-mode push needs one (rounds count distinct "
        "client_ids)");
  }
  return absl::OkStatus();
}

absl::Status CheckStaleness(const ConsistencyOptions& options, uint64_t base_version,
                            uint64_t version) {
  if (base_version >= version || version - base_version <= options.max_staleness) {
    return absl::OkStatus();
  }
  return StaleVersionError(absl::StrCat("staleness ", version - base_version,
                                        " exceeds --max-staleness=", options.max_staleness),
                           base_version, version);
}

}  // namespace fusedps
