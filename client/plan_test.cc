// Tests of ShardPlan (fusedps/plan.h) against docs/sharding.md: a small plan checked by hand,
// its hash over a literal text, coverage and balance on GPT-2 small and a 1.3B GPT, errors.
#include "fusedps/plan.h"

#include <openssl/evp.h>

#include <algorithm>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace fusedps::client {
namespace {

// Lowercase hex of the first 16 bytes of SHA-256(text).
std::string Sha256Prefix(absl::string_view text) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EXPECT_EQ(EVP_Digest(text.data(), text.size(), digest, &length, EVP_sha256(), nullptr), 1);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), 16));
}

// GPT-2 small as Hugging Face names it (148 tensors, 124,439,808 parameters), from
// tests/data/gpt2_small_tensors.json: [{"name": ..., "shape": [...]}, ...].
std::vector<PlanTensor> Gpt2Small() {
  std::ifstream file(absl::StrCat(FUSEDPS_SOURCE_DIR, "/tests/data/gpt2_small_tensors.json"));
  EXPECT_TRUE(file.good()) << "cannot read tests/data/gpt2_small_tensors.json";
  const nlohmann::json json = nlohmann::json::parse(file, nullptr, /*allow_exceptions=*/false);
  std::vector<PlanTensor> tensors;
  if (!json.is_array()) return tensors;
  for (const nlohmann::json& entry : json) {
    tensors.push_back({entry.at("name").get<std::string>(),
                       entry.at("shape").get<std::vector<int64_t>>(),
                       entry.value("param_group", std::string("default"))});
  }
  return tensors;
}

// A GPT in GPT-2's layout (and names) with d_model `d`, `layers` blocks, the vocabulary of
// GPT-2 and a context of `context` positions.
std::vector<PlanTensor> Gpt(int64_t d, int layers, int64_t context) {
  std::vector<PlanTensor> tensors = {{"transformer.wte.weight", {50257, d}},
                                     {"transformer.wpe.weight", {context, d}}};
  for (int i = 0; i < layers; ++i) {
    const std::string h = absl::StrCat("transformer.h.", i, ".");
    for (const char* ln : {"ln_1.", "ln_2."}) {
      tensors.push_back({h + ln + "weight", {d}});
      tensors.push_back({h + ln + "bias", {d}});
    }
    tensors.push_back({h + "attn.c_attn.weight", {d, 3 * d}});
    tensors.push_back({h + "attn.c_attn.bias", {3 * d}});
    tensors.push_back({h + "attn.c_proj.weight", {d, d}});
    tensors.push_back({h + "attn.c_proj.bias", {d}});
    tensors.push_back({h + "mlp.c_fc.weight", {d, 4 * d}});
    tensors.push_back({h + "mlp.c_fc.bias", {4 * d}});
    tensors.push_back({h + "mlp.c_proj.weight", {4 * d, d}});
    tensors.push_back({h + "mlp.c_proj.bias", {d}});
  }
  tensors.push_back({"transformer.ln_f.weight", {d}});
  tensors.push_back({"transformer.ln_f.bias", {d}});
  return tensors;
}

uint64_t Numel(const PlanTensor& tensor) {
  uint64_t numel = 1;
  for (int64_t dim : tensor.shape) numel *= static_cast<uint64_t>(dim);
  return numel;
}

uint64_t TotalNumel(const std::vector<PlanTensor>& tensors) {
  uint64_t total = 0;
  for (const PlanTensor& tensor : tensors) total += Numel(tensor);
  return total;
}

