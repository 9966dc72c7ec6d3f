// Tests of the update engine's embedding tables: a push's table rows step with its dense
// tensors (the table's rows as kernels/row_sparse.h's step gives them, its one step count
// published), lookups read rows in stream order, a bad key fails its push without a fault and
// changes nothing, sync mode refuses table rows, and a hashed table steps as the kernels'
// reference of one (slots, evictions, the initializer) bit for bit.
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/hashed_row_step.h"
#include "kernels/row_init.h"
#include "kernels/row_sparse.h"
#include "server/engine/engine_test_util.h"
#include "server/engine/update_engine.h"

namespace fusedps {
namespace {

constexpr int64_t kRows = 10;
constexpr int64_t kDim = 4;

class EngineTablesTest : public ::testing::Test {
 protected:
  // Registers dense tensor 0 ("w", 24 elements, values 1) and table 1 ("emb", [kRows, kDim],
  // values table0_) in group 1 ("tables": `hyper_`).
  void RegisterShard(UpdateEngine& engine) {
    ASSERT_TRUE(Sync<bool>([&](UpdateEngine::Done<bool> d) {
                  engine.RegisterParamGroup({"tables", hyper_}, d);
                }).ok());
    std::vector<TensorMeta> metas = {{"w", {24}, 1, 24, false},
                                     {"emb", {kRows, kDim}, 1, kRows * kDim, true}};
    absl::StatusOr<uint32_t> first =
        Sync<uint32_t>([&](UpdateEngine::Done<uint32_t> d) { engine.BeginRegistration(metas, d); });
    ASSERT_TRUE(first.ok()) << first.status();
    std::mt19937 rng(1);
    std::normal_distribution<float> normal;
    for (float& x : table0_) x = normal(rng);
    const std::vector<ParamWrite> writes = {{0, 0, dense0_.data(), 24},
                                            {1, 0, table0_.data(), kRows * kDim}};
    ASSERT_TRUE(
        Sync<bool>([&](UpdateEngine::Done<bool> d) { engine.WriteParams(writes, d); }).ok());
    ASSERT_TRUE(Sync<uint64_t>([&](UpdateEngine::Done<uint64_t> d) {
                  engine.CommitRegistration("", d);
                }).ok());
  }

  absl::StatusOr<StepResult> Push(UpdateEngine& engine, const ReadyPush& push) {
    return Sync<StepResult>([&](UpdateEngine::Done<StepResult> d) { engine.Step(&push, d); });
  }

  absl::StatusOr<RowsResult> Lookup(UpdateEngine& engine, uint32_t tensor,
                                    std::vector<int64_t> keys,
                                    TensorField field = TensorField::kParam) {
    return Sync<RowsResult>([&](UpdateEngine::Done<RowsResult> d) {
      engine.ReadRows({tensor, field, std::move(keys)}, d);
    });
  }

  // A push of dense grads (0.5) for "w" and `grads` for rows `keys` of "emb".
  ReadyPush TablePush(const std::vector<int64_t>& keys, const std::vector<float>& grads) {
    ReadyPush push = PushOf({0}, {24}, dense_grads_);
    push.tables.push_back({1, keys, grads});
    return push;
  }

