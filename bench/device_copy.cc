#include "bench/device_copy.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"

namespace fusedps {
namespace {

absl::Status Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

}  // namespace

absl::StatusOr<double> DeviceCopyMs(int ordinal, uint64_t bytes, int warmup, int iters,
                                    bool queued) {
  if (absl::Status s = Check(cudaSetDevice(ordinal), "cudaSetDevice"); !s.ok()) return s;
  void* src = nullptr;
  void* dst = nullptr;
  // events[i] before copy i, events[i + 1] after it (queued: shared with copy i + 1).
  std::vector<cudaEvent_t> events(warmup + iters + 1, nullptr);
  std::vector<double> ms;
  absl::Status status = Check(cudaMalloc(&src, bytes), "cudaMalloc");
  if (status.ok()) status = Check(cudaMalloc(&dst, bytes), "cudaMalloc");
  if (status.ok()) status = Check(cudaMemset(src, 0x5a, bytes), "cudaMemset");
  for (size_t i = 0; status.ok() && i < events.size(); ++i) {
    status = Check(cudaEventCreate(&events[i]), "cudaEventCreate");
  }
  if (status.ok()) status = Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  for (int i = 0; status.ok() && i < warmup + iters; ++i) {
    if (i == 0 || !queued) status = Check(cudaEventRecord(events[i]), "cudaEventRecord");
    if (status.ok())
      status = Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpyAsync");
    if (status.ok()) status = Check(cudaEventRecord(events[i + 1]), "cudaEventRecord");
    if (status.ok() && !queued) status = Check(cudaEventSynchronize(events[i + 1]), "sync");
  }
  if (status.ok()) status = Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  for (int i = warmup; status.ok() && i < warmup + iters; ++i) {
    float elapsed = 0;
    status = Check(cudaEventElapsedTime(&elapsed, events[i], events[i + 1]), "elapsed");
    ms.push_back(elapsed);
  }
  for (cudaEvent_t e : events) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  cudaFree(src);
  cudaFree(dst);
  if (!status.ok()) return status;
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace fusedps
