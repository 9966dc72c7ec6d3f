// device_staging.cu: device workspaces' memory and the checked copy out of them
// (device_staging.cuh).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_staging.cuh"

namespace fusedps {
namespace gpu {
namespace {

// Ranges per launch: the batch travels as the kernel's argument (well under 4 KiB).
constexpr int kRangesPerLaunch = 96;

struct RangeBatch {
  const char* src[kRangesPerLaunch];
  char* dst[kRangesPerLaunch];
  uint64_t bytes[kRangesPerLaunch];
  uint32_t count;
};

// One element's value, from its bits in `dtype` (LoadGrad's conversions).
__device__ __forceinline__ float ValueOf(GradDType dtype, uint32_t bits) {
  if (dtype == GradDType::kFloat32) return __uint_as_float(bits);
  const uint16_t h = static_cast<uint16_t>(bits);
  return dtype == GradDType::kBFloat16 ? BFloat16ToFloat(h) : Float16ToFloat(h);
}

__device__ __forceinline__ void See(float v, bool& non_finite, uint32_t& max_bits) {
  if (!isfinite(v)) {
    non_finite = true;
  } else {
    max_bits = max(max_bits, __float_as_uint(fabsf(v)));  // Non-negative floats order as bits.
  }
}

// Each block strides over every range in turn: 16-byte words where both ends and the length
// allow, elements otherwise. result: {any non-finite, the bits of the largest finite |g|}.
__global__ void __launch_bounds__(kThreads)
    CopyCheckGrads(RangeBatch batch, GradDType dtype, uint32_t* result) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint64_t first = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int size = DTypeSize(dtype);
  bool non_finite = false;
  uint32_t max_bits = 0;
  for (uint32_t r = 0; r < batch.count; ++r) {
    const char* src = batch.src[r];
    char* dst = batch.dst[r];
    const uint64_t bytes = batch.bytes[r];
    const bool vector =
        ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | bytes) % 16) == 0;
    uint64_t done = 0;
    if (vector) {
      const uint64_t words = bytes / 16;
      for (uint64_t w = first; w < words; w += stride) {
        const uint4 v = reinterpret_cast<const uint4*>(src)[w];
        reinterpret_cast<uint4*>(dst)[w] = v;
        const uint32_t parts[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if (size == 4) {
            See(ValueOf(dtype, parts[k]), non_finite, max_bits);
          } else {
            See(ValueOf(dtype, parts[k] & 0xffffu), non_finite, max_bits);
            See(ValueOf(dtype, parts[k] >> 16), non_finite, max_bits);
          }
        }
      }
      done = bytes;
    }
    const uint64_t elements = (bytes - done) / size;
    for (uint64_t i = first; i < elements; i += stride) {
      uint32_t bits;
      if (size == 4) {
        bits = reinterpret_cast<const uint32_t*>(src)[i];
        reinterpret_cast<uint32_t*>(dst)[i] = bits;
      } else {
        const uint16_t h = reinterpret_cast<const uint16_t*>(src)[i];
        reinterpret_cast<uint16_t*>(dst)[i] = h;
        bits = h;
      }
      See(ValueOf(dtype, bits), non_finite, max_bits);
    }
  }
  // Every thread reaches here: a warp's vote, then one atomic per warp.
  const bool any = __any_sync(0xffffffffu, non_finite);
  const uint32_t warp_max = __reduce_max_sync(0xffffffffu, max_bits);
  if (threadIdx.x % 32 == 0) {
    if (any) atomicOr(&result[0], 1u);
    if (warp_max > 0) atomicMax(&result[1], warp_max);
  }
}

std::string UuidText(const cudaUUID_t& uuid) {
  const unsigned char* b = reinterpret_cast<const unsigned char*>(uuid.bytes);
  return absl::StrFormat("GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                         b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
                         b[12], b[13], b[14], b[15]);
}

}  // namespace

