// Tests of UpdateEngine::LoadState on the CPU backend: a load is ordered with the steps around
// it, later steps continue from the loaded values and steps (kernels/adamw_math.h as the
// oracle, bit for bit), fields not loaded keep their values, params are loaded with their param
// copy, a refused load changes nothing, sync mode refuses a load while a round holds pushes,
// and a device fault during a load stops the shard.
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "common/notification.h"
#include "gtest/gtest.h"
#include "kernels/forwarding_backend.h"
#include "server/engine/engine_test_util.h"
#include "server/engine/update_engine.h"

namespace fusedps {
namespace {

constexpr uint64_t kNumel = 20;

// One field of one tensor, read through the engine (in stream order).
std::vector<float> ReadField(UpdateEngine& engine, TensorField field, uint32_t tensor) {
  std::vector<float> values(AlignedNumel(kNumel));
  ReadJob job;
  job.field = field;
  job.tensors = {tensor};
  job.dst_offsets = {0};
  job.dst = values.data();
  absl::StatusOr<ReadResult> read =
      Sync<ReadResult>([&](UpdateEngine::Done<ReadResult> d) { engine.Read(job, d); });
  EXPECT_TRUE(read.ok()) << read.status();
  values.resize(kNumel);
  return values;
}

// Every field of tensor 0 as bytes, its step, the version and the generation.
struct State {
  std::map<int, std::vector<float>> fields;
  std::vector<int64_t> steps;
  uint64_t version = 0, generation = 0;
};

State StateOf(UpdateEngine& engine, bool amsgrad = false) {
  State state;
  for (TensorField f : {TensorField::kParam, TensorField::kExpAvg, TensorField::kExpAvgSq,
                        TensorField::kMaxExpAvgSq}) {
    if (f == TensorField::kMaxExpAvgSq && !amsgrad) continue;
    state.fields[static_cast<int>(f)] = ReadField(engine, f, 0);
  }
  state.version = engine.Steps({0}, &state.steps);
  state.generation = engine.generation();
  return state;
}

void ExpectSameBits(const std::vector<float>& got, const std::vector<float>& want,
                    const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0) << what;
}

void ExpectSameState(const State& after, const State& before) {
  EXPECT_EQ(after.version, before.version);
  EXPECT_EQ(after.steps, before.steps);
  EXPECT_EQ(after.generation, before.generation);
  for (const auto& [field, values] : before.fields) {
    ExpectSameBits(after.fields.at(field), values, "field " + std::to_string(field));
  }
}

std::vector<float> Values(float base) {
  std::vector<float> v(kNumel);
  for (uint64_t i = 0; i < kNumel; ++i) v[i] = base + 0.01f * static_cast<float>(i);
  return v;
}

WriteRequest WriteOf(TensorField field, uint32_t tensor, const std::vector<float>& values,
                     uint64_t offset = 0) {
  WriteRequest w;
  w.field = field;
  w.tensor = tensor;
  w.offset = offset;
  w.count = values.size();
  w.src = values.data();
  return w;
}

absl::StatusOr<uint64_t> Load(UpdateEngine& engine, const StateLoad& load) {
  return Sync<uint64_t>([&](UpdateEngine::Done<uint64_t> d) { engine.LoadState(&load, d); });
}

class EngineLoadTest : public ::testing::Test {
 protected:
  ShardFault fault_;
  RetryTable retries_{100};
};

// A step submitted before the load, the load, and a step after it, all queued at once: the
// load overwrites what it names after the first step, and the second step continues from it.
TEST_F(EngineLoadTest, LoadIsOrderedWithTheStepsAroundIt) {
  UpdateEngine engine(MakeCpuBackend({.threads = 1}), &fault_, &retries_);
  const std::vector<uint32_t> tensors = Register(engine, {kNumel});
  std::vector<float> g1 = Values(0.5f), g2 = Values(-0.25f);
  g1.resize(AlignedNumel(kNumel));
  g2.resize(AlignedNumel(kNumel));
  const ReadyPush before = PushOf(tensors, {kNumel}, g1), after = PushOf(tensors, {kNumel}, g2);
  const std::vector<float> param = Values(3.0f), exp_avg = Values(0.125f);
  StateLoad load;  // params and exp_avg, not exp_avg_sq.
  load.writes = {WriteOf(TensorField::kParam, 0, param), WriteOf(TensorField::kExpAvg, 0, exp_avg)};
  load.tensors = {0};
  load.steps = {5};

  absl::StatusOr<StepResult> first, second;
  absl::StatusOr<uint64_t> loaded;
  Notification all[3];
  engine.Step(&before, [&](absl::StatusOr<StepResult> r) {
    first = r;
    all[0].Notify();
  });
  engine.LoadState(&load, [&](absl::StatusOr<uint64_t> v) {
    loaded = v;
    all[1].Notify();
  });
  engine.Step(&after, [&](absl::StatusOr<StepResult> r) {
    second = r;
    all[2].Notify();
  });
  for (Notification& n : all) ASSERT_TRUE(n.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(first.ok() && loaded.ok() && second.ok());
  EXPECT_EQ(first->reply.version, 1u);
  EXPECT_EQ(*loaded, 2u);
  EXPECT_EQ(second->reply.version, 3u);

  // The oracle: the same updates on the host.
  const AdamWHyperparameters h;
  std::vector<float> p(kNumel, 1.0f), m(kNumel, 0.0f), v(kNumel, 0.0f);
  const AdamWStepScalars s1 = MakeStepScalars(h, 1, 0), s6 = MakeStepScalars(h, 6, 0);
  for (uint64_t i = 0; i < kNumel; ++i) AdamWUpdate(s1, g1[i], p[i], m[i], v[i], nullptr);
  p = param;
  m = exp_avg;  // v keeps the first step's values: the load did not name exp_avg_sq.
  for (uint64_t i = 0; i < kNumel; ++i) AdamWUpdate(s6, g2[i], p[i], m[i], v[i], nullptr);
  const State state = StateOf(engine);
  ExpectSameBits(state.fields.at(1), p, "param");
  ExpectSameBits(state.fields.at(2), m, "exp_avg");
  ExpectSameBits(state.fields.at(3), v, "exp_avg_sq");
  EXPECT_EQ(state.steps, (std::vector<int64_t>{6}));
  EXPECT_EQ(state.version, 3u);
}

TEST_F(EngineLoadTest, ALoadIsReadBackExactlyWithItsStepAndVersion) {
  auto backend = MakeCpuBackend({.param_copy_dtype = ParamCopyDType::kBFloat16, .threads = 1});
  UpdateEngine engine(std::move(backend), &fault_, &retries_);
  AdamWHyperparameters amsgrad;
  amsgrad.amsgrad = true;
  ASSERT_TRUE(Sync<bool>([&](UpdateEngine::Done<bool> d) {
                engine.RegisterParamGroup({"ams", amsgrad}, d);
              }).ok());
  std::vector<TensorMeta> metas = {{"a", {static_cast<int64_t>(kNumel)}, 1, kNumel}};
  ASSERT_TRUE(Sync<uint32_t>([&](UpdateEngine::Done<uint32_t> d) {
                engine.BeginRegistration(metas, d);
              }).ok());
  ASSERT_TRUE(Sync<uint64_t>([&](UpdateEngine::Done<uint64_t> d) {
                engine.CommitRegistration("", d);
              }).ok());
  const std::vector<float> values[4] = {Values(-2.0f), Values(0.5f), Values(0.0625f),
                                        Values(0.25f)};
  StateLoad load;
  for (int f = 0; f < 4; ++f) {
    load.writes.push_back(WriteOf(static_cast<TensorField>(f + 1), 0, values[f]));
  }
  load.tensors = {0};
  load.steps = {1000};
  absl::StatusOr<uint64_t> version = Load(engine, load);
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_EQ(*version, 1u);
  const State state = StateOf(engine, /*amsgrad=*/true);
  for (int f = 0; f < 4; ++f) {
    ExpectSameBits(state.fields.at(f + 1), values[f], "field " + std::to_string(f + 1));
  }
  EXPECT_EQ(state.steps, (std::vector<int64_t>{1000}));
  EXPECT_EQ(state.version, 1u);
  // The bf16 copy that pulls read was written with the params.
  std::vector<uint16_t> copy(AlignedNumel(kNumel));
  ReadJob job;
  job.param_copy = true;
  job.tensors = {0};
  job.dst_offsets = {0};
  job.dst = copy.data();
  ASSERT_TRUE(
      Sync<ReadResult>([&](UpdateEngine::Done<ReadResult> d) { engine.Read(job, d); }).ok());
  for (uint64_t i = 0; i < kNumel; ++i) {
    EXPECT_EQ(copy[i], FloatToBFloat16(values[0][i])) << i;
  }
}

TEST_F(EngineLoadTest, ARefusedLoadChangesNothing) {
  UpdateEngine engine(MakeCpuBackend({.threads = 1}), &fault_, &retries_);
  const std::vector<uint32_t> tensors = Register(engine, {kNumel});
  std::vector<float> grads = Values(0.5f);
  grads.resize(AlignedNumel(kNumel));
  const ReadyPush push = PushOf(tensors, {kNumel}, grads);
  ASSERT_TRUE(
      Sync<StepResult>([&](UpdateEngine::Done<StepResult> d) { engine.Step(&push, d); }).ok());
  const std::vector<float> good = Values(7.0f), long_values(kNumel + 1, 1.0f);
  struct Case {
    const char* name;
    StateLoad load;
    absl::StatusCode code;
  };
  std::vector<Case> cases;
  // Each bad load starts with a good write, which must not happen either.
  const auto with = [&](WriteRequest bad, std::vector<int64_t> steps = {3}) {
    StateLoad load;
    load.writes = {WriteOf(TensorField::kParam, 0, good), bad};
    load.tensors = {0};
    load.steps = std::move(steps);
    return load;
  };
  cases.push_back({"past the end", with(WriteOf(TensorField::kExpAvg, 0, long_values)),
                   absl::StatusCode::kInvalidArgument});
  cases.push_back({"offset past the end", with(WriteOf(TensorField::kExpAvg, 0, good, 1)),
                   absl::StatusCode::kInvalidArgument});
  cases.push_back({"unknown tensor", with(WriteOf(TensorField::kExpAvg, 1, good)),
                   absl::StatusCode::kInvalidArgument});
  cases.push_back({"unknown field", with(WriteOf(static_cast<TensorField>(7), 0, good)),
                   absl::StatusCode::kInvalidArgument});
  WriteRequest copy = WriteOf(TensorField::kParam, 0, good);
  copy.param_copy = true;
  cases.push_back({"param copy", with(copy), absl::StatusCode::kInvalidArgument});
  cases.push_back({"max_exp_avg_sq without amsgrad",
                   with(WriteOf(TensorField::kMaxExpAvgSq, 0, good)),
                   absl::StatusCode::kFailedPrecondition});
  cases.push_back({"negative step", with(WriteOf(TensorField::kExpAvg, 0, good), {-1}),
                   absl::StatusCode::kInvalidArgument});
  cases.push_back({"steps of other tensors", with(WriteOf(TensorField::kExpAvg, 0, good), {}),
                   absl::StatusCode::kInvalidArgument});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const State before = StateOf(engine);
    absl::StatusOr<uint64_t> version = Load(engine, c.load);
    EXPECT_EQ(version.status().code(), c.code) << version.status();
    ExpectSameState(StateOf(engine), before);
  }
  EXPECT_TRUE(fault_.status().ok());
  absl::StatusOr<uint64_t> version = Load(engine, with(WriteOf(TensorField::kExpAvg, 0, good)));
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_EQ(*version, 2u);
}

ConsistencyOptions SyncMode(uint32_t k) {
  ConsistencyOptions c;
  c.mode = ConsistencyMode::kSync;
  c.replicas_to_aggregate = k;
  c.total_replicas = k;
  c.round_timeout = absl::ZeroDuration();  // The test's pushes have no arrival time.
  return c;
}

// A round's sums were taken from the values a load would replace: the load waits for a round
// without pushes. A load between rounds is a version of its own.
TEST_F(EngineLoadTest, SyncModeRefusesALoadWhileARoundHoldsPushes) {
  UpdateEngine engine(MakeCpuBackend({.threads = 1}), &fault_, &retries_, SyncMode(2));
  const std::vector<uint32_t> tensors = Register(engine, {kNumel});
  std::vector<float> grads = Values(0.5f);
  grads.resize(AlignedNumel(kNumel));
  const ReadyPush a = PushOf(tensors, {kNumel}, grads, "a", 1);
  const ReadyPush b = PushOf(tensors, {kNumel}, grads, "b", 1);
  absl::StatusOr<StepResult> a_result;
  Notification a_done;
  engine.Step(&a, [&](absl::StatusOr<StepResult> r) {
    a_result = r;
    a_done.Notify();
  });
  const std::vector<float> values = Values(9.0f);
  StateLoad load;
  load.writes = {WriteOf(TensorField::kParam, 0, values)};
  load.tensors = {0};
  load.steps = {4};
  const State before = StateOf(engine);
  absl::StatusOr<uint64_t> refused = Load(engine, load);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("sync round"), std::string::npos);
  ExpectSameState(StateOf(engine), before);

