// fusedps-kernel-bench: times one optimizer step of a backend on bench/workloads.h's workloads.
//
// For each workload it registers the tensors with a fresh backend, writes random normal params,
// stages random normal gradients once with StageGrads (as the server does while a push arrives;
// on a GPU they then sit in device memory), validates two steps on a few elements of every
// tensor against AdamWUpdate (kernels/adamw_math.h) run here on copies (reading whole tensors,
// as a pull does, and keeping the samples), and only then times steps on the staged gradients:
// the median of --iters steps after --warmup steps, each queued with Step() and waited for with
// Wait(marker), as wall time around both and as the device time that Wait reports
// (WorkDone::device_seconds: CUDA events around the kernel on a GPU); then --iters + 1 steps
// queued back to back (all Step() calls first), whose device times start where the previous
// step ended, so the host's launch latency is not in them (the first is dropped). The copy
// reference is timed both ways too. It exits non-zero on any mismatch.
//
// Bandwidth counts the bytes an ideal kernel moves per parameter: params, exp_avg and exp_avg_sq
// read and written (24 in fp32), the gradient read (4 for fp32, 2 for bf16) and the
// low-precision copy written (0 or 2). That is 28 for fp32 gradients and for bf16 gradients with
// a bf16 copy. With --state-dtype and --params-dtype the stored sizes count instead (bf16 state
// 2 + 2 each way, int8 1 + 1 plus the scales' 2 x 4 bytes per 256 elements each way; bf16
// params 2 each way), so GB/s is the actual traffic.
//
// Storage other than fp32 is validated against a CPU backend stepped alike ("twin"): every
// field of every tensor in its stored form, bit for bit, after each validation step.
//
// Usage:
//   fusedps-kernel-bench --backend=cpu --workload=all --scale=0.1 --iters=10
//   fusedps-kernel-bench --workload=gpt2 --grad-dtype=bf16 --param-copy=bf16 --json
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/kernel_bench_report.h"
#include "bench/step_validation.h"
#include "bench/workloads.h"
#include "common/dtype_names.h"
#include "common/flag_usage.h"
#include "kernels/adamw_math.h"
#include "kernels/backend.h"
#include "kernels/quant_math.h"
#include "kernels/tensor_layout.h"
#ifdef FUSEDPS_HAVE_CUDA
#include "bench/device_copy.h"
#include "kernels/cupti_kernel_counter.h"
#endif
#include "kernels/backend_factory.h"

ABSL_FLAG(std::string, backend, "cpu",
          "Optimizer backend, as kernels/backend_factory.h names it: cpu, cuda, cuda:N or auto");
ABSL_FLAG(std::string, workload, "all",
          "one_large, gpt2, t1000x100k, t10000x1k, all, or t<count>x<numel> (count tensors of "
          "numel elements, numel with an optional k or m suffix: t40000x1k)");
ABSL_FLAG(double, scale, 1.0,
          "Multiplies every tensor's element count (tensor counts stay); e.g. 0.1 on a small CPU");
ABSL_FLAG(std::string, grad_dtype, "fp32", "Gradient dtype: fp32 or bf16");
ABSL_FLAG(std::string, param_copy, "none",
          "Low-precision param copy the step writes: none or bf16");
ABSL_FLAG(std::string, state_dtype, "fp32",
          "How exp_avg and exp_avg_sq are stored: fp32, bf16 or int8");
ABSL_FLAG(std::string, params_dtype, "fp32",
          "How params are stored: fp32, or bf16 (stochastic rounding, no fp32 master)");
ABSL_FLAG(std::string, step_kernel, "auto",
          "CUDA backend's step kernel: auto, persistent or chunk-blocks (BackendOptions)");
ABSL_FLAG(int, warmup, 3, "Untimed steps before timing");
ABSL_FLAG(int, iters, 10, "Timed steps; the median is reported");
ABSL_FLAG(int, threads, 0, "CPU backend threads; 0 means one per hardware thread");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the random params, gradients and validation samples");
ABSL_FLAG(bool, copy_reference, true,
          "Also time a large memory copy on the backend's memory, the roof of a memory-bound "
          "step, and report each workload's bandwidth as a percentage of it");