absl::StatusOr<SharedDeviceMemory> AllocateShared(int device_ordinal, uint64_t bytes) {
  FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(device_ordinal));
  SharedDeviceMemory shared;
  // cudaMalloc, not the stream-ordered pool: only its allocations have legacy IPC handles.
  if (const cudaError_t e = cudaMalloc(&shared.data, std::max<uint64_t>(bytes, 1));
      e != cudaSuccess) {
    cudaGetLastError();  // Not sticky: clear it.
    return absl::ResourceExhaustedError(absl::StrCat("no device memory for a workspace of ", bytes,
                                                     " bytes: ", cudaGetErrorString(e)));
  }
  const auto fail = [&](const char* call, cudaError_t e) {
    cudaFree(shared.data);
    return absl::InternalError(absl::StrCat(call, ": ", cudaGetErrorString(e)));
  };
  // Zeroed, so that the caller never reads another user's bytes.
  if (const cudaError_t e = cudaMemset(shared.data, 0, bytes); e != cudaSuccess) {
    return fail("cudaMemset", e);
  }
  cudaIpcMemHandle_t handle;
  if (const cudaError_t e = cudaIpcGetMemHandle(&handle, shared.data); e != cudaSuccess) {
    return fail("cudaIpcGetMemHandle", e);
  }
  shared.ipc_handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
  cudaDeviceProp prop;
  if (const cudaError_t e = cudaGetDeviceProperties(&prop, device_ordinal); e != cudaSuccess) {
    return fail("cudaGetDeviceProperties", e);
  }
  shared.device_uuid = UuidText(prop.uuid);
  return shared;
}

absl::Status DeviceStagingCopier::Init() {
  MutexLock lock(&mu_);
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMalloc(&result_device_, 2 * sizeof(uint32_t)));
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMallocHost(&result_host_, 2 * sizeof(uint32_t)));
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  return absl::OkStatus();
}

void DeviceStagingCopier::Free() {
  MutexLock lock(&mu_);
  if (done_ != nullptr) cudaEventDestroy(done_);
  if (result_host_ != nullptr) cudaFreeHost(result_host_);
  if (result_device_ != nullptr) cudaFree(result_device_);
  done_ = nullptr;
  result_host_ = result_device_ = nullptr;
}

absl::StatusOr<GradCheck> DeviceStagingCopier::Copy(LaunchCounter& launches, int grid,
                                                    cudaStream_t stream, char* mirror,
                                                    absl::Span<const DeviceStagingCopy> copies,
                                                    GradDType dtype) {
  MutexLock lock(&mu_);
  if (done_ == nullptr) return absl::FailedPreconditionError("the device copier is not set up");
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(result_device_, 0, 2 * sizeof(uint32_t), stream));
  for (size_t begin = 0; begin < copies.size(); begin += kRangesPerLaunch) {
    RangeBatch batch;
    std::memset(&batch, 0, sizeof(batch));
    uint64_t largest = 0;
    for (size_t i = begin; i < copies.size() && batch.count < kRangesPerLaunch; ++i) {
      const DeviceStagingCopy& c = copies[i];
      if (c.bytes == 0) continue;
      batch.src[batch.count] = static_cast<const char*>(c.src);
      batch.dst[batch.count] = mirror + c.offset;
      batch.bytes[batch.count] = c.bytes;
      ++batch.count;
      largest = std::max(largest, c.bytes);
    }
    if (batch.count == 0) continue;
    // Enough blocks for the largest range's elements, at most the step's grid.
    const uint64_t wanted = (largest / DTypeSize(dtype) + kThreads - 1) / kThreads;
    const int blocks = static_cast<int>(std::clamp<uint64_t>(wanted, 1, grid));
    if (absl::Status s = launches.Launch("fusedps_workspace_gather", CopyCheckGrads, blocks, 0,
                                         stream, batch, dtype, result_device_);
        !s.ok()) {
      return s;
    }
  }
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(result_host_, result_device_, 2 * sizeof(uint32_t),
                                               cudaMemcpyDeviceToHost, stream));
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventRecord(done_, stream));
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(done_));
  GradCheck check;
  check.finite = result_host_[0] == 0;
  std::memcpy(&check.max_abs, &result_host_[1], sizeof(float));
  return check;
}

}  // namespace gpu
}  // namespace fusedps
