// Tests of kernels/hashed_row_step.h against an independent float64 model of a hashed table: its
// own key map and least-recently-updated bookkeeping, and SparseAdam written here from the
// formulas in sparse_adam_math.h's comment (plus our decoupled weight decay of pushed rows),
// not from the code under test. Only the initial values come from row_init.h in both.
#include "kernels/hashed_row_step.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/row_init.h"
#include "kernels/row_table_test_util.h"

namespace fusedps {
namespace {

using row_table_test::SameBytes;
using row_table_test::SparseAdamDefaults;

constexpr uint64_t kSeed = 2024;
constexpr float kInitStd = 0.5f;

// A hashed table in float64: rows by key, each with its slot and stamp; new keys (ascending)
// take the smallest free slot, else the slot of the smallest (stamp, slot) whose key the push
// does not name, evicting it.
struct ReferenceHashedTable {
  struct Row {
    int64_t slot = 0, stamp = 0;
    std::vector<double> params, exp_avg, exp_avg_sq;
  };
  int64_t dim = 0;
  int64_t step = 0, evictions = 0;
  std::map<int64_t, Row> rows;
  std::set<int64_t> free_slots;

  ReferenceHashedTable(int64_t capacity, int64_t dim) : dim(dim) {
    for (int64_t slot = 0; slot < capacity; ++slot) free_slots.insert(slot);
  }

  void Step(const AdamWHyperparameters& h, const std::vector<int64_t>& keys,
            const std::vector<float>& grads) {
    ++step;
    const std::map<int64_t, std::vector<double>> sums = row_table_test::SumRows(keys, grads, dim);
    for (const auto& [key, sum] : sums) {
      if (rows.count(key)) continue;
      Row row;
      if (!free_slots.empty()) {
        row.slot = *free_slots.begin();
        free_slots.erase(free_slots.begin());
      } else {
        auto victim = rows.end();
        for (auto it = rows.begin(); it != rows.end(); ++it) {
          if (sums.count(it->first)) continue;
          if (victim == rows.end() ||
              std::make_pair(it->second.stamp, it->second.slot) <
                  std::make_pair(victim->second.stamp, victim->second.slot)) {
            victim = it;
          }
        }
        row.slot = victim->second.slot;
        rows.erase(victim);
        ++evictions;
      }
      for (int64_t j = 0; j < dim; ++j) row.params.push_back(RowInitValue(kSeed, key, j, kInitStd));
      row.exp_avg.assign(dim, 0.0);
      row.exp_avg_sq.assign(dim, 0.0);
      rows[key] = row;
    }
    const double step_size = row_table_test::ReferenceStepSize(h, step);
    for (const auto& [key, sum] : sums) {
      Row& row = rows[key];
      row.stamp = step;
      row_table_test::ReferenceRowUpdate(h, step_size, sum, row.params.data(), row.exp_avg.data(),
                                         row.exp_avg_sq.data());
    }
  }
};

// A hashed table that owns its arrays (zeros: every row is written when created).
struct TestTable {
  std::vector<float> params, exp_avg, exp_avg_sq;
  RowSparseTable table;
  HashedRowIndex index;

  TestTable(int64_t capacity, int64_t dim)
      : params(capacity * dim),
        exp_avg(capacity * dim),
        exp_avg_sq(capacity * dim),
        table{absl::MakeSpan(params),
              absl::MakeSpan(exp_avg),
              absl::MakeSpan(exp_avg_sq),
              capacity,
              dim,
              0},
        index(capacity) {}
  TestTable(const TestTable&) = delete;
  TestTable& operator=(const TestTable&) = delete;