ABSL_FLAG(bool, json, false, "Print one JSON object instead of a table");

namespace fusedps {
namespace {

// Steps validated before timing. Two, so that the second starts from non-zero exp_avg and
// exp_avg_sq and a step count above one.
constexpr int kValidationSteps = 2;

// Bytes per buffer of the copy reference: well beyond any cache.
constexpr uint64_t kCopyReferenceBytes = uint64_t{512} << 20;

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// Median milliseconds of a host memcpy of `bytes` by `threads` OpenMP threads, in 1 MiB pieces.
double HostCopyMs(uint64_t bytes, int threads, int warmup, int iters) {
  constexpr uint64_t kPiece = uint64_t{1} << 20;
  std::vector<char> src(bytes, 1), dst(bytes, 0);  // Touched: no page faults while timed.
  const int64_t pieces = static_cast<int64_t>((bytes + kPiece - 1) / kPiece);
  std::vector<double> ms;
  for (int i = 0; i < warmup + iters; ++i) {
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t k = 0; k < pieces; ++k) {
      const uint64_t begin = static_cast<uint64_t>(k) * kPiece;
      std::memcpy(dst.data() + begin, src.data() + begin, std::min(kPiece, bytes - begin));
    }
    const auto stop = std::chrono::steady_clock::now();
    if (i >= warmup) ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
  }
  return Median(ms);
}

// Median milliseconds of copying `bytes` between two buffers of the memory `optimizer` steps
// in: the roof of a memory-bound step. UNIMPLEMENTED for a backend without one here yet (a GPU
// roof is cudaMemcpy device to device, timed with events).
// `queued`: copies queued back to back, each timed from the previous one's end (as queued
// steps are); a host copy is the same either way (unused without CUDA).
absl::StatusOr<double> CopyRoofMs(const OptimizerBackend& optimizer, int threads, uint64_t bytes,
                                  int warmup, int iters, [[maybe_unused]] bool queued) {
  if (optimizer.name() == "cpu") {
    return HostCopyMs(bytes, threads > 0 ? threads : omp_get_num_procs(), warmup, iters);
  }
#ifdef FUSEDPS_HAVE_CUDA
  // device() reads "cuda:N <name> (...)": the roof of the backend's own GPU.
  int ordinal = 0;
  if (optimizer.name() == "cuda" &&
      std::sscanf(optimizer.device().c_str(), "cuda:%d", &ordinal) == 1) {
    return DeviceCopyMs(ordinal, bytes, warmup, iters, queued);
  }
#endif
  return absl::UnimplementedError(
      absl::StrCat("no copy roof for backend '", optimizer.name(), "' yet"));
}

// The group every tensor of a workload is in.
AdamWHyperparameters GroupOf(const BenchConfig& config) {
  AdamWHyperparameters h;
  h.state_dtype = config.state_dtype;
  h.params_dtype = config.params_dtype;
  return h;
}

// Bytes an ideal step moves for one parameter of a tensor with this layout.
double BytesPerParam(const BenchConfig& config, TensorLayout layout) {
  const bool copy =
      config.param_copy != ParamCopyDType::kNone && layout.params == ParamsDType::kFloat32;
  double bytes = DTypeSize(config.grad_dtype) + 2.0 * ParamsBytes(layout.params) +
                 4.0 * StateBytes(layout.state) + (copy ? 2 : 0);
  if (layout.state == StateDType::kInt8) bytes += 2.0 * 2 * 4 / kQuantBlock;  // The scales.
  return bytes;
}

// Bytes an ideal step moves in all, over the workload's tensors.
double StepBytes(const BenchConfig& config, const Workload& workload) {
  double bytes = 0;
  for (uint64_t numel : workload.numels) {
    bytes += BytesPerParam(config, LayoutOf(GroupOf(config), numel)) * static_cast<double>(numel);
  }
  return bytes;
}

// Fills out[0, n) with standard normal samples, the same for a (seed, stream) whatever the
// number of threads.
void FillNormal(uint64_t seed, uint64_t stream, float* out, uint64_t n) {
  constexpr uint64_t kChunk = uint64_t{1} << 20;
  const int64_t chunks = static_cast<int64_t>((n + kChunk - 1) / kChunk);
#pragma omp parallel for schedule(dynamic, 1) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    std::mt19937_64 rng(SplitMix64(seed ^ SplitMix64(stream * 0x100000001b3ull + c)));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const uint64_t end = std::min(n, static_cast<uint64_t>(c + 1) * kChunk);
    for (uint64_t i = static_cast<uint64_t>(c) * kChunk; i < end; ++i) out[i] = normal(rng);
  }
}

