// device_memory.cuh (CUDA backend only): the memory a CUDA backend owns besides its streams:
// device buffers that grow all or nothing, and rings of page-locked host slots for uploads
// that must not wait for the device.
//
// Usage:
//   DeviceArray<float> params, exp_avg;
//   RETURN_IF_ERROR(GrowBuffers({params.ToHold(n), exp_avg.ToHold(n)}, stream));
//
//   PinnedRing ring;
//   RETURN_IF_ERROR(ring.Init(4));
//   absl::StatusOr<PinnedRing::Slot*> slot = ring.Acquire(bytes);  // Waits only on a wrap.
//   std::memcpy((*slot)->host, values, bytes);
//   cudaMemcpyAsync(device, (*slot)->host, bytes, cudaMemcpyHostToDevice, stream);
//   RETURN_IF_ERROR(ring.Release(*slot, stream));  // Reusable once that copy is done.
//
// Every call here acts on the calling thread's current device: the backend makes its device
// current first (cuda_check.h's UseDevice).
#ifndef FUSEDPS_KERNELS_CUDA_DEVICE_MEMORY_CUH_
#define FUSEDPS_KERNELS_CUDA_DEVICE_MEMORY_CUH_

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace fusedps {
namespace gpu {

class DeviceBuffer;

// A buffer and the bytes it must hold.
struct BufferGrowth {
  DeviceBuffer* buffer;
  uint64_t bytes;
};

// Device memory (cudaMalloc) that only grows, through GrowBuffers. bytes() may be read from
// any thread (metrics); everything else from one thread at a time.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  // Frees the memory if Free was not called. REQUIRES: no queued work uses it, and the device
  // is current (see Free).
  ~DeviceBuffer() { Free(); }

  void* raw() const { return data_; }
  uint64_t bytes() const { return bytes_.load(std::memory_order_relaxed); }

  // Frees the memory now (the backend's destructor calls it with its device current; nothing
  // here calls CUDA when nothing is allocated). REQUIRES: no queued work uses it.
  void Free();

 private:
  friend absl::Status GrowBuffers(absl::Span<const BufferGrowth> growths, cudaStream_t stream);
  void* data_ = nullptr;
  std::atomic<uint64_t> bytes_{0};
};

template <typename T>
class DeviceArray : public DeviceBuffer {
 public:
  T* data() const { return static_cast<T*>(raw()); }
  uint64_t capacity() const { return bytes() / sizeof(T); }
  // The growth that makes the array hold at least n elements.
  BufferGrowth ToHold(uint64_t n) { return {this, n * sizeof(T)}; }
};

// Grows every buffer whose allocation is smaller than its growth asks, all or nothing: either
// every one grows, keeping its contents, with the new bytes zero, or (RESOURCE_EXHAUSTED when
// device memory runs out) none changes and all memory allocated here is freed again. The copies
// run on `stream`, after the work already queued there (which may still use the old buffers),
// and the host then waits for that stream before freeing the old buffers: growth is rare
// (registration, a larger push than any before), so this wait is not on a step's usual path.
// REQUIRES: the old buffers are used by no stream other than `stream`.
absl::Status GrowBuffers(absl::Span<const BufferGrowth> growths, cudaStream_t stream);

// A few page-locked host slots for host-to-device copies that the host does not wait for. A
// slot is handed out again only once the copy that last read it is done (an event recorded
// after that copy), so the host waits only when the ring wraps onto a copy still queued.
// One thread at a time.
class PinnedRing {
 public:
  struct Slot {
    void* host = nullptr;  // Page-locked.
    uint64_t bytes = 0;
    cudaEvent_t read = nullptr;  // Recorded after the copy that reads the slot.
    bool in_flight = false;      // `read` was recorded and not waited for since.
  };

  PinnedRing() = default;
  PinnedRing(const PinnedRing&) = delete;
  PinnedRing& operator=(const PinnedRing&) = delete;
  ~PinnedRing() { Free(); }

  // Errors: INTERNAL with CUDA's message.
  absl::Status Init(int slots);

  // The next slot, holding at least `bytes` (grown when short), once the copy that last read
  // it is done. Errors: RESOURCE_EXHAUSTED when page-locked memory runs out; INTERNAL.
  absl::StatusOr<Slot*> Acquire(uint64_t bytes);

  // Marks `slot` in use until the work queued on `stream` so far (its copy) is done.
  absl::Status Release(Slot* slot, cudaStream_t stream);

  // Frees the slots and their events. REQUIRES: the device is current; no copy reads them.
  void Free();

 private:
  std::vector<Slot> slots_;
  size_t next_ = 0;
};

}  // namespace gpu
}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_CUDA_DEVICE_MEMORY_CUH_
