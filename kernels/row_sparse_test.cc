// Tests of kernels/row_sparse.h (and sparse_adam_math.h) against an independent float64
// SparseAdam reference, written here from torch.optim.SparseAdam's formulas (plus our decoupled
// weight decay of the pushed rows) rather than from the code under test.
#include "kernels/row_sparse.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/row_table_test_util.h"

namespace fusedps {
namespace {

using row_table_test::SparseAdamDefaults;

constexpr int64_t kRows = 64;

// SparseAdam of a [rows, dim] table in float64: one step count for the table; each pushed row's
// gradient is the sum of its duplicates; rows not pushed are untouched.
struct ReferenceTable {
  int64_t dim = 0;
  int64_t step = 0;
  std::vector<double> params, exp_avg, exp_avg_sq;

  void Step(const AdamWHyperparameters& h, const std::vector<int64_t>& keys,
            const std::vector<float>& grads, double grad_scale) {
    ++step;
    const double step_size = row_table_test::ReferenceStepSize(h, step);
    for (auto& [key, sum] : row_table_test::SumRows(keys, grads, dim)) {
      if (grad_scale > 0) {
        for (double& g : sum) g /= grad_scale;
      }
      const size_t e = key * dim;
      row_table_test::ReferenceRowUpdate(h, step_size, sum, &params[e], &exp_avg[e],
                                         &exp_avg_sq[e]);
    }
  }
};

// A table that owns its arrays: random params; moments zero (as torch starts them) or random.
struct TestTable {
  std::vector<float> params, exp_avg, exp_avg_sq;
  RowSparseTable table;

  TestTable(int64_t dim, uint32_t seed, bool random_moments)
      : params(kRows * dim), exp_avg(kRows * dim), exp_avg_sq(kRows * dim) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (size_t i = 0; i < params.size(); ++i) {
      params[i] = normal(rng);
      if (random_moments) {
        exp_avg[i] = 0.1f * normal(rng);
        exp_avg_sq[i] = 0.01f * std::abs(normal(rng));
      }
    }
    table = {
        absl::MakeSpan(params), absl::MakeSpan(exp_avg), absl::MakeSpan(exp_avg_sq), kRows, dim, 0};
  }
  TestTable(const TestTable&) = delete;
  TestTable& operator=(const TestTable&) = delete;

