// shard_files_test_util.h: the shard that shard_files_test and manifest_test checkpoint and
// restore: every storage (fp32, bf16 and int8 state, with a tensor too small to quantize; bf16
// params with stochastic rounding; amsgrad; a param copy), registered and stepped three times
// (ShardFilesTest::SetUp), and what a test compares (StoredStateOf: every stored byte).
#ifndef FUSEDPS_SERVER_CHECKPOINT_SHARD_FILES_TEST_UTIL_H_
#define FUSEDPS_SERVER_CHECKPOINT_SHARD_FILES_TEST_UTIL_H_

#include <unistd.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/checkpoint/checkpointer.h"
#include "server/checkpoint/manifest.h"
#include "server/checkpoint/shard_files.h"

namespace fusedps::checkpoint::test_util {

namespace fs = std::filesystem;

template <typename T, typename Submit>
absl::StatusOr<T> Wait(Submit submit) {
  return UpdateEngine::Wait<T>(submit);
}

struct GroupDef {
  const char* name;
  StateDType state;
  ParamsDType params;
  bool amsgrad;
  uint64_t seed;
};
// Index order: "default" is group 0 and keeps torch's defaults.
inline const GroupDef kGroups[] = {
    {"ams", StateDType::kFloat32, ParamsDType::kFloat32, true, 0},
    {"half", StateDType::kBFloat16, ParamsDType::kFloat32, false, 0},
    {"int8", StateDType::kInt8, ParamsDType::kFloat32, false, 0},
    {"sr8", StateDType::kInt8, ParamsDType::kBFloat16, false, 99},
    {"sr32", StateDType::kFloat32, ParamsDType::kBFloat16, false, 7}};

struct TensorDef {
  const char* name;
  int64_t numel;
  uint32_t group;
};
// Sizes off every multiple that matters (8, 256), one int8-group tensor under 4096 elements in
// each int8 group, and a bf16 one of odd size before fp32 ones in the same file.
inline const TensorDef kTensors[] = {{"a", 1000, 0},    {"m", 37, 1},        {"h", 3001, 2},
                                     {"q", 5000, 3},    {"q_small", 100, 3}, {"p", 4099, 4},
                                     {"p_small", 7, 4}, {"r", 333, 5},       {"z", 0, 3}};

inline uint64_t GradsNumel() {
  uint64_t n = 0;
  for (const TensorDef& t : kTensors) n += AlignedNumel(static_cast<uint64_t>(t.numel));
  return n;
}

// Every field of every tensor in its stored form, the param copy, the steps and the version.
inline std::string StoredStateOf(UpdateEngine& engine) {
  std::string state;
  const std::shared_ptr<const ShardView> view = engine.view();
  for (uint32_t t = 0; t < view->tensor_count(); ++t) {
    const TensorLayout layout = view->layout(t);
    const uint64_t numel = view->tensor(t).numel;
    for (TensorField field :
         {TensorField::kParam, TensorField::kExpAvg, TensorField::kExpAvgSq,
          TensorField::kMaxExpAvgSq, TensorField::kExpAvgAbsmax, TensorField::kExpAvgSqAbsmax}) {
      const bool amsgrad = view->groups()[view->tensor(t).group].hyperparameters.amsgrad;
      if (field == TensorField::kMaxExpAvgSq && !amsgrad) continue;
      const uint64_t bytes = StoredCount(layout, field, numel) * StoredElementBytes(layout, field);
      if ((field == TensorField::kExpAvgAbsmax || field == TensorField::kExpAvgSqAbsmax) &&
          layout.state != StateDType::kInt8) {
        continue;
      }
      std::string values(bytes, '\0');
      ReadJob job{field, false, {t}, {0}, values.data(), 0, /*stored=*/true};
      absl::StatusOr<ReadResult> read =
          Wait<ReadResult>([&](auto done) { engine.Read(job, done); });
      EXPECT_TRUE(read.ok()) << read.status();
      absl::StrAppend(&state, view->tensor(t).name, ".", TensorFieldName(field), "=", values,
                      "|step ", read.ok() ? read->steps[0] : -1, "|");
    }
    if (layout.params == ParamsDType::kFloat32) {
      std::string copy(numel * 2, '\0');
      ReadJob job{TensorField::kParam, true, {t}, {0}, copy.data(), 0};
      EXPECT_TRUE(Wait<ReadResult>([&](auto done) { engine.Read(job, done); }).ok());
      absl::StrAppend(&state, "copy=", copy, "|");
    }
  }
  return absl::StrCat(state, "version ", engine.version());
}

struct Shard {
  Shard() = default;
  ShardFault fault;
  RetryTable retries{100};
  UpdateEngine engine{MakeCpuBackend({.param_copy_dtype = ParamCopyDType::kBFloat16, .threads = 2}),
                      &fault, &retries};
  Metrics metrics{{"test", "cpu", "cpu"}, [] { return ShardMetrics{}; }};
};

inline void Register(UpdateEngine& engine) {
  for (const GroupDef& g : kGroups) {
    ParamGroupSpec group{g.name, AdamWHyperparameters{}};
    group.hyperparameters.lr = 0.01;
    group.hyperparameters.amsgrad = g.amsgrad;
    group.hyperparameters.state_dtype = g.state;
    group.hyperparameters.params_dtype = g.params;
    group.hyperparameters.rounding_seed = g.seed;
    ASSERT_TRUE(Wait<bool>([&](auto done) { engine.RegisterParamGroup(group, done); }).ok());
  }
  std::vector<TensorMeta> metas;
  for (const TensorDef& t : kTensors) {
    metas.push_back({t.name, {t.numel}, t.group, static_cast<uint64_t>(t.numel)});
  }
  ASSERT_TRUE(Wait<uint32_t>([&](auto done) { engine.BeginRegistration(metas, done); }).ok());
  std::vector<std::vector<float>> values;
  std::vector<ParamWrite> writes;
  for (uint32_t i = 0; i < metas.size(); ++i) {
    values.emplace_back(metas[i].numel);
    for (uint64_t k = 0; k < metas[i].numel; ++k) {
      values.back()[k] = 0.001f * static_cast<float>((k * 7919 + i * 104729) % 2001) - 1.0f;
    }
    writes.push_back({i, 0, values.back().data(), metas[i].numel});
  }
  ASSERT_TRUE(Wait<bool>([&](auto done) { engine.WriteParams(writes, done); }).ok());
  ASSERT_TRUE(Wait<uint64_t>([&](auto done) { engine.CommitRegistration("", done); }).ok());
}

// One push of every tensor, with gradients that differ by step.
inline void Step(UpdateEngine& engine, int seed) {
  std::vector<float> grads(GradsNumel());
  for (size_t k = 0; k < grads.size(); ++k) {
    grads[k] =
        0.0001f * static_cast<float>((k * 31 + static_cast<size_t>(seed) * 977) % 1999) - 0.1f;
  }
  ReadyPush push;
  uint64_t offset = 0;
  for (uint32_t i = 0; i < std::size(kTensors); ++i) {
    push.tensors.push_back(i);
    push.grad_offsets.push_back(offset);
    offset += AlignedNumel(static_cast<uint64_t>(kTensors[i].numel));
  }
  push.grads = grads.data();
  absl::StatusOr<StepResult> r = Wait<StepResult>([&](auto done) { engine.Step(&push, done); });
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_FALSE(r->reply.skipped);
}

inline absl::Status RestoreFrom(const Loaded& checkpoint, UpdateEngine& engine) {
  absl::StatusOr<std::unique_ptr<ShardReader>> reader =
      ShardReader::Open(checkpoint, &engine, /*slot_bytes=*/1000);
  if (!reader.ok()) return reader.status();
  return Wait<uint64_t>(
             [&](auto done) { engine.Restore(&(*reader)->shard(), reader->get(), done); })
      .status();
}

// `checkpoint`'s manifest after `change` to its JSON: the message (format 4's, whatever format
// it was read from) printed as format 4's JSON, changed (perhaps into another format's JSON),
// then parsed as the reader parses manifest.json (ParseManifest). ParseManifest's errors.
inline absl::Status ChangeManifest(Loaded* checkpoint,
                                   const std::function<void(nlohmann::json&)>& change) {
  absl::StatusOr<std::string> text = ManifestToJson(checkpoint->manifest);
  if (!text.ok()) return text.status();
  nlohmann::json m = nlohmann::json::parse(*text);
  change(m);
  absl::StatusOr<v1::CheckpointManifest> parsed =
      ParseManifest(m.dump(1), absl::StrCat(checkpoint->directory, "/", kManifestName));
  if (!parsed.ok()) return parsed.status();
  checkpoint->manifest = *std::move(parsed);
  return absl::OkStatus();
}

class ShardFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = absl::StrCat(fs::temp_directory_path().string(), "/shard_files_test_", getpid(), "_",
                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    ASSERT_NO_FATAL_FAILURE(Register(shard_.engine));
    for (int s = 1; s <= 3; ++s) ASSERT_NO_FATAL_FAILURE(Step(shard_.engine, s));
  }
  void TearDown() override { fs::remove_all(root_); }