  AdamWHyperparameters hyper_ = [] {
    AdamWHyperparameters h;
    h.lr = 0.05;
    h.weight_decay = 0.01;
    return h;
  }();
  ShardFault fault_;
  RetryTable retries_{100};
  std::vector<float> dense0_ = std::vector<float>(24, 1.0f);
  std::vector<float> table0_ = std::vector<float>(kRows * kDim);
  std::vector<float> dense_grads_ = std::vector<float>(24, 0.5f);
};

std::vector<int64_t> AllRows() {
  std::vector<int64_t> keys(kRows);
  for (int64_t i = 0; i < kRows; ++i) keys[i] = i;
  return keys;
}

TEST_F(EngineTablesTest, TableRowsStepWithTheDenseTensorsAndLookupsSeeThem) {
  UpdateEngine engine(MakeCpuBackend({.threads = 1}), &fault_, &retries_);
  RegisterShard(engine);
  std::vector<float> params = table0_, exp_avg(kRows * kDim), exp_avg_sq(kRows * kDim);
  RowSparseTable reference{
      absl::MakeSpan(params), absl::MakeSpan(exp_avg), absl::MakeSpan(exp_avg_sq), kRows, kDim, 0};
  for (int step = 1; step <= 3; ++step) {
    const std::vector<int64_t> keys = {3, 7, 3, step};
    std::vector<float> grads(keys.size() * kDim);
    for (size_t i = 0; i < grads.size(); ++i) grads[i] = 0.1f * static_cast<float>(i) - step;
    const ReadyPush push = TablePush(keys, grads);
    absl::StatusOr<StepResult> result = Push(engine, push);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->reply.version, static_cast<uint64_t>(step));
    EXPECT_EQ(result->reply.tensors_updated, 2u);
    ASSERT_TRUE(*ApplyRowSparseStep(reference, hyper_, keys, grads, 0.0f));
  }
  std::vector<int64_t> steps;
  EXPECT_EQ(engine.Steps({0, 1}, &steps), 3u);
  EXPECT_EQ(steps, (std::vector<int64_t>{3, 3}));
  const std::vector<int64_t> keys = {7, 0, 7};
  absl::StatusOr<RowsResult> rows = Lookup(engine, 1, keys);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(rows->version, 3u);
  EXPECT_EQ(rows->step, 3);
  ASSERT_EQ(rows->rows.size(), keys.size() * kDim);
  for (size_t i = 0; i < keys.size(); ++i) {
    EXPECT_EQ(std::memcmp(&rows->rows[i * kDim], &params[keys[i] * kDim], kDim * sizeof(float)), 0)
        << "row " << i;
  }
  absl::StatusOr<RowsResult> moments = Lookup(engine, 1, AllRows(), TensorField::kExpAvgSq);
  ASSERT_TRUE(moments.ok());
  EXPECT_EQ(std::memcmp(moments->rows.data(), exp_avg_sq.data(), exp_avg_sq.size() * 4), 0);
}

TEST_F(EngineTablesTest, ABadKeyFailsItsPushWithoutAFaultAndChangesNothing) {
  UpdateEngine engine(MakeCpuBackend({.threads = 1}), &fault_, &retries_);
  RegisterShard(engine);
  const std::vector<float> grads(2 * kDim, 1.0f);
  const ReadyPush bad = TablePush({1, kRows}, grads);
  absl::StatusOr<StepResult> result = Push(engine, bad);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(result.status().message().find("table_rows[0].keys[1] = 10 is outside [0, 10)"),
            absl::string_view::npos)
      << result.status();
  EXPECT_TRUE(fault_.status().ok()) << fault_.status();
  EXPECT_EQ(engine.version(), 0u);
  absl::StatusOr<RowsResult> rows = Lookup(engine, 1, AllRows());
  ASSERT_TRUE(rows.ok());
  EXPECT_EQ(std::memcmp(rows->rows.data(), table0_.data(), table0_.size() * 4), 0);
  EXPECT_EQ(rows->step, 0);
  // The shard goes on: a good push applies.
  const ReadyPush good = TablePush({1, 2}, grads);
  ASSERT_TRUE(Push(engine, good).ok());
  EXPECT_EQ(engine.version(), 1u);
}

TEST_F(EngineTablesTest, LookupsOfADenseTensorOrABadKeyAreRefused) {
  UpdateEngine engine(MakeCpuBackend({.threads = 1}), &fault_, &retries_);
  RegisterShard(engine);
  absl::StatusOr<RowsResult> dense = Lookup(engine, 0, {0});
  EXPECT_EQ(dense.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(dense.status().message().find("tensor 0 is not an embedding table"),
            absl::string_view::npos);
  absl::StatusOr<RowsResult> outside = Lookup(engine, 1, {2, -1});
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(outside.status().message().find("keys[1] = -1 is outside [0, 10)"),
            absl::string_view::npos)
      << outside.status();
  EXPECT_TRUE(fault_.status().ok());
}

// A hashed table of kSlots slots, stepped through the engine, against the kernels' reference
// of one (ApplyHashedRowStep: the same index rules and math on host arrays): bit for bit, the
// evictions counted, lookups of absent keys the initializer's rows, and a push of more unique
// keys than slots refused with nothing changed.
TEST_F(EngineTablesTest, HashedTableStepsAsTheHashedReferenceBitForBit) {
  constexpr int64_t kSlots = 6, kWidth = 5;
  constexpr uint64_t kSeed = 42;
  constexpr float kStd = 0.25f;
  UpdateEngine engine(MakeCpuBackend({.threads = 1}), &fault_, &retries_);
  ASSERT_TRUE(Sync<bool>([&](UpdateEngine::Done<bool> d) {
                engine.RegisterParamGroup({"tables", hyper_}, d);
              }).ok());
  TensorMeta meta{"h", {kSlots, kWidth}, 1, kSlots * kWidth, true};
  meta.hashed = HashedKeys{kSeed, kStd};
  ASSERT_TRUE(Sync<uint32_t>([&](UpdateEngine::Done<uint32_t> d) {
                engine.BeginRegistration({meta}, d);
              }).ok());
  ASSERT_TRUE(Sync<uint64_t>([&](UpdateEngine::Done<uint64_t> d) {
                engine.CommitRegistration("", d);
              }).ok());
  std::vector<float> params(kSlots * kWidth), exp_avg(params.size()), exp_avg_sq(params.size());
  RowSparseTable reference{absl::MakeSpan(params),
                           absl::MakeSpan(exp_avg),
                           absl::MakeSpan(exp_avg_sq),
                           kSlots,
                           kWidth,
                           0};
  HashedRowIndex index(kSlots);
  // The reference's rows of `keys` in `field`: a held key's slot, else its initializer's.
  const auto expected = [&](const std::vector<int64_t>& keys, TensorField field) {
    std::vector<float> out(keys.size() * kWidth, 0.0f);
    const std::vector<float>& source = field == TensorField::kParam    ? params
                                       : field == TensorField::kExpAvg ? exp_avg
                                                                       : exp_avg_sq;
    for (size_t i = 0; i < keys.size(); ++i) {
      const int64_t slot = index.FindSlot(keys[i]);
      if (slot >= 0) {
        std::memcpy(&out[i * kWidth], &source[slot * kWidth], kWidth * sizeof(float));
      } else if (field == TensorField::kParam) {
        InitRow(kSeed, keys[i], kStd, kWidth, &out[i * kWidth]);
      }
    }
    return out;
  };
  std::vector<int64_t> ids;
  for (int64_t k = -3; k < 9; ++k) ids.push_back(k * 1000003);
  std::mt19937 rng(7);
  std::uniform_int_distribution<size_t> pick(0, ids.size() - 1);
  std::normal_distribution<float> normal;
  uint64_t evicted = 0;
  for (int step = 1; step <= 12; ++step) {
    std::vector<int64_t> keys;
    for (int i = 0; i < 5; ++i) keys.push_back(ids[pick(rng)]);
    keys.push_back(keys[0]);  // A duplicate.
    std::vector<float> grads(keys.size() * kWidth);
    for (float& g : grads) g = normal(rng);
    ReadyPush push;
    push.tables.push_back({0, keys, grads});
    absl::StatusOr<StepResult> result = Push(engine, push);
    ASSERT_TRUE(result.ok()) << result.status();
    const uint64_t before = static_cast<uint64_t>(index.evictions_total());
    ASSERT_TRUE(*ApplyHashedRowStep(reference, index, hyper_, keys, grads, 0.0f, kSeed, kStd));
    ASSERT_EQ(result->table_evictions.size(), 1u);
    EXPECT_EQ(result->table_evictions[0], index.evictions_total() - before) << "push " << step;
    evicted += result->table_evictions[0];
    EXPECT_EQ(engine.HashedRowsInUse(0), static_cast<uint64_t>(index.rows_in_use()));
    for (TensorField f : {TensorField::kParam, TensorField::kExpAvg, TensorField::kExpAvgSq}) {
      absl::StatusOr<RowsResult> rows = Lookup(engine, 0, ids, f);
      ASSERT_TRUE(rows.ok()) << rows.status();
      EXPECT_EQ(rows->step, step);
      EXPECT_EQ(rows->misses, ids.size() - static_cast<size_t>(index.rows_in_use()));
      const std::vector<float> want = expected(ids, f);
      EXPECT_EQ(std::memcmp(rows->rows.data(), want.data(), want.size() * sizeof(float)), 0)
          << "push " << step << " field " << TensorFieldName(f);
    }
  }
  EXPECT_GT(evicted, 10u);
  // Seven unique keys for six slots: refused, nothing changed.
  std::vector<int64_t> too_many(ids.begin(), ids.begin() + 7);
  ReadyPush refused;
  refused.tables.push_back({0, too_many, std::vector<float>(7 * kWidth, 1.0f)});
  absl::StatusOr<StepResult> result = Push(engine, refused);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(result.status().message().find("7 unique keys exceed the table's capacity of 6"),
            absl::string_view::npos)
      << result.status();
  EXPECT_TRUE(fault_.status().ok());
  absl::StatusOr<RowsResult> rows = Lookup(engine, 0, ids);
  ASSERT_TRUE(rows.ok());
  const std::vector<float> want = expected(ids, TensorField::kParam);
  EXPECT_EQ(std::memcmp(rows->rows.data(), want.data(), want.size() * sizeof(float)), 0);
  EXPECT_EQ(rows->step, 12);
}

TEST_F(EngineTablesTest, SyncModeRefusesTableRows) {
  ConsistencyOptions sync;
  sync.mode = ConsistencyMode::kSync;
  UpdateEngine engine(MakeCpuBackend({.threads = 1}), &fault_, &retries_, sync);
  RegisterShard(engine);
  ReadyPush push = TablePush({1}, std::vector<float>(kDim, 1.0f));
  push.client_id = "trainer-0";
  absl::StatusOr<StepResult> result = Push(engine, push);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kUnimplemented) << result.status();
  EXPECT_EQ(engine.version(), 0u);
}

}  // namespace
}  // namespace fusedps
