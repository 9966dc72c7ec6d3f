// device_memory.cu: growing device buffers and the page-locked upload ring of the CUDA backend
// (device_memory.cuh).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_memory.cuh"

namespace fusedps {
namespace gpu {

void DeviceBuffer::Free() {
  if (data_ == nullptr) return;  // No CUDA call: cudaFree(nullptr) would create a context.
  cudaFree(data_);
  data_ = nullptr;
  bytes_.store(0, std::memory_order_relaxed);
}

absl::Status GrowBuffers(absl::Span<const BufferGrowth> growths, cudaStream_t stream) {
  std::vector<void*> fresh(growths.size(), nullptr);
  const auto free_fresh = [&fresh] {
    for (void*& p : fresh) {
      if (p != nullptr) cudaFree(p);
      p = nullptr;
    }
  };
  // Allocate everything first, so that running out changes nothing.
  bool any = false;
  for (size_t i = 0; i < growths.size(); ++i) {
    const BufferGrowth& g = growths[i];
    if (g.bytes <= g.buffer->bytes()) continue;
    if (const cudaError_t err = cudaMalloc(&fresh[i], g.bytes); err != cudaSuccess) {
      cudaGetLastError();  // Out of memory is not sticky: clear it, the device is fine.
      fresh[i] = nullptr;
      free_fresh();
      if (err != cudaErrorMemoryAllocation) {
        return absl::InternalError(absl::StrCat("cudaMalloc: ", cudaGetErrorString(err)));
      }
      return absl::ResourceExhaustedError(
          absl::StrCat("device memory: cannot allocate ", g.bytes, " bytes"));
    }
    any = true;
  }
  if (!any) return absl::OkStatus();
  absl::Status status = [&]() -> absl::Status {
    for (size_t i = 0; i < growths.size(); ++i) {
      if (fresh[i] == nullptr) continue;
      DeviceBuffer& b = *growths[i].buffer;
      const uint64_t old_bytes = b.bytes();
      char* p = static_cast<char*>(fresh[i]);
      FUSEDPS_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(p + old_bytes, 0, growths[i].bytes - old_bytes, stream));
      if (old_bytes > 0) {
        FUSEDPS_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(p, b.data_, old_bytes, cudaMemcpyDeviceToDevice, stream));
      }
    }
    // Queued work may still read or write the old buffers; they are freed once it is done.
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    free_fresh();
    return status;
  }
  for (size_t i = 0; i < growths.size(); ++i) {
    if (fresh[i] == nullptr) continue;
    DeviceBuffer& b = *growths[i].buffer;
    if (b.data_ != nullptr) cudaFree(b.data_);
    b.data_ = fresh[i];
    b.bytes_.store(growths[i].bytes, std::memory_order_relaxed);
  }
  return absl::OkStatus();
}

absl::Status PinnedRing::Init(int slots) {
  slots_.resize(slots);
  for (Slot& slot : slots_) {
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&slot.read, cudaEventDisableTiming));
  }
  return absl::OkStatus();
}

absl::StatusOr<PinnedRing::Slot*> PinnedRing::Acquire(uint64_t bytes) {
  Slot& slot = slots_[next_];
  if (slot.in_flight) {
    // The ring wrapped onto a slot whose copy may still be queued.
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(slot.read));
    slot.in_flight = false;
  }
  if (slot.bytes < bytes) {
    // Grow by doubling, so that a slot settles after a few steps.
    const uint64_t grown = std::max<uint64_t>({bytes, 2 * slot.bytes, 4096});
    void* host = nullptr;
    if (const cudaError_t err = cudaHostAlloc(&host, grown, cudaHostAllocDefault);
        err != cudaSuccess) {
      cudaGetLastError();
      if (err != cudaErrorMemoryAllocation) {
        return absl::InternalError(absl::StrCat("cudaHostAlloc: ", cudaGetErrorString(err)));
      }
      return absl::ResourceExhaustedError(
          absl::StrCat("page-locked host memory: cannot allocate ", grown, " bytes"));
    }
    if (slot.host != nullptr) cudaFreeHost(slot.host);
    slot.host = host;
    slot.bytes = grown;
  }
  next_ = (next_ + 1) % slots_.size();
  return &slot;
}

absl::Status PinnedRing::Release(Slot* slot, cudaStream_t stream) {
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot->read, stream));
  slot->in_flight = true;
  return absl::OkStatus();
}

void PinnedRing::Free() {
  for (Slot& slot : slots_) {
    if (slot.host != nullptr) cudaFreeHost(slot.host);
    if (slot.read != nullptr) cudaEventDestroy(slot.read);
  }
  slots_.clear();
}

}  // namespace gpu
}  // namespace fusedps
