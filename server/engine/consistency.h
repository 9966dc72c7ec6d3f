// consistency.h: how a shard turns pushes into optimizer steps (docs/consistency.md).
//
//   async    every push is its own AdamW step (asynchronous SGD), whatever its base_version.
//   bounded  stale synchronous parallel (Ho et al. 2013): a push is its own step when its
//            staleness tau = version - base_version is at most max_staleness, else ABORTED;
//            optionally that step's lr is lr / (1 + tau) (Zhang et al. 2016, on the lr because
//            Adam normalizes a scaled gradient away).
//   sync     K of N (TensorFlow's SyncReplicasOptimizer, Chen et al. 2016): a round at version
//            v sums, on the device as each push lands, the gradients of the first K pushes from
//            distinct client_ids whose base_version is v; their mean is one AdamW step, and the
//            version becomes v + 1. Every pusher of the round is answered once that step ran.
//            Pushes for another version (the N - K backups' late ones among them) are ABORTED.
//            A round with fewer than K pushes round_timeout after its first is applied with the
//            pushes it has (their mean). A non-finite gradient in any push skips the whole
//            round's step, as DDP with GradScaler skips a step on every rank.
//
// The engine applies the mode (update_engine.h; engine_rounds.cc); the service refuses what it
// can from the header alone, before reading a payload.
#ifndef FUSEDPS_SERVER_ENGINE_CONSISTENCY_H_
#define FUSEDPS_SERVER_ENGINE_CONSISTENCY_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace fusedps {

// Values match proto fusedps.v1.ConsistencyMode.
enum class ConsistencyMode : uint8_t { kAsync = 1, kSync = 2, kBounded = 3 };

struct ConsistencyOptions {
  ConsistencyMode mode = ConsistencyMode::kAsync;
  uint32_t replicas_to_aggregate = 1;                // sync: K, 1..total_replicas.
  uint32_t total_replicas = 1;                       // sync: N, the trainers (N - K backups).
  absl::Duration round_timeout = absl::Seconds(30);  // sync; zero: a round waits for ever.
  uint64_t max_staleness = 0;                        // bounded: s.
  bool staleness_lr_scaling = false;                 // bounded: lr / (1 + tau).
};

// "async", "sync", "bounded": the spelling of --mode.
const char* ConsistencyModeName(ConsistencyMode mode);
// INVALID_ARGUMENT naming --mode for another spelling.
absl::StatusOr<ConsistencyMode> ParseConsistencyMode(absl::string_view name);
// INVALID_ARGUMENT naming the flag and its limit: K in 1..N, N >= 1, a finite round timeout
// >= 0.
absl::Status ValidateConsistency(const ConsistencyOptions& options);

// Why a push was refused for its version (fusedps_pushes_dropped_total{reason}).
inline constexpr char kDropStaleVersion[] = "stale_version";            // sync.
inline constexpr char kDropClientInRound[] = "client_in_round";         // sync.
inline constexpr char kDropStalenessExceeded[] = "staleness_exceeded";  // bounded.

// One sync round, once its step ran and its pushers were answered. Seconds.
struct RoundStats {
  uint32_t workers = 0;    // Pushes averaged.
  bool timed_out = false;  // Closed by round_timeout rather than K pushes.
  double duration = 0;     // The first push's arrival until its pushers were answered.
  double receive = 0;      // The first push's arrival until the last push had arrived whole.
  double accumulate = 0;   // Then until the last push's gradients were summed on the device.
  double apply = 0;        // Then until the round's step had run.
  double ack = 0;          // Then until every pusher's reply was handed to its call.
};

// What the engine tells the metrics about consistency. Called on the engine's threads; the
// methods must be thread-safe and must not block.
class ConsistencyObserver {
 public:
  virtual ~ConsistencyObserver() = default;
  // The staleness of a push as the engine takes it (before any refusal), in every mode.
  virtual void OnStaleness(uint64_t tau) = 0;
  // A push refused for its version, with one of the kDrop reasons.
  virtual void OnDropped(absl::string_view reason) = 0;
  virtual void OnRound(const RoundStats& round) = 0;
};

// The ABORTED a push gets when its base_version does not fit the shard's `version`.
absl::Status StaleVersionError(absl::string_view why, uint64_t base_version, uint64_t version);

// INVALID_ARGUMENT unless a sync-mode push has a client_id. It may name any of the shard's
// tensors (a model's frozen or unused parameters have no gradient).
absl::Status CheckSyncPush(absl::string_view client_id);

// Bounded mode: ABORTED when a push of `base_version` is more than max_staleness behind
// `version` (a base_version ahead is not judged here).
absl::Status CheckStaleness(const ConsistencyOptions& options, uint64_t base_version,
                            uint64_t version);

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_ENGINE_CONSISTENCY_H_
