#include "server/checkpoint/checkpoint_dir.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/file_io.h"
#include "common/logging.h"
#include "common/safetensors.h"

namespace fusedps::checkpoint {
namespace {

namespace fs = std::filesystem;
using file_io::Errno;
using file_io::Fd;
using file_io::SyncPath;
using file_io::WriteAll;

constexpr char kPrefix[] = "checkpoint-";

// Writes `text` to path via path.tmp: write, fsync, rename, fsync of the directory.
absl::Status WriteDurably(const std::string& directory, const std::string& name,
                          const std::string& text) {
  const std::string path = absl::StrCat(directory, "/", name);
  const std::string tmp = absl::StrCat(path, ".tmp");
  Fd fd(open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return Errno("cannot create", tmp);
  if (absl::Status s = WriteAll(fd.get(), text.data(), text.size(), tmp); !s.ok()) return s;
  if (fsync(fd.get()) != 0) return Errno("cannot fsync", tmp);
  if (absl::Status s = fd.Close(tmp); !s.ok()) return s;
  if (rename(tmp.c_str(), path.c_str()) != 0) return Errno("cannot rename to", path);
  return SyncPath(directory);
}

bool ParseDirectoryName(const std::string& name, uint64_t* serial) {
  return name.size() == sizeof(kPrefix) - 1 + 20 && absl::StartsWith(name, kPrefix) &&
         absl::SimpleAtoi(name.substr(sizeof(kPrefix) - 1), serial);
}

}  // namespace

std::string DirectoryName(uint64_t serial) { return absl::StrFormat("%s%020u", kPrefix, serial); }

PendingCheckpoint::PendingCheckpoint(std::string root, uint64_t serial, uint64_t version)
    : root_(std::move(root)),
      serial_(serial),
      version_(version),
      directory_(absl::StrCat(root_, "/", DirectoryName(serial))) {}

absl::StatusOr<PendingCheckpoint> PendingCheckpoint::Begin(const std::string& root,
                                                           uint64_t version) {
  std::error_code error;
  fs::create_directories(root, error);
  if (error) return absl::ErrnoToStatus(error.value(), absl::StrCat("cannot create ", root));
  const std::vector<std::pair<uint64_t, std::string>> existing = ListCheckpoints(root);
  PendingCheckpoint pending(root, existing.empty() ? 1 : existing.front().first + 1, version);
  if (mkdir(pending.directory_.c_str(), 0755) != 0) {
    return Errno("cannot create", pending.directory_);
  }
  if (absl::Status s = SyncPath(root); !s.ok()) return s;
  return pending;
}

std::string PendingCheckpoint::PathOf(const std::string& file) const {
  return absl::StrCat(directory_, "/", file);
}

absl::Status PendingCheckpoint::AddFile(const std::string& name, uint64_t bytes, uint32_t crc32) {
  if (name.empty() || absl::StrContains(name, '/') || absl::StartsWith(name, kManifestName) ||
      files_.count(name) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint file name \"", name,
                                                   "\" is empty, has '/', is the manifest's or "
                                                   "was added already"));
  }
  v1::CheckpointManifest::File& file = files_[name];
  file.set_bytes(bytes);
  file.set_crc32(crc32);
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> PendingCheckpoint::Commit(v1::CheckpointManifest body, int keep) {
  if (keep < 1) return absl::InvalidArgumentError(absl::StrCat("keep ", keep, " < 1"));
  body.set_format(kManifestFormat);
  body.set_format_version(kFormatVersion);
  body.set_serial(serial_);
  body.set_version(version_);
  *body.mutable_files() = files_;
  const absl::StatusOr<std::string> manifest = ManifestToJson(body);
  if (!manifest.ok()) return manifest.status();
  if (absl::Status s = WriteDurably(directory_, kManifestName, *manifest); !s.ok()) return s;
  if (absl::Status s = WriteDurably(root_, kLatestName, DirectoryName(serial_)); !s.ok()) {
    return s;
  }
  // Prune: the newest `keep` complete checkpoints stay, and anything newer than this one (none,
  // with one writer). Incomplete ones older than this are dead.
  int complete = 0;
  for (const auto& [serial, directory] : ListCheckpoints(root_)) {
    if (serial > serial_) continue;
    const bool done = access(absl::StrCat(directory, "/", kManifestName).c_str(), F_OK) == 0;
    if (done && ++complete <= keep) continue;
    std::error_code error;
    fs::remove_all(directory, error);
    if (error) {
      LOG(WARNING) << "checkpoint: cannot remove " << directory << ": " << error.message();
    }
  }
  return manifest->size();
}

std::vector<std::pair<uint64_t, std::string>> ListCheckpoints(const std::string& root) {
  std::vector<std::pair<uint64_t, std::string>> found;
  std::error_code error;
  for (const fs::directory_entry& entry : fs::directory_iterator(root, error)) {
    uint64_t serial = 0;
    if (entry.is_directory(error) && ParseDirectoryName(entry.path().filename(), &serial)) {
      found.emplace_back(serial, entry.path().string());
    }
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a > b; });
  return found;
}