// Registers the workload's tensors, writes random params and stages random gradients.
absl::StatusOr<StagedGrads> Populate(const Workload& workload, const BenchConfig& config,
                                     OptimizerBackend& optimizer) {
  absl::Status status = optimizer.SetParamGroup(0, GroupOf(config));
  if (!status.ok()) return status;
  std::vector<NewTensor> tensors;
  StagedGrads grads;
  grads.dtype = config.grad_dtype;
  uint64_t arena_numel = 0;
  for (uint64_t numel : workload.numels) {
    grads.tensors.push_back(static_cast<uint32_t>(tensors.size()));
    grads.offsets.push_back(arena_numel);
    const std::string name = absl::StrCat("t", tensors.size());
    tensors.push_back({.numel = numel,
                       .param_group = 0,
                       .rounding_key = TensorRoundingKey(name.data(), name.size())});
    arena_numel += AlignedNumel(numel);
  }
  absl::StatusOr<uint32_t> first = optimizer.AddTensors(tensors);
  if (!first.ok()) return first.status();
  if (*first != 0) {
    return absl::InternalError(absl::StrCat("a fresh backend numbered its first tensor ", *first));
  }
  grads.arena_numel = arena_numel;

  std::vector<float> values(arena_numel);
  FillNormal(config.seed, /*stream=*/1, values.data(), arena_numel);
  for (uint32_t t = 0; t < tensors.size(); ++t) {
    status = optimizer.WriteParams(
        t, 0, absl::MakeConstSpan(values.data() + grads.offsets[t], workload.numels[t]));
    if (!status.ok()) return status;
  }
  FillNormal(config.seed, /*stream=*/2, values.data(), arena_numel);
  const int size = DTypeSize(grads.dtype);
  grads.host.resize((arena_numel * size + 3) / 4);
  if (grads.dtype == GradDType::kFloat32) {
    std::memcpy(grads.host.data(), values.data(), arena_numel * sizeof(float));
  } else {
    auto* bf16 = reinterpret_cast<uint16_t*>(grads.host.data());
    for (uint64_t i = 0; i < arena_numel; ++i) bf16[i] = FloatToBFloat16(values[i]);
  }
  const char* host = reinterpret_cast<const char*>(grads.host.data());
  for (uint32_t t = 0; t < tensors.size(); ++t) {  // Payloads only, never the padding.
    status = optimizer.StageGrads(grads.offsets[t] * size, host + grads.offsets[t] * size,
                                  workload.numels[t], grads.dtype, /*grad_scale=*/0.0f);
    if (!status.ok()) return status;
  }
  return grads;
}

// One step, queued and waited for: Step() returns once the step is queued (at once on a GPU),
// Wait(marker) once it has run.
absl::StatusOr<WorkDone> StepAndWait(OptimizerBackend& optimizer, const StepRequest& request) {
  absl::StatusOr<StepOutcome> outcome = optimizer.Step(request);
  if (!outcome.ok()) return outcome.status();
  if (outcome->skipped) return absl::InternalError("a timed step was skipped");
  return optimizer.Wait(outcome->marker);
}

