// grad_check.h: the all-or-nothing check for non-finite gradients, on the host.
//
// Gradients reach a fusedps server through host memory (the network, then staging), so the
// check runs where each payload is staged, on the CPU, in parallel. A device-side check would
// read every gradient a second time (4 of the 28 bytes an fp32 step moves per parameter); this
// way the device step is a single launch over bytes it must move anyway.
#ifndef FUSEDPS_KERNELS_GRAD_CHECK_H_
#define FUSEDPS_KERNELS_GRAD_CHECK_H_

#include <cstdint>
#include <functional>

#include "kernels/adamw_math.h"
#include "kernels/backend.h"

namespace fusedps {

// True when all `count` elements at `grads` are finite once divided by grad_scale
// (grad_scale <= 0: none), as AdamWUpdate will use them. With `parallel`, OpenMP threads share
// large counts; without, the calling thread checks alone (many callers at once, e.g. per chunk).
bool GradsAllFinite(const void* grads, GradDType dtype, uint64_t count, float grad_scale,
                    bool parallel = true);

// What one pass over `count` gradients saw (GradCheck: whether all were finite, the largest
// |g| among them), so that the verdict can be made later for any grad_scale
// (GradCheckFinite): the host's side of CopyDeviceToStaging's check, for the chunks that came
// inline in a push through a device workspace. Single-threaded.
GradCheck SeeGrads(const void* grads, GradDType dtype, uint64_t count);
// Folds `more` into *into (both seen in one push).
void MergeGradChecks(GradCheck* into, const GradCheck& more);
// Whether every gradient a check saw is finite once divided by grad_scale (<= 0: none): a finite
// g / grad_scale overflows exactly when max_abs / grad_scale does (division is monotonic).
bool GradCheckFinite(const GradCheck& check, float grad_scale);

// The same over a push's tensors: element ranges [grad_offsets[i], + numel(tensors[i])) of
// request.grads (host memory). Padding between tensors is not read.
bool PushGradsAllFinite(const StepRequest& request,
                        const std::function<uint64_t(uint32_t tensor)>& numel);

// Whether a step's gradients are all finite, as a backend's Step decides it: for grads staged
// earlier (request.grads == nullptr) from *staged_non_finite, which StageGrads accumulated and
// this clears; from the caller's check when request.grads_checked (always so for a step from
// the accumulator); else by reading them.
bool StepGradsFinite(const StepRequest& request, bool* staged_non_finite,
                     const std::function<uint64_t(uint32_t tensor)>& numel);

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_GRAD_CHECK_H_
