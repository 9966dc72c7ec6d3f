#include "server/workspace/workspace.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/logging.h"

namespace fusedps {
namespace {

constexpr char kFilePrefix[] = "fusedps-ws-";  // fusedps-ws-<pid>-<id>

absl::Status FileError(absl::string_view call, const std::string& path, int error) {
  const std::string what = absl::StrCat(call, "(", path, "): ", std::strerror(error));
  if (error == ENOSPC || error == ENOMEM || error == EFBIG) {
    return absl::ResourceExhaustedError(absl::StrCat("no room for a workspace: ", what));
  }
  return absl::InternalError(absl::StrCat("cannot make a workspace: ", what));
}

absl::StatusOr<std::string> RandomId() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::InternalError(absl::StrCat("getrandom: ", std::strerror(errno)));
    got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

}  // namespace

Workspace::~Workspace() {
  if (data_ == nullptr) return;
  if (device_owner_ != nullptr) {
    device_owner_->FreeSharedDeviceMemory(data_);
    return;
  }
  if (pinned_by_ != nullptr) pinned_by_->UnregisterHostMemory(data_);
  munmap(data_, bytes_);
  unlink(path_.c_str());  // Gone already after Close (ENOENT).
}

WorkspaceTable::WorkspaceTable(WorkspaceOptions options, const OptimizerBackend* backend)
    : options_(std::move(options)), backend_(backend) {
  if (enabled()) RemoveDeadFiles();
}

WorkspaceTable::~WorkspaceTable() {
  MutexLock lock(&mu_);
  for (const auto& [id, workspace] : open_) {
    if (!workspace->on_device()) unlink(workspace->path().c_str());
  }
  open_.clear();
}

void WorkspaceTable::RemoveDeadFiles() const {
  DIR* dir = opendir(options_.dir.c_str());
  if (dir == nullptr) return;  // Open reports a missing directory, naming it.
  while (const dirent* entry = readdir(dir)) {
    absl::string_view name = entry->d_name;
    if (!absl::ConsumePrefix(&name, kFilePrefix)) continue;
    const std::vector<absl::string_view> parts = absl::StrSplit(name, '-');
    int pid = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &pid) || pid <= 0) continue;
    if (kill(pid, 0) == 0 || errno != ESRCH) continue;  // Alive, or not ours to judge.
    const std::string path = absl::StrCat(options_.dir, "/", entry->d_name);
    if (unlink(path.c_str()) == 0) {
      LOG(INFO) << "removed the workspace file of a server that is gone: " << path;
    }
  }
  closedir(dir);
}

absl::StatusOr<std::shared_ptr<const Workspace>> WorkspaceTable::Open(std::string owner,
                                                                      uint64_t bytes,
                                                                      WorkspaceMemory memory) {
  if (!enabled()) {
    return absl::FailedPreconditionError(
        "this server has same-host workspaces off (--workspace-dir is empty)");
  }
  if (bytes == 0) return absl::InvalidArgumentError("bytes = 0: a workspace needs at least 1");
  {
    MutexLock lock(&mu_);
    if (bytes > options_.budget_bytes - open_bytes_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("a workspace of ", bytes,
                       " bytes would pass --workspace-budget-bytes = ", options_.budget_bytes, " (",
                       open_bytes_, " held by ", open_.size(), " open workspaces)"));
    }
    open_bytes_ += bytes;  // Held while the file is made; given back below on failure.
  }
  std::unique_ptr<Workspace> w(new Workspace());
  absl::Status made = [&]() -> absl::Status {
    absl::StatusOr<std::string> id = RandomId();
    if (!id.ok()) return id.status();
    w->id_ = *id;
    w->owner_ = std::move(owner);
    if (memory == WorkspaceMemory::kDevice) return MakeDeviceMemory(*w, bytes);
    w->path_ = absl::StrCat(options_.dir, "/", kFilePrefix, getpid(), "-", w->id_);
    const int fd = open(w->path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return FileError("open", w->path_, errno);
    absl::Status s = [&]() -> absl::Status {
      if (const int e = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); e != 0) {
        return FileError("posix_fallocate", w->path_, e);
      }
      struct stat st {};
      if (fstat(fd, &st) != 0) return FileError("fstat", w->path_, errno);
      w->file_device_ = st.st_dev;
      w->file_inode_ = st.st_ino;
      void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (data == MAP_FAILED) return FileError("mmap", w->path_, errno);
      w->data_ = static_cast<char*>(data);
      w->bytes_ = bytes;
      return absl::OkStatus();
    }();
    close(fd);
    if (!s.ok()) {
      unlink(w->path_.c_str());
      return s;
    }
    if (backend_ != nullptr) {
      if (absl::Status pinned = backend_->RegisterHostMemory(w->data_, bytes); !pinned.ok()) {
        return pinned;  // ~Workspace unmaps and removes the file.
      }
      w->pinned_by_ = backend_;
    }
    return absl::OkStatus();
  }();
  MutexLock lock(&mu_);
  if (!made.ok()) {
    open_bytes_ -= bytes;
    return made;
  }
  std::shared_ptr<const Workspace> shared(std::move(w));
  open_.emplace(shared->id(), shared);
  return shared;
}

absl::Status WorkspaceTable::MakeDeviceMemory(Workspace& w, uint64_t bytes) const {
  if (backend_ == nullptr) {
    return absl::FailedPreconditionError("this server has no device for a device workspace");
  }
  absl::StatusOr<SharedDeviceMemory> shared = backend_->AllocateSharedDeviceMemory(bytes);
  if (!shared.ok()) return shared.status();
  w.data_ = static_cast<char*>(shared->data);
  w.bytes_ = bytes;
  w.device_owner_ = backend_;  // ~Workspace frees it from now on.
  w.ipc_handle_ = std::move(shared->ipc_handle);
  w.device_uuid_ = std::move(shared->device_uuid);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Workspace>> WorkspaceTable::Find(
    absl::string_view id, absl::string_view owner) const {
  MutexLock lock(&mu_);
  const auto it = open_.find(id);
  if (it == open_.end() || it->second->owner() != owner) {
    return absl::NotFoundError(
        absl::StrCat("workspace \"", absl::CHexEscape(id.substr(0, 64)),
                     "\" is not open (its OpenWorkspace call has ended, or it "
                     "was never yours)"));
  }
  return it->second;
}

void WorkspaceTable::Close(absl::string_view id) {
  std::shared_ptr<const Workspace> closed;  // Its last holder may be this: freed unlocked.
  MutexLock lock(&mu_);
  const auto it = open_.find(id);
  if (it == open_.end()) return;
  closed = std::move(it->second);
  open_.erase(it);
  open_bytes_ -= closed->memory().size();
  if (!closed->on_device()) unlink(closed->path().c_str());
}

size_t WorkspaceTable::open_count() const {
  MutexLock lock(&mu_);
  return open_.size();
}

uint64_t WorkspaceTable::open_bytes() const {
  MutexLock lock(&mu_);
  return open_bytes_;
}

bool IsLocalPeer(absl::string_view peer) {
  if (absl::StartsWith(peer, "unix:") || absl::StartsWith(peer, "unix-abstract:")) return true;
  return absl::StartsWith(peer, "ipv4:127.") || absl::StartsWith(peer, "ipv6:[::1]:") ||
         absl::StartsWith(peer, "ipv6:[::ffff:127.");
}

}  // namespace fusedps
