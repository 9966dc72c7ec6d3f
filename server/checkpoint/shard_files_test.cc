// Checkpoints of a shard that mixes every storage (format_version 2): fp32, bf16 and int8 state
// (with a tensor too small to quantize), bf16 params with stochastic rounding, amsgrad, and a
// param copy. A checkpoint restored into a fresh engine holds every stored byte as it was
// (codes and scales included), full and fenced, in small read buffers; the next step after the
// restore gives the same bits as the next step of the original. The files hold each entry in
// its stored form and dtype, the manifest the groups' storage, each tensor's layout and the
// int8 codebooks; the reader refuses a manifest or file that disagrees with them (DATA_LOSS),
// and still reads a manifest without the storage keys (written before they existed) as fp32.
#include "server/checkpoint/shard_files.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/file_io.h"
#include "gtest/gtest.h"
#include "kernels/quant_math.h"
#include "server/checkpoint/checkpointer.h"
#include "server/schema/hyperparameters.h"

namespace fusedps::checkpoint {
namespace {

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
const GroupDef kGroups[] = {{"ams", StateDType::kFloat32, ParamsDType::kFloat32, true, 0},
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
const TensorDef kTensors[] = {{"a", 1000, 0},    {"m", 37, 1},        {"h", 3001, 2},
                              {"q", 5000, 3},    {"q_small", 100, 3}, {"p", 4099, 4},
                              {"p_small", 7, 4}, {"r", 333, 5},       {"z", 0, 3}};

uint64_t GradsNumel() {
  uint64_t n = 0;
  for (const TensorDef& t : kTensors) n += AlignedNumel(static_cast<uint64_t>(t.numel));
  return n;
}

// Every field of every tensor in its stored form, the param copy, the steps and the version.
std::string StoredStateOf(UpdateEngine& engine) {
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

void Register(UpdateEngine& engine) {
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
void Step(UpdateEngine& engine, int seed) {
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

absl::Status RestoreFrom(const Loaded& checkpoint, UpdateEngine& engine) {
  absl::StatusOr<std::unique_ptr<ShardReader>> reader =
      ShardReader::Open(checkpoint, &engine, /*slot_bytes=*/1000);
  if (!reader.ok()) return reader.status();
  return Wait<uint64_t>(
             [&](auto done) { engine.Restore(&(*reader)->shard(), reader->get(), done); })
      .status();
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

  // ShardReader::Open's verdict on `checkpoint` after `change` to its manifest.
  absl::Status OpenChanged(Loaded checkpoint, const std::function<void(nlohmann::json&)>& change) {
    change(checkpoint.manifest);
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

class RoundTripTest : public ShardFilesTest, public ::testing::WithParamInterface<bool> {};

TEST_P(RoundTripTest, EveryStoredByteComesBackAndTheNextStepsAgree) {
  const Loaded checkpoint = Checkpoint(/*fenced=*/GetParam());
  Shard restored;
  const absl::Status restore = RestoreFrom(checkpoint, restored.engine);
  ASSERT_TRUE(restore.ok()) << restore;
  const std::string before = StoredStateOf(shard_.engine);
  EXPECT_EQ(StoredStateOf(restored.engine), before);
  const std::shared_ptr<const ShardView> view = restored.engine.view();
  ASSERT_EQ(view->groups().size(), std::size(kGroups) + 1);
  for (size_t g = 0; g < std::size(kGroups); ++g) {
    const AdamWHyperparameters& h = view->groups()[g + 1].hyperparameters;
    EXPECT_EQ(h.state_dtype, kGroups[g].state) << kGroups[g].name;
    EXPECT_EQ(h.params_dtype, kGroups[g].params) << kGroups[g].name;
    EXPECT_EQ(h.rounding_seed, kGroups[g].seed) << kGroups[g].name;
    EXPECT_EQ(h.amsgrad, kGroups[g].amsgrad) << kGroups[g].name;
  }
  // Stochastic rounding's bits depend on the tensor's name, its step and the seed, all of
  // which the checkpoint holds: the same steps give the same bits.
  for (int s = 4; s <= 5; ++s) {
    ASSERT_NO_FATAL_FAILURE(Step(shard_.engine, s));
    ASSERT_NO_FATAL_FAILURE(Step(restored.engine, s));
  }
  const std::string after = StoredStateOf(shard_.engine);
  EXPECT_NE(after, before);
  EXPECT_EQ(StoredStateOf(restored.engine), after);
}

INSTANTIATE_TEST_SUITE_P(FullAndFenced, RoundTripTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "fenced" : "full"; });

// The dtype and shape of every entry of a file, in data order: "name:DTYPE[dims]".
std::vector<std::string> EntriesOf(const Loaded& checkpoint, const std::string& file) {
  absl::StatusOr<safetensors::File> f = safetensors::File::Read(checkpoint.directory + "/" + file);
  EXPECT_TRUE(f.ok()) << f.status();
  std::vector<std::string> out;
  if (!f.ok()) return out;
  for (const safetensors::Entry& e : f->entries()) {
    std::string dims;
    for (int64_t d : e.shape) absl::StrAppend(&dims, dims.empty() ? "" : ",", d);
    out.push_back(absl::StrCat(e.name, ":", safetensors::DTypeName(e.dtype), "[", dims, "]"));
  }
  return out;
}

TEST_F(ShardFilesTest, FilesHoldTheStoredFormAndTheManifestItsLayout) {
  const Loaded c = Checkpoint(/*fenced=*/false);
  using V = std::vector<std::string>;
  // Largest elements first, registration order within each dtype.
  EXPECT_EQ(EntriesOf(c, "params.safetensors"),
            (V{"a:F32[1000]", "m:F32[37]", "h:F32[3001]", "q:F32[5000]", "q_small:F32[100]",
               "z:F32[0]", "p:BF16[4099]", "p_small:BF16[7]", "r:BF16[333]"}));
  EXPECT_EQ(EntriesOf(c, "exp_avg.safetensors"),
            (V{"a:F32[1000]", "m:F32[37]", "q_small:F32[100]", "p_small:F32[7]", "r:F32[333]",
               "z:F32[0]", "h:BF16[3001]", "q:U8[5000]", "p:U8[4099]"}));
  EXPECT_EQ(EntriesOf(c, "exp_avg_sq.safetensors"), EntriesOf(c, "exp_avg.safetensors"));
  EXPECT_EQ(EntriesOf(c, "max_exp_avg_sq.safetensors"), (V{"m:F32[37]"}));
  EXPECT_EQ(EntriesOf(c, "exp_avg_absmax.safetensors"), (V{"q:F32[20]", "p:F32[17]"}));
  EXPECT_EQ(EntriesOf(c, "exp_avg_sq_absmax.safetensors"), (V{"q:F32[20]", "p:F32[17]"}));
  EXPECT_EQ(EntriesOf(c, "param_copy.safetensors"),
            (V{"a:BF16[1000]", "m:BF16[37]", "h:BF16[3001]", "q:BF16[5000]", "q_small:BF16[100]",
               "z:BF16[0]"}));

  const nlohmann::json& m = c.manifest;
  EXPECT_EQ(m["format_version"], 3);
  const nlohmann::json& sr8 = m["param_groups"][4];
  EXPECT_EQ(sr8["name"], "sr8");
  // Protobuf's JSON mapping of fusedps.v1.Hyperparameters: enums by name, uint64 as a string.
  EXPECT_EQ(sr8["hyperparameters"]["state_dtype"], "STATE_DTYPE_INT8");
  EXPECT_EQ(sr8["hyperparameters"]["params_dtype"], "DTYPE_BFLOAT16");
  EXPECT_EQ(sr8["hyperparameters"]["rounding_seed"], "99");
  EXPECT_EQ(sr8["hyperparameters"]["weight_decay_mode"], "WEIGHT_DECAY_MODE_DECOUPLED");
  EXPECT_EQ(sr8["hyperparameters"]["lr"], shard_.engine.view()->groups()[4].hyperparameters.lr);
  EXPECT_EQ(m["param_groups"][0]["hyperparameters"]["state_dtype"], "STATE_DTYPE_FLOAT32");
  EXPECT_EQ(m["param_groups"][2]["hyperparameters"]["state_dtype"], "STATE_DTYPE_BFLOAT16");
  const nlohmann::json& q_small = m["tensors"][4];
  EXPECT_EQ(q_small["name"], "q_small");
  EXPECT_EQ(q_small["state_dtype"], "fp32");  // Under 4096 elements.
  EXPECT_EQ(q_small["params_dtype"], "fp32");
  EXPECT_EQ(m["tensors"][5]["state_dtype"], "int8");
  EXPECT_EQ(m["tensors"][5]["params_dtype"], "bf16");
  // The codebooks, exactly: each JSON number converts back to the server's float.
  const Int8Codebooks& books = DynamicCodebooks();
  ASSERT_EQ(m["int8_codebooks"]["exp_avg"].size(), 256u);
  ASSERT_EQ(m["int8_codebooks"]["exp_avg_sq"].size(), 256u);
  for (int i = 0; i < 256; ++i) {
    const float m_value = static_cast<float>(m["int8_codebooks"]["exp_avg"][i].get<double>());
    const float v_value = static_cast<float>(m["int8_codebooks"]["exp_avg_sq"][i].get<double>());
    EXPECT_EQ(FloatToBits(m_value), FloatToBits(books.exp_avg.values[i])) << i;
    EXPECT_EQ(FloatToBits(v_value), FloatToBits(books.exp_avg_sq.values[i])) << i;
  }
}

std::vector<BufferValue> SomeBuffers() {
  const int64_t count = 1234567890123;
  std::string count_bytes(8, '\0');
  std::memcpy(count_bytes.data(), &count, 8);
  std::string mean(12, '\0');
  for (size_t i = 0; i < mean.size(); ++i) mean[i] = static_cast<char>(i * 37 + 1);
  return {{"bn.running_mean", safetensors::DType::kF32, {3}, mean},
          {"bn.num_batches_tracked", safetensors::DType::kI64, {}, count_bytes},
          {"mask", safetensors::DType::kBool, {2, 1}, std::string("\x01\x00", 2)},
          {"empty", safetensors::DType::kF64, {0}, ""}};
}

TEST_F(ShardFilesTest, BuffersComeBackBitForBitAndADamagedBuffersFileIsDataLoss) {
  const Loaded without = Checkpoint(/*fenced=*/false);
  EXPECT_FALSE(without.manifest["files"].contains(kBuffersFileName));
  ASSERT_TRUE(
      Wait<uint64_t>([&](auto done) { shard_.engine.WriteBuffers(SomeBuffers(), done); }).ok());
  for (bool fenced : {false, true}) {
    const Loaded c = Checkpoint(fenced);
    ASSERT_TRUE(c.manifest["files"].contains(kBuffersFileName));
    // By name, each in its own dtype and shape.
    EXPECT_EQ(EntriesOf(c, kBuffersFileName),
              (std::vector<std::string>{"bn.num_batches_tracked:I64[]", "bn.running_mean:F32[3]",
                                        "empty:F64[0]", "mask:BOOL[2,1]"}));
    Shard restored;
    const absl::Status restore = RestoreFrom(c, restored.engine);
    ASSERT_TRUE(restore.ok()) << restore;
    const std::shared_ptr<const BufferSet> buffers = restored.engine.buffers();
    ASSERT_EQ(buffers->size(), 4u);
    for (const BufferValue& want : SomeBuffers()) {
      const BufferValue* got = buffers->Find(want.name);
      ASSERT_NE(got, nullptr) << want.name;
      EXPECT_EQ(got->dtype, want.dtype) << want.name;
      EXPECT_EQ(got->shape, want.shape) << want.name;
      EXPECT_EQ(got->data, want.data) << want.name;
    }
    EXPECT_EQ(StoredStateOf(restored.engine), StoredStateOf(shard_.engine));
  }

  // One flipped bit in the buffers' file: the checkpoint is damaged, naming the file.
  const Loaded c = Checkpoint(/*fenced=*/false);
  const std::string path = c.directory + "/" + kBuffersFileName;
  absl::StatusOr<std::string> bytes = file_io::ReadFile(path);
  ASSERT_TRUE(bytes.ok());
  (*bytes)[bytes->size() - 3] ^= 0x10;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << *bytes;
  Shard restored;
  const absl::Status restore = RestoreFrom(c, restored.engine);
  EXPECT_EQ(restore.code(), absl::StatusCode::kDataLoss) << restore;
  EXPECT_NE(restore.message().find(kBuffersFileName), std::string::npos) << restore;
  EXPECT_TRUE(restored.engine.buffers()->empty());
}

// Another tool may write a file's entries in any order: here params.safetensors with the odd
// bf16 tensors first, so that every fp32 tensor after them starts 2 bytes off a 4-byte
// boundary, read through 1000-byte buffers (cut on element boundaries).
TEST_F(ShardFilesTest, EntriesOfAnyOrderAndAlignmentRestore) {
  Loaded c = Checkpoint(/*fenced=*/false);
  const std::string path = c.directory + "/params.safetensors";
  absl::StatusOr<safetensors::File> file = safetensors::File::Read(path);
  ASSERT_TRUE(file.ok()) << file.status();
  std::vector<safetensors::TensorView> views;
  for (const char* name : {"p_small", "r", "p", "a", "m", "h", "q", "q_small", "z"}) {
    const safetensors::Entry* e = file->Find(name);
    ASSERT_NE(e, nullptr) << name;
    views.push_back({e->name, e->dtype, e->shape, file->Data(*e)});
  }
  absl::StatusOr<safetensors::WriteResult> written = safetensors::WriteFile(path + ".new", views);
  ASSERT_TRUE(written.ok()) << written.status();
  fs::rename(path + ".new", path);
  c.manifest["files"]["params.safetensors"] = {{"bytes", written->bytes},
                                               {"crc32", written->crc32}};
  absl::StatusOr<safetensors::File> reordered = safetensors::File::Read(path);
  ASSERT_TRUE(reordered.ok());
  EXPECT_EQ(reordered->Find("a")->begin % 4, 2u);  // 7 + 333 + 4099 bf16 values before it.
  Shard restored;
  const absl::Status restore = RestoreFrom(c, restored.engine);
  ASSERT_TRUE(restore.ok()) << restore;
  EXPECT_EQ(StoredStateOf(restored.engine), StoredStateOf(shard_.engine));
}

// The manifest as format_version 2 wrote it (docs/checkpoints.md; read since format 3 for the
// checkpoints written before): each hyperparameter a key of its group, weight decay as
// decoupled_weight_decay, the storage by dtype names, rounding_seed a number.
void ToFormatVersion2(nlohmann::json& m) {
  m["format_version"] = 2;
  for (nlohmann::json& g : m["param_groups"]) {
    const nlohmann::json h = g["hyperparameters"];
    g.erase("hyperparameters");
    for (const char* key : {"lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad", "maximize"}) {
      g[key] = h.at(key);
    }
    g["decoupled_weight_decay"] = h.at("weight_decay_mode") != "WEIGHT_DECAY_MODE_L2";
    const std::map<std::string, std::string> names = {{"STATE_DTYPE_FLOAT32", "fp32"},
                                                      {"STATE_DTYPE_BFLOAT16", "bf16"},
                                                      {"STATE_DTYPE_INT8", "int8"},
                                                      {"DTYPE_FLOAT32", "fp32"},
                                                      {"DTYPE_BFLOAT16", "bf16"}};
    g["state_dtype"] = names.at(h.at("state_dtype"));
    g["params_dtype"] = names.at(h.at("params_dtype"));
    g["rounding_seed"] = std::stoull(h.at("rounding_seed").get<std::string>());
  }
}

// A checkpoint written before format 3 restores bit for bit, every storage included, and its
// groups come back with the same hyperparameters.
TEST_F(ShardFilesTest, AFormatVersion2ManifestRestoresBitExactly) {
  Loaded c = Checkpoint(/*fenced=*/false);
  ToFormatVersion2(c.manifest);
  ASSERT_FALSE(c.manifest["param_groups"][4].contains("hyperparameters"));
  EXPECT_EQ(c.manifest["param_groups"][4]["state_dtype"], "int8");
  Shard restored;
  const absl::Status restore = RestoreFrom(c, restored.engine);
  ASSERT_TRUE(restore.ok()) << restore;
  EXPECT_EQ(StoredStateOf(restored.engine), StoredStateOf(shard_.engine));
  const auto& before = shard_.engine.view()->groups();
  const auto& after = restored.engine.view()->groups();
  ASSERT_EQ(after.size(), before.size());
  for (size_t g = 0; g < before.size(); ++g) {
    EXPECT_EQ(after[g].name, before[g].name);
    EXPECT_TRUE(SameHyperparameters(after[g].hyperparameters, before[g].hyperparameters))
        << before[g].name;
  }
}

struct BadManifest {
  const char* name;
  std::function<void(nlohmann::json&)> change;
  std::vector<std::string> message_has;
};

TEST_F(ShardFilesTest, AManifestThatDisagreesWithTheFilesOrTheServerIsDataLoss) {
  const Loaded c = Checkpoint(/*fenced=*/false);
  const auto drop_tensor_layouts = [](nlohmann::json& m) {
    for (nlohmann::json& t : m["tensors"]) {
      t.erase("state_dtype");
      t.erase("params_dtype");
    }
  };
  const BadManifest cases[] = {
      {"a codebook value",
       [](nlohmann::json& m) { m["int8_codebooks"]["exp_avg"][5] = 0.5; },
       {"int8_codebooks.exp_avg[5]", "0.5", "not this server's"}},
      {"no codebooks",
       [](nlohmann::json& m) { m.erase("int8_codebooks"); },
       {"lacks \"int8_codebooks\""}},
      {"too few codebook values",
       [](nlohmann::json& m) { m["int8_codebooks"]["exp_avg_sq"].erase(0); },
       {"int8_codebooks.exp_avg_sq", "255 values"}},
      {"an unknown state_dtype",
       [](nlohmann::json& m) { m["param_groups"][3]["hyperparameters"]["state_dtype"] = "fp8"; },
       {"param_groups[3]", "fp8"}},
      {"fp16 params",
       [](nlohmann::json& m) {
         m["param_groups"][4]["hyperparameters"]["params_dtype"] = "DTYPE_FLOAT16";
       },
       {"param_groups[4]", "params_dtype = 3 must be FLOAT32 (1) or BFLOAT16 (2)"}},
      {"a seed that is not a uint64",
       [](nlohmann::json& m) { m["param_groups"][4]["hyperparameters"]["rounding_seed"] = -1; },
       {"param_groups[4]"}},
      {"amsgrad with int8 state",
       [](nlohmann::json& m) { m["param_groups"][3]["hyperparameters"]["amsgrad"] = true; },
       {"param_groups[3]", "amsgrad needs state_dtype FLOAT32"}},
      {"a hyperparameter the proto lacks",
       [](nlohmann::json& m) { m["param_groups"][1]["hyperparameters"]["learning_rate"] = 1; },
       {"param_groups[1]", "learning_rate"}},
      {"a group without hyperparameters",
       [](nlohmann::json& m) { m["param_groups"][1].erase("hyperparameters"); },
       {"param_groups[1]", "lacks \"hyperparameters\""}},
      {"format_version 2: an unknown state_dtype",
       [](nlohmann::json& m) {
         ToFormatVersion2(m);
         m["param_groups"][3]["state_dtype"] = "fp8";
       },
       {"param_groups[3].state_dtype", "\"fp8\"", "fp32, bf16, int8"}},
      {"format_version 2: a seed that is not a uint64",
       [](nlohmann::json& m) {
         ToFormatVersion2(m);
         m["param_groups"][4]["rounding_seed"] = -1;
       },
       {"param_groups[4].rounding_seed", "wrong type"}},
      {"a tensor's layout unlike its group's",
       [](nlohmann::json& m) { m["tensors"][4]["state_dtype"] = "int8"; },
       {"tensors[4].state_dtype", "is int8", "give fp32"}},
      {"a tensor's params unlike its group's",
       [](nlohmann::json& m) { m["tensors"][7]["params_dtype"] = "fp32"; },
       {"tensors[7].params_dtype", "its group stores bf16"}},
      // The group's state changed, tensors' layouts dropped: the files' dtypes disagree.
      {"files of another state_dtype",
       [&](nlohmann::json& m) {
         drop_tensor_layouts(m);
         m["param_groups"][3]["hyperparameters"]["state_dtype"] = "STATE_DTYPE_BFLOAT16";
       },
       {"exp_avg.safetensors", "'q_small' is F32 [100]", "makes it BF16 [100]"}},
      {"files of another params_dtype",
       [&](nlohmann::json& m) {
         drop_tensor_layouts(m);
         m["param_groups"][5]["hyperparameters"]["params_dtype"] = "DTYPE_FLOAT32";
       },
       {"params.safetensors", "'r' is BF16 [333]", "makes it F32 [333]"}},
      {"another shape",
       [&](nlohmann::json& m) {
         drop_tensor_layouts(m);
         m["tensors"][3]["shape"] = {5001};
       },
       {"'q'", "[5000]", "[5001]"}},
  };
  for (const BadManifest& bad : cases) {
    const absl::Status s = OpenChanged(c, bad.change);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << bad.name << ": " << s;
    for (const std::string& part : bad.message_has) {
      EXPECT_NE(s.message().find(part), std::string::npos)
          << bad.name << ": '" << s.message() << "' lacks '" << part << "'";
    }
  }
  // The manifest as written opens.
  const absl::Status as_written = OpenChanged(c, [](nlohmann::json&) {});
  EXPECT_TRUE(as_written.ok()) << as_written;
}

TEST_F(ShardFilesTest, WithoutInt8StateThereAreNoScalesAndNoCodebooks) {
  // No tensor with int8 state: no scale files, no codebooks; a manifest that still has
  // codebooks must have the server's.
  Shard plain;
  ParamGroupSpec half{"half", AdamWHyperparameters{}};
  half.hyperparameters.state_dtype = StateDType::kBFloat16;
  const std::string root = root_ + "_plain";
  Loaded loaded;
  ASSERT_NO_FATAL_FAILURE(RegisterAndCheckpoint(plain, half, {{"w", {64}, 1, 64}}, root, &loaded));
  const std::string path = loaded.directory;
  EXPECT_FALSE(loaded.manifest.contains("int8_codebooks"));
  EXPECT_FALSE(fs::exists(path + "/exp_avg_absmax.safetensors"));
  EXPECT_FALSE(fs::exists(path + "/exp_avg_sq_absmax.safetensors"));
  EXPECT_EQ(EntriesOf(loaded, "exp_avg.safetensors"), (std::vector<std::string>{"w:BF16[64]"}));
  EXPECT_TRUE(OpenChanged(loaded, [](nlohmann::json&) {}).ok());
  const absl::Status bad = OpenChanged(loaded, [](nlohmann::json& m) {
    m["int8_codebooks"] = Int8CodebooksJson();
    m["int8_codebooks"]["exp_avg_sq"][255] = 2.0;
  });
  EXPECT_EQ(bad.code(), absl::StatusCode::kDataLoss) << bad;
  fs::remove_all(root);
}

// A checkpoint written before the storage keys existed (format_version 2, every field F32)
// restores as an fp32 shard.
TEST_F(ShardFilesTest, AManifestWithoutStorageKeysIsAllFp32) {
  Shard plain;
  ParamGroupSpec ams{"ams", AdamWHyperparameters{}};
  ams.hyperparameters.amsgrad = true;
  const std::string root = root_ + "_legacy";
  Loaded loaded;
  ASSERT_NO_FATAL_FAILURE(
      RegisterAndCheckpoint(plain, ams, {{"w", {5000}, 0, 5000}, {"b", {3}, 1, 3}}, root, &loaded));
  ToFormatVersion2(loaded.manifest);
  for (nlohmann::json& g : loaded.manifest["param_groups"]) {
    g.erase("state_dtype");
    g.erase("params_dtype");
    g.erase("rounding_seed");
  }
  for (nlohmann::json& t : loaded.manifest["tensors"]) {
    t.erase("state_dtype");
    t.erase("params_dtype");
  }
  Shard restored;
  ASSERT_TRUE(RestoreFrom(loaded, restored.engine).ok());
  EXPECT_EQ(StoredStateOf(restored.engine), StoredStateOf(plain.engine));
  EXPECT_TRUE(IsFloat32Layout(restored.engine.view()->layout(0)));
  fs::remove_all(root);
}

}  // namespace
}  // namespace fusedps::checkpoint
