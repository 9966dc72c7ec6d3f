// checkpoint_dir.h: the on-disk protocol of checkpoints. How a checkpoint is committed so that a
// crash at any moment leaves the last complete one loadable, how the newest good one is found
// again, and how old ones are pruned. What goes in the files is the caller's (the engine's
// snapshot); this layer sees files, their checksums and the manifest (manifest.h: the message
// fusedps.v1.CheckpointManifest, written as protobuf's JSON mapping).
//
// Layout under the checkpoint root (--checkpoint-dir):
//   checkpoint-<serial>/      one checkpoint (serial: 20 digits, zero-padded; one more than the
//                             highest under the root, so that the newest written is the newest
//                             loaded, also after a rollback to an older shard version)
//     <data files>            written and fsynced first
//     manifest.json           written last: manifest.json.tmp, fsync, rename, fsync of the dir
//   latest                    the newest complete checkpoint's directory name, for tools and
//                             people; moved (tmp, fsync, rename, fsync of the root) only after
//                             its manifest is synced
// The manifest records the serial and the shard version the checkpoint holds.
// A directory without manifest.json is incomplete (the writer died) and is never loaded. The
// manifest lists every data file with its size and CRC-32; a checkpoint whose files disagree
// is skipped at load, and the next older one is tried. This is the commit rule of
// torch.distributed.checkpoint (metadata last), with the directory fsyncs it leaves to the
// filesystem.
#ifndef FUSEDPS_SERVER_CHECKPOINT_CHECKPOINT_DIR_H_
#define FUSEDPS_SERVER_CHECKPOINT_CHECKPOINT_DIR_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/safetensors.h"
#include "fusedps/v1/checkpoint.pb.h"
#include "server/checkpoint/manifest.h"

namespace fusedps::checkpoint {

inline constexpr char kManifestName[] = "manifest.json";
inline constexpr char kLatestName[] = "latest";
// The format written and those read: kFormatVersion and kOldestFormatVersionRead (manifest.h).

// "checkpoint-00000000000000000042" for serial 42.
std::string DirectoryName(uint64_t serial);

// One checkpoint being written. Not thread-safe; one at a time per root (the engine's
// checkpoint job holds it).
class PendingCheckpoint {
 public:
  // Creates <root>/checkpoint-<serial>/ (and root) for a checkpoint of shard version `version`,
  // serial one more than the highest directory under root. Errors: the errno's status when the
  // directories cannot be made.
  static absl::StatusOr<PendingCheckpoint> Begin(const std::string& root, uint64_t version);

  const std::string& directory() const { return directory_; }
  uint64_t serial() const { return serial_; }
  std::string PathOf(const std::string& file) const;  // directory()/file.

  // Records a data file the caller wrote, fsynced and checksummed (safetensors::WriteFile with
  // fsync). INVALID_ARGUMENT for a name with '/', "manifest.json" or one added twice.
  absl::Status AddFile(const std::string& name, uint64_t bytes, uint32_t crc32);

  // Writes the manifest (`body` with its format, format_version, serial, version and files set
  // here, as format 4's JSON: ManifestToJson), makes it durable, moves `latest` here, then
  // removes all but the newest `keep` complete checkpoints (keep >= 1) and any incomplete one
  // older than this. Returns the manifest's size in bytes. After an error the checkpoint is
  // incomplete and `latest` is unchanged; a failed prune is only logged.
  absl::StatusOr<uint64_t> Commit(v1::CheckpointManifest body, int keep);

 private:
  PendingCheckpoint(std::string root, uint64_t serial, uint64_t version);

  std::string root_;
  uint64_t serial_;
  uint64_t version_;
  std::string directory_;
  google::protobuf::Map<std::string, v1::CheckpointManifest::File> files_;  // By AddFile.
};

// A complete checkpoint: every file the manifest lists is there with its size (ReadManifest).
struct Loaded {
  std::string directory;
  uint64_t serial = 0;
  uint64_t version = 0;
  // As format 4's message, whatever format the file has (ParseManifest); its format_version is
  // the file's.
  v1::CheckpointManifest manifest;
};

// Reads one checkpoint's manifest (ParseManifest: formats 2 to 4) and checks that every file it
// lists exists with its size (its contents are checked against its crc32 as they are read:
// ExpectedCrc32). DATA_LOSS naming the file for a missing or unparsable manifest (naming the
// key, when one is unknown or of the wrong type), or a missing file or one of another size;
// FAILED_PRECONDITION for a format_version this server does not read; NOT_FOUND for no
// directory.
absl::StatusOr<Loaded> ReadManifest(const std::string& directory);

// The CRC-32 that the manifest lists for file `name` (its whole contents must have it).
// DATA_LOSS naming the file when the manifest does not list it.
absl::StatusOr<uint32_t> ExpectedCrc32(const Loaded& checkpoint, const std::string& name);

// A small data file of the checkpoint (the buffers', the hashed tables') read whole, checked
// against the manifest's CRC-32 and parsed as safetensors. DATA_LOSS naming the file: not in
// the manifest, unreadable, another CRC-32, not a safetensors file.
absl::StatusOr<safetensors::File> ReadWholeFile(const Loaded& checkpoint, const std::string& name);

// Loads the newest checkpoint under root that `load` accepts, trying them by serial, newest
// first (the manifest is the commit point: a crash between it and `latest`'s move loses
// nothing). `load` gets each complete checkpoint's manifest (ReadManifest) and returns OK when
// it loaded it, DATA_LOSS to pass it over, or another error to stop the search with (e.g. a
// load that failed half-way). A manifest of a format_version this server does not read stops
// the search too (FAILED_PRECONDITION): the operator decides (docs/operations.md). `on_skip`
// hears of each checkpoint passed over, and why (for the log). NOT_FOUND when none loads (or
// root has none).
using Loader = std::function<absl::Status(const Loaded& checkpoint)>;
using SkipObserver = std::function<void(const std::string& directory, const absl::Status& why)>;
absl::StatusOr<Loaded> LoadLatestGood(const std::string& root, const Loader& load,
                                      const SkipObserver& on_skip);

// The checkpoint directories under root (complete or not), newest (highest serial) first.
std::vector<std::pair<uint64_t, std::string>> ListCheckpoints(const std::string& root);

}  // namespace fusedps::checkpoint

#endif  // FUSEDPS_SERVER_CHECKPOINT_CHECKPOINT_DIR_H_
