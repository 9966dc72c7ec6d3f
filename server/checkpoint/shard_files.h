// shard_files.h: what a checkpoint's files hold (docs/checkpoints.md): the engine's snapshot
// written as safetensors files and a manifest, and a checkpoint read back into a shard to
// restore. The commit protocol underneath is checkpoint_dir.h's.
//
// Files (format_version 1): params, exp_avg, exp_avg_sq (F32, every tensor, by name, in
// registration order), max_exp_avg_sq (F32, tensors of amsgrad groups), param_copy (BF16 or
// F16, when the server keeps a copy), each "<field>.safetensors"; the manifest holds the param
// groups, the tensors with their steps, the shard version and the retry table.
//
// Usage:
//   absl::StatusOr<Written> w = WriteCheckpoint(snapshot, settings);       // a writer thread
//   checkpoint::LoadLatestGood(root, [&](const checkpoint::Loaded& c) {
//     absl::StatusOr<std::unique_ptr<LoadedShard>> shard = ReadCheckpoint(c, copy_dtype);
//     ...  engine.Restore(&(*shard)->shard, ...)
//   }, on_skip);
#ifndef FUSEDPS_SERVER_CHECKPOINT_SHARD_FILES_H_
#define FUSEDPS_SERVER_CHECKPOINT_SHARD_FILES_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/safetensors.h"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/engine/update_engine.h"

namespace fusedps::checkpoint {

struct WriteSettings {
  std::string root;   // --checkpoint-dir.
  int keep = 3;       // --checkpoint-keep (>= 1).
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

// A checkpoint read into memory and checked, ready for UpdateEngine::Restore: `shard`'s arrays
// point into `files`.
struct LoadedShard {
  RestoredShard shard;
  std::vector<safetensors::File> files;
  uint64_t bytes = 0;  // Of the data files read.
};

// Reads every file of a complete checkpoint (ReadManifest's) and checks it all before anything
// is restored: each file's sha256, the manifest's groups, tensors and retry table (the names,
// shapes and hyperparameters that registration would accept), and that each file holds exactly
// the tensors it must, with their shapes and dtypes. A param copy of another dtype than
// `copy` (the server's --param-copy-dtype) is not used; the copy is then computed from params.
// Errors: DATA_LOSS naming the file and what is wrong.
absl::StatusOr<std::unique_ptr<LoadedShard>> ReadCheckpoint(const Loaded& checkpoint,
                                                            ParamCopyDType copy);

// "none", "bf16", "fp16": the manifest's param_copy_dtype.
const char* ParamCopyName(ParamCopyDType copy);

}  // namespace fusedps::checkpoint

#endif  // FUSEDPS_SERVER_CHECKPOINT_SHARD_FILES_H_
