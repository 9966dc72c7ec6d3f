// device_arenas.cuh (CUDA backend only): the device arenas of one shard, one per stored dtype of
// each field (tensor_table.h): what they must hold, their pointers for the kernel and for
// TensorTable::FieldOf, and their sizes for metrics.
//
// Usage:
//   DeviceArenaSet arenas;
//   RETURN_IF_ERROR(GrowBuffers(arenas.ToHold(sizes, amsgrad, copy), stream));
//   DeviceArenas kernel_view = arenas.KernelView();  // then set grads, step, ...
#ifndef FUSEDPS_KERNELS_CUDA_DEVICE_ARENAS_CUH_
#define FUSEDPS_KERNELS_CUDA_DEVICE_ARENAS_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cuda/adamw_kernel.cuh"
#include "kernels/cuda/device_memory.cuh"
#include "kernels/tensor_table.h"

namespace fusedps {
namespace gpu {

class DeviceArenaSet {
 public:
  // The growths that make every arena hold `sizes`; max_exp_avg_sq when `amsgrad`, the param
  // copy when `copy`.
  std::vector<BufferGrowth> ToHold(const ArenaSizes& sizes, bool amsgrad, bool copy);

  // Queues zeroing every arena past `sizes` (what truncated tensors held), on `stream`.
  absl::Status ZeroFrom(const ArenaSizes& sizes, cudaStream_t stream);

  // The arenas for TensorTable::FieldOf.
  Arenas Pointers() const;
  // The arenas' part of the kernel's arguments (the rest is left null).
  DeviceArenas KernelView() const;

  // Bytes by metric kind (backend.h's memory_bytes): params, exp_avg, exp_avg_sq,
  // max_exp_avg_sq, state_scales, param_copy. Thread-safe (atomics).
  std::map<std::string, uint64_t> Bytes() const;

  std::vector<DeviceBuffer*> Buffers();
  uint64_t max_exp_avg_sq_capacity() const { return max_exp_avg_sq_.capacity(); }
  uint64_t copy_capacity() const { return copy_.capacity(); }

 private:
  DeviceArray<float> params32_, exp_avg32_, exp_avg_sq32_, max_exp_avg_sq_;
  DeviceArray<uint16_t> params16_, copy_, exp_avg16_, exp_avg_sq16_;
  DeviceArray<uint8_t> exp_avg8_, exp_avg_sq8_;
  DeviceArray<float> absmax_m_, absmax_v_;
};

}  // namespace gpu
}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_CUDA_DEVICE_ARENAS_CUH_
