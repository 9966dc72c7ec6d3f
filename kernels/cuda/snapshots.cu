// snapshots.cu: pull snapshots in device memory (snapshots.cuh).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/mutex.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/snapshots.cuh"

namespace fusedps {
namespace gpu {

absl::Status SnapshotStore::Init() {
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
  return absl::OkStatus();
}

absl::StatusOr<void*> SnapshotStore::Allocate(uint64_t bytes, cudaStream_t stream) {
  void* snapshot = nullptr;
  const cudaError_t err = cudaMallocAsync(&snapshot, std::max<uint64_t>(bytes, 1), stream);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // Not sticky: clear it, the device is fine.
    return absl::ResourceExhaustedError(
        absl::StrCat("device memory: cannot allocate a pull snapshot of ", bytes, " bytes"));
  }
  FUSEDPS_CUDA_RETURN_IF_ERROR(err);
  MutexLock lock(&mu_);
  sizes_[snapshot] = bytes;
  bytes_ += bytes;
  return snapshot;
}

absl::Status SnapshotStore::Release(void* snapshot, cudaStream_t stream) {
  MutexLock lock(&mu_);
  const auto it = sizes_.find(snapshot);
  if (it == sizes_.end()) return absl::InvalidArgumentError("not a snapshot");
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaFreeAsync(snapshot, stream));
  bytes_ -= it->second;
  sizes_.erase(it);
  return absl::OkStatus();
}

absl::Status SnapshotStore::CheckRange(const void* snapshot, uint64_t end) const {
  MutexLock lock(&mu_);
  const auto it = sizes_.find(snapshot);
  if (it == sizes_.end()) return absl::InvalidArgumentError("not a snapshot");
  if (end > it->second) {
    return absl::InvalidArgumentError(
        absl::StrCat("byte ", end, " is past the end of a snapshot of ", it->second));
  }
  return absl::OkStatus();
}

absl::Status SnapshotStore::CopyOut(const void* snapshot, uint64_t offset, uint64_t bytes,
                                    void* dst) {
  if (absl::Status s = CheckRange(snapshot, offset + bytes); !s.ok()) return s;
  if (bytes == 0) return absl::OkStatus();
  MutexLock lock(&copy_mu_);
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, static_cast<const char*>(snapshot) + offset,
                                               bytes, cudaMemcpyDeviceToHost, copy_stream_));
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(copy_stream_));
  return absl::OkStatus();
}

uint64_t SnapshotStore::bytes() const {
  MutexLock lock(&mu_);
  return bytes_;
}

void SnapshotStore::Free(cudaStream_t stream) {
  MutexLock lock(&mu_);
  if (copy_stream_ != nullptr) cudaStreamSynchronize(copy_stream_);
  for (const auto& snapshot : sizes_) cudaFreeAsync(const_cast<void*>(snapshot.first), stream);
  if (!sizes_.empty()) cudaStreamSynchronize(stream);
  sizes_.clear();
  bytes_ = 0;
  if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
  copy_stream_ = nullptr;
}

}  // namespace gpu
}  // namespace fusedps