  ReferenceTable Reference() const {
    return {table.dim,
            table.step,
            {params.begin(), params.end()},
            {exp_avg.begin(), exp_avg.end()},
            {exp_avg_sq.begin(), exp_avg_sq.end()}};
  }
  bool Push(const AdamWHyperparameters& h, const std::vector<int64_t>& keys,
            const std::vector<float>& grads, float grad_scale = 0.0f) {
    absl::StatusOr<bool> applied = ApplyRowSparseStep(table, h, keys, grads, grad_scale);
    EXPECT_TRUE(applied.ok()) << applied.status();
    return applied.ok() && *applied;
  }
};

// Everything a step may change, copied.
struct Snapshot : row_table_test::TableBytes {
  explicit Snapshot(const TestTable& t) : TableBytes(t.table) {}
};

void ExpectBitIdentical(const Snapshot& before, const TestTable& t) {
  row_table_test::ExpectSameBytes(before, Snapshot(t));
}

// Whether row `row` of all three arrays has the same bytes in a and b.
bool SameRow(const Snapshot& a, const TestTable& b, int64_t row) {
  const int64_t dim = b.table.dim;
  const size_t bytes = dim * sizeof(float);
  return std::memcmp(&a.params[row * dim], &b.params[row * dim], bytes) == 0 &&
         std::memcmp(&a.exp_avg[row * dim], &b.exp_avg[row * dim], bytes) == 0 &&
         std::memcmp(&a.exp_avg_sq[row * dim], &b.exp_avg_sq[row * dim], bytes) == 0;
}

// A random push of keys in [0, key_limit), with at least one duplicate, and normal gradients.
struct Push {
  std::vector<int64_t> keys;
  std::vector<float> grads;
};
Push RandomPush(std::mt19937& rng, int64_t key_limit, int64_t dim, float scale = 1.0f) {
  std::uniform_int_distribution<int> count(1, 24);
  std::uniform_int_distribution<int64_t> key(0, key_limit - 1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Push push;
  for (int n = count(rng); n > 0; --n) push.keys.push_back(key(rng));
  push.keys.push_back(push.keys.front());
  for (size_t i = 0; i < push.keys.size() * dim; ++i) push.grads.push_back(normal(rng) * scale);
  return push;
}

// 25 steps on a [64, dim] table against the float64 reference (step 13 pushes nothing; rows 60
// to 63 are never pushed and must keep their bytes), within fp32-vs-float64 tolerance.
void ExpectMatchesReferenceOver25Steps(const AdamWHyperparameters& h) {
  for (const int64_t dim : {1, 7, 128, 129}) {
    SCOPED_TRACE(testing::Message() << "dim " << dim);
    TestTable t(dim, 100 + dim, /*random_moments=*/false);
    ReferenceTable ref = t.Reference();
    const Snapshot initial(t);
    std::mt19937 rng(dim);
    for (int step = 1; step <= 25; ++step) {
      Push push = step == 13 ? Push{} : RandomPush(rng, 60, dim);
      ASSERT_TRUE(t.Push(h, push.keys, push.grads)) << step;
      ref.Step(h, push.keys, push.grads, 0);
    }
    EXPECT_EQ(t.table.step, 25);
    for (size_t i = 0; i < t.params.size(); ++i) {
      ASSERT_NEAR(t.params[i], ref.params[i], 1e-6 + 1.3e-6 * std::abs(ref.params[i])) << i;
      ASSERT_NEAR(t.exp_avg[i], ref.exp_avg[i], 1e-6 + 1.3e-6 * std::abs(ref.exp_avg[i])) << i;
      ASSERT_NEAR(t.exp_avg_sq[i], ref.exp_avg_sq[i], 1e-6 + 1.3e-6 * ref.exp_avg_sq[i]) << i;
    }
    for (int64_t row = 60; row < kRows; ++row) EXPECT_TRUE(SameRow(initial, t, row)) << row;
  }
}

TEST(RowSparseStepTest, MatchesFloat64SparseAdamOver25Steps) {
  ExpectMatchesReferenceOver25Steps(SparseAdamDefaults());
}

TEST(RowSparseStepTest, MatchesFloat64SparseAdamWithOddBetasAndEps) {
  ExpectMatchesReferenceOver25Steps(row_table_test::OddSparseAdam());
}

TEST(RowSparseStepTest, DecoupledWeightDecayOfPushedRowsMatchesFloat64Reference) {
  AdamWHyperparameters h = SparseAdamDefaults();
  h.weight_decay = 0.1;
  ExpectMatchesReferenceOver25Steps(h);
}

TEST(RowSparseStepTest, MaximizeMatchesFloat64ReferenceAndNegatedGradients) {
  AdamWHyperparameters h = SparseAdamDefaults();
  h.maximize = true;
  ExpectMatchesReferenceOver25Steps(h);

  TestTable maximized(7, 3, true), negated(7, 3, true);
  AdamWHyperparameters minimize = h;
  minimize.maximize = false;
  std::mt19937 rng(5);
  for (int step = 0; step < 5; ++step) {
    Push push = RandomPush(rng, kRows, 7);
    ASSERT_TRUE(maximized.Push(h, push.keys, push.grads));
    for (float& g : push.grads) g = -g;
    ASSERT_TRUE(negated.Push(minimize, push.keys, push.grads));
  }
  ExpectBitIdentical(Snapshot(negated), maximized);
}

// Lazy: rows never pushed keep every byte of params and moments (nonzero here, so that a decay
// of their moments or params would show), while the table's step count advances.
TEST(RowSparseStepTest, RowsNeverPushedStayBitIdentical) {
  AdamWHyperparameters h = SparseAdamDefaults();
  h.weight_decay = 0.1;
  TestTable t(5, 11, /*random_moments=*/true);
  const Snapshot initial(t);
  std::mt19937 rng(11);
  for (int step = 0; step < 10; ++step) {
    Push push = RandomPush(rng, kRows / 2, 5);
    for (int64_t& key : push.keys) key *= 2;  // Even rows only.
    ASSERT_TRUE(t.Push(h, push.keys, push.grads));
  }
  EXPECT_EQ(t.table.step, 10);
  int changed = 0;
  for (int64_t row = 0; row < kRows; ++row) {
    if (row % 2 == 1) {
      EXPECT_TRUE(SameRow(initial, t, row)) << row;
    } else {
      changed += !SameRow(initial, t, row);
    }
  }
  EXPECT_GT(changed, 0);
}

TEST(RowSparseStepTest, DuplicateKeysStepAsTheirSum) {
  const AdamWHyperparameters h = SparseAdamDefaults();
  TestTable twice(3, 21, true), summed(3, 21, true);
  const Snapshot initial(twice);
  const std::vector<float> a = {0.5f, -1.25f, 3e-3f}, b = {0.1f, 2.0f, -7.5f};
  std::vector<float> both = a, a_plus_b(3);
  both.insert(both.end(), b.begin(), b.end());
  for (int j = 0; j < 3; ++j) a_plus_b[j] = a[j] + b[j];
  ASSERT_TRUE(twice.Push(h, {5, 5}, both));
  ASSERT_TRUE(summed.Push(h, {5}, a_plus_b));
  ExpectBitIdentical(Snapshot(summed), twice);
  EXPECT_FALSE(SameRow(initial, twice, 5));
}

TEST(CoalesceRowsTest, SortsKeysAndSumsDuplicatesInPushOrder) {
  // Key 9's rows sum to 0 in push order (1e8 + 1 rounds to 1e8 in fp32), to 1 in others.
  const std::vector<int64_t> keys = {9, 2, 9, 2, 7, 9};
  const std::vector<float> grads = {1e8f, 1, 1, 2, 1, 3, 2, 4, 5, 6, -1e8f, 8};
  const CoalescedRows rows = CoalesceRows(keys, grads, 2);
  EXPECT_EQ(rows.keys, (std::vector<int64_t>{2, 7, 9}));
  EXPECT_EQ(rows.grads, (std::vector<float>{3, 6, 5, 6, 0, 12}));
}

TEST(RowSparseStepTest, GradScaleDividesTheSummedGradients) {
  const AdamWHyperparameters h = SparseAdamDefaults();
  TestTable scaled(129, 31, true), plain(129, 31, true);
  std::mt19937 rng(31);
  for (int step = 0; step < 5; ++step) {
    Push push = RandomPush(rng, kRows, 129);
    ASSERT_TRUE(plain.Push(h, push.keys, push.grads, /*grad_scale=*/0.0f));
    for (float& g : push.grads) g *= 1024.0f;
    ASSERT_TRUE(scaled.Push(h, push.keys, push.grads, /*grad_scale=*/1024.0f));
  }
  ExpectBitIdentical(Snapshot(plain), scaled);

  // A tiny scale (1 / 1e-39 overflows in fp32) divides too: the step is applied, as with the
  // quotients pushed unscaled.
  TestTable tiny(2, 32, true), quotients(2, 32, true);
  const std::vector<float> grads = {3e-40f, -5e-40f, 1e-40f, 2e-40f};
  ASSERT_TRUE(tiny.Push(h, {3, 8}, grads, /*grad_scale=*/1e-39f));
  std::vector<float> divided;
  for (float g : grads) divided.push_back(g / 1e-39f);
  ASSERT_TRUE(quotients.Push(h, {3, 8}, divided));
  ExpectBitIdentical(Snapshot(quotients), tiny);
}

TEST(RowSparseStepTest, NonFiniteGradientSkipsTheWholeStep) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  struct Case {
    const char* name;
    std::vector<int64_t> keys;
    std::vector<float> grads;  // dim 2
    float grad_scale;
  } cases[] = {
      {"nan", {1, 4}, {0.5f, -0.25f, nan, 1}, 0},
      {"inf", {1, 4}, {0.5f, -0.25f, 1, inf}, 0},
      {"minus_inf", {4, 1}, {-inf, 1, 0.5f, -0.25f}, 0},
      {"duplicates_overflow", {4, 1, 4}, {3e38f, 1, 0.5f, 0.5f, 3e38f, 1}, 0},
      {"grad_scale_overflows", {1, 4}, {1, 2, 0, 0}, 1e-39f},
  };
  const AdamWHyperparameters h = SparseAdamDefaults();
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TestTable t(2, 41, true);
    ASSERT_TRUE(t.Push(h, {1, 4, 4}, {1, 2, 3, 4, 5, 6}));
    const Snapshot before(t);
    absl::StatusOr<bool> applied = ApplyRowSparseStep(t.table, h, c.keys, c.grads, c.grad_scale);
    ASSERT_TRUE(applied.ok()) << applied.status();
    EXPECT_FALSE(*applied);
    ExpectBitIdentical(before, t);
  }
}