// Every element of every tensor in exactly one slice, slices as step 2 cuts them, loads that
// add up, each shard's slices in plan order.
void ExpectCovers(const ShardPlan& plan, const std::vector<PlanTensor>& model) {
  ASSERT_EQ(plan.tensors().size(), model.size());
  for (size_t t = 1; t < plan.tensors().size(); ++t) {
    ASSERT_LT(plan.tensors()[t - 1].name, plan.tensors()[t].name);
  }
  const uint64_t c = plan.slice_elements();
  size_t s = 0;
  std::vector<uint64_t> loads(plan.shards(), 0);
  for (const PlanTensor& tensor : plan.tensors()) {
    const uint64_t n = Numel(tensor);
    const uint64_t expected_slices = n <= c ? 1 : (n + c - 1) / c;
    for (uint64_t k = 0; k < expected_slices; ++k, ++s) {
      ASSERT_LT(s, plan.slices().size());
      const PlanSlice& slice = plan.slices()[s];
      ASSERT_EQ(slice.tensor, tensor.name);
      ASSERT_EQ(slice.begin, k * c);
      ASSERT_EQ(slice.end, std::min(n, (k + 1) * c));
      ASSERT_EQ(slice.param_group, tensor.param_group);
      ASSERT_LT(slice.shard, plan.shards());
      if (expected_slices == 1) {
        ASSERT_EQ(slice.server_tensor, tensor.name);
        ASSERT_EQ(slice.server_shape, tensor.shape);
      } else {
        ASSERT_EQ(slice.server_tensor,
                  absl::StrCat(tensor.name, "[", slice.begin, ":", slice.end, "]"));
        ASSERT_EQ(slice.server_shape, std::vector<int64_t>{static_cast<int64_t>(slice.numel())});
      }
      loads[slice.shard] += slice.numel();
    }
  }
  EXPECT_EQ(s, plan.slices().size());
  EXPECT_EQ(loads, plan.loads());
  size_t in_shards = 0;
  for (uint32_t shard = 0; shard < plan.shards(); ++shard) {
    const std::vector<PlanSlice> slices = plan.ShardSlices(shard);
    in_shards += slices.size();
    auto cursor = plan.slices().begin();
    for (const PlanSlice& slice : slices) {
      EXPECT_EQ(slice.shard, shard);
      cursor = std::find_if(cursor, plan.slices().end(), [&](const PlanSlice& p) {
        return p.server_tensor == slice.server_tensor;
      });
      ASSERT_NE(cursor, plan.slices().end()) << "out of plan order: " << slice.server_tensor;
    }
  }
  EXPECT_EQ(in_shards, plan.slices().size());
  EXPECT_EQ(TotalNumel(model), TotalNumel(plan.tensors()));
}

// max/mean <= 1 + C/mean, for 2 to 8 shards.
void ExpectBalanced(const std::vector<PlanTensor>& model, uint64_t slice_elements) {
  for (uint32_t shards = 2; shards <= 8; ++shards) {
    SCOPED_TRACE(absl::StrCat(shards, " shards"));
    const ShardPlan plan = ShardPlan::Make(model, shards, slice_elements).value();
    ExpectCovers(plan, model);
    const double mean = static_cast<double>(TotalNumel(model)) / shards;
    const double max =
        static_cast<double>(*std::max_element(plan.loads().begin(), plan.loads().end()));
    EXPECT_LE(max / mean, 1.0 + static_cast<double>(slice_elements) / mean);
  }
}