  absl::StatusOr<bool> Push(const AdamWHyperparameters& h, const std::vector<int64_t>& keys,
                            const std::vector<float>& grads, float grad_scale = 0.0f) {
    return ApplyHashedRowStep(table, index, h, keys, grads, grad_scale, kSeed, kInitStd);
  }
  void ExpectApplied(const AdamWHyperparameters& h, const std::vector<int64_t>& keys,
                     const std::vector<float>& grads) {
    absl::StatusOr<bool> applied = Push(h, keys, grads);
    ASSERT_TRUE(applied.ok()) << applied.status();
    EXPECT_TRUE(*applied);
  }
};

// Everything a step may change, copied.
struct Snapshot : row_table_test::TableBytes {
  explicit Snapshot(const TestTable& t) : TableBytes(t.table), index(t.index.Export()) {}
  HashedRowIndexState index;
};

void ExpectBitIdentical(const Snapshot& a, const Snapshot& b) {
  row_table_test::ExpectSameBytes(a, b);
  EXPECT_TRUE(a.index == b.index);
}

// A push of 1 to 12 keys drawn from 40 ids (spread over int64, negatives included), one key
// repeated, with normal gradients.
struct Push {
  std::vector<int64_t> keys;
  std::vector<float> grads;
};
Push RandomPush(std::mt19937& rng, int64_t dim) {
  std::uniform_int_distribution<int> count(1, 12);
  std::uniform_int_distribution<uint64_t> id(0, 39);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Push push;
  for (int n = count(rng); n > 0; --n) {
    push.keys.push_back(static_cast<int64_t>(id(rng) * 0x9e3779b97f4a7c15ull));
  }
  push.keys.push_back(push.keys.front());
  for (size_t i = 0; i < push.keys.size() * dim; ++i) push.grads.push_back(normal(rng));
  return push;
}

bool Near(float actual, double expected) {
  return std::abs(actual - expected) <= 1e-6 + 1.3e-6 * std::abs(expected);
}

void ExpectMatchesReferenceOver30Steps(const AdamWHyperparameters& h) {
  constexpr int64_t kCapacity = 16;
  for (const int64_t dim : {4, 33}) {
    SCOPED_TRACE(testing::Message() << "dim " << dim);
    TestTable t(kCapacity, dim);
    ReferenceHashedTable ref(kCapacity, dim);
    std::mt19937 rng(dim);
    for (int step = 1; step <= 30; ++step) {
      const Push push = RandomPush(rng, dim);
      ASSERT_NO_FATAL_FAILURE(t.ExpectApplied(h, push.keys, push.grads)) << step;
      ref.Step(h, push.keys, push.grads);
    }
    EXPECT_EQ(t.table.step, 30);
    EXPECT_GT(ref.evictions, 10);
    EXPECT_EQ(t.index.evictions_total(), ref.evictions);
    EXPECT_EQ(t.index.rows_in_use(), static_cast<int64_t>(ref.rows.size()));  // With the next
    for (const auto& [key, row] : ref.rows) {  // loop: the same key set.
      const int64_t slot = t.index.FindSlot(key);
      ASSERT_EQ(slot, row.slot) << key;
      EXPECT_EQ(t.index.SlotStamp(slot), row.stamp) << key;
      for (int64_t j = 0; j < dim; ++j) {
        const size_t e = slot * dim + j;
        ASSERT_TRUE(Near(t.params[e], row.params[j])) << key << " " << j;
        ASSERT_TRUE(Near(t.exp_avg[e], row.exp_avg[j])) << key << " " << j;
        ASSERT_TRUE(Near(t.exp_avg_sq[e], row.exp_avg_sq[j])) << key << " " << j;
      }
    }
  }
}

TEST(HashedRowStepTest, MatchesFloat64ModelOver30StepsWithEvictions) {
  ExpectMatchesReferenceOver30Steps(SparseAdamDefaults());
}

TEST(HashedRowStepTest, MatchesFloat64ModelWithWeightDecayMaximizeOddBetasAndEps) {
  AdamWHyperparameters h = row_table_test::OddSparseAdam();
  h.weight_decay = 0.1;
  h.maximize = true;
  ExpectMatchesReferenceOver30Steps(h);
}

TEST(HashedRowStepTest, AnEvictedRowComesBackFromItsInitializerWithZeroMoments) {
  const AdamWHyperparameters h = SparseAdamDefaults();
  TestTable t(1, 3);
  t.ExpectApplied(h, {5}, {1, 2, 3});
  t.ExpectApplied(h, {6}, {1, 2, 3});  // Evicts 5.
  EXPECT_EQ(t.index.FindSlot(5), -1);
  t.ExpectApplied(h, {5}, {0, 0, 0});  // A zero gradient keeps the new row's bits.
  std::vector<float> expected(3);
  InitRow(kSeed, 5, kInitStd, 3, expected.data());
  EXPECT_TRUE(SameBytes(t.params, expected));
  EXPECT_TRUE(SameBytes(t.exp_avg, {0, 0, 0}));
  EXPECT_TRUE(SameBytes(t.exp_avg_sq, {0, 0, 0}));
  EXPECT_EQ(t.index.evictions_total(), 2);
}

TEST(HashedRowStepTest, NonFinitePushToAFullTableChangesNothing) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  struct Case {
    const char* name;
    std::vector<int64_t> keys;  // New keys, which would evict, and old ones.
    std::vector<float> grads;   // dim 2
    float grad_scale;
  } cases[] = {
      {"nan", {100, 1}, {0.5f, -0.25f, nan, 1}, 0},
      {"inf", {1, 100, 101}, {0.5f, -0.25f, 1, inf, 1, 1}, 0},
      {"duplicates_overflow", {100, 1, 100}, {3e38f, 1, 0.5f, 0.5f, 3e38f, 1}, 0},
      {"grad_scale_overflows", {100, 101}, {1, 2, 0, 0}, 1e-39f},
  };
  const AdamWHyperparameters h = SparseAdamDefaults();
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TestTable t(4, 2);
    t.ExpectApplied(h, {1, 2}, {1, 2, 3, 4});
    t.ExpectApplied(h, {3, 4, 3}, {1, 2, 3, 4, 5, 6});
    t.index.Lookup({1, 9});
    const Snapshot before(t);
    absl::StatusOr<bool> applied = t.Push(h, c.keys, c.grads, c.grad_scale);
    ASSERT_TRUE(applied.ok()) << applied.status();
    EXPECT_FALSE(*applied);
    ExpectBitIdentical(before, Snapshot(t));
  }
}

