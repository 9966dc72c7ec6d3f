// step_validation.h: how fusedps-kernel-bench (bench/kernel_bench.cc) checks a backend's steps
// before it times them: a few sampled ranges of every tensor (head, tail, one random run),
// read back before and after a step, against AdamWUpdate (kernels/adamw_math.h) applied here.
//
// Usage:
//   std::vector<SampleRange> samples = PickSamples(workload.numels, seed);
//   absl::StatusOr<uint64_t> checked = ValidateOneStep(backend, staged_grads, samples);
#ifndef FUSEDPS_BENCH_STEP_VALIDATION_H_
#define FUSEDPS_BENCH_STEP_VALIDATION_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace fusedps {

// A 64-bit mix (SplitMix64's finalizer): seeds derived from one seed stay independent.
inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The gradients of a push covering every tensor, staged in the backend, and the host copy the
// reference reads. Laid out as the backend's arenas are.
struct StagedGrads {
  std::vector<uint32_t> tensors;  // 0..N-1.
  std::vector<uint64_t> offsets;  // Per tensor, in elements, multiples of 8.
  uint64_t arena_numel = 0;       // Elements of the layout, padding included.
  std::vector<uint32_t> host;     // fp32 or bf16 elements.
  GradDType dtype = GradDType::kFloat32;

  // A step on the backend's staged gradients (grads == nullptr).
  StepRequest Request() const {
    StepRequest request;
    request.tensors = tensors;
    request.grad_offsets = offsets;
    request.grad_dtype = dtype;
    return request;
  }
};

struct SampleRange {
  uint32_t tensor;
  uint64_t begin;
  uint64_t count;
};

// Each tensor's head, tail and one random run of up to 8 elements, by tensor.
std::vector<SampleRange> PickSamples(const std::vector<uint64_t>& numels, uint64_t seed);

// Steps once (Step, then Wait) on the staged grads and checks every sampled element against
// AdamWUpdate applied to the values read before the step; also the step counts and the bf16
// copy. Reads whole tensors, as a pull does. Returns the elements checked.
// Errors: INTERNAL for a mismatch; the backend's own errors.
absl::StatusOr<uint64_t> ValidateOneStep(OptimizerBackend& optimizer, const StagedGrads& grads,
                                         const std::vector<SampleRange>& samples);

// Steps `optimizer` (on its staged grads) and `twin` (a CPU backend with the same tensors,
// groups and values, on grads.host) once, then compares every field of every tensor in its
// stored form (params, exp_avg, exp_avg_sq, int8 scales) and the steps, bit for bit: for
// storage the sampled check cannot follow (bf16 and int8 state, stochastic rounding). Returns
// the elements compared. Errors: INTERNAL naming the first difference; the backends' errors.
absl::StatusOr<uint64_t> ValidateAgainstTwin(OptimizerBackend& optimizer, OptimizerBackend& twin,
                                             const StagedGrads& grads);

}  // namespace fusedps

#endif  // FUSEDPS_BENCH_STEP_VALIDATION_H_
