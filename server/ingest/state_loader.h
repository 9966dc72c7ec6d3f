// state_loader.h: LoadState's ingest: a header checked against the shard, float32 chunks of
// (tensor, field) ranges assembled in one staging reservation, then the engine's load, all or
// nothing. Free of gRPC.
//
// A load names tensors, each with its step afterwards and the fields it writes
// (LoadStateHeader); their values then arrive as chunks in any order and any split, each
// naming its tensor and field. The loader:
//   1. checks the header against the engine's current view (registered tensors, fields,
//      amsgrad, plan_hash) and reserves staging for every value it lists, before reading a
//      chunk;
//   2. checks each chunk (its (tensor, field) listed, whole float32 elements, no overlap, inside
//      the tensor) and copies its payload into the reservation, one ChunkAssembler per field;
//   3. once every listed field has arrived exactly once, has the engine load the values and
//      steps (UpdateEngine::LoadState), in stream order with pushes.
// Until step 3 nothing in the shard changes; a loader destroyed before then (a bad chunk, a
// cancelled call) just gives its staging back.
//
// The calls block (the staging pool, the engine job), so they belong to a thread that may wait:
// the synchronous LoadState handler.
//
// Usage:
//   absl::StatusOr<std::unique_ptr<StateLoader>> l =
//       StateLoader::Begin(engine, staging, header, cancelled);
//   for each message: RETURN_IF_ERROR((*l)->AddChunks(message.chunks()));
//   absl::StatusOr<uint64_t> version = (*l)->Commit();
#ifndef FUSEDPS_SERVER_INGEST_STATE_LOADER_H_
#define FUSEDPS_SERVER_INGEST_STATE_LOADER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fusedps/v1/parameter_service.pb.h"
#include "server/engine/update_engine.h"
#include "server/ingest/chunk_assembler.h"
#include "server/ingest/staging_pool.h"
#include "server/store/shard_view.h"

namespace fusedps {

// The TensorField a wire value names (TENSOR_FIELD_UNSPECIFIED means PARAM, as in pulls), or
// nullopt for a value that is not a TensorField. Shared by LoadState and PullParameters.
std::optional<TensorField> TensorFieldFromProto(int value);

class StateLoader {
 public:
  // Step 1. `cancelled` is polled while waiting for staging. Errors: NOT_FOUND for a tensor
  // that is not registered; INVALID_ARGUMENT for no tensors, a tensor listed twice, a field
  // listed twice or not a TensorField, a step < 0; FAILED_PRECONDITION for max_exp_avg_sq of
  // a tensor whose group has no amsgrad, or a plan_hash that is not the shard's (CheckPlanHash);
  // RESOURCE_EXHAUSTED when the values are larger than the whole staging pool; CANCELLED.
  static absl::StatusOr<std::unique_ptr<StateLoader>> Begin(UpdateEngine* engine,
                                                            StagingPool* staging,
                                                            const v1::LoadStateHeader& header,
                                                            const std::function<bool()>& cancelled);

  // Step 2 for one message's chunks. Errors: NOT_FOUND for a chunk of a tensor that is not
  // registered; INVALID_ARGUMENT for a chunk of a (tensor, field) the header does not list, or
  // one that ChunkAssembler::Claim refuses (the message names the field).
  absl::Status AddChunks(const google::protobuf::RepeatedPtrField<v1::TensorChunk>& chunks);

  // Step 3: the shard's version after the load. Errors: INVALID_ARGUMENT for elements that
  // never arrived (naming the field); the engine's (UpdateEngine::LoadState).
  absl::StatusOr<uint64_t> Commit();

  // The tensors the header names.
  uint32_t tensors_loaded() const { return static_cast<uint32_t>(load_.tensors.size()); }

 private:
  // The fields a load may write, by TensorField value less 1.
  static constexpr int kFields = 4;

  StateLoader(UpdateEngine* engine, std::shared_ptr<const ShardView> view);

  UpdateEngine* const engine_;
  const std::shared_ptr<const ShardView> view_;  // The view the header was checked against.
  // Per field: the tensors that load it (indices of the view, in header order) and the
  // assembler of their values, laid out in window_ one field after the other.
  std::vector<uint32_t> tensors_of_[kFields];
  std::optional<ChunkAssembler> fields_[kFields];
  StagingPool::Reservation window_;
  StateLoad load_;  // Its tensors and steps, from the header; its writes at Commit.
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_INGEST_STATE_LOADER_H_
