// Tests of the update engine's embedding tables: a push's table rows step with its dense
// tensors (the table's rows as kernels/row_sparse.h's step gives them, its one step count
// published), lookups read rows in stream order, a bad key fails its push without a fault and
// changes nothing, a hashed table steps as the kernels' reference of one (slots, evictions, the
// initializer) bit for bit, sync rounds step the mean of their members' rows, and the rows in
// use are read beside hashed pushes (a stress test for the sanitizers).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/forwarding_backend.h"
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

  // Registers hashed table 0 ("h", [slots, width] slots, the initializer's seed and std) in
  // group 1 ("tables": `hyper_`).
  void RegisterHashedTable(UpdateEngine& engine, int64_t slots, int64_t width, uint64_t seed,
                           float init_std) {
    ASSERT_TRUE(Sync<bool>([&](UpdateEngine::Done<bool> d) {
                  engine.RegisterParamGroup({"tables", hyper_}, d);
                }).ok());
    TensorMeta meta{"h", {slots, width}, 1, static_cast<uint64_t>(slots * width), true};
    meta.hashed = HashedKeys{seed, init_std};
    ASSERT_TRUE(Sync<uint32_t>([&](UpdateEngine::Done<uint32_t> d) {
                  engine.BeginRegistration({meta}, d);
                }).ok());
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
  RegisterHashedTable(engine, kSlots, kWidth, kSeed, kStd);
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

// A sync round steps its members' rows as one SparseAdam step on their mean: each member's
// rows divided by its grad_scale, duplicates summed across members, a row one member left out
// counting as zero for it. The oracle: the mean computed here in float64, stepped by
// kernels/row_sparse.h's step.
TEST_F(EngineTablesTest, SyncRoundStepsTheMeanOfItsMembersRows) {
  UpdateEngine engine(MakeCpuBackend({.threads = 1}), &fault_, &retries_, SyncMode(2, 2));
  RegisterShard(engine);
  const std::vector<int64_t> keys_a = {3, 5, 3}, keys_b = {5, 8};
  std::vector<float> ga(keys_a.size() * kDim), gb(keys_b.size() * kDim);
  for (size_t i = 0; i < ga.size(); ++i) ga[i] = 0.3f * static_cast<float>(i % 5) - 0.7f;
  for (size_t i = 0; i < gb.size(); ++i) gb[i] = 0.11f * static_cast<float>(i) - 0.4f;
  ReadyPush a = TablePush(keys_a, ga);  // With dense grads for "w".
  a.client_id = "a";
  a.grad_scale = 4.0f;
  ReadyPush b;  // Rows only.
  b.client_id = "b";
  b.tables.push_back({1, keys_b, gb});
  PushOutcome oa, ob;
  PushAsync(engine, &a, &oa);
  EXPECT_FALSE(oa.done.WaitForNotificationWithTimeout(absl::Milliseconds(50)));
  PushAsync(engine, &b, &ob);
  for (PushOutcome* o : {&oa, &ob}) {
    ASSERT_TRUE(o->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    ASSERT_TRUE(o->result.ok()) << o->result.status();
    EXPECT_EQ(o->result->reply.version, 1u);
    EXPECT_EQ(o->result->reply.round_workers, 2u);
    EXPECT_EQ(o->result->reply.tensors_updated, 2u);  // "w" and the table.
  }
  // The mean gradient of rows 3, 5 and 8 in float64.
  const std::vector<int64_t> unique = {3, 5, 8};
  std::vector<double> sum(unique.size() * kDim, 0.0);
  const auto add = [&](const std::vector<int64_t>& keys, const std::vector<float>& g,
                       double scale) {
    for (size_t i = 0; i < keys.size(); ++i) {
      const size_t u =
          static_cast<size_t>(std::find(unique.begin(), unique.end(), keys[i]) - unique.begin());
      for (int64_t j = 0; j < kDim; ++j) sum[u * kDim + j] += g[i * kDim + j] / scale;
    }
  };
  add(keys_a, ga, 4.0);
  add(keys_b, gb, 1.0);
  std::vector<float> mean(sum.size());
  for (size_t i = 0; i < sum.size(); ++i) mean[i] = static_cast<float>(sum[i] / 2.0);
  std::vector<float> params = table0_, exp_avg(kRows * kDim), exp_avg_sq(kRows * kDim);
  RowSparseTable reference{
      absl::MakeSpan(params), absl::MakeSpan(exp_avg), absl::MakeSpan(exp_avg_sq), kRows, kDim, 0};
  ASSERT_TRUE(*ApplyRowSparseStep(reference, hyper_, unique, mean, 0.0f));
  for (TensorField f : {TensorField::kParam, TensorField::kExpAvg, TensorField::kExpAvgSq}) {
    absl::StatusOr<RowsResult> rows = Lookup(engine, 1, AllRows(), f);
    ASSERT_TRUE(rows.ok()) << rows.status();
    EXPECT_EQ(rows->step, 1);
    const std::vector<float>& want = f == TensorField::kParam    ? params
                                     : f == TensorField::kExpAvg ? exp_avg
                                                                 : exp_avg_sq;
    for (size_t i = 0; i < want.size(); ++i) {
      const int64_t row = static_cast<int64_t>(i) / kDim;
      if (std::find(unique.begin(), unique.end(), row) == unique.end()) {
        EXPECT_EQ(rows->rows[i], want[i]) << "row " << row << " was not pushed";  // Bit for bit.
      } else {
        EXPECT_NEAR(rows->rows[i], want[i], 1e-6 + 1e-6 * std::abs(want[i]))
            << TensorFieldName(f) << " element " << i;
      }
    }
  }
}

// A hashed table in sync rounds: a push whose new keys would bring the round's unique keys
// above the capacity is refused (INVALID_ARGUMENT, naming the table and its capacity) and the
// round goes on without it; a round's evictions are reported once, at the first member that
// named the table.
TEST_F(EngineTablesTest, SyncRoundsKeepAHashedTablesKeysWithinItsCapacity) {
  constexpr int64_t kSlots = 6, kWidth = 5;
  UpdateEngine engine(MakeCpuBackend({.threads = 1}), &fault_, &retries_, SyncMode(2, 2));
  RegisterHashedTable(engine, kSlots, kWidth, 42, 0.25f);
  const auto push = [](std::string client, uint64_t sequence_number, uint64_t base_version,
                       std::vector<int64_t> keys) {
    ReadyPush p;
    p.client_id = std::move(client);
    p.sequence_number = sequence_number;
    p.base_version = base_version;
    std::vector<float> grads(keys.size() * kWidth, 0.25f);
    p.tables.push_back({0, std::move(keys), std::move(grads)});
    return p;
  };
  // Round 1: a names 4 keys; b's 3 new ones would make 7 of 6 slots; b's retry with 1 new fits.
  const ReadyPush a1 = push("a", 1, 0, {1, 2, 3, 4}), b1 = push("b", 1, 0, {5, 6, 7});
  const ReadyPush b2 = push("b", 2, 0, {4, 5, 4});
  PushOutcome oa1, ob1, ob2;
  PushAsync(engine, &a1, &oa1);
  PushAsync(engine, &b1, &ob1);
  ASSERT_TRUE(ob1.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(ob1.result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(ob1.result.status().message().find(
                "table_rows of table 'h': the sync round's pushes would name 7 unique keys (3 "
                "new in this push), above the table's capacity of 6"),
            absl::string_view::npos)
      << ob1.result.status();
  EXPECT_FALSE(oa1.done.HasBeenNotified());  // The round waits for its second member.
  PushAsync(engine, &b2, &ob2);
  for (PushOutcome* o : {&oa1, &ob2}) {
    ASSERT_TRUE(o->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    ASSERT_TRUE(o->result.ok()) << o->result.status();
    EXPECT_EQ(o->result->reply.version, 1u);
    EXPECT_EQ(o->result->table_evictions, std::vector<uint64_t>{0});
  }
  EXPECT_EQ(engine.HashedRowsInUse(0), 5u);
  // Round 2: both name keys 7 and 8, new: one row of the five goes, counted at a's reply.
  const ReadyPush a2 = push("a", 2, 1, {7, 8}), b3 = push("b", 3, 1, {8, 7});
  PushOutcome oa2, ob3;
  PushAsync(engine, &a2, &oa2);
  PushAsync(engine, &b3, &ob3);
  for (PushOutcome* o : {&oa2, &ob3}) {
    ASSERT_TRUE(o->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    ASSERT_TRUE(o->result.ok()) << o->result.status();
    EXPECT_EQ(o->result->reply.version, 2u);
  }
  EXPECT_EQ(oa2.result->table_evictions, std::vector<uint64_t>{1});
  EXPECT_EQ(ob3.result->table_evictions, std::vector<uint64_t>{0});
  EXPECT_EQ(engine.HashedRowsInUse(0), 6u);
  absl::StatusOr<RowsResult> rows = Lookup(engine, 0, {1, 2, 3, 4, 5, 7, 8});
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(rows->misses, 1u);  // The evicted row (the smallest stamp and slot: key 1's).
  EXPECT_EQ(rows->step, 2);
  EXPECT_TRUE(fault_.status().ok()) << fault_.status();
}

// A backend whose first Accumulate runs out of memory (an expected refusal of that push).
class AccumulateOnceFails final : public ForwardingBackend {
 public:
  explicit AccumulateOnceFails(std::unique_ptr<OptimizerBackend> inner)
      : ForwardingBackend(std::move(inner)) {}
  absl::StatusOr<Marker> Accumulate(const StepRequest& request, bool first) override {
    if (!failed_) {
      failed_ = true;
      return absl::ResourceExhaustedError("the gradient accumulator (injected)");
    }
    return ForwardingBackend::Accumulate(request, first);
  }

 private:
  bool failed_ = false;  // The engine thread's only.
};

// A push refused after its keys were checked (its dense gradients could not be summed) leaves
// the round's keys as they were: only members' keys count against a hashed table's capacity.
TEST_F(EngineTablesTest, ARefusedSyncPushLeavesTheRoundsKeys) {
  constexpr int64_t kSlots = 6, kWidth = 2;
  UpdateEngine engine(std::make_unique<AccumulateOnceFails>(MakeCpuBackend({.threads = 1})),
                      &fault_, &retries_, SyncMode(2, 2));
  ASSERT_TRUE(Sync<bool>([&](UpdateEngine::Done<bool> d) {
                engine.RegisterParamGroup({"tables", hyper_}, d);
              }).ok());
  TensorMeta hashed{"h", {kSlots, kWidth}, 1, kSlots * kWidth, true};
  hashed.hashed = HashedKeys{3, 0.1f};
  const std::vector<TensorMeta> metas = {{"w", {24}, 1, 24, false}, hashed};
  ASSERT_TRUE(Sync<uint32_t>([&](UpdateEngine::Done<uint32_t> d) {
                engine.BeginRegistration(metas, d);
              }).ok());
  const std::vector<ParamWrite> writes = {{0, 0, dense0_.data(), 24}};
  ASSERT_TRUE(Sync<bool>([&](UpdateEngine::Done<bool> d) { engine.WriteParams(writes, d); }).ok());
  ASSERT_TRUE(Sync<uint64_t>([&](UpdateEngine::Done<uint64_t> d) {
                engine.CommitRegistration("", d);
              }).ok());
  const auto push = [&](std::string client, uint64_t sequence_number, std::vector<int64_t> keys) {
    ReadyPush p = PushOf({0}, {24}, dense_grads_, std::move(client), sequence_number);
    std::vector<float> grads(keys.size() * kWidth, 0.5f);
    p.tables.push_back({1, std::move(keys), std::move(grads)});
    return p;
  };
  const ReadyPush refused = push("a", 1, {1, 2, 3, 4}), b = push("b", 1, {5, 6, 7});
  const ReadyPush a = push("a", 2, {1, 2, 3});
  PushOutcome o_refused, ob, oa;
  PushAsync(engine, &refused, &o_refused);
  ASSERT_TRUE(o_refused.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(o_refused.result.status().code(), absl::StatusCode::kResourceExhausted)
      << o_refused.result.status();
  PushAsync(engine, &b, &ob);  // 3 of 6 keys: the refused push's 4 are not the round's.
  PushAsync(engine, &a, &oa);  // 6 of 6.
  for (PushOutcome* o : {&ob, &oa}) {
    ASSERT_TRUE(o->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    ASSERT_TRUE(o->result.ok()) << o->result.status();
    EXPECT_EQ(o->result->reply.round_workers, 2u);
  }
  EXPECT_EQ(engine.HashedRowsInUse(1), static_cast<uint64_t>(kSlots));
  EXPECT_TRUE(fault_.status().ok()) << fault_.status();
}

// A stress test for TSan and ASan: the metrics read a hashed table's rows in use (and the
// version) on their own thread while pushes that create and evict rows commit on the engine's.
// Every read is a count the table had: at most its capacity, never decreasing (rows are only
// evicted to make room, so the count grows to the capacity and stays there).
TEST_F(EngineTablesTest, RowsInUseAreReadBesideHashedPushes) {
  constexpr int64_t kSlots = 64, kWidth = 4;
  constexpr int kPushes = 300;
  UpdateEngine engine(MakeCpuBackend({.threads = 1}), &fault_, &retries_);
  RegisterHashedTable(engine, kSlots, kWidth, 5, 0.1f);
  std::atomic<bool> pushing{true};
  std::vector<uint64_t> seen;
  std::thread scraper([&] {
    while (pushing.load()) {
      seen.push_back(engine.HashedRowsInUse(0));
      (void)engine.version();
    }
  });
  // Pushes of 8 keys each from 1,000 ids, several in flight at once.
  std::mt19937 rng(11);
  std::uniform_int_distribution<int64_t> id(0, 999);
  constexpr int kInFlight = 8;
  std::vector<ReadyPush> pushes(kInFlight);
  std::vector<PushOutcome> outcomes(kPushes);
  for (int i = 0; i < kPushes; ++i) {
    if (i >= kInFlight) {
      ASSERT_TRUE(outcomes[i - kInFlight].done.WaitForNotificationWithTimeout(absl::Seconds(30)));
      ASSERT_TRUE(outcomes[i - kInFlight].result.ok()) << outcomes[i - kInFlight].result.status();
    }
    ReadyPush& push = pushes[i % kInFlight];
    push = ReadyPush();
    std::vector<int64_t> keys(8);
    for (int64_t& k : keys) k = id(rng) * 7919;
    push.tables.push_back({0, keys, std::vector<float>(keys.size() * kWidth, 0.5f)});
    PushAsync(engine, &push, &outcomes[i]);
  }
  for (int i = kPushes - kInFlight; i < kPushes; ++i) {
    ASSERT_TRUE(outcomes[i].done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  }
  pushing.store(false);
  scraper.join();
  EXPECT_EQ(engine.version(), static_cast<uint64_t>(kPushes));
  EXPECT_EQ(engine.HashedRowsInUse(0), static_cast<uint64_t>(kSlots));
  ASSERT_FALSE(seen.empty());
  for (size_t i = 0; i < seen.size(); ++i) {
    ASSERT_LE(seen[i], static_cast<uint64_t>(kSlots));
    if (i > 0) {
      ASSERT_GE(seen[i], seen[i - 1]) << "read " << i;
    }
  }
}

}  // namespace
}  // namespace fusedps
