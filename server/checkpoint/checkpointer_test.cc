// The checkpointer under concurrency (also run under ASan and TSan): steps from several threads,
// checkpoints on demand from several others, the timer and the version trigger all at once, in
// full and fenced mode; the last checkpoint, restored into a fresh engine, is the shard bit for
// bit, retry table included.
#include "server/checkpoint/checkpointer.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/checkpoint/shard_files.h"
#include "server/checkpoint/shard_files_test_util.h"  // RestoreFrom

namespace fusedps::checkpoint {
namespace {

using test_util::RestoreFrom;

namespace fs = std::filesystem;

template <typename T, typename Submit>
absl::StatusOr<T> Wait(Submit submit) {
  return UpdateEngine::Wait<T>(submit);
}

constexpr uint64_t kSizes[] = {1000, 37, 4096};
constexpr char kPlanHash[] = "0123456789abcdef0123456789abcdef";  // A sharded shard's.

void Register(UpdateEngine& engine) {
  ParamGroupSpec group{"ams", AdamWHyperparameters{}};
  group.hyperparameters.amsgrad = true;
  ASSERT_TRUE(Wait<bool>([&](auto done) { engine.RegisterParamGroup(group, done); }).ok());
  std::vector<TensorMeta> metas;
  for (size_t i = 0; i < 3; ++i) {
    metas.push_back({absl::StrCat("t", i),
                     {static_cast<int64_t>(kSizes[i])},
                     static_cast<uint32_t>(i % 2),
                     kSizes[i]});
  }
  ASSERT_TRUE(Wait<uint32_t>([&](auto done) { engine.BeginRegistration(metas, done); }).ok());
  std::vector<std::vector<float>> values;
  std::vector<ParamWrite> writes;
  for (uint32_t i = 0; i < 3; ++i) {
    values.emplace_back(kSizes[i], 0.5f + static_cast<float>(i));
    writes.push_back({i, 0, values.back().data(), kSizes[i]});
  }
  ASSERT_TRUE(Wait<bool>([&](auto done) { engine.WriteParams(writes, done); }).ok());
  ASSERT_TRUE(Wait<uint64_t>([&](auto done) { engine.CommitRegistration(kPlanHash, done); }).ok());
}

// Every field of every tensor, and the steps, as one byte string.
std::string StateOf(UpdateEngine& engine) {
  std::string state;
  const std::shared_ptr<const ShardView> view = engine.view();
  for (TensorField field : {TensorField::kParam, TensorField::kExpAvg, TensorField::kExpAvgSq,
                            TensorField::kMaxExpAvgSq}) {
    for (uint32_t t = 0; t < view->tensor_count(); ++t) {
      if (field == TensorField::kMaxExpAvgSq && view->tensor(t).group != 1) continue;
      std::vector<float> values(view->tensor(t).numel);
      ReadJob job{field, false, {t}, {0}, values.data(), 0};
      absl::StatusOr<ReadResult> read =
          Wait<ReadResult>([&](auto done) { engine.Read(job, done); });
      EXPECT_TRUE(read.ok()) << read.status();
      state.append(reinterpret_cast<const char*>(values.data()), values.size() * 4);
      state.append(absl::StrCat("|step ", read->steps[0], "|"));
    }
  }
  return absl::StrCat(state, "version ", engine.version());
}

// A shard on the CPU backend (registered, or empty for a restore), and the metrics a
// checkpointer records into.
struct Shard {
  explicit Shard(bool registered = true) {
    if (registered) Register(engine);
  }
  ShardFault fault;
  RetryTable retries{100};
  UpdateEngine engine{MakeCpuBackend({.threads = 2}), &fault, &retries};
  Metrics metrics{{"test", "cpu", "cpu"}, [] { return ShardMetrics{}; }};
};

class CheckpointerStressTest : public ::testing::TestWithParam<bool> {};

TEST_P(CheckpointerStressTest, StepsAndCheckpointsAtOnceRestoreExactly) {
  const bool fenced = GetParam();
  const std::string root = absl::StrCat(fs::temp_directory_path().string(), "/checkpointer_test_",
                                        getpid(), "_", fenced);
  fs::remove_all(root);
  Shard shard;
  UpdateEngine& engine = shard.engine;
  CheckpointerOptions options;
  options.root = root;
  options.keep = 2;
  options.interval = absl::Milliseconds(5);
  options.every_versions = 3;
  options.host_buffer_bytes = fenced ? 20000 : 0;  // Fenced: smaller than the shard.
  {
    // A sync round's reply: its retry after a restart must say how many pushes it averaged.
    PushReply round_reply;
    round_reply.round_workers = 3;
    ASSERT_EQ(shard.retries.Begin("sync-trainer", 9).kind, RetryTable::Kind::kNew);
    shard.retries.Finish("sync-trainer", 9, round_reply);
    Checkpointer checkpointer(&engine, &shard.metrics, options);
    checkpointer.Start();
    constexpr int kPushers = 2, kSteps = 60;
    std::vector<float> grads(
        AlignedNumel(kSizes[0]) + AlignedNumel(kSizes[1]) + AlignedNumel(kSizes[2]), 0.25f);
    std::atomic<int> pushing{kPushers};
    std::vector<std::thread> threads;
    for (int p = 0; p < kPushers; ++p) {
      threads.emplace_back([&, p] {
        for (int s = 1; s <= kSteps; ++s) {
          ReadyPush push;
          push.client_id = absl::StrCat("trainer-", p);
          push.sequence_number = static_cast<uint64_t>(s);
          push.tensors = {0, 1, 2};
          push.grad_offsets = {0, AlignedNumel(kSizes[0]),
                               AlignedNumel(kSizes[0]) + AlignedNumel(kSizes[1])};
          push.grads = grads.data();
          absl::StatusOr<StepResult> r =
              Wait<StepResult>([&](auto done) { engine.Step(&push, done); });
          EXPECT_TRUE(r.ok()) << r.status();
        }
        --pushing;
      });
    }
    for (int c = 0; c < 2; ++c) {
      threads.emplace_back([&] {
        uint64_t last = 0;
        while (pushing > 0) {
          absl::StatusOr<CheckpointResult> r = checkpointer.CheckpointNow();
          ASSERT_TRUE(r.ok()) << r.status();
          EXPECT_GE(r->version, last);
          last = r->version;
        }
      });
    }
    for (std::thread& t : threads) t.join();
    absl::StatusOr<CheckpointResult> last = checkpointer.CheckpointNow();
    ASSERT_TRUE(last.ok()) << last.status();
    EXPECT_EQ(last->version, uint64_t{kPushers * kSteps});

    // The last checkpoint, into a fresh engine.
    absl::StatusOr<Loaded> loaded = ReadManifest(last->path);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    Shard restored(/*registered=*/false);
    ASSERT_TRUE(RestoreFrom(*loaded, restored.engine).ok());
    EXPECT_EQ(StateOf(restored.engine), StateOf(engine));
    EXPECT_EQ(restored.engine.view()->plan_hash(), kPlanHash);
    for (int p = 0; p < kPushers; ++p) {
      const std::string id = absl::StrCat("trainer-", p);
      EXPECT_EQ(restored.retries.Lookup(id, kSteps).kind, RetryTable::Kind::kDone);
      EXPECT_EQ(restored.retries.Lookup(id, kSteps).reply.version,
                shard.retries.Lookup(id, kSteps).reply.version);
      EXPECT_EQ(restored.retries.Lookup(id, kSteps + 1).kind, RetryTable::Kind::kNew);
    }
    const RetryTable::Verdict round = restored.retries.Lookup("sync-trainer", 9);
    EXPECT_EQ(round.kind, RetryTable::Kind::kDone);
    EXPECT_EQ(round.reply.round_workers, 3u);
    EXPECT_LE(ListCheckpoints(root).size(), 3u) << "keep 2, and at most one being written";
  }
  fs::remove_all(root);
}

// The failures of a checkpoint directory that cannot be written, counted in the metrics.
double IoFailures(const Metrics& metrics) {
  const std::string text = metrics.ScrapeText();
  const std::string key = "fusedps_checkpoint_failures_total{model=\"default\",reason=\"io\"} ";
  const size_t at = text.find(key);
  return at == std::string::npos ? -1 : std::stod(text.substr(at + key.size()));
}

TEST(CheckpointerTest, AFailingCheckpointWaitsForTheNextTriggerInsteadOfRetryingInALoop) {
  const std::string root =
      absl::StrCat(fs::temp_directory_path().string(), "/checkpointer_test_file_", getpid());
  { std::ofstream(root) << "a file, not a directory"; }
  Shard shard;
  UpdateEngine& engine = shard.engine;
  CheckpointerOptions options;
  options.root = root;
  options.every_versions = 2;
  Checkpointer checkpointer(&engine, &shard.metrics, options);
  checkpointer.Start();
  std::vector<float> grads(8192, 0.25f);
  ReadyPush push;
  push.tensors = {0};
  push.grad_offsets = {0};
  push.grads = grads.data();
  for (int s = 0; s < 4; ++s) {
    ASSERT_TRUE(Wait<StepResult>([&](auto done) { engine.Step(&push, done); }).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  // Versions 2 and 4 triggered one try each.
  EXPECT_GE(IoFailures(shard.metrics), 1);
  EXPECT_LE(IoFailures(shard.metrics), 2);
  fs::remove(root);
}

// A restore streams values into the engine before the last file's checksum is known: one that
// fails it is undone, and the engine restores an older checkpoint as if nothing had happened.
TEST(CheckpointerTest, ARestoreThatFailsItsChecksumIsUndoneAndAnOlderOneLoads) {
  const std::string root =
      absl::StrCat(fs::temp_directory_path().string(), "/checkpointer_test_undo_", getpid());
  fs::remove_all(root);
  Shard shard;
  UpdateEngine& engine = shard.engine;
  CheckpointerOptions options;
  options.root = root;
  Checkpointer checkpointer(&engine, &shard.metrics, options);
  checkpointer.Start();
  std::vector<float> grads(8192, 0.25f);
  ReadyPush push;
  push.tensors = {0, 2};
  push.grad_offsets = {0, AlignedNumel(kSizes[0])};
  push.grads = grads.data();
  ASSERT_TRUE(Wait<StepResult>([&](auto done) { engine.Step(&push, done); }).ok());
  absl::StatusOr<CheckpointResult> older = checkpointer.CheckpointNow();
  ASSERT_TRUE(older.ok()) << older.status();
  const std::string older_state = StateOf(engine);
  ASSERT_TRUE(Wait<StepResult>([&](auto done) { engine.Step(&push, done); }).ok());
  absl::StatusOr<CheckpointResult> newer = checkpointer.CheckpointNow();
  ASSERT_TRUE(newer.ok()) << newer.status();

  // The last byte of the newer checkpoint's exp_avg_sq: its other values upload first.
  const std::string file = newer->path + "/exp_avg_sq.safetensors";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    const char last = static_cast<char>(f.get());
    f.seekp(-1, std::ios::end);
    f.put(static_cast<char>(last ^ 0x10));
  }
  Shard restored(/*registered=*/false);
  absl::StatusOr<Loaded> bad = ReadManifest(newer->path);
  ASSERT_TRUE(bad.ok()) << bad.status();
  const absl::Status failed = RestoreFrom(*bad, restored.engine);
  EXPECT_EQ(failed.code(), absl::StatusCode::kDataLoss) << failed;
  EXPECT_NE(failed.message().find(file), std::string::npos) << failed;
  EXPECT_EQ(restored.engine.view()->tensor_count(), 0u);
  EXPECT_EQ(restored.engine.version(), 0u);

  absl::StatusOr<Loaded> good = ReadManifest(older->path);
  ASSERT_TRUE(good.ok()) << good.status();
  ASSERT_TRUE(RestoreFrom(*good, restored.engine).ok());
  EXPECT_EQ(StateOf(restored.engine), older_state);
  fs::remove_all(root);
}

INSTANTIATE_TEST_SUITE_P(FullAndFenced, CheckpointerStressTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "fenced" : "full"; });

}  // namespace
}  // namespace fusedps::checkpoint
