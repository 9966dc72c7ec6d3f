#include "bench/workloads.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "absl/strings/numbers.h"
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

// A count and a size as "t<count>x<numel>", numel with an optional k (1,000) or m (1,000,000)
// suffix ("t10000x1k"): false if `name` is not of that form or a number is out of range.
bool ParseUniform(absl::string_view name, uint64_t& count, uint64_t& numel) {
  if (name.size() < 4 || name[0] != 't') return false;
  const size_t x = name.find('x');
  if (x == absl::string_view::npos) return false;
  absl::string_view size = name.substr(x + 1);
  uint64_t unit = 1;
  if (!size.empty() && (size.back() == 'k' || size.back() == 'm')) {
    unit = size.back() == 'k' ? 1'000 : 1'000'000;
    size.remove_suffix(1);
  }
  if (!absl::SimpleAtoi(name.substr(1, x - 1), &count) || !absl::SimpleAtoi(size, &numel) ||
      count == 0 || numel == 0 || count > 10'000'000 || numel > 10'000'000'000 / unit) {
    return false;
  }
  numel *= unit;
  return true;
}

// The named workload (WorkloadNames() or t<count>x<numel>) at scale, or nothing for an unknown
// name.
std::optional<Workload> Make(absl::string_view name, double scale) {
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
  } else {
    uint64_t count = 0, numel = 0;
    if (!ParseUniform(name, count, numel)) return std::nullopt;
    w.description = absl::StrCat(count, " tensors x ", numel);
    w.numels.assign(count, numel);
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
    for (const std::string& n : names) workloads.push_back(*Make(n, scale));
    return workloads;
  }
  std::optional<Workload> workload = Make(name, scale);
  if (!workload.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown workload '", name, "'; expected all, ", absl::StrJoin(names, ", "),
        ", or t<count>x<numel> (count in [1, 1e7], numel in [1, 1e10] with an optional k or m "
        "suffix)"));
  }
  workloads.push_back(*std::move(workload));
  return workloads;
}

}  // namespace fusedps
