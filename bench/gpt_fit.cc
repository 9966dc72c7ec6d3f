// fusedps-gpt-fit: the largest GPT whose whole AdamW state fits one device, per storage option,
// found by registering it for real: a fresh backend allocates the server's staging mirror
// (--staging-bytes, the server's --staging-pool-bytes default), then AddTensors registers every
// tensor of the model (params, exp_avg, exp_avg_sq, int8 scales, tables), and one step runs on
// it. It fits when both succeed; RESOURCE_EXHAUSTED means it does not.
//
// Models: GPT-3's sizes (Brown et al. 2020, table 2.1: n_layers, d_model; vocabulary 50257,
// context 2048) with GPT-2's tensors (as bench/workloads.h lists them: wte, wpe, per layer ln_1,
// c_attn, attn c_proj, ln_2, c_fc, mlp c_proj, then ln_f), then the most layers at the widest size
// that fits.
//
// Usage: fusedps-gpt-fit --backend=cuda:0 [--json]
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/flag_usage.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "kernels/tensor_layout.h"

ABSL_FLAG(std::string, backend, "cuda:0", "The backend to fill (backend_factory.h)");
ABSL_FLAG(uint64_t, staging_bytes, uint64_t{2} << 30,
          "Staging arena (with its device mirror) allocated first, as the server does");
ABSL_FLAG(bool, json, false, "One JSON object per line instead of a table");