TEST(ShardPlanTest, HandCheckedExample) {
  // Sorted (by bytes): a, b, c, z, é. a (10 elements) is cut into [0:4] [4:8] [8:10]. Largest
  // first: a[0:4] -> 0, a[4:8] -> 1, b (3) -> 0, a[8:10] -> 1 (loads 7, 6), é (2) -> 1,
  // c (1) -> 0, z (0) -> 0 (8, 8: a tie goes to shard 0).
  const std::vector<PlanTensor> model = {
      {"z", {0}}, {"b", {3}, "emb"}, {"\xc3\xa9", {2}}, {"a", {2, 5}}, {"c", {}, ""}};
  const ShardPlan plan = ShardPlan::Make(model, 2, 4).value();
  struct Expected {
    std::string tensor, server_tensor;
    std::vector<int64_t> server_shape;
    std::string group;
    uint64_t begin, end;
    uint32_t shard;
  };
  const std::vector<Expected> expected = {{"a", "a[0:4]", {4}, "default", 0, 4, 0},
                                          {"a", "a[4:8]", {4}, "default", 4, 8, 1},
                                          {"a", "a[8:10]", {2}, "default", 8, 10, 1},
                                          {"b", "b", {3}, "emb", 0, 3, 0},
                                          {"c", "c", {}, "default", 0, 1, 0},
                                          {"z", "z", {0}, "default", 0, 0, 0},
                                          {"\xc3\xa9", "\xc3\xa9", {2}, "default", 0, 2, 1}};
  ASSERT_EQ(plan.slices().size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    SCOPED_TRACE(expected[i].server_tensor);
    const PlanSlice& slice = plan.slices()[i];
    EXPECT_EQ(slice.tensor, expected[i].tensor);
    EXPECT_EQ(slice.server_tensor, expected[i].server_tensor);
    EXPECT_EQ(slice.server_shape, expected[i].server_shape);
    EXPECT_EQ(slice.param_group, expected[i].group);
    EXPECT_EQ(slice.begin, expected[i].begin);
    EXPECT_EQ(slice.end, expected[i].end);
    EXPECT_EQ(slice.shard, expected[i].shard);
  }
  EXPECT_EQ(plan.loads(), (std::vector<uint64_t>{8, 8}));
  EXPECT_EQ(plan.shards(), 2u);
  EXPECT_EQ(plan.slice_elements(), 4u);
  ASSERT_EQ(plan.ShardSlices(1).size(), 3u);
  EXPECT_EQ(plan.ShardSlices(1)[2].server_tensor, "\xc3\xa9");
  EXPECT_TRUE(plan.ShardSlices(2).empty());

  // The hash's text, written out by hand; its hash computed by `sha256sum | cut -c1-32`.
  const std::string text =
      "fusedps-plan-v1 shards=2 slice_elements=4\n"
      "1:a [2,5] 7:default 0 4 0\n"
      "1:a [2,5] 7:default 4 8 1\n"
      "1:a [2,5] 7:default 8 10 1\n"
      "1:b [3] 3:emb 0 3 0\n"
      "1:c [] 7:default 0 1 0\n"
      "1:z [0] 7:default 0 0 0\n"
      "2:\xc3\xa9 [2] 7:default 0 2 1\n";
  constexpr char kHash[] = "a70ee94687b0898ba76209728ce5271b";
  EXPECT_EQ(Sha256Prefix(text), kHash);
  EXPECT_EQ(plan.HashText(), text);
  EXPECT_EQ(plan.hash(), kHash);

  // What Python's json.dumps(plan.to_dict(), ensure_ascii=False) writes.
  EXPECT_EQ(plan.ToJson(),
            "{\"hash\": \"a70ee94687b0898ba76209728ce5271b\", \"shards\": 2, "
            "\"slice_elements\": 4, \"slices\": [[\"a\", 0, 4, 0], [\"a\", 4, 8, 1], "
            "[\"a\", 8, 10, 1], [\"b\", 0, 3, 0], [\"c\", 0, 1, 0], [\"z\", 0, 0, 0], "
            "[\"\xc3\xa9\", 0, 2, 1]]}");
  const nlohmann::json parsed = nlohmann::json::parse(plan.ToJson());
  EXPECT_EQ(parsed.at("slices").size(), expected.size());
  EXPECT_EQ(parsed.at("slices")[6][0].get<std::string>(), "\xc3\xa9");
}

TEST(ShardPlanTest, TheSpecsExampleLine) {
  // docs/sharding.md: `6:wpe.wb [1024,768] 7:default 0 786432 1`.
  const ShardPlan plan =
      ShardPlan::Make({{"a", {1 << 20}}, {"wpe.wb", {1024, 768}}}, 2, 1 << 20).value();
  EXPECT_NE(plan.HashText().find("\n6:wpe.wb [1024,768] 7:default 0 786432 1\n"), std::string::npos)
      << plan.HashText();
}

