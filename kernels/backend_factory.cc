#include "kernels/backend_factory.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace fusedps {

#ifdef FUSEDPS_HAVE_CUDA
// kernels/cuda/cuda_backend.cu
int CudaDeviceCount();
absl::StatusOr<std::unique_ptr<OptimizerBackend>> MakeCudaBackend(const BackendOptions& options);
#else
int CudaDeviceCount() { return 0; }
absl::StatusOr<std::unique_ptr<OptimizerBackend>> MakeCudaBackend(const BackendOptions&) {
  return absl::UnavailableError("this build of fusedps has no CUDA backend (FUSEDPS_CUDA=OFF)");
}
#endif

absl::StatusOr<std::unique_ptr<OptimizerBackend>> MakeBackend(absl::string_view device,
                                                              BackendOptions options) {
  if (device == "cpu") return MakeCpuBackend(options);
  if (device == "auto") {
    if (CudaDeviceCount() > 0) return MakeCudaBackend(options);
    return MakeCpuBackend(options);
  }
  if (device == "cuda") device = "cuda:0";
  if (absl::StartsWith(device, "cuda:") &&
      absl::SimpleAtoi(device.substr(5), &options.device_ordinal) && options.device_ordinal >= 0) {
    return MakeCudaBackend(options);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--device = '", device, "' must be auto, cpu, cuda or cuda:N"));
}

}  // namespace fusedps
