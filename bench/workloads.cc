#include "bench/workloads.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fusedps {
namespace {

// GPT-2 small (124M): token and position embeddings, 12 blocks, the final layer norm.
// Shapes are flattened; an elementwise optimizer sees only element counts.
std::vector<uint64_t> Gpt2SmallNumels() {
  constexpr uint64_t kVocab = 50257, kContext = 1024, kEmbed = 768, kLayers = 12;
  std::vector<uint64_t> numels = {kVocab * kEmbed, kContext * kEmbed};
  for (uint64_t layer = 0; layer < kLayers; ++layer) {
    // clang-format off
    const std::vector<uint64_t> block = {
        kEmbed,              kEmbed,      // ln_1 weight, bias
        kEmbed * 3 * kEmbed, 3 * kEmbed,  // attn.c_attn weight, bias
        kEmbed * kEmbed,     kEmbed,      // attn.c_proj weight, bias
        kEmbed,              kEmbed,      // ln_2 weight, bias
        kEmbed * 4 * kEmbed, 4 * kEmbed,  // mlp.c_fc weight, bias
        4 * kEmbed * kEmbed, kEmbed,      // mlp.c_proj weight, bias
    };
    // clang-format on
    numels.insert(numels.end(), block.begin(), block.end());
  }
  numels.push_back(kEmbed);  // ln_f weight
  numels.push_back(kEmbed);  // ln_f bias
  return numels;
}

Workload Make(absl::string_view name, double scale) {
  Workload w;
  w.name = std::string(name);
  if (name == "one_large") {
    w.description = "1 tensor x 100M";
    w.numels = {100'000'000};
  } else if (name == "gpt2") {
    w.description = "GPT-2 small, 148 tensors, 124M";
    w.numels = Gpt2SmallNumels();
  } else if (name == "t1000x100k") {
    w.description = "1000 tensors x 100K";
    w.numels.assign(1000, 100'000);
  } else if (name == "t10000x1k") {
    w.description = "10000 tensors x 1K";
    w.numels.assign(10000, 1'000);
  }
  for (uint64_t& n : w.numels) n = ScaledNumel(n, scale);
  return w;
}

}  // namespace

uint64_t Workload::total_numel() const {
  uint64_t total = 0;
  for (uint64_t n : numels) total += n;
  return total;
}

std::vector<std::string> WorkloadNames() {
  return {"one_large", "gpt2", "t1000x100k", "t10000x1k"};
}

uint64_t ScaledNumel(uint64_t numel, double scale) {
  const double scaled = std::floor(static_cast<double>(numel) * scale + 0.5);
  return std::max<uint64_t>(1, static_cast<uint64_t>(scaled));
}

absl::StatusOr<std::vector<Workload>> MakeWorkloads(absl::string_view name, double scale) {
  if (!(scale > 0.0 && scale <= 1e3)) {
    return absl::InvalidArgumentError(absl::StrCat("scale ", scale, " is not in (0, 1000]"));
  }
  const std::vector<std::string> names = WorkloadNames();
  std::vector<Workload> workloads;
  if (name == "all") {
    for (const std::string& n : names) workloads.push_back(Make(n, scale));
    return workloads;
  }
  if (std::find(names.begin(), names.end(), name) == names.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown workload '", name, "'; expected all, ", absl::StrJoin(names, ", ")));
  }
  workloads.push_back(Make(name, scale));
  return workloads;
}

}  // namespace fusedps
