// The manifest's formats (manifest.h, manifest_legacy.h): format 4's JSON round-trips the message
// and names what it refuses; manifests of formats 2 and 3 convert to the message that format 4
// writes and restore bit for bit. testdata/format3_manifest.json is the manifest that the format
// 3 writer made of ShardFilesTest's shard (shard_files_test_util.h) after its three steps; the
// data files the current writer makes of that shard are the same bytes, so that manifest,
// converted, must restore them.
#include "server/checkpoint/manifest.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/file_io.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/checkpoint/shard_files_test_util.h"
#include "server/schema/hyperparameters.h"

namespace fusedps::checkpoint {
namespace {

using nlohmann::json;
using test_util::RestoreFrom;
using test_util::Shard;
using test_util::ShardFilesTest;
using test_util::StoredStateOf;

constexpr char kPath[] = "/ckpt/manifest.json";

// Whether two manifests are the same message: their deterministic serializations (map entries
// by key) are equal; on failure both are printed as format 4. Not MessageDifferencer: its
// reflection over a map field crashed in the ThreadSanitizer build (SEGV in
// MapFieldBase::SyncRepeatedFieldWithMap, inside Debian's uninstrumented libprotobuf), where
// generated code and the JSON util, which work on the map or the bytes, do not.
std::string Deterministic(const v1::CheckpointManifest& m) {
  std::string out;
  {
    google::protobuf::io::StringOutputStream stream(&out);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    m.SerializeToCodedStream(&coded);
  }
  return out;
}
void ExpectSameManifest(const v1::CheckpointManifest& a, const v1::CheckpointManifest& b) {
  EXPECT_TRUE(Deterministic(a) == Deterministic(b))
      << ManifestToJson(a).value_or("?") << "\nis not\n"
      << ManifestToJson(b).value_or("?");
}

std::string Format3Text() {
  absl::StatusOr<std::string> text =
      file_io::ReadFile(absl::StrCat(FUSEDPS_CHECKPOINT_TESTDATA, "/format3_manifest.json"));
  EXPECT_TRUE(text.ok()) << text.status();
  return text.ok() ? *text : "";
}

// Format 4's JSON (this server's) as format 3 wrote it: 64-bit integers as numbers, a tensor's
// dtypes and the param copy's by their short names.
void ToFormatVersion3(json& m) {
  const std::map<std::string, std::string> names = {{"STATE_DTYPE_FLOAT32", "fp32"},
                                                    {"STATE_DTYPE_BFLOAT16", "bf16"},
                                                    {"STATE_DTYPE_INT8", "int8"},
                                                    {"DTYPE_FLOAT32", "fp32"},
                                                    {"DTYPE_BFLOAT16", "bf16"}};
  const auto number = [](json& v) { v = std::stoull(v.get<std::string>()); };
  m["format_version"] = 3;
  const std::map<std::string, std::string> copies = {
      {"DTYPE_UNSPECIFIED", "none"}, {"DTYPE_BFLOAT16", "bf16"}, {"DTYPE_FLOAT16", "fp16"}};
  m["param_copy_dtype"] = copies.at(m["param_copy_dtype"]);
  number(m["serial"]);
  number(m["version"]);
  for (json& t : m["tensors"]) {
    for (json& d : t["shape"]) number(d);
    number(t["step"]);
    t["params_dtype"] = names.at(t["params_dtype"]);
    t["state_dtype"] = names.at(t["state_dtype"]);
  }
  for (auto& [name, file] : m["files"].items()) number(file["bytes"]);
  for (json& client : m["retry_table"]) {
    number(client["highest"]);
    for (json& r : client["replies"]) {
      for (const char* key : {"sequence_number", "version", "grad_bytes"}) number(r[key]);
    }
  }
}

// Format 3's JSON as format 2 wrote it (docs/checkpoints.md): each hyperparameter a key of its
// group, weight decay as decoupled_weight_decay, the storage by dtype names, rounding_seed a
// number.
void ToFormatVersion2(json& m) {
  m["format_version"] = 2;
  for (json& g : m["param_groups"]) {
    const json h = g["hyperparameters"];
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

// `checkpoint` with manifest.json replaced by `text`, read back as a server reads it.
absl::StatusOr<Loaded> WithManifest(const Loaded& checkpoint, const std::string& text) {
  std::ofstream(checkpoint.directory + "/" + kManifestName, std::ios::trunc) << text;
  return ReadManifest(checkpoint.directory);
}

// `checkpoint` restores into a fresh shard bit for bit (StoredStateOf: every stored value and
// step) with `original`'s groups, hyperparameters and storage included.
void ExpectRestoresAs(const Loaded& checkpoint, UpdateEngine& original) {
  Shard restored;
  const absl::Status restore = RestoreFrom(checkpoint, restored.engine);
  ASSERT_TRUE(restore.ok()) << restore;
  EXPECT_EQ(StoredStateOf(restored.engine), StoredStateOf(original));
  const auto& before = original.view()->groups();
  const auto& after = restored.engine.view()->groups();
  ASSERT_EQ(after.size(), before.size());
  for (size_t g = 0; g < before.size(); ++g) {
    EXPECT_EQ(after[g].name, before[g].name);
    EXPECT_TRUE(SameHyperparameters(after[g].hyperparameters, before[g].hyperparameters))
        << before[g].name;
  }
}

TEST_F(ShardFilesTest, AFormat3ManifestFromTheFormat3WriterRestoresBitExactly) {
  const Loaded written = Checkpoint(/*fenced=*/false);
  ASSERT_EQ(written.manifest.format_version(), 4u);
  absl::StatusOr<Loaded> c = WithManifest(written, Format3Text());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->manifest.format_version(), 3u);
  // Its files are those this writer made (the format changed the manifest only); if this fails,
  // the shard of shard_files_test_util.h changed, and so must testdata/format3_manifest.json.
  for (const auto& [name, file] : written.manifest.files()) {
    ASSERT_EQ(c->manifest.files().count(name), 1u) << name;
    EXPECT_EQ(c->manifest.files().at(name).crc32(), file.crc32()) << name;
  }
  // Converted, it is the message that format 4 writes, but for when and by which format.
  v1::CheckpointManifest converted = c->manifest, current = written.manifest;
  for (v1::CheckpointManifest* m : {&converted, &current}) {
    m->clear_format_version();
    m->clear_created_unix_seconds();
  }
  ExpectSameManifest(converted, current);

  ExpectRestoresAs(*c, shard_.engine);
}

// A checkpoint written before format 3 restores bit for bit, every storage included, and its
// groups come back with the same hyperparameters.
TEST_F(ShardFilesTest, AFormatVersion2ManifestRestoresBitExactly) {
  const Loaded written = Checkpoint(/*fenced=*/false);
  json m = json::parse(Format3Text());
  ToFormatVersion2(m);
  ASSERT_FALSE(m["param_groups"][4].contains("hyperparameters"));
  EXPECT_EQ(m["param_groups"][4]["state_dtype"], "int8");
  absl::StatusOr<Loaded> c = WithManifest(written, m.dump(1));
  ASSERT_TRUE(c.ok()) << c.status();
  ExpectRestoresAs(*c, shard_.engine);
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
  const absl::Status changed = test_util::ChangeManifest(&loaded, [](json& m) {
    ToFormatVersion3(m);
    ToFormatVersion2(m);
    for (json& g : m["param_groups"]) {
      g.erase("state_dtype");
      g.erase("params_dtype");
      g.erase("rounding_seed");
    }
    for (json& t : m["tensors"]) {
      t.erase("state_dtype");
      t.erase("params_dtype");
    }
  });
  ASSERT_TRUE(changed.ok()) << changed;
  EXPECT_EQ(loaded.manifest.format_version(), 2u);
  Shard restored;
  ASSERT_TRUE(RestoreFrom(loaded, restored.engine).ok());
  EXPECT_EQ(StoredStateOf(restored.engine), StoredStateOf(plain.engine));
  EXPECT_TRUE(IsFloat32Layout(restored.engine.view()->layout(0)));
  std::filesystem::remove_all(root);
}

struct BadLegacy {
  const char* name;
  std::function<void(json&)> change;  // Of format 3's JSON.
  std::vector<std::string> message_has;
};

TEST_F(ShardFilesTest, TheConverterRefusesWhatTheFormat3ReaderRefusedNamingTheKey) {
  const Loaded c = Checkpoint(/*fenced=*/false);
  const BadLegacy cases[] = {
      {"format 2: an unknown state_dtype",
       [](json& m) {
         ToFormatVersion2(m);
         m["param_groups"][3]["state_dtype"] = "fp8";
       },
       {"param_groups[3].state_dtype", "\"fp8\"", "fp32, bf16, int8"}},
      {"format 2: a seed that is not a uint64",
       [](json& m) {
         ToFormatVersion2(m);
         m["param_groups"][4]["rounding_seed"] = -1;
       },
       {"param_groups[4].rounding_seed", "wrong type"}},
      {"format 2: no decoupled_weight_decay",
       [](json& m) {
         ToFormatVersion2(m);
         m["param_groups"][2].erase("decoupled_weight_decay");
       },
       {"param_groups[2] lacks \"decoupled_weight_decay\""}},
      {"a hyperparameter the proto lacks",
       [](json& m) { m["param_groups"][1]["hyperparameters"]["learning_rate"] = 1; },
       {"param_groups[1]", "learning_rate"}},
      {"an unknown tensor state_dtype",
       [](json& m) { m["tensors"][2]["state_dtype"] = "fp8"; },
       {"tensors[2].state_dtype", "\"fp8\""}},
      {"a tensor's layout unlike its group's",  // Converted, then refused by the reader.
       [](json& m) { m["tensors"][4]["state_dtype"] = "int8"; },
       {"tensors[4].state_dtype", "is int8", "give fp32"}},
      {"a step that is not a count",
       [](json& m) { m["tensors"][0]["step"] = -3; },
       {"tensors[0].step", "wrong type"}},
      {"an unknown param_copy_dtype",
       [](json& m) { m["param_copy_dtype"] = "fp8"; },
       {"param_copy_dtype", "\"fp8\"", "none, bf16, fp16"}},
      {"a serial that is a string",
       [](json& m) { m["serial"] = "1"; },
       {"manifest.serial", "wrong type"}},
      {"a codebook value that is no number",
       [](json& m) { m["int8_codebooks"]["exp_avg"][3] = "x"; },
       {"int8_codebooks.exp_avg[3]", "wrong type"}},
      {"a crc32 over 32 bits",
       [](json& m) { m["files"]["params.safetensors"]["crc32"] = uint64_t{1} << 32; },
       {"a bad entry for params.safetensors"}},
      {"a reply without missing_replicas",
       [](json& m) {
         m["retry_table"] = {{{"client_id", "c"},
                              {"highest", 1},
                              {"replies",
                               {{{"sequence_number", 1},
                                 {"version", 1},
                                 {"skipped", false},
                                 {"tensors_updated", 9},
                                 {"grad_bytes", 100},
                                 {"round_timed_out", true}}}}}};
       },
       {"retry_table[0].replies[0] lacks \"missing_replicas\""}},
  };
  for (const BadLegacy& bad : cases) {
    const absl::Status s = ShardFilesTest::OpenChanged(c, [&](json& m) {
      ToFormatVersion3(m);
      bad.change(m);
    });
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << bad.name << ": " << s;
    for (const std::string& part : bad.message_has) {
      EXPECT_NE(s.message().find(part), std::string::npos)
          << bad.name << ": '" << s.message() << "' lacks '" << part << "'";
    }
  }
  // Format 3 as this server would have written it opens; a key it does not know is ignored.
  const absl::Status as_format3 = ShardFilesTest::OpenChanged(c, [](json& m) {
    ToFormatVersion3(m);
    m["shard"] = "test";
  });
  EXPECT_TRUE(as_format3.ok()) << as_format3;
}

// The retry table of format 3, every key of a reply, and a reply written before round_workers
// and round_timed_out existed.
TEST(ManifestTest, AFormat3RetryTableConverts) {
  json m = json::parse(Format3Text());
  m["retry_table"] = json::parse(R"([
    {"client_id": "trainer-0", "highest": 18446744073709551615, "replies": [
      {"sequence_number": 7, "version": 12, "skipped": false, "tensors_updated": 3,
       "grad_bytes": 4096},
      {"sequence_number": 8, "version": 13, "skipped": true, "tensors_updated": 0,
       "grad_bytes": 64, "round_workers": 4, "round_timed_out": true,
       "missing_replicas": ["trainer-2", "trainer-3"]}]}])");
  absl::StatusOr<v1::CheckpointManifest> read = ParseManifest(m.dump(), kPath);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->retry_table_size(), 1);
  const v1::CheckpointManifest::RetryClient& client = read->retry_table(0);
  EXPECT_EQ(client.client_id(), "trainer-0");
  EXPECT_EQ(client.highest(), UINT64_MAX);
  ASSERT_EQ(client.replies_size(), 2);
  const v1::CheckpointManifest::Reply& old = client.replies(0);
  EXPECT_EQ(old.sequence_number(), 7u);
  EXPECT_EQ(old.version(), 12u);
  EXPECT_EQ(old.tensors_updated(), 3u);
  EXPECT_EQ(old.grad_bytes(), 4096u);
  EXPECT_EQ(old.round_workers(), 0u);
  EXPECT_FALSE(old.round_timed_out());
  const v1::CheckpointManifest::Reply& sync = client.replies(1);
  EXPECT_TRUE(sync.skipped());
  EXPECT_EQ(sync.round_workers(), 4u);
  EXPECT_TRUE(sync.round_timed_out());
  EXPECT_EQ(
      std::vector<std::string>(sync.missing_replicas().begin(), sync.missing_replicas().end()),
      (std::vector<std::string>{"trainer-2", "trainer-3"}));
  // Printed as format 4 and read back: the same message.
  absl::StatusOr<std::string> text = ManifestToJson(*read);
  ASSERT_TRUE(text.ok()) << text.status();
  json as4 = json::parse(*text);
  EXPECT_EQ(as4["retry_table"][0]["highest"], "18446744073709551615");
  as4["format_version"] = 4;
  absl::StatusOr<v1::CheckpointManifest> again = ParseManifest(as4.dump(), kPath);
  ASSERT_TRUE(again.ok()) << again.status();
  again->set_format_version(3);
  ExpectSameManifest(*again, *read);
}

TEST(ManifestTest, Format4RefusesAnUnknownKeyNamingIt) {
  // The format 3 manifest, converted and printed as format 4.
  absl::StatusOr<v1::CheckpointManifest> read = ParseManifest(Format3Text(), kPath);
  ASSERT_TRUE(read.ok()) << read.status();
  absl::StatusOr<std::string> text = ManifestToJson(*read);
  ASSERT_TRUE(text.ok());
  for (const auto& [where, change] :
       std::vector<std::pair<std::string, std::function<void(json&)>>>{
           {"top", [](json& j) { j["checksum_kind"] = "crc32"; }},
           {"file", [](json& j) { j["files"]["params.safetensors"]["checksum_kind"] = 1; }},
           {"codebooks", [](json& j) { j["int8_codebooks"]["checksum_kind"] = {1.0}; }}}) {
    json j = json::parse(*text);
    j["format_version"] = 4;
    ASSERT_TRUE(ParseManifest(j.dump(), kPath).ok()) << where;
    change(j);
    const absl::Status s = ParseManifest(j.dump(), kPath).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << where << ": " << s;
    EXPECT_NE(s.message().find("checksum_kind"), std::string::npos) << where << ": " << s;
    EXPECT_NE(s.message().find(kPath), std::string::npos) << where << ": " << s;
  }
}

TEST(ManifestTest, WhatIsNotAManifestOfAFormatReadIsSaidSo) {
  json m = json::parse(Format3Text());
  for (int format_version : {1, 5}) {
    m["format_version"] = format_version;
    const absl::Status s = ParseManifest(m.dump(), kPath).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find(absl::StrCat("has format_version ", format_version,
                                            "; this server reads 2 to 4")),
              std::string::npos)
        << s;
  }
  // A format 5 with keys this server does not know is still FAILED_PRECONDITION, not damage.
  m["shape_of_things_to_come"] = true;
  EXPECT_EQ(ParseManifest(m.dump(), kPath).status().code(), absl::StatusCode::kFailedPrecondition);
  for (const std::string& text :
       {std::string("{\"format\": \"fusedps-checkpoint\""), std::string("[]"),
        std::string(R"({"format": "other", "format_version": 4, "serial": "1", "version": "1",
                       "files": {}})"),
        std::string(R"({"format": "fusedps-checkpoint", "format_version": 4, "version": "1",
                       "files": {}})")}) {
    const absl::Status s = ParseManifest(text, kPath).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << text << ": " << s;
    EXPECT_NE(s.message().find("is not a complete manifest"), std::string::npos) << s;
  }
}

}  // namespace
}  // namespace fusedps::checkpoint