TEST(HashedRowStepTest, RefusedPushesNameTheFieldAndChangeNothing) {
  AdamWHyperparameters amsgrad = SparseAdamDefaults();
  amsgrad.amsgrad = true;
  std::vector<int64_t> seventeen;
  for (int64_t key = 0; key < 17; ++key) seventeen.push_back(key * 3);
  seventeen.push_back(3);  // 18 keys, 17 unique.
  std::vector<int64_t> sixteen(seventeen.begin(), seventeen.begin() + 16);
  const AdamWHyperparameters h = SparseAdamDefaults();
  struct Case {
    const char* name;
    AdamWHyperparameters hyper;
    std::vector<int64_t> keys;
    size_t grad_count;  // dim 2
    float init_std;
    std::vector<std::string> message_parts;
  } cases[] = {
      {"too_many_keys", h, seventeen, 36, 0.5f, {"keys: 17 unique keys", "capacity of 16"}},
      {"short_grads", h, {1, 2}, 3, 0.5f, {"grads has 3", "2 * 2"}},
      {"init_std_nan", h, {1}, 2, std::numeric_limits<float>::quiet_NaN(), {"init_std = nan"}},
      {"init_std_negative", h, {1}, 2, -1.0f, {"init_std = -1"}},
      {"amsgrad", amsgrad, {1}, 2, 0.5f, {"amsgrad"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TestTable t(16, 2);
    t.ExpectApplied(h, sixteen, std::vector<float>(32, 0.5f));  // Full.
    const Snapshot before(t);
    const std::vector<float> grads(c.grad_count, 0.5f);
    absl::StatusOr<bool> applied =
        ApplyHashedRowStep(t.table, t.index, c.hyper, c.keys, grads, 0.0f, kSeed, c.init_std);
    ASSERT_EQ(applied.status().code(), absl::StatusCode::kInvalidArgument) << applied.status();
    for (const std::string& part : c.message_parts) {
      EXPECT_NE(applied.status().message().find(part), absl::string_view::npos)
          << applied.status().message() << " lacks " << part;
    }
    ExpectBitIdentical(before, Snapshot(t));
  }
  // 20 keys, 16 unique: fits.
  TestTable t(16, 2);
  std::vector<int64_t> keys = sixteen;
  keys.insert(keys.end(), {0, 3, 6, 9});
  t.ExpectApplied(h, keys, std::vector<float>(40, 0.5f));
  // A table whose rows are not the index's capacity.
  TestTable small(16, 2);
  small.index = HashedRowIndex(8);
  EXPECT_EQ(small.Push(h, {1}, {1, 2}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(HashedRowStepTest, AnImportedIndexContinuesBitIdentically) {
  const AdamWHyperparameters h = SparseAdamDefaults();
  constexpr int64_t kDim = 5;
  TestTable original(16, kDim);
  std::mt19937 rng(99);
  for (int step = 0; step < 10; ++step) {
    const Push push = RandomPush(rng, kDim);
    original.ExpectApplied(h, push.keys, push.grads);
  }
  original.index.Lookup({1, 2, 3});
  ASSERT_GT(original.index.evictions_total(), 0);
  TestTable restored(16, kDim);
  std::copy(original.params.begin(), original.params.end(), restored.params.begin());
  std::copy(original.exp_avg.begin(), original.exp_avg.end(), restored.exp_avg.begin());
  std::copy(original.exp_avg_sq.begin(), original.exp_avg_sq.end(), restored.exp_avg_sq.begin());
  restored.table.step = original.table.step;
  absl::StatusOr<HashedRowIndex> index = HashedRowIndex::Import(original.index.Export());
  ASSERT_TRUE(index.ok()) << index.status();
  restored.index = *std::move(index);
  for (int step = 0; step < 5; ++step) {
    const Push push = RandomPush(rng, kDim);
    original.ExpectApplied(h, push.keys, push.grads);
    restored.ExpectApplied(h, push.keys, push.grads);
  }
  ExpectBitIdentical(Snapshot(original), Snapshot(restored));
}

}  // namespace
}  // namespace fusedps
