// backend_factory.h: picks an optimizer backend from a device name.
#ifndef FUSEDPS_KERNELS_BACKEND_FACTORY_H_
#define FUSEDPS_KERNELS_BACKEND_FACTORY_H_

#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"

namespace fusedps {

// device: "auto" (cuda:0 when this build has CUDA and a GPU is present, else cpu), "cpu",
// "cuda" or "cuda:N". Errors: INVALID_ARGUMENT for another name; UNAVAILABLE when CUDA is asked
// for and this build or machine has none.
absl::StatusOr<std::unique_ptr<OptimizerBackend>> MakeBackend(absl::string_view device,
                                                              BackendOptions options);

// Number of CUDA devices visible (0 without CUDA).
int CudaDeviceCount();

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_BACKEND_FACTORY_H_
