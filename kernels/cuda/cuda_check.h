// cuda_check.h (CUDA backend only): turning CUDA errors into absl::Status, and making the
// backend's device current on the calling thread.
//
// Usage:
//   FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(ordinal));
//   FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, kind, stream));
#ifndef FUSEDPS_KERNELS_CUDA_CUDA_CHECK_H_
#define FUSEDPS_KERNELS_CUDA_CUDA_CHECK_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

// Returns INTERNAL with the expression and CUDA's message when `expr` is not cudaSuccess.
#define FUSEDPS_CUDA_RETURN_IF_ERROR(expr)                                                    \
  do {                                                                                        \
    const cudaError_t fusedps_err = (expr);                                                   \
    if (fusedps_err != cudaSuccess) {                                                         \
      return absl::InternalError(absl::StrCat(#expr, ": ", cudaGetErrorString(fusedps_err))); \
    }                                                                                         \
  } while (0)

namespace fusedps {
namespace gpu {

// Makes device `ordinal` current on the calling thread. The CUDA runtime's current device is
// per thread, and allocations (cudaMalloc), kernel launches and event records act on it, so
// every backend call that touches CUDA starts here, whatever thread it runs on. Cheap when the
// device is current already (one thread-local read).
//
// It does not restore the previous device afterwards: on a thread that never used CUDA the
// "previous" device is 0, and since CUDA 12 cudaSetDevice(0) creates device 0's primary
// context, which would cost hundreds of MiB on a GPU this backend does not use (another
// server's, say). Code that shares a thread with the backend sets its own device.
inline cudaError_t UseDevice(int ordinal) {
  int current = -1;
  const cudaError_t err = cudaGetDevice(&current);
  if (err == cudaSuccess && current == ordinal) return cudaSuccess;
  return cudaSetDevice(ordinal);
}

}  // namespace gpu
}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_CUDA_CUDA_CHECK_H_