TEST(RowSparseStepTest, InvalidArgumentsNameTheFieldAndChangeNothing) {
  AdamWHyperparameters amsgrad = SparseAdamDefaults();
  amsgrad.amsgrad = true;
  struct Case {
    const char* name;
    AdamWHyperparameters hyper;
    std::vector<int64_t> keys;
    size_t grad_count;  // dim 4
    std::vector<std::string> message_parts;
  } cases[] = {
      {"out_of_range", SparseAdamDefaults(), {1, 2, 70}, 12, {"keys[2] = 70", "[0, 64)"}},
      {"at_rows", SparseAdamDefaults(), {64}, 4, {"keys[0] = 64", "[0, 64)"}},
      {"negative", SparseAdamDefaults(), {1, -1}, 8, {"keys[1] = -1", "[0, 64)"}},
      {"short_grads", SparseAdamDefaults(), {1, 2}, 7, {"grads has 7", "2 * 4"}},
      {"long_grads", SparseAdamDefaults(), {1, 2}, 12, {"grads has 12", "2 * 4"}},
      {"amsgrad", amsgrad, {1}, 4, {"amsgrad"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TestTable t(4, 51, true);
    const Snapshot before(t);
    const std::vector<float> grads(c.grad_count, 0.5f);
    absl::StatusOr<bool> applied = ApplyRowSparseStep(t.table, c.hyper, c.keys, grads, 0.0f);
    ASSERT_EQ(applied.status().code(), absl::StatusCode::kInvalidArgument) << applied.status();
    for (const std::string& part : c.message_parts) {
      EXPECT_NE(applied.status().message().find(part), absl::string_view::npos)
          << applied.status().message() << " lacks " << part;
    }
    ExpectBitIdentical(before, t);
  }
}

TEST(RowSparseStepTest, TableOfTheWrongSizeIsInvalid) {
  TestTable t(4, 61, false);
  t.table.exp_avg_sq = t.table.exp_avg_sq.subspan(1);
  absl::StatusOr<bool> applied =
      ApplyRowSparseStep(t.table, SparseAdamDefaults(), {1}, {1, 2, 3, 4}, 0.0f);
  ASSERT_EQ(applied.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(applied.status().message().find("table.exp_avg_sq has 255"), absl::string_view::npos)
      << applied.status().message();
  EXPECT_EQ(t.table.step, 0);
}

}  // namespace
}  // namespace fusedps
