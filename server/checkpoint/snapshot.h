// snapshot.h: what the update engine and the checkpoint files exchange: a consistent cut of a
// shard (Snapshot), and a whole shard to restore (Restore).
//
// The layout of a checkpoint's values is a format fact (docs/checkpoints.md): the fields' file
// stems, which tensors each field holds, their order and padding. SnapshotLayout decides it,
// once, for the engine (which reads the values into that layout) and the files (which write
// and check it). The engine includes this header; this header includes nothing of the engine,
// so the checkpoint code's other parts (shard_files.h, checkpointer.h) may build on the engine.
#ifndef FUSEDPS_SERVER_CHECKPOINT_SNAPSHOT_H_
#define FUSEDPS_SERVER_CHECKPOINT_SNAPSHOT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/hashed_rows.h"
#include "server/store/buffer_set.h"
#include "server/store/retry_table.h"
#include "server/store/shard_view.h"

namespace fusedps {

// One field of the shard in a checkpoint snapshot: where each tensor's values lie in the host
// buffer, in their stored form (ReadRequest::stored: StoredCount(layout, field, numel) elements
// of StoredElementBytes each; the param copy's numel 16-bit values). Tensors are indices of the
// cut's view.
struct SnapshotField {
  std::string name;  // The checkpoint's file stem: "params", "exp_avg", "exp_avg_sq",
                     // "max_exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax" or
                     // "param_copy".
  TensorField field = TensorField::kParam;
  bool param_copy = false;  // The 16-bit copy (2-byte elements), else the stored form.
  std::vector<uint32_t> tensors;
  std::vector<uint64_t> offsets;  // Bytes into the buffer, 16-byte aligned.
};

// The elements of tensor `tensor` of `view` in `field`'s stored form (the param copy's: numel
// 16-bit values).
uint64_t StoredElements(const ShardView& view, const SnapshotField& field, uint32_t tensor);

// The bytes of tensor `tensor` of `view` in `field`'s stored form (without padding).
uint64_t StoredBytes(const ShardView& view, const SnapshotField& field, uint32_t tensor);

// The fields a checkpoint of `view` holds, laid out one after the other; *bytes is the buffer
// they need. Every field holds every tensor, but max_exp_avg_sq (tensors of amsgrad groups;
// absent when none is), exp_avg_absmax and exp_avg_sq_absmax (tensors with int8 state; absent
// when none has it) and param_copy (tensors with fp32 params, when the backend keeps a copy;
// absent when none). Within a field, tensors come by element size, largest first (4, 2, then
// 1 byte), in registration order within each, so that every tensor's data in a file is aligned
// to its element size; each tensor is padded as in its arena (AlignedNumel elements; whole
// kQuantBlock blocks of int8 codes; the scales to 16 bytes), so that one copy moves a run of
// tensors adjacent there.
std::vector<SnapshotField> SnapshotLayout(const ShardView& view, ParamCopyDType copy,
                                          uint64_t* bytes);

// The state of a shard at one point of its stream order, but for the tensors' values.
struct ShardCut {
  uint64_t version = 0;
  std::shared_ptr<const ShardView> view;
  std::vector<int64_t> steps;  // By tensor index of the view.
  std::vector<RetryTable::ClientRecord> retries;
  std::shared_ptr<const BufferSet> buffers;  // The model's buffers at the cut.
  // The slot index of each hashed table (TensorMeta::hashed), by tensor index of the view.
  std::map<uint32_t, HashedRowIndexState> hashed_tables;
  // Counts the jobs that changed the shard (steps, skipped steps, registrations, group
  // changes, a restore): equal generations mean equal shards.
  uint64_t generation = 0;
};

// Reads the shard's values at the cut while the engine is held (the fenced snapshot); and
// releases the engine when done with, or destroyed.
class SnapshotFence {
 public:
  // Reads `field` of its tensors [begin, end) into dst, at offsets[i] - offsets[begin], and
  // waits for the copy. Errors: INTERNAL (a device fault, also reported to the ShardFault).
  virtual absl::Status Read(const SnapshotField& field, size_t begin, size_t end, void* dst) = 0;
  virtual ~SnapshotFence() = default;
};

struct CheckpointSnapshot {
  ShardCut cut;
  std::vector<SnapshotField> fields;
  // Full snapshot: the values, at fields' offsets, in the caller's buffer; null when fenced.
  const char* data = nullptr;
  // Fenced snapshot: read the values through it; no job runs until it is destroyed.
  std::unique_ptr<SnapshotFence> fence;
};

// A whole shard to restore, but for the tensors' values (a RestoreSource's).
struct RestoredShard {
  uint64_t version = 0;
  std::vector<ParamGroupSpec> groups;  // By index; groups[0] replaces "default".
  std::vector<TensorMeta> tensors;     // In registration order.
  std::vector<int64_t> steps;          // Of tensors[i], each >= 0.
  std::vector<RetryTable::ClientRecord> retries;
  // The source holds the param copy. When it does not and the backend keeps one, the copy is
  // computed from the params (as registration computes it).
  bool param_copy = false;
  std::string plan_hash;                     // ShardView::plan_hash; empty when unsharded.
  std::shared_ptr<const BufferSet> buffers;  // The model's buffers; null: none.
  // The slot index of each hashed table of tensors (TensorMeta::hashed), by index; a hashed
  // table without one starts empty.
  std::map<uint32_t, HashedRowIndexState> hashed_tables;
};

// Where a restore's values come from: host memory that other threads fill (a checkpoint's
// files, read from disk and checked) while the engine uploads what is ready. Every value of
// every field the shard has (SnapshotLayout's fields) must come exactly once, in its stored
// form (WriteRequest::stored; the param copy's 16-bit values with param_copy): params, exp_avg
// and exp_avg_sq of every tensor, max_exp_avg_sq of those in amsgrad groups, the scales of
// those with int8 state, and the param copy (of tensors with fp32 params) when param_copy.
class RestoreSource {
 public:
  struct Batch {
    // Tensor indices are RestoredShard::tensors'; the memory stays as it is until Release.
    std::vector<WriteRequest> writes;
    int slot = 0;  // For Release.
  };
  // Blocks until a batch is ready (true), or every value has been handed out and checked
  // (false). Errors: DATA_LOSS naming the file for values that fail their check, which may come
  // after some of their batches were handed out (the restore then stops and is undone).
  virtual absl::StatusOr<bool> Next(Batch* batch) = 0;
  // The batch's writes are done: its memory may be refilled.
  virtual void Release(int slot) = 0;
  virtual ~RestoreSource() = default;
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_CHECKPOINT_SNAPSHOT_H_
