// registration.h: registers tensors whose initial values stream in as chunks, through a bounded
// window of staging, whatever the tensors' size. Free of gRPC.
//
// A registration names tensor specs, then sends fp32 values for every element of every new one,
// as chunks in any order and any split (RegisterTensorsRequest). Specs identical to registered
// ones are left as they are; their chunks are checked, then dropped. The registration:
//   1. waits for its turn (one registration at a time per shard: `gate`), then checks the specs
//      against the engine's current view;
//   2. has the engine add the new tensors (invisible to readers and pushes until step 4);
//   3. copies chunk payloads into one staging reservation of at most `window_bytes` and, each
//      time it fills, has the engine write what it holds into the tensors' params;
//   4. once every element of every new tensor has arrived exactly once, commits: the tensors
//      appear in the view, all together.
// Anything that fails (a bad chunk, missing elements, a cancelled call) before step 4 removes
// the tensors added in step 2: the shard is as before. The destructor does that for a
// registration that was not committed.
//
// The calls block (engine jobs, the staging pool), so they belong to a thread that may wait: the
// synchronous RegisterTensors handler.
//
// Usage:
//   absl::StatusOr<std::unique_ptr<Registration>> r =
//       Registration::Begin(engine, staging, &gate, specs, 16 << 20, cancelled);
//   for each message: RETURN_IF_ERROR((*r)->AddChunks(message.chunks()));
//   absl::StatusOr<RegistrationOutcome> outcome = (*r)->Commit();
#ifndef FUSEDPS_SERVER_INGEST_REGISTRATION_H_
#define FUSEDPS_SERVER_INGEST_REGISTRATION_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fusedps/v1/parameter_service.pb.h"
#include "server/engine/update_engine.h"
#include "server/ingest/chunk_assembler.h"
#include "server/ingest/staging_pool.h"
#include "server/store/shard_view.h"

namespace fusedps {

struct RegistrationOutcome {
  uint32_t created = 0;
  uint32_t existing = 0;
  uint64_t version = 0;
};

class Registration {
 public:
  // Steps 1 and 2. `plan_hash` is RegisterTensorsHeader.plan_hash (CheckPlanHash: an empty
  // shard takes it at Commit). `cancelled` is polled while waiting for the gate and for staging.
  // Errors: those of ShardView::CheckTensorSpecs; RESOURCE_EXHAUSTED when the tensors do not fit
  // in memory; CANCELLED when the call was cancelled while waiting.
  static absl::StatusOr<std::unique_ptr<Registration>> Begin(
      UpdateEngine* engine, StagingPool* staging, std::timed_mutex* gate,
      const std::vector<TensorSpec>& specs, uint64_t window_bytes,
      const std::function<bool()>& cancelled, std::string plan_hash = "");
  ~Registration();  // Aborts an uncommitted registration.

  // Step 3 for one message's chunks. Errors: INVALID_ARGUMENT or NOT_FOUND for a bad chunk
  // (ChunkAssembler::Claim, ClaimChunk); errors of the engine's writes.
  absl::Status AddChunks(const google::protobuf::RepeatedPtrField<v1::TensorChunk>& chunks);

  // Step 4. Errors: INVALID_ARGUMENT for elements that never arrived.
  absl::StatusOr<RegistrationOutcome> Commit();

 private:
  Registration(UpdateEngine* engine, std::unique_lock<std::timed_mutex> turn);
  absl::Status Flush();  // Writes what the window holds.

  UpdateEngine* const engine_;
  std::unique_lock<std::timed_mutex> turn_;
  std::shared_ptr<const ShardView> view_;  // The view the specs were checked against.
  std::vector<uint32_t> index_of_;         // Per spec: its tensor index, if new.
  std::vector<bool> is_new_;
  uint32_t created_ = 0;
  bool begun_ = false;  // The engine added the new tensors.
  bool committed_ = false;
  std::optional<ChunkAssembler> tracker_;  // Coverage of every spec's elements.
  StagingPool::Reservation window_;
  uint64_t window_used_ = 0;        // Bytes of window_ holding values not yet written.
  std::vector<ParamWrite> writes_;  // What those bytes are.
  std::string plan_hash_;
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_INGEST_REGISTRATION_H_
