// fuzz_shards.h: the shards the fuzz targets check their input against, and the checks that
// stop a target.
//
// A shard is a list of tensors, in the groups "default" and "custom" (amsgrad), and a plan
// hash. A push is checked against a ShardView alone (PushViews); a registration or a state load
// needs the whole shard: an UpdateEngine on the CPU backend with its staging pool, wired as
// server/server.cc wires them, its tensors registered through the engine's own registration
// jobs (EngineShard).
//
// Usage:
//   const ShardDef& def = ShardDefs()[input.mode % ShardDefs().size()];
//   std::shared_ptr<const ShardView> view = PushViews()[input.mode % PushViews().size()];
//   EngineShard shard(def);  RETURN_IF_ERROR(Registration::Begin(&shard.engine(), ...));
#ifndef FUSEDPS_TESTS_FUZZ_FUZZ_SHARDS_H_
#define FUSEDPS_TESTS_FUZZ_FUZZ_SHARDS_H_

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/engine/update_engine.h"
#include "server/ingest/staging_pool.h"
#include "server/store/shard_view.h"

namespace fusedps::fuzz {

inline constexpr char kCustomGroup[] = "custom";  // amsgrad, and every hyperparameter changed.

struct ShardDef {
  std::vector<TensorSpec> tensors;
  std::string plan_hash;
};

// 0: "w" [16, 33] and "s" [] in "custom", "b" [33] (the integration tests' shard);
// 1: odd sizes, a 0-element tensor, a UTF-8 name, one tensor larger than EngineShard's
//    staging pool, and a plan hash;
// 2: no tensors, no plan hash (a first registration sets it).
const std::vector<ShardDef>& ShardDefs();

// ShardDefs()'s shards as views, in the same order.
const std::vector<std::shared_ptr<const ShardView>>& PushViews();

// A shard on the CPU backend (one thread), as the server runs it.
class EngineShard {
 public:
  static constexpr uint64_t kStagingBytes = 64 << 10;

  explicit EngineShard(const ShardDef& def);  // Aborts when the shard cannot be set up.
  ~EngineShard();
  EngineShard(const EngineShard&) = delete;
  EngineShard& operator=(const EngineShard&) = delete;

  UpdateEngine& engine() { return *engine_; }
  StagingPool& staging() { return *staging_; }
  std::timed_mutex& registration_gate() { return gate_; }

  // One field of whole tensors (indices of the current view), read through the engine's pull
  // path. Aborts on an error.
  std::vector<std::vector<float>> Read(TensorField field, const std::vector<uint32_t>& tensors);

 private:
  ShardFault fault_;
  RetryTable retries_{16};
  std::unique_ptr<UpdateEngine> engine_;
  std::unique_ptr<StagingPool> staging_;  // Its arena is the engine's: it goes first.
  std::timed_mutex gate_;
};

// Stops the fuzzer (a crash it reports) with `what` when `condition` is false.
void Require(bool condition, absl::string_view what);
// Stops the fuzzer unless `status` has one of `codes`.
void RequireCode(const absl::Status& status, std::initializer_list<absl::StatusCode> codes,
                 absl::string_view where);

// Whether a and b hold the same floats, bit for bit (NaNs too).
bool SameBits(const std::vector<float>& a, const std::vector<float>& b);

// Quiets protobuf's log (it logs every string field with invalid UTF-8 it parses).
void QuietProtobufLog();

}  // namespace fusedps::fuzz

#endif  // FUSEDPS_TESTS_FUZZ_FUZZ_SHARDS_H_
