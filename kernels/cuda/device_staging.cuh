// device_staging.cuh: the CUDA backend's device workspaces (backend.h's SharedDeviceMemory):
// their allocation for CUDA IPC, and the copy of a push's gradients out of one into the
// staging arena's device mirror, checked on the way (CopyDeviceToStaging).
//
// A push through a device workspace (server/workspace/) never passes through host memory: the
// trainer's bytes are on the server's GPU (or a peer's, by CUDA IPC), and one launch per batch
// of ranges copies them where the step reads them. The check the host makes of every other
// push (kernels/grad_check.h) happens in the same pass: each element is read once as the
// wire dtype, and the pass reports whether all were finite and the largest magnitude, from
// which the caller decides for any grad_scale.
//
// Thread safety: Copy may be called from any thread (gRPC's, one per message); one copy is in
// flight at a time (mu_), since the pass's result lives in one device word pair and one
// page-locked host pair. Lifetime: Init on the backend's device before use; Free before the
// device goes (the backend's destructor).
#ifndef FUSEDPS_KERNELS_CUDA_DEVICE_STAGING_CUH_
#define FUSEDPS_KERNELS_CUDA_DEVICE_STAGING_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/mutex.h"
#include "kernels/backend.h"
#include "kernels/cuda/adamw_kernel.cuh"

namespace fusedps {
namespace gpu {

// `bytes` of zeroed device memory on the current device, exported for CUDA IPC, with the
// device's UUID. Errors: RESOURCE_EXHAUSTED when the device has no room; INTERNAL otherwise.
absl::StatusOr<SharedDeviceMemory> AllocateShared(int device_ordinal, uint64_t bytes);

class DeviceStagingCopier {
 public:
  absl::Status Init();
  void Free();

  // Copies each range to mirror + its offset on `stream` (after the work queued there), reading
  // every element as `dtype`, and waits for it. REQUIRES: the ranges were checked against the
  // mirror's size (the backend does), and their bytes are multiples of the dtype's size.
  absl::StatusOr<GradCheck> Copy(LaunchCounter& launches, int grid, cudaStream_t stream,
                                 char* mirror, absl::Span<const DeviceStagingCopy> copies,
                                 GradDType dtype) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  Mutex mu_;
  uint32_t* result_device_ ABSL_GUARDED_BY(mu_) = nullptr;  // {non-finite seen, max |g| bits}
  uint32_t* result_host_ ABSL_GUARDED_BY(mu_) = nullptr;    // Page-locked, the same two words.
  cudaEvent_t done_ ABSL_GUARDED_BY(mu_) = nullptr;
};

}  // namespace gpu
}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_CUDA_DEVICE_STAGING_CUH_
