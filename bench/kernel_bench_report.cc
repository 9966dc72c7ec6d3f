// kernel_bench_report.cc: fusedps-kernel-bench's table and JSON output (kernel_bench_report.h).
#include "bench/kernel_bench_report.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/dtype_names.h"
#include "common/json_string.h"
#include "kernels/backend.h"
#include "kernels/tensor_layout.h"

namespace fusedps {
namespace {

const char* GradDTypeName(GradDType dtype) {
  return dtypes::ShortName(static_cast<v1::DType>(dtype));  // The proto's codes.
}
double MeanBytesPerParam(const std::vector<Result>& results) {
  return results.empty() ? 0 : results[0].bytes_per_param;
}
}  // namespace

void PrintTable(const BenchConfig& config, double scale, const std::vector<Result>& results) {
  absl::PrintF(
      "fusedps-kernel-bench: backend=%s device=\"%s\" grad_dtype=%s param_copy=%s "
      "state_dtype=%s params_dtype=%s scale=%g warmup=%d iters=%d bytes/param=%.4g\n",
      config.backend, results.empty() ? "" : results[0].device, GradDTypeName(config.grad_dtype),
      ParamCopyDTypeName(config.param_copy), StateDTypeName(config.state_dtype),
      ParamsDTypeName(config.params_dtype), scale, config.warmup, config.iters,
      MeanBytesPerParam(results));
  absl::PrintF("%-11s %8s %12s %10s %10s %10s %8s %9s %10s %7s %9s %9s %7s %10s\n", "workload",
               "tensors", "params", "ms/step", "min ms", "device ms", "GB/s", "dev GB/s",
               "copy GB/s", "% copy", "queued %", "launches", "cupti", "validated");
  for (const Result& r : results) {
    const std::string copy_gbps = r.copy_gbps > 0 ? absl::StrFormat("%.2f", r.copy_gbps) : "-";
    // % copy compares the step's device time (events on a GPU) with the copy's.
    const std::string pct_copy =
        r.copy_gbps > 0 ? absl::StrFormat("%.0f%%", 100 * r.device_gbps / r.copy_gbps) : "-";
    // The same for steps and copies queued back to back.
    const std::string queued_pct =
        r.queued_copy_gbps > 0
            ? absl::StrFormat("%.0f%%", 100 * r.queued_device_gbps / r.queued_copy_gbps)
            : "-";
    const std::string cupti = r.timing.cupti_kernels_per_step >= 0
                                  ? absl::StrFormat("%.1f", r.timing.cupti_kernels_per_step)
                                  : "-";
    absl::PrintF("%-11s %8d %12d %10.3f %10.3f %10.3f %8.2f %9.2f %10s %7s %9s %9.1f %7s %10d\n",
                 r.workload.name, r.workload.numels.size(), r.workload.total_numel(),
                 r.timing.ms_median, r.timing.ms_min, r.timing.device_ms_median, r.gbps,
                 r.device_gbps, copy_gbps, pct_copy, queued_pct, r.timing.launches_per_step, cupti,
                 r.validated_elements);
  }
}

void PrintJson(const BenchConfig& config, double scale, const std::vector<Result>& results) {
  absl::PrintF(
      "{\"tool\": \"fusedps-kernel-bench\", \"backend\": %s, \"device\": %s, "
      "\"grad_dtype\": \"%s\", \"param_copy\": \"%s\", \"state_dtype\": \"%s\", "
      "\"params_dtype\": \"%s\", \"scale\": %.17g, "
      "\"warmup\": %d, \"iters\": %d, \"bytes_per_param\": %.6g, \"results\": [",
      JsonString(config.backend), JsonString(results.empty() ? "" : results[0].device),
      GradDTypeName(config.grad_dtype), ParamCopyDTypeName(config.param_copy),
      StateDTypeName(config.state_dtype), ParamsDTypeName(config.params_dtype), scale,
      config.warmup, config.iters, MeanBytesPerParam(results));
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    std::string by_kernel;
    for (const auto& [kernel, per_step] : r.timing.launches_per_step_by_kernel) {
      absl::StrAppend(&by_kernel, by_kernel.empty() ? "" : ", ", JsonString(kernel), ": ",
                      absl::StrFormat("%.3f", per_step));
    }
    absl::PrintF(
        "%s\n  {\"workload\": %s, \"description\": %s, \"tensors\": %d, "
        "\"params\": %d, \"ms_median\": %.6f, \"ms_min\": %.6f, \"ms_max\": %.6f, "
        "\"device_ms_median\": %.6f, \"gbps\": %.4f, \"device_gbps\": %.4f, "
        "\"copy_gbps\": %s, \"queued_device_ms_median\": %.6f, \"queued_device_gbps\": %.4f, "
        "\"queued_copy_gbps\": %s, \"launches_per_step\": %.3f, "
        "\"launches_per_step_by_kernel\": {%s}, \"cupti_kernels_per_step\": %.3f, "
        "\"validated_elements\": %d, \"bytes_per_param\": %.6f, "
        "\"device_bytes_per_param\": %.6f}",
        i == 0 ? "" : ",", JsonString(r.workload.name), JsonString(r.workload.description),
        r.workload.numels.size(), r.workload.total_numel(), r.timing.ms_median, r.timing.ms_min,
        r.timing.ms_max, r.timing.device_ms_median, r.gbps, r.device_gbps,
        r.copy_gbps > 0 ? absl::StrFormat("%.4f", r.copy_gbps) : "null",
        r.timing.queued_device_ms_median, r.queued_device_gbps,
        r.queued_copy_gbps > 0 ? absl::StrFormat("%.4f", r.queued_copy_gbps) : "null",
        r.timing.launches_per_step, by_kernel, r.timing.cupti_kernels_per_step,
        r.validated_elements, r.bytes_per_param, r.device_bytes_per_param);
  }
  absl::PrintF("\n]}\n");
}

}  // namespace fusedps
