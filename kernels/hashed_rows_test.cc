// Tests of kernels/row_init.h (the rows' initializer) and kernels/hashed_rows.h (slots, the
// eviction order, lookups, export and import). The step of a hashed table, against a float64
// reference, is in hashed_row_step_test.cc.
#include "kernels/hashed_rows.h"

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/hashed_row_step.h"
#include "kernels/row_init.h"

namespace fusedps {
namespace {

uint32_t Bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

TEST(RowInitTest, LogAndCosAreWithin1e15OfTheExactFunctions) {
  const long double kPi = 3.141592653589793238462643383279502884L;
  std::vector<uint32_t> inputs = {0,           1,           2,           0x3fffffffu, 0x40000000u,
                                  0x5fffffffu, 0x60000000u, 0x7fffffffu, 0x80000000u, 0xb504f333u,
                                  0xb504f334u, 0xdfffffffu, 0xe0000000u, 0xfffffffeu, 0xffffffffu};
  std::mt19937 rng(1);
  for (int i = 0; i < 200000; ++i) inputs.push_back(static_cast<uint32_t>(rng()));
  for (const uint32_t x : inputs) {
    const long double u = (x + 0.5L) / 4294967296.0L;
    const long double log_u = std::log(u);
    ASSERT_LE(std::abs(RowInitLog(x) - log_u), 1e-15L * std::abs(log_u)) << x;
    const long double cos_t = std::cos(2.0L * kPi * (x / 4294967296.0L));
    ASSERT_LE(std::abs(RowInitCos(x) - cos_t), 1e-15L) << x;
  }
  EXPECT_EQ(RowInitCos(0), 1.0);
  EXPECT_EQ(RowInitCos(0x80000000u), -1.0);
}

// The recipe is fixed: checkpoints (rows evicted come back from it) and the CUDA backend depend
// on these exact bits. Change them only with the recipe, on purpose.
TEST(RowInitTest, GoldenBits) {
  EXPECT_EQ(Bits(RowInitValue(0, 0, 0, 1.0f)), 0xbefd396eu);
  EXPECT_EQ(Bits(RowInitValue(42, -7, 3, 0.5f)), 0x3e736fefu);
  EXPECT_EQ(Bits(RowInitValue(~uint64_t{0}, INT64_MIN, 1000, 0.01f)), 0xbb8be929u);
}

TEST(RowInitTest, SameSeedKeyColumnGiveTheSameBits) {
  constexpr int64_t kDim = 33;
  std::vector<float> row(kDim);
  InitRow(9, 123456789, 0.25f, kDim, row.data());
  for (int64_t j = 0; j < kDim; ++j) {
    EXPECT_EQ(Bits(row[j]), Bits(RowInitValue(9, 123456789, j, 0.25f))) << j;
  }
  // Another key, another seed: other values.
  std::vector<float> other_key(kDim), other_seed(kDim);
  InitRow(9, 123456790, 0.25f, kDim, other_key.data());
  InitRow(10, 123456789, 0.25f, kDim, other_seed.data());
  int same_key = 0, same_seed = 0, same_column = 0;
  for (int64_t j = 0; j < kDim; ++j) {
    same_key += row[j] == other_key[j];
    same_seed += row[j] == other_seed[j];
    same_column += j > 0 && row[j] == row[j - 1];
  }
  EXPECT_EQ(same_key, 0);
  EXPECT_EQ(same_seed, 0);
  EXPECT_EQ(same_column, 0);
  // std scales exactly (a power of 2 commutes with the one rounding).
  EXPECT_EQ(RowInitValue(9, 5, 2, 2.0f), 4.0f * RowInitValue(9, 5, 2, 0.5f));
}

// Rows created through a table, in different orders and so in different slots, have the
// initializer's bits (a zero gradient leaves a new row's params as they are: exp_avg stays 0,
// and param + -step_size * (0 / eps) = param).
TEST(RowInitTest, CreatedRowsHaveTheSameBitsWhicheverSlotOrOrder) {
  constexpr int64_t kCapacity = 8, kDim = 5;
  constexpr uint64_t kSeed = 77;
  constexpr float kStd = 0.1f;
  AdamWHyperparameters h;
  h.weight_decay = 0;
  struct Table {
    std::vector<float> params = std::vector<float>(kCapacity * kDim);
    std::vector<float> exp_avg = params, exp_avg_sq = params;
    RowSparseTable table{absl::MakeSpan(params),
                         absl::MakeSpan(exp_avg),
                         absl::MakeSpan(exp_avg_sq),
                         kCapacity,
                         kDim,
                         0};
    HashedRowIndex index{kCapacity};
    void Push(const AdamWHyperparameters& h, std::vector<int64_t> keys) {
      const std::vector<float> zeros(keys.size() * kDim, 0.0f);
      absl::StatusOr<bool> applied =
          ApplyHashedRowStep(table, index, h, keys, zeros, 0.0f, kSeed, kStd);
      ASSERT_TRUE(applied.ok() && *applied) << applied.status();
    }
  } a, b;
  a.Push(h, {3, 100, -5});
  b.Push(h, {-5});
  b.Push(h, {77});
  b.Push(h, {100, 3, 100});
  EXPECT_NE(a.index.FindSlot(3), b.index.FindSlot(3));
  for (const int64_t key : {3, 100, -5}) {
    std::vector<float> expected(kDim);
    InitRow(kSeed, key, kStd, kDim, expected.data());
    for (const Table* t : {&a, &b}) {
      const int64_t slot = t->index.FindSlot(key);
      ASSERT_GE(slot, 0) << key;
      EXPECT_EQ(std::memcmp(&t->params[slot * kDim], expected.data(), kDim * sizeof(float)), 0)
          << key;
    }
  }
}

// Loose bounds on a fixed sample (deterministic: it cannot flake). Standard errors for 1e5
// normal samples: mean 0.0032, std 0.0022, fractions 0.0015 and 0.0007 (in units of std).
TEST(RowInitTest, ValuesAreNormalWithMeanZeroAndTheGivenStd) {
  constexpr float kStd = 0.5f;
  double sum = 0, sum_sq = 0, max_abs = 0;
  int within_one = 0, within_two = 0;
  constexpr int kKeys = 10000, kColumns = 10, kCount = kKeys * kColumns;
  for (int64_t key = 0; key < kKeys; ++key) {
    for (int64_t column = 0; column < kColumns; ++column) {
      const double z = RowInitValue(1234, key * 1000003, column, kStd) / kStd;
      sum += z;
      sum_sq += z * z;
      max_abs = std::max(max_abs, std::abs(z));
      within_one += std::abs(z) < 1;
      within_two += std::abs(z) < 2;
    }
  }
  const double mean = sum / kCount;
  const double std = std::sqrt(sum_sq / kCount - mean * mean);
  EXPECT_LT(std::abs(mean), 0.02);
  EXPECT_LT(std::abs(std - 1.0), 0.02);
  EXPECT_NEAR(within_one / static_cast<double>(kCount), 0.6827, 0.01);
  EXPECT_NEAR(within_two / static_cast<double>(kCount), 0.9545, 0.005);
  EXPECT_LE(max_abs, 6.8);
}

// A plan and its commit, expecting success.
HashedRowIndex::SlotPlan Push(HashedRowIndex& index, std::vector<int64_t> keys, int64_t step) {
  absl::StatusOr<HashedRowIndex::SlotPlan> plan = index.PlanSlots(keys);
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return {};
  index.Commit(*plan, step);
  return *plan;
}

TEST(HashedRowIndexTest, EvictsLeastRecentlyUpdatedFirstTiesToTheSmallestSlot) {
  HashedRowIndex index(4);
  EXPECT_EQ(Push(index, {10, 11}, 1).slots, (std::vector<int64_t>{0, 1}));  // Free slots first.
  EXPECT_EQ(Push(index, {12, 13}, 2).slots, (std::vector<int64_t>{2, 3}));
  Push(index, {11}, 3);  // Stamps: slot 0 (key 10) 1, slot 1 (11) 3, slots 2 (12), 3 (13) 2.
  EXPECT_EQ(index.rows_in_use(), 4);
  EXPECT_EQ(index.evictions_total(), 0);

  // 10 goes (stamp 1), then 12 (stamp 2, tied with 13 in slot 3: the smaller slot).
  HashedRowIndex::SlotPlan plan = Push(index, {20, 21}, 4);
  EXPECT_EQ(plan.slots, (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(plan.created, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(plan.evicted_keys, (std::vector<int64_t>{10, 12}));
  EXPECT_EQ(index.evictions_total(), 2);
  EXPECT_EQ(index.FindSlot(10), -1);
  EXPECT_EQ(index.FindSlot(12), -1);
  EXPECT_EQ(index.SlotKey(2), 21);
  EXPECT_EQ(index.SlotStamp(0), 4);
  EXPECT_EQ(index.SlotStamp(3), 2);

  // Ties at stamp 4 (slots 0 and 2): slot 0 goes before slot 2 once 13 (stamp 2) and 11 (3) have.
  plan = Push(index, {1, 2, 3, 4}, 5);
  EXPECT_EQ(plan.evicted_keys, (std::vector<int64_t>{13, 11, 20, 21}));
  EXPECT_EQ(plan.slots, (std::vector<int64_t>{3, 1, 0, 2}));
  EXPECT_EQ(index.evictions_total(), 6);
}

TEST(HashedRowIndexTest, AKeyOfThePushIsNeverEvictedByIt) {
  HashedRowIndex index(4);
  Push(index, {13}, 1);
  Push(index, {11}, 2);
  Push(index, {20}, 3);
  Push(index, {21}, 4);
  // 13 is the oldest but named: 11, the oldest not named, goes.
  HashedRowIndex::SlotPlan plan = Push(index, {13, 30}, 5);
  EXPECT_EQ(plan.evicted_keys, (std::vector<int64_t>{11}));
  EXPECT_EQ(index.FindSlot(13), 0);
  EXPECT_EQ(index.FindSlot(30), 1);
  // A full push naming 3 of 4 keys: the fourth (21, not the oldest) is the only victim.
  plan = Push(index, {20, 13, 30, 40}, 6);
  EXPECT_EQ(plan.evicted_keys, (std::vector<int64_t>{21}));
  EXPECT_EQ(plan.slots, (std::vector<int64_t>{2, 0, 1, 3}));
}

TEST(HashedRowIndexTest, PlanChangesNothingAndRefusesTooManyOrRepeatedKeys) {
  HashedRowIndex index(3);
  Push(index, {1, 2, 3}, 1);
  const HashedRowIndexState before = index.Export();
  ASSERT_TRUE(index.PlanSlots({4, 5, 6}).ok());
  EXPECT_EQ(index.Export(), before);

  absl::StatusOr<HashedRowIndex::SlotPlan> plan = index.PlanSlots({4, 5, 6, 7});
  ASSERT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(plan.status().message(), "keys: 4 unique keys exceed the table's capacity of 3 rows");
  plan = index.PlanSlots({4, 5, 4});
  ASSERT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("keys[2] = 4"), absl::string_view::npos);
  EXPECT_EQ(index.Export(), before);
}

TEST(HashedRowIndexTest, LookupCreatesNothingStampsNothingAndCountsMisses) {
  HashedRowIndex index(2);
  Push(index, {7}, 1);
  Push(index, {8}, 2);
  const HashedRowIndexState before = index.Export();
  EXPECT_EQ(index.Lookup({7, 9, 8, 9, 7}), (std::vector<int64_t>{0, -1, 1, -1, 0}));
  EXPECT_EQ(index.lookups_total(), 5);
  EXPECT_EQ(index.lookup_misses_total(), 2);
  EXPECT_EQ(index.FindSlot(9), -1);
  EXPECT_EQ(index.rows_in_use(), 2);
  HashedRowIndexState after = index.Export();
  EXPECT_EQ(after.stamps, before.stamps);
  after.lookups_total = after.lookup_misses_total = 0;
  EXPECT_EQ(after, before);
  // 7 was looked up last, yet it is still the least recently updated.
  EXPECT_EQ(Push(index, {9}, 3).evicted_keys, (std::vector<int64_t>{7}));
}

TEST(HashedRowIndexTest, ImportRestoresTheEvictionOrderAndRefusesBadStates) {
  HashedRowIndex index(5);
  Push(index, {1, 2}, 1);
  Push(index, {3}, 2);
  Push(index, {1}, 3);
  index.Lookup({3, 4});
  absl::StatusOr<HashedRowIndex> copy = HashedRowIndex::Import(index.Export());
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_EQ(copy->Export(), index.Export());
  for (HashedRowIndex* i : {&index, &*copy}) {
    EXPECT_EQ(Push(*i, {4, 5, 6, 7}, 4).evicted_keys, (std::vector<int64_t>{2, 3}));
    EXPECT_EQ(Push(*i, {8}, 5).evicted_keys, (std::vector<int64_t>{1}));
  }
  EXPECT_EQ(copy->Export(), index.Export());

  const HashedRowIndexState good = index.Export();
  struct Case {
    const char* name;
    void (*edit)(HashedRowIndexState&);
    const char* message_part;
  } cases[] = {
      {"slot_range", [](HashedRowIndexState& s) { s.slots.back() = 5; }, "state.slots[4] = 5"},
      {"slot_order", [](HashedRowIndexState& s) { s.slots[1] = 0; }, "state.slots[1] = 0"},
      {"repeated_key", [](HashedRowIndexState& s) { s.keys[2] = s.keys[0]; }, "state.keys[2]"},
      {"lengths", [](HashedRowIndexState& s) { s.stamps.pop_back(); }, "different lengths"},
      {"stamp", [](HashedRowIndexState& s) { s.stamps[0] = -1; }, "state.stamps[0] = -1"},
      {"misses", [](HashedRowIndexState& s) { s.lookup_misses_total = 9; }, "lookup_misses"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    HashedRowIndexState bad = good;
    c.edit(bad);
    absl::StatusOr<HashedRowIndex> imported = HashedRowIndex::Import(bad);
    ASSERT_EQ(imported.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(imported.status().message().find(c.message_part), absl::string_view::npos)
        << imported.status().message();
  }
}

}  // namespace
}  // namespace fusedps