TEST(ShardPlanTest, Gpt2SmallCoveredAndBalanced) {
  const std::vector<PlanTensor> model = Gpt2Small();
  ASSERT_EQ(model.size(), 148u);
  ASSERT_EQ(TotalNumel(model), 124'439'808u);
  ExpectBalanced(model, ShardPlan::kDefaultSliceElements);
  ExpectBalanced(model, 100'000);
}

TEST(ShardPlanTest, Gpt1_3BCoveredAndBalanced) {
  const std::vector<PlanTensor> model = Gpt(2048, 24, 2048);
  ASSERT_EQ(model.size(), 2u + 24 * 12 + 2);
  EXPECT_GT(TotalNumel(model), 1'300'000'000u);
  ExpectBalanced(model, ShardPlan::kDefaultSliceElements);
}

TEST(ShardPlanTest, OneShardHoldsEverything) {
  const std::vector<PlanTensor> model = Gpt2Small();
  const ShardPlan plan = ShardPlan::Make(model, 1).value();
  ExpectCovers(plan, model);
  EXPECT_EQ(plan.loads(), std::vector<uint64_t>{TotalNumel(model)});
}

TEST(ShardPlanTest, MoreShardsThanSlicesLeavesSomeEmpty) {
  const ShardPlan plan = ShardPlan::Make({{"w", {10}}, {"b", {3}}}, 4).value();
  EXPECT_EQ(plan.loads(), (std::vector<uint64_t>{10, 3, 0, 0}));
  EXPECT_TRUE(plan.ShardSlices(3).empty());
}

TEST(ShardPlanTest, InputOrderDoesNotMatter) {
  std::vector<PlanTensor> model = Gpt2Small();
  const ShardPlan plan = ShardPlan::Make(model, 5).value();
  std::shuffle(model.begin(), model.end(), std::mt19937(7));
  const ShardPlan shuffled = ShardPlan::Make(model, 5).value();
  EXPECT_EQ(plan.hash(), shuffled.hash());
  EXPECT_EQ(plan.ToJson(), shuffled.ToJson());
}

TEST(ShardPlanTest, HashNamesEverythingThePlanDependsOn) {
  const std::vector<PlanTensor> model = {{"w", {8, 8}}, {"b", {8}}};
  const std::string hash = ShardPlan::Make(model, 2, 16).value().hash();
  EXPECT_EQ(hash.size(), 32u);
  EXPECT_EQ(hash.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_NE(ShardPlan::Make(model, 3, 16).value().hash(), hash);
  EXPECT_NE(ShardPlan::Make(model, 2, 17).value().hash(), hash);
  EXPECT_NE(ShardPlan::Make({{"w", {64}}, {"b", {8}}}, 2, 16).value().hash(), hash);
  EXPECT_NE(ShardPlan::Make({{"w", {8, 8}}, {"b", {8}, "no_decay"}}, 2, 16).value().hash(), hash);
  EXPECT_NE(ShardPlan::Make({{"w", {8, 8}}, {"c", {8}}}, 2, 16).value().hash(), hash);
  EXPECT_EQ(ShardPlan::Make({{"b", {8}, ""}, {"w", {8, 8}, "default"}}, 2, 16).value().hash(),
            hash);
}

TEST(ShardPlanTest, Errors) {
  const std::vector<PlanTensor> model = {{"w", {4}}};
  struct Case {
    std::vector<PlanTensor> tensors;
    uint32_t shards;
    uint64_t slice_elements;
    std::string message;
  };
  const std::vector<Case> cases = {
      {model, 0, 4, "shards"},
      {model, 2, 0, "slice_elements"},
      {{{"w", {4}}, {"w", {2}}}, 2, 4, "w is listed twice"},
      {{{"w", {4, -1}}}, 2, 4, "w"},
      {{{"", {4}}}, 2, 4, "empty name"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    absl::StatusOr<ShardPlan> plan = ShardPlan::Make(c.tensors, c.shards, c.slice_elements);
    ASSERT_FALSE(plan.ok());
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(plan.status().message().find(c.message), absl::string_view::npos) << plan.status();
  }
  absl::StatusOr<ShardPlan> negative = ShardPlan::Make({{"w", {4, -1}}}, 2, 4);
  EXPECT_NE(negative.status().message().find("negative"), absl::string_view::npos)
      << negative.status();
  EXPECT_TRUE(ShardPlan::Make({}, 3).ok());  // No tensors: an empty plan.
}

}  // namespace
}  // namespace fusedps::client
