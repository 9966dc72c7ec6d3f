// cupti_kernel_counter.h (tests and benchmarks, CUDA builds only): counts the CUDA kernels that
// actually ran, by kernel name, through CUPTI's activity API. It is independent of fusedps's own
// launch counter, and is what that counter is checked against.
//
// Usage:
//   CuptiKernelCounter counter;
//   counter.Start();
//   ... launch work, synchronize ...
//   absl::StatusOr<std::map<std::string, uint64_t>> kernels = counter.Stop();
//
// One counter at a time per process (CUPTI's activity buffers are process-wide).
#ifndef FUSEDPS_KERNELS_CUPTI_KERNEL_COUNTER_H_
#define FUSEDPS_KERNELS_CUPTI_KERNEL_COUNTER_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fusedps {

class CuptiKernelCounter {
 public:
  // Errors: INTERNAL with CUPTI's message when it cannot enable kernel activity records.
  absl::Status Start();
  // Flushes CUPTI's buffers and returns the kernels recorded since Start, by mangled or plain
  // name as CUPTI reports it. REQUIRES: the work was synchronized.
  absl::StatusOr<std::map<std::string, uint64_t>> Stop();

  // Sum over names containing `substring`.
  static uint64_t CountMatching(const std::map<std::string, uint64_t>& kernels,
                                const std::string& substring);
};

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_CUPTI_KERNEL_COUNTER_H_
