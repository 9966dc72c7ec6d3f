// workspace.h: same-host workspaces, the data plane beside gRPC (proto: OpenWorkspace).
//
// A workspace is a file of shared memory under a directory (--workspace-dir, /dev/shm by
// default) that the server maps and a trainer on the same host maps too. A push's chunks then
// name bytes in it instead of carrying them (TensorChunk.workspace_offset_bytes and
// workspace_bytes), and a pull writes its values into it: the bytes never pass through gRPC or
// the trainer's CPU (on a GPU, both sides page-lock the mapping, so the copies to and from the
// devices are DMA). gRPC keeps everything else: who calls, the push header and its
// exactly-once key, versions, sync rounds, metrics.
//
// What a workspace trusts: the file is created with mode 0600 by the server's user, so only
// that user (or root) can map it; a caller gets one only through OpenWorkspace, which admits a
// trainer-role caller on a loopback or unix-socket peer (IsLocalPeer). Its bytes are the
// caller's own: the server copies a push's bytes out of it before checking and applying them,
// so a trainer that writes its workspace while the server reads it spoils only its own push,
// never the shard. A workspace is reachable only by the principal that opened it.
//
// Lifetimes: WorkspaceTable::Open creates the file, maps it, fallocates it (so that a full
// file system is an error now, not a SIGBUS later) and page-locks it through the backend. The
// table holds it until Close (the end of its OpenWorkspace call), which removes the file's name
// and gives its bytes back to the budget; each push or pull that found it holds a shared_ptr,
// and the last one to let go unmaps it (after the backend unpins it). The caller's own mapping
// keeps the memory alive on its side until it unmaps it. A server that died leaves its files
// behind: the next table over the same directory removes the files of processes that are gone.
//
// A device workspace (WorkspaceMemory::kDevice) is device memory of the server's GPU instead
// of a file: the backend allocates it (OptimizerBackend::AllocateSharedDeviceMemory) and the
// caller maps it through its CUDA IPC handle. memory() is then device memory, which host code
// must never touch: a push's chunks in it are copied on the device
// (OptimizerBackend::CopyDeviceToStaging, checked there), and a pull reads into it device to
// device. The same budget, owner and lifetime rules hold; the last holder frees the memory.
//
// Thread safety: every method of WorkspaceTable may be called from any thread; a Workspace is
// immutable (its bytes belong to the calls that use it).
#ifndef FUSEDPS_SERVER_WORKSPACE_WORKSPACE_H_
#define FUSEDPS_SERVER_WORKSPACE_WORKSPACE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/mutex.h"
#include "kernels/backend.h"

namespace fusedps {

enum class WorkspaceMemory { kHost, kDevice };

class Workspace {
 public:
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  ~Workspace();  // Unpins and unmaps the memory, and removes the file if Close has not.

  const std::string& id() const { return id_; }      // 32 hex digits.
  const std::string& path() const { return path_; }  // The file the caller maps.
  const std::string& owner() const { return owner_; }
  uint64_t file_device() const { return file_device_; }
  uint64_t file_inode() const { return file_inode_; }
  // The mapping: bytes() bytes, shared with the caller; device memory when on_device().
  absl::Span<char> memory() const { return {data_, bytes_}; }
  bool on_device() const { return device_owner_ != nullptr; }
  // A device workspace's CUDA IPC handle (64 bytes) and its GPU's UUID; empty otherwise.
  const std::string& ipc_handle() const { return ipc_handle_; }
  const std::string& device_uuid() const { return device_uuid_; }

 private:
  friend class WorkspaceTable;
  Workspace() = default;

  std::string id_, path_, owner_;
  uint64_t file_device_ = 0, file_inode_ = 0;
  char* data_ = nullptr;
  uint64_t bytes_ = 0;
  const OptimizerBackend* pinned_by_ = nullptr;     // The backend that page-locked it, or null.
  const OptimizerBackend* device_owner_ = nullptr;  // A device workspace's allocator, or null.
  std::string ipc_handle_, device_uuid_;
};

struct WorkspaceOptions {
  std::string dir = "/dev/shm";                // Empty: workspaces are off.
  uint64_t budget_bytes = uint64_t{64} << 30;  // The most that open workspaces hold in all.
};

class WorkspaceTable {
 public:
  // `backend`, when not null, page-locks each host workspace
  // (OptimizerBackend::RegisterHostMemory) and allocates each device workspace, and must
  // outlive every workspace. Removes the files of dead servers in options.dir.
  WorkspaceTable(WorkspaceOptions options, const OptimizerBackend* backend);
  ~WorkspaceTable();  // Closes every workspace still open.

  bool enabled() const { return !options_.dir.empty(); }

  // A new workspace of `bytes` bytes for `owner` (the caller's principal; empty without
  // authentication), in host or device memory. Errors: FAILED_PRECONDITION when workspaces are
  // off, or for device memory without a backend that has a device; INVALID_ARGUMENT for bytes
  // 0; RESOURCE_EXHAUSTED past the budget, or when the file system, the page-locking or the
  // device has no room; INTERNAL for another failure of the file system (naming the call and
  // path) or of the device.
  absl::StatusOr<std::shared_ptr<const Workspace>> Open(
      std::string owner, uint64_t bytes, WorkspaceMemory memory = WorkspaceMemory::kHost)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The open workspace `id` of `owner`. NOT_FOUND (naming the id) for one that is not open, or
  // is another owner's (which is not told apart, so that ids of others cannot be probed).
  absl::StatusOr<std::shared_ptr<const Workspace>> Find(absl::string_view id,
                                                        absl::string_view owner) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Closes `id`: Find fails from now on, its file's name goes, its bytes go back to the
  // budget; its memory goes with the last holder. Nothing for an id that is not open.
  void Close(absl::string_view id) ABSL_LOCKS_EXCLUDED(mu_);

  size_t open_count() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t open_bytes() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void RemoveDeadFiles() const;
  // A device workspace's memory, through backend_ (Open's errors for it).
  absl::Status MakeDeviceMemory(Workspace& w, uint64_t bytes) const;

  const WorkspaceOptions options_;
  const OptimizerBackend* const backend_;
  mutable Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<const Workspace>> open_ ABSL_GUARDED_BY(mu_);
  uint64_t open_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// True for a gRPC peer on this host: "ipv4:127.x.y.z:port", "ipv6:[::1]:port",
// "ipv6:[::ffff:127.x.y.z]:port", "unix:..." or "unix-abstract:...".
bool IsLocalPeer(absl::string_view peer);

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_WORKSPACE_WORKSPACE_H_
