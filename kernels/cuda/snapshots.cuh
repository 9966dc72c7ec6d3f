// snapshots.cuh (CUDA backend only): pull snapshots (backend.h's AllocateSnapshot) in device
// memory, from the stream-ordered allocator, and the copies out of them on a stream of their
// own, so that copying a snapshot out never waits for the steps queued after its read.
//
// Usage:
//   absl::StatusOr<void*> snapshot = snapshots.Allocate(bytes, apply_stream);
//   ... queue a read into it on apply_stream, wait for a marker after it ...
//   snapshots.CopyOut(*snapshot, offset, bytes, host);  // From any thread, while steps run.
//   snapshots.Release(*snapshot, apply_stream);         // After the work queued so far.
#ifndef FUSEDPS_KERNELS_CUDA_SNAPSHOTS_CUH_
#define FUSEDPS_KERNELS_CUDA_SNAPSHOTS_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"

namespace fusedps {
namespace gpu {

// Thread-safe. Every call acts on the calling thread's current device: the backend's.
class SnapshotStore {
 public:
  SnapshotStore() = default;
  SnapshotStore(const SnapshotStore&) = delete;
  SnapshotStore& operator=(const SnapshotStore&) = delete;

  // Creates the copy stream. Errors: INTERNAL.
  absl::Status Init();

  // `bytes` of device memory, ready for work queued on `stream` after this call (cudaMallocAsync
  // takes it from the stream's device's pool). Errors: RESOURCE_EXHAUSTED; INTERNAL.
  absl::StatusOr<void*> Allocate(uint64_t bytes, cudaStream_t stream) ABSL_LOCKS_EXCLUDED(mu_);

  // Frees a snapshot after the work queued on `stream` so far. Errors: INVALID_ARGUMENT for an
  // address that is not a snapshot.
  absl::Status Release(void* snapshot, cudaStream_t stream) ABSL_LOCKS_EXCLUDED(mu_);

  // OK when [0, end) lies inside the snapshot, else INVALID_ARGUMENT.
  absl::Status CheckRange(const void* snapshot, uint64_t end) const ABSL_LOCKS_EXCLUDED(mu_);

  // Copies [offset, offset + bytes) of a snapshot into host memory and returns once copied.
  // REQUIRES: the work that wrote it is done (the host waited for it).
  absl::Status CopyOut(const void* snapshot, uint64_t offset, uint64_t bytes, void* dst)
      ABSL_LOCKS_EXCLUDED(mu_, copy_mu_);

  // Bytes of the snapshots not released yet.
  uint64_t bytes() const ABSL_LOCKS_EXCLUDED(mu_);

  // Frees the remaining snapshots after the work queued on `stream`, then the copy stream.
  // REQUIRES: the device is current.
  void Free(cudaStream_t stream) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable Mutex mu_;
  std::unordered_map<const void*, uint64_t> sizes_ ABSL_GUARDED_BY(mu_);  // By address.
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // One copy at a time on one stream: concurrent copies would share the same link to the host
  // anyway, and a stream synchronized under the mutex waits for exactly this call's copy.
  Mutex copy_mu_;
  cudaStream_t copy_stream_ = nullptr;
};

}  // namespace gpu
}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_CUDA_SNAPSHOTS_CUH_