namespace fusedps {
namespace {

struct GptConfig {
  std::string name;
  int layers;
  int d_model;
};

constexpr uint64_t kVocab = 50257, kContext = 2048;

std::vector<uint64_t> GptNumels(int layers, uint64_t d) {
  std::vector<uint64_t> numels = {kVocab * d, kContext * d};
  for (int l = 0; l < layers; ++l) {
    for (uint64_t n : {d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d}) {
      numels.push_back(n);
    }
  }
  numels.push_back(d);
  numels.push_back(d);
  return numels;
}

uint64_t Sum(const std::vector<uint64_t>& v) {
  uint64_t s = 0;
  for (uint64_t x : v) s += x;
  return s;
}

struct Storage {
  const char* name;
  StateDType state;
  ParamsDType params;
};

// Whether the model registers and steps on a fresh backend. Errors other than
// RESOURCE_EXHAUSTED are returned.
absl::StatusOr<bool> Fits(const std::string& backend_name, const Storage& storage, int layers,
                          int d_model, double* device_bytes_per_param) {
  absl::StatusOr<std::unique_ptr<OptimizerBackend>> backend = MakeBackend(backend_name, {});
  if (!backend.ok()) return backend.status();
  OptimizerBackend& b = **backend;
  if (absl::StatusOr<char*> arena = b.AllocateStagingArena(absl::GetFlag(FLAGS_staging_bytes));
      !arena.ok()) {
    return arena.status();
  }
  AdamWHyperparameters h;
  h.state_dtype = storage.state;
  h.params_dtype = storage.params;
  if (absl::Status s = b.SetParamGroup(0, h); !s.ok()) return s;
  const std::vector<uint64_t> numels = GptNumels(layers, static_cast<uint64_t>(d_model));
  std::vector<NewTensor> tensors;
  for (uint64_t n : numels) tensors.push_back({n, 0, tensors.size()});
  absl::StatusOr<uint32_t> first = b.AddTensors(tensors);
  if (!first.ok()) {
    if (first.status().code() == absl::StatusCode::kResourceExhausted) return false;
    return first.status();
  }
  // One step of the smallest tensors (a full step's gradients would not fit the staging).
  const uint32_t t = static_cast<uint32_t>(numels.size() - 1);
  std::vector<uint16_t> grads(AlignedNumel(numels[t]), FloatToBFloat16(0.5f));
  const uint64_t offset = 0;
  absl::StatusOr<StepOutcome> step =
      StepNow(b, {absl::MakeConstSpan(&t, 1), absl::MakeConstSpan(&offset, 1), grads.data(),
                  GradDType::kBFloat16, 0});
  if (!step.ok()) return step.status();
  double bytes = 0;
  for (const auto& [kind, n] : b.memory_bytes()) {
    if (kind != "grad_staging") bytes += static_cast<double>(n);
  }
  *device_bytes_per_param = bytes / static_cast<double>(Sum(numels));
  return true;
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Finds the largest GPT whose whole AdamW state fits one device, per storage option.\n"
      "  fusedps-gpt-fit --backend=cuda:0 [--json]");
  if (std::optional<int> exit_code = ParseProgramFlags(argc, argv, {__FILE__})) {
    return *exit_code;
  }
  const std::string backend = absl::GetFlag(FLAGS_backend);
  const bool json = absl::GetFlag(FLAGS_json);
  const std::vector<GptConfig> ladder = {
      {"GPT-3 Small 125M", 12, 768},  {"GPT-3 Medium 350M", 24, 1024},
      {"GPT-3 Large 760M", 24, 1536}, {"GPT-3 XL 1.3B", 24, 2048},
      {"GPT-3 2.7B", 32, 2560},       {"GPT-3 6.7B", 32, 4096},
      {"GPT-3 13B", 40, 5120},        {"GPT-3 175B", 96, 12288}};
  const Storage storages[] = {
      {"fp32 state, fp32 params", StateDType::kFloat32, ParamsDType::kFloat32},
      {"bf16 state, fp32 params", StateDType::kBFloat16, ParamsDType::kFloat32},
      {"int8 state, fp32 params", StateDType::kInt8, ParamsDType::kFloat32},
      {"int8 state, bf16 params", StateDType::kInt8, ParamsDType::kBFloat16}};
  for (const Storage& storage : storages) {
    const GptConfig* largest = nullptr;
    double bytes_per_param = 0;
    for (const GptConfig& c : ladder) {
      double per_param = 0;
      absl::StatusOr<bool> fits = Fits(backend, storage, c.layers, c.d_model, &per_param);
      if (!fits.ok()) {
        absl::FPrintF(stderr, "fusedps-gpt-fit: %s\n", fits.status().ToString());
        return 1;
      }
      if (!*fits) break;
      largest = &c;
      bytes_per_param = per_param;
    }
    // The most layers at the width of the next size up (or the largest's), by bisection.
    const GptConfig* next = largest == nullptr ? &ladder[0] : largest + 1;
    if (next == ladder.data() + ladder.size()) next = largest;
    int lo = 0, hi = 4 * next->layers;  // lo fits (0 layers: embeddings only, assumed), hi not.
    double lo_bytes = 0;
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      double per_param = 0;
      absl::StatusOr<bool> fits = Fits(backend, storage, mid, next->d_model, &per_param);
      if (!fits.ok()) {
        absl::FPrintF(stderr, "fusedps-gpt-fit: %s\n", fits.status().ToString());
        return 1;
      }
      (*fits ? lo : hi) = mid;
      if (*fits) lo_bytes = per_param;
    }
    const uint64_t ladder_params =
        largest == nullptr ? 0 : Sum(GptNumels(largest->layers, largest->d_model));
    const uint64_t most_params = Sum(GptNumels(lo, next->d_model));
    if (json) {
      absl::PrintF(
          "{\"storage\": \"%s\", \"largest\": \"%s\", \"largest_params\": %d, "
          "\"device_bytes_per_param\": %.4f, \"width\": %d, \"most_layers\": %d, "
          "\"most_params\": %d, \"most_device_bytes_per_param\": %.4f}\n",
          storage.name, largest == nullptr ? "none" : largest->name, ladder_params, bytes_per_param,
          next->d_model, lo, most_params, lo_bytes);
    } else {
      absl::PrintF(
          "%-24s largest: %-18s (%.2fB params, %.3f bytes/param); at d_model %d: %d "
          "layers, %.2fB params\n",
          storage.name, largest == nullptr ? "none" : largest->name, ladder_params / 1e9,
          bytes_per_param, next->d_model, lo, most_params / 1e9);
    }
  }
  return 0;
}

}  // namespace
}  // namespace fusedps

int main(int argc, char** argv) { return fusedps::Main(argc, argv); }
