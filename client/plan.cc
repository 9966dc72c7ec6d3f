#include "fusedps/plan.h"

#include <openssl/evp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <queue>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/wire.h"
#include "nlohmann/json.hpp"

namespace fusedps::client {
namespace {

constexpr char kHashVersion[] = "fusedps-plan-v1";
constexpr size_t kHashBytes = 16;

// Lowercase hex of the first kHashBytes bytes of SHA-256(text).
std::string HashOf(const std::string& text) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  const int ok = EVP_Digest(text.data(), text.size(), digest, &length, EVP_sha256(), nullptr);
  if (ok != 1 || length < kHashBytes) {
    // OpenSSL's SHA-256 does not fail on data in memory; a failure is a broken library.
    std::fprintf(stderr, "fusedps: OpenSSL's SHA-256 failed\n");
    std::abort();
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(digest), kHashBytes));
}

// The plan's text (docs/sharding.md): a version line, then one line per slice.
std::string PlanText(uint32_t shards, uint64_t slice_elements,
                     const std::vector<PlanTensor>& tensors, const std::vector<PlanSlice>& slices) {
  std::string text =
      absl::StrCat(kHashVersion, " shards=", shards, " slice_elements=", slice_elements, "\n");
  size_t t = 0;
  for (const PlanSlice& slice : slices) {
    while (tensors[t].name != slice.tensor) ++t;  // Slices come in tensor order.
    absl::StrAppend(&text, slice.tensor.size(), ":", slice.tensor, " [",
                    absl::StrJoin(tensors[t].shape, ","), "] ", slice.param_group.size(), ":",
                    slice.param_group, " ", slice.begin, " ", slice.end, " ", slice.shard, "\n");
  }
  return text;
}

// A JSON string as Python's json.dumps(ensure_ascii=False) writes it.
std::string JsonString(const std::string& text) {
  return nlohmann::json(text).dump(-1, ' ', /*ensure_ascii=*/false,
                                   nlohmann::json::error_handler_t::replace);
}

}  // namespace

absl::StatusOr<ShardPlan> ShardPlan::Make(absl::Span<const PlanTensor> tensors, uint32_t shards,
                                          uint64_t slice_elements) {
  if (shards == 0) return absl::InvalidArgumentError("shards must be >= 1, not 0");
  if (slice_elements == 0) return absl::InvalidArgumentError("slice_elements must be >= 1, not 0");
  ShardPlan plan;
  plan.shards_ = shards;
  plan.slice_elements_ = slice_elements;
  plan.tensors_.assign(tensors.begin(), tensors.end());
  absl::flat_hash_set<absl::string_view> names;
  std::vector<uint64_t> numels;
  for (PlanTensor& tensor : plan.tensors_) {
    if (tensor.name.empty()) return absl::InvalidArgumentError("a tensor has an empty name");
    if (!names.insert(tensor.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor name ", tensor.name, " is listed twice"));
    }
    if (tensor.param_group.empty()) tensor.param_group = "default";
  }
  // Step 1: by name, comparing bytes (std::string compares chars as unsigned).
  std::sort(plan.tensors_.begin(), plan.tensors_.end(),
            [](const PlanTensor& a, const PlanTensor& b) { return a.name < b.name; });

  // Step 2: each tensor whole, or cut into slices of slice_elements.
  for (const PlanTensor& tensor : plan.tensors_) {
    absl::StatusOr<uint64_t> numel = internal::NumElements(tensor.shape);
    if (!numel.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape of tensor ", tensor.name, ": ", numel.status().message()));
    }
    if (*numel <= slice_elements) {
      plan.slices_.push_back(
          {tensor.name, tensor.name, tensor.shape, tensor.param_group, 0, *numel, 0});
      continue;
    }
    for (uint64_t begin = 0; begin < *numel; begin += slice_elements) {
      const uint64_t end = std::min(*numel, begin + slice_elements);
      plan.slices_.push_back({tensor.name,
                              absl::StrCat(tensor.name, "[", begin, ":", end, "]"),
                              {static_cast<int64_t>(end - begin)},
                              tensor.param_group,
                              begin,
                              end,
                              0});
    }
  }

  // Step 3: largest first, ties in the order of step 2.
  std::vector<size_t> order(plan.slices_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return plan.slices_[a].numel() > plan.slices_[b].numel();
  });

  // Step 4: each to the shard with the fewest elements so far, ties to the lowest index.
  using Load = std::pair<uint64_t, uint32_t>;  // (elements, shard)
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> lightest;
  for (uint32_t shard = 0; shard < shards; ++shard) lightest.push({0, shard});
  plan.loads_.assign(shards, 0);
  for (size_t index : order) {
    const uint32_t shard = lightest.top().second;
    lightest.pop();
    PlanSlice& slice = plan.slices_[index];
    slice.shard = shard;
    plan.loads_[shard] += slice.numel();
    lightest.push({plan.loads_[shard], shard});
  }
  plan.hash_ = HashOf(plan.HashText());
  return plan;
}

std::string ShardPlan::HashText() const {
  return PlanText(shards_, slice_elements_, tensors_, slices_);
}

std::vector<PlanSlice> ShardPlan::ShardSlices(uint32_t shard) const {
  std::vector<PlanSlice> slices;
  for (const PlanSlice& slice : slices_) {
    if (slice.shard == shard) slices.push_back(slice);
  }
  return slices;
}

std::string ShardPlan::ToJson() const {
  std::string json = absl::StrCat("{\"hash\": \"", hash_, "\", \"shards\": ", shards_,
                                  ", \"slice_elements\": ", slice_elements_, ", \"slices\": [");
  for (size_t i = 0; i < slices_.size(); ++i) {
    const PlanSlice& slice = slices_[i];
    absl::StrAppend(&json, i == 0 ? "" : ", ", "[", JsonString(slice.tensor), ", ", slice.begin,
                    ", ", slice.end, ", ", slice.shard, "]");
  }
  absl::StrAppend(&json, "]}");
  return json;
}

}  // namespace fusedps::client
