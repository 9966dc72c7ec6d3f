// adamw_kernel.cuh (CUDA backend only): the one kernel of an optimizer step, AdamWApply, as the
// rest of the backend sees it: the chunk list it walks, the arenas it updates, the grid that
// fills the GPU, and the launcher that checks and counts every launch. The kernel itself and
// its tuning history are in adamw_kernel.cu; the device memory and tables that feed it are in
// cuda_backend.cu.
//
// Usage:
//   std::vector<Chunk> chunks;
//   AppendChunks(tensor, group, numel, arena_offset, grad_offset, chunks);
//   ... upload the chunks and fill a DeviceArenas ...
//   RETURN_IF_ERROR(LaunchAdamWApply(launches, grid, stream, grad_dtype, copy_dtype, arenas,
//                                    device_chunks, chunks.size(), grad_scale));
#ifndef FUSEDPS_KERNELS_CUDA_ADAMW_KERNEL_CUH_
#define FUSEDPS_KERNELS_CUDA_ADAMW_KERNEL_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/adamw_math.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_check.h"

namespace fusedps {
namespace gpu {

constexpr int kVec = 8;                                      // Elements per lane per portion.
constexpr uint32_t kPortionNumel = 32 * kVec;                // Elements per portion: one warp pass.
constexpr uint32_t kPortions = 8;                            // Portions per chunk.
constexpr uint32_t kChunkNumel = kPortions * kPortionNumel;  // 2048 elements per chunk.
constexpr int kThreads = 256;                                // Threads per block.
constexpr int kWarpsPerBlock = kThreads / 32;

// One unit of work: up to kChunkNumel elements of one tensor. 32 bytes, everything a warp
// needs to start its loads at once.
struct Chunk {
  uint64_t arena_offset;  // Element of the arenas that holds the chunk's first element.
  uint64_t grad_offset;   // Element of the staging buffer that holds its first gradient.
  uint32_t tensor;
  uint32_t count;  // Elements; 0 only for a tensor of no elements.
  uint32_t group;
  uint32_t unused;
};

// Device pointers of a step, passed by value to the kernel.
struct DeviceArenas {
  float* params;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // Null until a group has amsgrad.
  uint16_t* copy;         // Null without a param copy.
  const void* grads;      // The step's gradients on the device, in the wire dtype.
  int64_t* step;
  const AdamWHyperparameters* hyper;
  uint32_t* remaining;          // Per tensor: portions of this step still to read its step.
  const uint32_t* portions_of;  // Per tensor: kPortions x its number of chunks.
};

// Every launch goes through here: one place checks it and counts it by kernel name. The counts
// are thread-safe.
class LaunchCounter {
 public:
  template <typename... KernelArgs, typename... Args>
  absl::Status Launch(const char* name, void (*kernel)(KernelArgs...), int grid,
                      cudaStream_t stream, Args&&... args) {
    kernel<<<grid, kThreads, 0, stream>>>(std::forward<Args>(args)...);
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_[name];
    ++total_;
    return absl::OkStatus();
  }
  uint64_t total() const {
    std::lock_guard<std::mutex> lock(mu_);
    return total_;
  }
  std::map<std::string, uint64_t> counts() const {
    std::lock_guard<std::mutex> lock(mu_);
    return counts_;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::string, uint64_t> counts_;
  uint64_t total_ = 0;
};

// The number of chunks of a tensor: at least 1, since an empty tensor still has an entry, so
// that its step advances.
inline uint64_t ChunksOf(uint64_t numel) {
  return numel == 0 ? 1 : (numel + kChunkNumel - 1) / kChunkNumel;
}

// Appends a tensor's chunks and returns how many (ChunksOf(numel)).
uint32_t AppendChunks(uint32_t tensor, uint32_t group, uint64_t numel, uint64_t arena_offset,
                      uint64_t grad_offset, std::vector<Chunk>& out);

// The grid that fills the current device: its SMs times the fewest blocks of any instantiation
// of AdamWApply that fit on one. Errors: INTERNAL with CUDA's message.
absl::StatusOr<int> AdamWApplyGrid();

// Launches one step, AdamWApply over `chunk_count` chunks, on `stream` with at most `grid`
// blocks, checks the launch and counts it in `launches` as "fusedps_adamw_apply".
// REQUIRES: the stream's device is current; chunk_count > 0.
// Each step's lr is its group's lr / lr_divisor (float64, MakeStepScalars).
absl::Status LaunchAdamWApply(LaunchCounter& launches, int grid, cudaStream_t stream,
                              GradDType grad_dtype, ParamCopyDType copy_dtype,
                              const DeviceArenas& arenas, const Chunk* chunks, uint32_t chunk_count,
                              float grad_scale, double lr_divisor);

// Launches GradAccumulate over `chunk_count` chunks: for each element of each chunk,
// accumulator[arena_offset + i] = (first ? 0 : itself) + grads[grad_offset + i] / grad_scale
// (grad_scale <= 0: none), in fp32; counted as "fusedps_grad_accumulate".
// REQUIRES: as LaunchAdamWApply's.
absl::Status LaunchGradAccumulate(LaunchCounter& launches, int grid, cudaStream_t stream,
                                  GradDType grad_dtype, float* accumulator, const void* grads,
                                  const Chunk* chunks, uint32_t chunk_count, float grad_scale,
                                  bool first);

}  // namespace gpu
}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_CUDA_ADAMW_KERNEL_CUH_