absl::StatusOr<Timing> TimeSteps(OptimizerBackend& optimizer, const StagedGrads& grads,
                                 const BenchConfig& config) {
  const StepRequest request = grads.Request();
  for (int i = 0; i < config.warmup; ++i) {
    absl::StatusOr<WorkDone> done = StepAndWait(optimizer, request);
    if (!done.ok()) return done.status();
  }
  const uint64_t launches_before = optimizer.launches_total();
  const std::map<std::string, uint64_t> by_kernel_before = optimizer.launch_counts();
#ifdef FUSEDPS_HAVE_CUDA
  // CUPTI counts the kernels that really ran, independently of the backend's own counter.
  CuptiKernelCounter cupti;
  const bool counting = optimizer.name() == "cuda" && cupti.Start().ok();
#endif
  std::vector<double> ms, device_ms;
  for (int i = 0; i < config.iters; ++i) {
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<WorkDone> done = StepAndWait(optimizer, request);
    const auto stop = std::chrono::steady_clock::now();
    if (!done.ok()) return done.status();
    ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
    device_ms.push_back(done->device_seconds * 1e3);
  }
  Timing timing;
#ifdef FUSEDPS_HAVE_CUDA
  if (counting) {
    absl::StatusOr<std::map<std::string, uint64_t>> kernels = cupti.Stop();
    if (!kernels.ok()) return kernels.status();
    uint64_t total = 0;
    for (const auto& [name, count] : *kernels) total += count;
    timing.cupti_kernels_per_step = static_cast<double>(total) / config.iters;
  }
#endif
  timing.launches_per_step =
      static_cast<double>(optimizer.launches_total() - launches_before) / config.iters;
  for (const auto& [kernel, count] : optimizer.launch_counts()) {
    const auto before = by_kernel_before.find(kernel);
    const uint64_t launched = count - (before == by_kernel_before.end() ? 0 : before->second);
    if (launched > 0) {
      timing.launches_per_step_by_kernel[kernel] = static_cast<double>(launched) / config.iters;
    }
  }
  // Queued: all steps first, then the waits. The first starts on an idle device: not counted.
  std::vector<Marker> markers;
  for (int i = 0; i <= config.iters; ++i) {
    absl::StatusOr<StepOutcome> outcome = optimizer.Step(request);
    if (!outcome.ok()) return outcome.status();
    if (outcome->skipped) return absl::InternalError("a timed step was skipped");
    markers.push_back(outcome->marker);
  }
  std::vector<double> queued_ms;
  for (size_t i = 0; i < markers.size(); ++i) {
    absl::StatusOr<WorkDone> done = optimizer.Wait(markers[i]);
    if (!done.ok()) return done.status();
    if (i > 0) queued_ms.push_back(done->device_seconds * 1e3);
  }
  timing.queued_device_ms_median = Median(queued_ms);
  timing.ms_median = Median(ms);
  timing.ms_min = *std::min_element(ms.begin(), ms.end());
  timing.ms_max = *std::max_element(ms.begin(), ms.end());
  timing.device_ms_median = Median(device_ms);
  return timing;
}

