// Checkpoints of a shard that mixes every storage (shard_files_test_util.h): fp32, bf16 and int8
// state (with a tensor too small to quantize), bf16 params with stochastic rounding, amsgrad,
// and a param copy. A checkpoint restored into a fresh engine holds every stored byte as it was
// (codes and scales included), full and fenced, in small read buffers; the next step after the
// restore gives the same bits as the next step of the original. The files hold each entry in
// its stored form and dtype, the manifest (format 4: fusedps.v1.CheckpointManifest's JSON) the
// groups' storage, each tensor's layout and the int8 codebooks; the reader refuses a manifest
// or file that disagrees with them (DATA_LOSS). Formats 2 and 3: manifest_test.cc.
#include "server/checkpoint/shard_files.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/file_io.h"
#include "gtest/gtest.h"
#include "kernels/quant_math.h"
#include "server/checkpoint/shard_files_test_util.h"
#include "server/schema/hyperparameters.h"

namespace fusedps::checkpoint {
namespace {

using test_util::kGroups;
using test_util::RestoreFrom;
using test_util::Shard;
using test_util::ShardFilesTest;
using test_util::Step;
using test_util::StoredStateOf;
using test_util::Wait;
namespace fs = std::filesystem;

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

  // The manifest as written: fusedps.v1.CheckpointManifest in protobuf's JSON mapping, with the
  // proto's field names and every field, defaults too; 64-bit integers as strings.
  absl::StatusOr<std::string> text = file_io::ReadFile(c.directory + "/" + kManifestName);
  ASSERT_TRUE(text.ok()) << text.status();
  const nlohmann::json m = nlohmann::json::parse(*text);
  std::vector<std::string> keys;
  for (const auto& [key, value] : m.items()) keys.push_back(key);
  EXPECT_EQ(keys, (std::vector<std::string>{
                      "created_unix_seconds", "files", "format", "format_version", "int8_codebooks",
                      "param_copy_dtype", "param_groups", "plan_hash", "retry_table", "serial",
                      "server_version", "tensors", "version"}));  // nlohmann sorts them.
  EXPECT_EQ(m["format"], "fusedps-checkpoint");
  EXPECT_EQ(m["format_version"], 4);  // A number: any reader reads it before the rest.
  EXPECT_EQ(m["serial"], "1");
  EXPECT_EQ(m["version"], "3");
  EXPECT_EQ(m["plan_hash"], "");
  EXPECT_EQ(m["retry_table"], nlohmann::json::array());
  EXPECT_EQ(m["param_copy_dtype"], "DTYPE_BFLOAT16");
  EXPECT_TRUE(m["created_unix_seconds"].is_number_float());
  const nlohmann::json& params_file = m["files"]["params.safetensors"];
  EXPECT_EQ(params_file["bytes"],
            std::to_string(fs::file_size(c.directory + "/params.safetensors")));
  EXPECT_TRUE(params_file["crc32"].is_number_unsigned());
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
  EXPECT_EQ(q_small, (nlohmann::json{{"name", "q_small"},
                                     {"shape", {"100"}},
                                     {"param_group", "int8"},
                                     {"step", "3"},
                                     {"params_dtype", "DTYPE_FLOAT32"},
                                     {"state_dtype", "STATE_DTYPE_FLOAT32"},
                                     {"table", false}}));  // Under 4096.
  EXPECT_EQ(m["tensors"][3]["state_dtype"], "STATE_DTYPE_INT8");
  EXPECT_EQ(m["tensors"][5]["state_dtype"], "STATE_DTYPE_INT8");
  EXPECT_EQ(m["tensors"][5]["params_dtype"], "DTYPE_BFLOAT16");
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
  EXPECT_EQ(without.manifest.files().count(kBuffersFileName), 0u);
  ASSERT_TRUE(
      Wait<uint64_t>([&](auto done) { shard_.engine.WriteBuffers(SomeBuffers(), done); }).ok());
  for (bool fenced : {false, true}) {
    const Loaded c = Checkpoint(fenced);
    ASSERT_EQ(c.manifest.files().count(kBuffersFileName), 1u);
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
  v1::CheckpointManifest::File& listed = (*c.manifest.mutable_files())["params.safetensors"];
  listed.set_bytes(written->bytes);
  listed.set_crc32(written->crc32);
  absl::StatusOr<safetensors::File> reordered = safetensors::File::Read(path);
  ASSERT_TRUE(reordered.ok());
  EXPECT_EQ(reordered->Find("a")->begin % 4, 2u);  // 7 + 333 + 4099 bf16 values before it.
  Shard restored;
  const absl::Status restore = RestoreFrom(c, restored.engine);
  ASSERT_TRUE(restore.ok()) << restore;
  EXPECT_EQ(StoredStateOf(restored.engine), StoredStateOf(shard_.engine));
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
  const nlohmann::json reply = {{"sequence_number", "1"},  {"version", "1"},
                                {"skipped", false},        {"tensors_updated", 9},
                                {"grad_bytes", "100"},     {"round_workers", 2},
                                {"round_timed_out", true}, {"missing_replicas", {"r1"}}};
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
       {"manifest.json", "state_dtype", "fp8"}},
      {"fp16 params",
       [](nlohmann::json& m) {
         m["param_groups"][4]["hyperparameters"]["params_dtype"] = "DTYPE_FLOAT16";
       },
       {"param_groups[4]", "params_dtype = 3 must be FLOAT32 (1) or BFLOAT16 (2)"}},
      {"a seed that is not a uint64",
       [](nlohmann::json& m) { m["param_groups"][4]["hyperparameters"]["rounding_seed"] = -1; },
       {"manifest.json", "rounding_seed", "-1"}},
      {"amsgrad with int8 state",
       [](nlohmann::json& m) { m["param_groups"][3]["hyperparameters"]["amsgrad"] = true; },
       {"param_groups[3]", "amsgrad needs state_dtype FLOAT32"}},
      {"a hyperparameter the proto lacks",
       [](nlohmann::json& m) { m["param_groups"][1]["hyperparameters"]["learning_rate"] = 1; },
       {"manifest.json", "learning_rate"}},
      {"a group without hyperparameters",
       [](nlohmann::json& m) { m["param_groups"][1].erase("hyperparameters"); },
       {"param_groups[1]", "lacks \"hyperparameters\""}},
      {"a key the manifest lacks",
       [](nlohmann::json& m) { m["shard"] = "test"; },
       {"manifest.json", "shard"}},
      {"a key a tensor lacks",
       [](nlohmann::json& m) { m["tensors"][2]["dtype"] = "fp32"; },
       {"manifest.json", "dtype"}},
      {"format 3's dtype names",
       [](nlohmann::json& m) { m["tensors"][2]["state_dtype"] = "bf16"; },
       {"manifest.json", "state_dtype", "bf16"}},
      {"a tensor's layout unlike its group's",
       [](nlohmann::json& m) { m["tensors"][4]["state_dtype"] = "STATE_DTYPE_INT8"; },
       {"tensors[4].state_dtype", "is int8", "give fp32"}},
      {"a tensor's params unlike its group's",
       [](nlohmann::json& m) { m["tensors"][7]["params_dtype"] = "DTYPE_FLOAT32"; },
       {"tensors[7].params_dtype", "its group stores bf16"}},
      {"a tensor's params of a dtype no group stores",
       [](nlohmann::json& m) { m["tensors"][0]["params_dtype"] = "DTYPE_FLOAT16"; },
       {"tensors[0].params_dtype", "DTYPE_FLOAT16", "not one of DTYPE_FLOAT32, DTYPE_BFLOAT16"}},
      {"a negative step",
       [](nlohmann::json& m) { m["tensors"][1]["step"] = "-1"; },
       {"tensors[1].step", "negative"}},
      {"an fp32 param copy",
       [](nlohmann::json& m) { m["param_copy_dtype"] = "DTYPE_FLOAT32"; },
       {"param_copy_dtype", "DTYPE_FLOAT32", "not one of DTYPE_UNSPECIFIED (none)"}},
      {"a plan_hash too long",
       [](nlohmann::json& m) { m["plan_hash"] = std::string(65, 'x'); },
       {"plan_hash", "more than 64 bytes"}},
      {"a missing replica that is no client_id",
       [&](nlohmann::json& m) {
         nlohmann::json bad_reply = reply;
         bad_reply["missing_replicas"].push_back(std::string(257, 'x'));
         m["retry_table"] = {{{"client_id", "c"}, {"highest", "1"}, {"replies", {bad_reply}}}};
       },
       {"retry_table[0].replies[0].missing_replicas", "other than client_ids"}},
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
  // The manifest as written opens, and so does one with a retry table of every field.
  const absl::Status as_written = OpenChanged(c, [](nlohmann::json&) {});
  EXPECT_TRUE(as_written.ok()) << as_written;
  const absl::Status with_retries = OpenChanged(c, [&](nlohmann::json& m) {
    m["retry_table"] = {{{"client_id", "c"}, {"highest", "1"}, {"replies", {reply}}}};
  });
  EXPECT_TRUE(with_retries.ok()) << with_retries;
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
  EXPECT_FALSE(loaded.manifest.has_int8_codebooks());
  EXPECT_FALSE(fs::exists(path + "/exp_avg_absmax.safetensors"));
  EXPECT_FALSE(fs::exists(path + "/exp_avg_sq_absmax.safetensors"));
  EXPECT_EQ(EntriesOf(loaded, "exp_avg.safetensors"), (std::vector<std::string>{"w:BF16[64]"}));
  EXPECT_TRUE(OpenChanged(loaded, [](nlohmann::json&) {}).ok());
  Loaded with_books = loaded;
  *with_books.manifest.mutable_int8_codebooks() = ManifestCodebooks();
  EXPECT_TRUE(OpenChanged(with_books, [](nlohmann::json&) {}).ok());
  with_books.manifest.mutable_int8_codebooks()->set_exp_avg_sq(255, 2.0f);
  const absl::Status bad = OpenChanged(with_books, [](nlohmann::json&) {});
  EXPECT_EQ(bad.code(), absl::StatusCode::kDataLoss) << bad;
  fs::remove_all(root);
}

}  // namespace
}  // namespace fusedps::checkpoint
