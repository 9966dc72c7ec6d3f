// kernel_bench_report.h: what fusedps-kernel-bench (bench/kernel_bench.cc) was asked to run
// (BenchConfig) and what it measured of each workload (Timing, Result), and the two forms it prints
// them in: a table, or one JSON object (--json).
//
// Usage:
//   std::vector<Result> results = ...;  // One per workload, from RunWorkload.
//   PrintTable(config, scale, results);
#ifndef FUSEDPS_BENCH_KERNEL_BENCH_REPORT_H_
#define FUSEDPS_BENCH_KERNEL_BENCH_REPORT_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "bench/workloads.h"
#include "kernels/backend.h"

namespace fusedps {

// The run's settings, from the flags (kernel_bench.cc's ConfigFromFlags).
struct BenchConfig {
  std::string backend;
  GradDType grad_dtype = GradDType::kFloat32;
  ParamCopyDType param_copy = ParamCopyDType::kNone;
  StateDType state_dtype = StateDType::kFloat32;
  ParamsDType params_dtype = ParamsDType::kFloat32;
  StepKernel step_kernel = StepKernel::kAuto;
  int warmup = 0;
  int iters = 0;
  int threads = 0;
  uint64_t seed = 0;
  bool copy_reference = true;
};

// The timed steps of one workload (TimeSteps).
struct Timing {
  double ms_median = 0;  // Wall time around Step() and Wait().
  double ms_min = 0;
  double ms_max = 0;
  double device_ms_median = 0;  // WorkDone::device_seconds, as Wait reports it.
  // The same for steps queued back to back (as a loaded server runs them): each step's device
  // time then starts when the previous one ends, so the host's launch latency is not in it.
  double queued_device_ms_median = 0;
  double launches_per_step = 0;
  std::map<std::string, double> launches_per_step_by_kernel;
  double cupti_kernels_per_step = -1;  // Kernels CUPTI saw run per step; -1: not counted.
};

// One workload's row: its timing, and the bandwidths derived from it (RunWorkload).
struct Result {
  Workload workload;
  std::string device;
  uint64_t validated_elements = 0;
  Timing timing;
  double gbps = 0;                    // From the wall-time median.
  double device_gbps = 0;             // From the device-time median (CUDA events on a GPU).
  double copy_gbps = 0;               // 0: not measured.
  double queued_device_gbps = 0;      // From the queued device-time median.
  double queued_copy_gbps = 0;        // Copies queued back to back; 0: not measured.
  double bytes_per_param = 0;         // Moved by an ideal step (StepBytes / params).
  double device_bytes_per_param = 0;  // memory_bytes() but staging and snapshots, / params.
};

// Prints the run's settings, then one row per workload, to stdout.
void PrintTable(const BenchConfig& config, double scale, const std::vector<Result>& results);

// Prints one JSON object (the settings, and "results": one object per workload) to stdout.
void PrintJson(const BenchConfig& config, double scale, const std::vector<Result>& results);

}  // namespace fusedps

#endif  // FUSEDPS_BENCH_KERNEL_BENCH_REPORT_H_