absl::StatusOr<Result> RunWorkload(const Workload& workload, const BenchConfig& config) {
  BackendOptions options;
  options.param_copy_dtype = config.param_copy;
  options.threads = config.threads;
  options.step_kernel = config.step_kernel;
  // The one place that picks the implementation.
  absl::StatusOr<std::unique_ptr<OptimizerBackend>> backend = MakeBackend(config.backend, options);
  if (!backend.ok()) return backend.status();
  OptimizerBackend& optimizer = **backend;
  absl::StatusOr<StagedGrads> grads = Populate(workload, config, optimizer);
  if (!grads.ok()) return grads.status();

  Result result;
  result.workload = workload;
  result.device = optimizer.device();
  const std::vector<SampleRange> samples = PickSamples(workload.numels, config.seed);
  const bool fp32 =
      config.state_dtype == StateDType::kFloat32 && config.params_dtype == ParamsDType::kFloat32;
  // Other storage: a CPU backend with the same tensors and values, stepped alike.
  std::unique_ptr<OptimizerBackend> twin;
  if (!fp32) {
    twin = MakeCpuBackend(options);
    if (absl::StatusOr<StagedGrads> twin_grads = Populate(workload, config, *twin);
        !twin_grads.ok()) {
      return twin_grads.status();
    }
  }
  for (int i = 0; i < kValidationSteps; ++i) {
    absl::StatusOr<uint64_t> checked = fp32 ? ValidateOneStep(optimizer, *grads, samples)
                                            : ValidateAgainstTwin(optimizer, *twin, *grads);
    if (!checked.ok()) {
      return absl::Status(checked.status().code(),
                          absl::StrCat("validation of ", workload.name, ", step ", i + 1,
                                       " failed: ", checked.status().message()));
    }
    result.validated_elements += *checked;
  }
  twin.reset();
  absl::StatusOr<Timing> timing = TimeSteps(optimizer, *grads, config);
  if (!timing.ok()) return timing.status();
  result.timing = *timing;
  const double bytes = StepBytes(config, workload);
  result.bytes_per_param = bytes / workload.total_numel();
  for (const auto& [kind, b] : optimizer.memory_bytes()) {
    if (kind != "grad_staging" && kind != "pull_snapshots") {
      result.device_bytes_per_param += static_cast<double>(b) / workload.total_numel();
    }
  }
  result.gbps = bytes / (result.timing.ms_median * 1e-3) / 1e9;
  result.device_gbps = bytes / (result.timing.device_ms_median * 1e-3) / 1e9;
  result.queued_device_gbps = bytes / (result.timing.queued_device_ms_median * 1e-3) / 1e9;
  if (config.copy_reference) {
    // Right after the steps, so that both see the same machine; a copy reads and writes. Each
    // way the steps were timed: one at a time, and queued back to back.
    for (const bool queued : {false, true}) {
      absl::StatusOr<double> ms = CopyRoofMs(optimizer, config.threads, kCopyReferenceBytes,
                                             config.warmup, config.iters, queued);
      if (!ms.ok()) {
        absl::FPrintF(stderr, "fusedps-kernel-bench: %s\n", ms.status().message());
        break;
      }
      (queued ? result.queued_copy_gbps : result.copy_gbps) =
          2.0 * kCopyReferenceBytes / (*ms * 1e-3) / 1e9;
    }
  }
  return result;
}

// A dtype flag's value in either spelling (common/dtype_names.h), one of `allowed`, the dtypes
// the bench runs (the kernels' enums have the proto's codes). `also`: other values the caller
// takes itself, for the message ("none or ").
template <typename ProtoDType>
absl::StatusOr<ProtoDType> DTypeFlag(absl::string_view flag, const std::string& value,
                                     std::initializer_list<ProtoDType> allowed,
                                     absl::string_view also = "") {
  absl::StatusOr<ProtoDType> parsed;
  if constexpr (std::is_same_v<ProtoDType, v1::StateDType>) {
    parsed = dtypes::ParseStateDType(value);
  } else {
    parsed = dtypes::ParseDType(value);
  }
  if (parsed.ok() && std::find(allowed.begin(), allowed.end(), *parsed) != allowed.end()) {
    return *parsed;
  }
  std::string names;  // "fp32, bf16 or int8"
  for (auto it = allowed.begin(); it != allowed.end(); ++it) {
    if (it != allowed.begin()) absl::StrAppend(&names, it + 1 == allowed.end() ? " or " : ", ");
    absl::StrAppend(&names, dtypes::ShortName(*it));
  }
  return absl::InvalidArgumentError(absl::StrCat(flag, "=", value, ": expected ", also, names));
}

