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

absl::StatusOr<double> DeviceCopyMs(int ordinal, uint64_t bytes, int warmup, int iters) {
  if (absl::Status s = Check(cudaSetDevice(ordinal), "cudaSetDevice"); !s.ok()) return s;
  void* src = nullptr;
  void* dst = nullptr;
  cudaEvent_t begin = nullptr, end = nullptr;
  std::vector<double> ms;
  absl::Status status = Check(cudaMalloc(&src, bytes), "cudaMalloc");
  if (status.ok()) status = Check(cudaMalloc(&dst, bytes), "cudaMalloc");
  if (status.ok()) status = Check(cudaMemset(src, 0x5a, bytes), "cudaMemset");
  if (status.ok()) status = Check(cudaEventCreate(&begin), "cudaEventCreate");
  if (status.ok()) status = Check(cudaEventCreate(&end), "cudaEventCreate");
  for (int i = 0; status.ok() && i < warmup + iters; ++i) {
    status = Check(cudaEventRecord(begin), "cudaEventRecord");
    if (status.ok()) status = Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice),
                                    "cudaMemcpyAsync");
    if (status.ok()) status = Check(cudaEventRecord(end), "cudaEventRecord");
    if (status.ok()) status = Check(cudaEventSynchronize(end), "cudaEventSynchronize");
    float elapsed = 0;
    if (status.ok()) status = Check(cudaEventElapsedTime(&elapsed, begin, end), "elapsed");
    if (status.ok() && i >= warmup) ms.push_back(elapsed);
  }
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  cudaFree(src);
  cudaFree(dst);
  if (!status.ok()) return status;
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace fusedps
