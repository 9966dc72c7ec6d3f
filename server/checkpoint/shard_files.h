// shard_files.h: what a checkpoint's files hold (docs/checkpoints.md): the engine's snapshot
// written as safetensors files and a manifest, and a checkpoint read back into a shard to
// restore. The commit protocol underneath is checkpoint_dir.h's.
//
// Files (format_version 4, docs/checkpoints.md): one per field of SnapshotLayout,
// "<field>.safetensors": params, exp_avg, exp_avg_sq (every tensor), max_exp_avg_sq (tensors
// of amsgrad groups), exp_avg_absmax and exp_avg_sq_absmax (tensors with int8 state),
// param_copy (tensors with fp32 params, when the server keeps a copy); and "buffers.safetensors"
// when the model has buffers (BufferSet: each in its own dtype and shape). Each entry holds the
// field's stored form bit for bit (ReadRequest::stored): params F32 or BF16; exp_avg and
// exp_avg_sq F32, BF16 or U8 (int8 codes); the scales F32 of shape [QuantBlocks(numel)]
// ([rows] for a table); max_exp_avg_sq F32; the copy BF16 or F16. The manifest
// (fusedps.v1.CheckpointManifest, manifest.h) holds the param groups with their hyperparameters,
// the tensors with their steps and layouts, the shard version, the retry table, and int8_codebooks
// when a tensor has int8 state. Manifests of formats 2 and 3 are read too (manifest_legacy.h), and
// one without the storage keys (written before they existed) as all fp32.
//
// Lifetimes: a ShardReader owns its threads and buffers; it must outlive the Restore it feeds
// (its `done`), and its destructor joins the threads.
//
// Usage:
//   absl::StatusOr<Written> w = WriteCheckpoint(snapshot, settings);       // a writer thread
//   checkpoint::LoadLatestGood(root, [&](const checkpoint::Loaded& c) {
//     absl::StatusOr<std::unique_ptr<ShardReader>> reader = ShardReader::Open(c, &engine);
//     ...  engine.Restore(&(*reader)->shard(), reader->get(), ...)
//   }, on_skip);
#ifndef FUSEDPS_SERVER_CHECKPOINT_SHARD_FILES_H_
#define FUSEDPS_SERVER_CHECKPOINT_SHARD_FILES_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"
#include "common/safetensors.h"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/engine/update_engine.h"

namespace fusedps::checkpoint {

// The file of the model's buffers (absent when it has none).
inline constexpr char kBuffersFileName[] = "buffers.safetensors";

struct WriteSettings {
  std::string root;  // --checkpoint-dir.
  int keep = 3;      // --checkpoint-keep (>= 1).
  std::string server_version;
  ParamCopyDType param_copy_dtype = ParamCopyDType::kNone;
  // A fenced snapshot's staging: host memory of this many bytes, at least the largest tensor's
  // padded size in any field.
  char* fence_buffer = nullptr;
  uint64_t fence_buffer_bytes = 0;
};

struct Written {
  std::string directory;
  uint64_t serial = 0;
  uint64_t version = 0;
  uint64_t bytes = 0;  // Data files and manifest.
};

// Writes `snapshot` as a new checkpoint under settings.root and commits it: data files in
// parallel (one thread each) from a full snapshot, or one at a time through the fence from a
// fenced one. Errors: the errno's status of the first file that failed (RESOURCE_EXHAUSTED for
// a full disk), after which the checkpoint is incomplete and `latest` is unchanged; INTERNAL
// from the fence (a device fault).
absl::StatusOr<Written> WriteCheckpoint(const CheckpointSnapshot& snapshot,
                                        const WriteSettings& settings);

// A field's file in a checkpoint ("params.safetensors"), and the dtype and shape there of a
// tensor with this layout: the writer's and the reader's.
std::string FileOf(const SnapshotField& field);
safetensors::DType DTypeOf(const SnapshotField& field, TensorLayout layout, ParamCopyDType copy);
std::vector<int64_t> ShapeOf(const SnapshotField& field, const TensorMeta& tensor);

// The manifest's int8_codebooks: the 256 fp32 values of each of DynamicCodebooks()' maps.
v1::CheckpointManifest::Int8Codebooks ManifestCodebooks();

// A complete checkpoint (ReadManifest's) opened for UpdateEngine::Restore: its manifest checked
// under the rules registration holds a client to (names, shapes, hyperparameters, retry table),
// each tensor's layout in the manifest against its group's, the int8 codebooks against the
// server's own (DynamicCodebooks: codes mean nothing under other maps), and each data file's
// header checked to hold exactly the tensors it must (the fields of SnapshotLayout, as the
// writer made them), with the shapes and dtypes of their stored form. Every write it hands out
// is in the stored form (WriteRequest::stored), or the param copy's. As a RestoreSource,
// it reads the files' data with one thread per file into a few page-locked buffers (the
// engine's AllocateHostBuffer), and checks each file's CRC-32 once it is read whole (a file
// that fails the check is DATA_LOSS from Next, naming it). The buffers' file, when there is one,
// is read whole and checked by Open (DATA_LOSS naming it). A param copy of another dtype than
// the engine's (--param-copy-dtype) is not read; the copy is then computed from params.
class ShardReader final : public RestoreSource {
 public:
  // Reads go into buffers of `slot_bytes` (a multiple of 4), three per file.
  // Errors: DATA_LOSS naming the file and what is wrong; RESOURCE_EXHAUSTED for the buffers.
  static constexpr uint64_t kSlotBytes = uint64_t{4} << 20;
  // REQUIRES: engine outlives the reader.
  static absl::StatusOr<std::unique_ptr<ShardReader>> Open(const Loaded& checkpoint,
                                                           UpdateEngine* engine,
                                                           uint64_t slot_bytes = kSlotBytes);
  ~ShardReader() override;  // Stops the reader threads (a restore may end early).

  const RestoredShard& shard() const { return shard_; }
  uint64_t bytes() const { return bytes_; }  // The data files' sizes.

  absl::StatusOr<bool> Next(Batch* batch) ABSL_LOCKS_EXCLUDED(mu_) override;
  void Release(int slot) ABSL_LOCKS_EXCLUDED(mu_) override;

 private:
  struct Part;
  explicit ShardReader(UpdateEngine* engine);
  void ReadPart(Part* part) ABSL_LOCKS_EXCLUDED(mu_);  // A reader thread.

  UpdateEngine* const engine_;
  RestoredShard shard_;
  uint64_t bytes_ = 0;
  char* buffers_ = nullptr;
  uint64_t buffer_bytes_ = 0;  // Of each of the slots in buffers_.
  std::vector<std::unique_ptr<Part>> parts_;
  std::vector<std::thread> threads_;

  Mutex mu_;
  CondVar cv_;
  std::vector<int> free_slots_ ABSL_GUARDED_BY(mu_);
  std::deque<Batch> ready_ ABSL_GUARDED_BY(mu_);
  size_t parts_done_ ABSL_GUARDED_BY(mu_) = 0;  // Files read whole and checked.
  absl::Status error_ ABSL_GUARDED_BY(mu_);     // The first reader's error.
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace fusedps::checkpoint

#endif  // FUSEDPS_SERVER_CHECKPOINT_SHARD_FILES_H_
