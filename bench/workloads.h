// workloads.h: the tensor lists that fusedps's optimizer benchmarks run (DESIGN.md, "Numbers to
// beat"), so that every benchmark and every baseline steps exactly the same tensors.
//
// bench/torch_baseline.py holds the same lists in Python; scripts/bench.sh checks that both
// sides report the same tensor and parameter counts.
//
// Usage:
//   absl::StatusOr<std::vector<Workload>> workloads = MakeWorkloads("all", /*scale=*/0.1);
//   for (const Workload& w : *workloads) Run(w.numels);
#ifndef FUSEDPS_BENCH_WORKLOADS_H_
#define FUSEDPS_BENCH_WORKLOADS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fusedps {

struct Workload {
  std::string name;  // Flag value: "one_large", "gpt2", "t1000x100k", "t10000x1k", "t<N>x<M>".
  std::string description;       // As DESIGN.md's table says it, at scale 1.
  std::vector<uint64_t> numels;  // One entry per tensor, in registration order.

  uint64_t total_numel() const;
};

// The workload names MakeWorkloads accepts, in the order "all" runs them.
std::vector<std::string> WorkloadNames();

// Scales a tensor's element count: max(1, floor(numel * scale + 0.5)). The number of tensors
// never changes, so per-tensor overheads stay what they are at full size.
uint64_t ScaledNumel(uint64_t numel, double scale);

// Returns the named workload (or every workload for "all") with element counts scaled. Besides
// WorkloadNames(), "t<count>x<numel>" names `count` tensors of `numel` elements each, numel with
// an optional k (x 1,000) or m (x 1,000,000) suffix: "t40000x1k" is DESIGN.md's 10,000 x 1K
// four times over, which tells a step's fixed cost from its cost per tensor.
// Errors: INVALID_ARGUMENT for an unknown name, a count outside [1, 1e7], a numel outside
// [1, 1e10], or a scale outside (0, 1e3].
absl::StatusOr<std::vector<Workload>> MakeWorkloads(absl::string_view name, double scale);

}  // namespace fusedps

#endif  // FUSEDPS_BENCH_WORKLOADS_H_
