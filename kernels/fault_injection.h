// fault_injection.h: an optimizer backend that fails on purpose, for tests of the server's
// error policy (docs/errors.md) and for `fusedps-server --testing-fault-at-step`.
//
// It wraps a real backend and forwards every call, except the numbered ones it is told to fail:
//   - a device fault (INTERNAL, as a failed CUDA launch or kernel reports): once one has been
//     injected, every later call fails with INTERNAL too, as CUDA's sticky errors do;
//   - running out of memory in AddTensors (RESOURCE_EXHAUSTED, nothing added), which the
//     server must survive.
#ifndef FUSEDPS_KERNELS_FAULT_INJECTION_H_
#define FUSEDPS_KERNELS_FAULT_INJECTION_H_

#include <cstdint>
#include <memory>

#include "kernels/backend.h"

namespace fusedps {

struct InjectedFaults {
  int64_t step = 0;         // The n-th Step call (1-based) fails: a launch failure.
  int64_t step_wait = 0;    // Waiting for the n-th queued step fails: a fault in its kernel.
  int64_t add_tensors = 0;  // The n-th AddTensors call runs out of memory (nothing added).
};

// REQUIRES: inner != nullptr.
std::unique_ptr<OptimizerBackend> MakeFaultInjectingBackend(std::unique_ptr<OptimizerBackend> inner,
                                                            const InjectedFaults& faults);

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_FAULT_INJECTION_H_