  // A checkpoint of the shard as it is; fenced through a buffer smaller than the shard.
  Loaded Checkpoint(bool fenced) {
    CheckpointerOptions options;
    options.root = root_;
    options.host_buffer_bytes = fenced ? 30000 : 0;
    Checkpointer checkpointer(&shard_.engine, &shard_.metrics, options);
    checkpointer.Start();
    absl::StatusOr<CheckpointResult> result = checkpointer.CheckpointNow();
    EXPECT_TRUE(result.ok()) << result.status();
    absl::StatusOr<Loaded> loaded = ReadManifest(result.ok() ? result->path : root_);
    EXPECT_TRUE(loaded.ok()) << loaded.status();
    return loaded.ok() ? *loaded : Loaded{};
  }

  // ShardReader::Open's verdict on `checkpoint` after `change` to its manifest's JSON (as
  // ChangeManifest), or ParseManifest's.
  static absl::Status OpenChanged(Loaded checkpoint,
                                  const std::function<void(nlohmann::json&)>& change) {
    if (absl::Status s = ChangeManifest(&checkpoint, change); !s.ok()) return s;
    Shard fresh;
    return ShardReader::Open(checkpoint, &fresh.engine).status();
  }

  // A fresh engine of one more group and `metas` (params zero, no step), checkpointed under
  // root_ + suffix; returns the checkpoint read back.
  static void RegisterAndCheckpoint(Shard& plain, const ParamGroupSpec& group,
                                    const std::vector<TensorMeta>& metas, const std::string& root,
                                    Loaded* loaded) {
    ASSERT_TRUE(Wait<bool>([&](auto done) { plain.engine.RegisterParamGroup(group, done); }).ok());
    ASSERT_TRUE(
        Wait<uint32_t>([&](auto done) { plain.engine.BeginRegistration(metas, done); }).ok());
    ASSERT_TRUE(Wait<uint64_t>([&](auto done) { plain.engine.CommitRegistration("", done); }).ok());
    CheckpointerOptions options;
    options.root = root;
    absl::StatusOr<CheckpointResult> result;
    {
      Checkpointer checkpointer(&plain.engine, &plain.metrics, options);
      checkpointer.Start();
      result = checkpointer.CheckpointNow();
    }
    ASSERT_TRUE(result.ok()) << result.status();
    absl::StatusOr<Loaded> read = ReadManifest(result->path);
    ASSERT_TRUE(read.ok()) << read.status();
    *loaded = *std::move(read);
  }

  std::string root_;
  Shard shard_;
};

}  // namespace fusedps::checkpoint::test_util

#endif  // FUSEDPS_SERVER_CHECKPOINT_SHARD_FILES_TEST_UTIL_H_