absl::StatusOr<Loaded> ReadManifest(const std::string& directory) {
  struct stat info;
  if (stat(directory.c_str(), &info) != 0) return Errno("no checkpoint at", directory);
  const std::string manifest_path = absl::StrCat(directory, "/", kManifestName);
  absl::StatusOr<std::string> text = file_io::ReadFile(manifest_path);
  if (!text.ok()) {
    return absl::DataLossError(
        absl::StrCat(manifest_path, ": ", text.status().message(), " (an incomplete checkpoint)"));
  }
  absl::StatusOr<v1::CheckpointManifest> manifest = ParseManifest(*text, manifest_path);
  if (!manifest.ok()) return manifest.status();
  Loaded loaded;
  loaded.directory = directory;
  loaded.manifest = *std::move(manifest);
  loaded.version = loaded.manifest.version();
  loaded.serial = loaded.manifest.serial();
  for (const auto& [name, entry] : loaded.manifest.files()) {
    const std::string path = absl::StrCat(directory, "/", name);
    if (stat(path.c_str(), &info) != 0) {
      return absl::DataLossError(absl::StrCat(path, " is missing"));
    }
    if (static_cast<uint64_t>(info.st_size) != entry.bytes()) {
      return absl::DataLossError(
          absl::StrCat(path, " has ", info.st_size, " bytes, the manifest says ", entry.bytes()));
    }
  }
  return loaded;
}

absl::StatusOr<uint32_t> ExpectedCrc32(const Loaded& checkpoint, const std::string& name) {
  const auto file = checkpoint.manifest.files().find(name);
  if (file == checkpoint.manifest.files().end()) {
    return absl::DataLossError(
        absl::StrCat(checkpoint.directory, "/", name, " is not in the manifest"));
  }
  return file->second.crc32();
}

absl::StatusOr<safetensors::File> ReadWholeFile(const Loaded& checkpoint, const std::string& name) {
  absl::StatusOr<uint32_t> crc32 = ExpectedCrc32(checkpoint, name);
  if (!crc32.ok()) return crc32.status();
  const std::string path = absl::StrCat(checkpoint.directory, "/", name);
  absl::StatusOr<std::string> bytes = file_io::ReadFile(path);
  if (!bytes.ok()) return absl::DataLossError(bytes.status().message());
  if (safetensors::Crc32(0, bytes->data(), bytes->size()) != *crc32) {
    return absl::DataLossError(absl::StrCat(path, ": its CRC-32 is not the manifest's"));
  }
  absl::StatusOr<safetensors::File> file = safetensors::File::Parse(*std::move(bytes), path);
  if (!file.ok()) return absl::DataLossError(file.status().message());
  return file;
}

absl::StatusOr<Loaded> LoadLatestGood(const std::string& root, const Loader& load,
                                      const SkipObserver& on_skip) {
  for (const auto& [serial, directory] : ListCheckpoints(root)) {
    absl::StatusOr<Loaded> loaded = ReadManifest(directory);
    // A format this server cannot read (a newer server wrote it): never pass it over for an
    // older checkpoint, which would drop the newer state without a word.
    if (absl::IsFailedPrecondition(loaded.status())) return loaded.status();
    if (loaded.ok()) {
      const absl::Status s = load(*loaded);
      if (s.ok()) return loaded;
      if (!absl::IsDataLoss(s)) return s;
      loaded = s;
    }
    if (on_skip) on_skip(directory, loaded.status());
  }
  return absl::NotFoundError(absl::StrCat("no complete checkpoint under ", root));
}

}  // namespace fusedps::checkpoint