absl::StatusOr<BenchConfig> ConfigFromFlags() {
  BenchConfig config;
  config.backend = absl::GetFlag(FLAGS_backend);
  absl::StatusOr<v1::DType> grad_dtype = DTypeFlag("--grad-dtype", absl::GetFlag(FLAGS_grad_dtype),
                                                   {v1::DTYPE_FLOAT32, v1::DTYPE_BFLOAT16});
  if (!grad_dtype.ok()) return grad_dtype.status();
  config.grad_dtype = static_cast<GradDType>(*grad_dtype);
  const std::string param_copy = absl::GetFlag(FLAGS_param_copy);
  if (param_copy == "none") {
    config.param_copy = ParamCopyDType::kNone;
  } else {
    absl::StatusOr<v1::DType> copy =
        DTypeFlag("--param-copy", param_copy, {v1::DTYPE_BFLOAT16}, "none or ");
    if (!copy.ok()) return copy.status();
    config.param_copy = static_cast<ParamCopyDType>(*copy);
  }
  const std::string step_kernel = absl::GetFlag(FLAGS_step_kernel);
  if (step_kernel == "auto") {
    config.step_kernel = StepKernel::kAuto;
  } else if (step_kernel == "persistent") {
    config.step_kernel = StepKernel::kPersistent;
  } else if (step_kernel == "chunk-blocks") {
    config.step_kernel = StepKernel::kChunkBlocks;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--step-kernel=", step_kernel, ": expected auto, persistent or chunk-blocks"));
  }
  absl::StatusOr<v1::StateDType> state_dtype =
      DTypeFlag("--state-dtype", absl::GetFlag(FLAGS_state_dtype),
                {v1::STATE_DTYPE_FLOAT32, v1::STATE_DTYPE_BFLOAT16, v1::STATE_DTYPE_INT8});
  if (!state_dtype.ok()) return state_dtype.status();
  config.state_dtype = static_cast<StateDType>(*state_dtype);
  absl::StatusOr<v1::DType> params_dtype = DTypeFlag(
      "--params-dtype", absl::GetFlag(FLAGS_params_dtype), {v1::DTYPE_FLOAT32, v1::DTYPE_BFLOAT16});
  if (!params_dtype.ok()) return params_dtype.status();
  config.params_dtype = static_cast<ParamsDType>(*params_dtype);
  config.warmup = absl::GetFlag(FLAGS_warmup);
  config.iters = absl::GetFlag(FLAGS_iters);
  config.threads = absl::GetFlag(FLAGS_threads);
  config.seed = absl::GetFlag(FLAGS_seed);
  config.copy_reference = absl::GetFlag(FLAGS_copy_reference);
  if (config.warmup < 0 || config.iters < 1 || config.threads < 0) {
    return absl::InvalidArgumentError("need --warmup >= 0, --iters >= 1 and --threads >= 0");
  }
  return config;
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Validates, then times one AdamW step of a fusedps backend on the workloads of\n"
      "bench/workloads.h (GPT-2 small and others).\n"
      "  fusedps-kernel-bench --backend=cpu --workload=all --scale=0.1 --iters=10");
  if (std::optional<int> exit_code = ParseProgramFlags(argc, argv, {__FILE__})) {
    return *exit_code;
  }
  absl::StatusOr<BenchConfig> config = ConfigFromFlags();
  const double scale = absl::GetFlag(FLAGS_scale);
  absl::StatusOr<std::vector<Workload>> workloads =
      MakeWorkloads(absl::GetFlag(FLAGS_workload), scale);
  for (const absl::Status& status : {config.status(), workloads.status()}) {
    if (!status.ok()) {
      absl::FPrintF(stderr, "fusedps-kernel-bench: %s\n", status.ToString());
      return 2;
    }
  }

  std::vector<Result> results;
  for (const Workload& workload : *workloads) {
    absl::FPrintF(stderr,
                  "fusedps-kernel-bench: %s (%d tensors, %d params): validating, then "
                  "timing %d steps\n",
                  workload.name, workload.numels.size(), workload.total_numel(), config->iters);
    absl::StatusOr<Result> result = RunWorkload(workload, *config);
    if (!result.ok()) {
      absl::FPrintF(stderr, "fusedps-kernel-bench: %s\n", result.status().ToString());
      return 1;
    }
    results.push_back(*std::move(result));
  }
  if (absl::GetFlag(FLAGS_json)) {
    PrintJson(*config, scale, results);
  } else {
    PrintTable(*config, scale, results);
  }
  return 0;
}

}  // namespace
}  // namespace fusedps

int main(int argc, char** argv) { return fusedps::Main(argc, argv); }
