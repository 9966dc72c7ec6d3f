// checkpoint_dir.h: the on-disk protocol of checkpoints. How a checkpoint is committed so that a
// crash at any moment leaves the last complete one loadable, how the newest good one is found
// again, and how old ones are pruned. What goes in the files is the caller's (the engine's
// snapshot); this layer sees files, their checksums and a JSON manifest.
//
// Layout under the checkpoint root (--checkpoint-dir):
//   checkpoint-<version>/     one checkpoint (version: 20 digits, zero-padded)
//     <data files>            written and fsynced first
//     manifest.json           written last: manifest.json.tmp, fsync, rename, fsync of the dir
//   latest                    the newest complete checkpoint's directory name, for tools and
//                             people; moved (tmp, fsync, rename, fsync of the root) only after
//                             its manifest is synced
// A directory without manifest.json is incomplete (the writer died) and is never loaded. The
// manifest lists every data file with its size and sha256; a checkpoint whose files disagree
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
#include "nlohmann/json.hpp"

namespace fusedps::checkpoint {

inline constexpr char kManifestName[] = "manifest.json";
inline constexpr char kLatestName[] = "latest";
inline constexpr int kFormatVersion = 1;

// "checkpoint-00000000000000000042" for version 42.
std::string DirectoryName(uint64_t version);

// One checkpoint being written. Not thread-safe; one at a time per root (the engine's
// checkpoint job holds it).
class PendingCheckpoint {
 public:
  // Creates <root>/checkpoint-<version>/ (and root), removing an incomplete directory of that
  // name left by a crash. Errors: ALREADY_EXISTS when a complete checkpoint of this version
  // exists; the errno's status when the directories cannot be made.
  static absl::StatusOr<PendingCheckpoint> Begin(const std::string& root, uint64_t version);

  const std::string& directory() const { return directory_; }
  std::string PathOf(const std::string& file) const;  // directory()/file.

  // Records a data file the caller wrote, fsynced and checksummed (safetensors::WriteFile with
  // fsync). INVALID_ARGUMENT for a name with '/', "manifest.json" or one added twice.
  absl::Status AddFile(const std::string& name, uint64_t bytes, const std::string& sha256);

  // Writes the manifest (`body`'s keys plus "format", "format_version", "version" and "files"),
  // makes it durable, moves `latest` here, then removes all but the newest `keep` complete
  // checkpoints (keep >= 1) and any incomplete one older than this. After an error the
  // checkpoint is incomplete and `latest` is unchanged; a failed prune is only logged.
  absl::Status Commit(nlohmann::json body, int keep);

 private:
  PendingCheckpoint(std::string root, uint64_t version);

  std::string root_;
  uint64_t version_;
  std::string directory_;
  nlohmann::json files_ = nlohmann::json::object();
};

// A complete checkpoint, verified: every file the manifest lists has its size and sha256.
struct Loaded {
  std::string directory;
  uint64_t version = 0;
  nlohmann::json manifest;
};

// Checks one checkpoint directory. DATA_LOSS naming the file for a missing or unparsable
// manifest, a missing file, or a size or checksum that differs; NOT_FOUND for no directory.
absl::StatusOr<Loaded> Verify(const std::string& directory);

// The newest checkpoint under root that verifies, trying them by version, newest first (the
// manifest is the commit point: a crash between it and `latest`'s move loses nothing). `on_skip` hears of each one passed over, and why (for the log). NOT_FOUND when
// none verifies (or root has none).
absl::StatusOr<Loaded> LoadLatestGood(
    const std::string& root,
    const std::function<void(const std::string& directory, const absl::Status& why)>& on_skip);

// The checkpoint directories under root (complete or not), newest version first.
std::vector<std::pair<uint64_t, std::string>> ListCheckpoints(const std::string& root);

}  // namespace fusedps::checkpoint

#endif  // FUSEDPS_SERVER_CHECKPOINT_CHECKPOINT_DIR_H_