  ASSERT_TRUE(Sync<StepResult>([&](UpdateEngine::Done<StepResult> d) { engine.Step(&b, d); }).ok());
  ASSERT_TRUE(a_done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(a_result.ok()) << a_result.status();
  EXPECT_EQ(a_result->reply.version, 1u);
  absl::StatusOr<uint64_t> version = Load(engine, load);
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_EQ(*version, 2u);
  ExpectSameBits(ReadField(engine, TensorField::kParam, 0), values, "param");
  // The next round is at the load's version: a push computed before the load is stale.
  ReadyPush stale = PushOf(tensors, {kNumel}, grads, "a", 2);
  stale.base_version = 1;
  absl::StatusOr<StepResult> aborted =
      Sync<StepResult>([&](UpdateEngine::Done<StepResult> d) { engine.Step(&stale, d); });
  EXPECT_EQ(aborted.status().code(), absl::StatusCode::kAborted) << aborted.status();
}

// A backend whose writes fail as a device would (a failed cudaMemcpyAsync).
class FailingWrites final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  absl::Status Write(const WriteRequest&) override {
    return absl::InternalError("cudaMemcpyAsync: an illegal memory access was encountered");
  }
};

TEST_F(EngineLoadTest, ADeviceFaultDuringALoadStopsTheShard) {
  UpdateEngine engine(std::make_unique<FailingWrites>(MakeCpuBackend({.threads = 1})), &fault_,
                      &retries_);
  const std::vector<uint32_t> tensors = Register(engine, {kNumel});
  const std::vector<float> values = Values(1.5f);
  StateLoad load;
  load.writes = {WriteOf(TensorField::kExpAvg, 0, values)};
  load.tensors = {0};
  load.steps = {1};
  absl::StatusOr<uint64_t> failed = Load(engine, load);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kInternal) << failed.status();
  EXPECT_FALSE(fault_.status().ok());
  std::vector<float> grads = Values(0.5f);
  grads.resize(AlignedNumel(kNumel));
  const ReadyPush push = PushOf(tensors, {kNumel}, grads);
  absl::StatusOr<StepResult> after =
      Sync<StepResult>([&](UpdateEngine::Done<StepResult> d) { engine.Step(&push, d); });
  EXPECT_EQ(after.status().code(), absl::StatusCode::kUnavailable) << after.status();
  EXPECT_EQ(Load(engine, load).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace fusedps
