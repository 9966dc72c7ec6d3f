// The checkpoint directory protocol: commit, verify, fall back past corruption and incomplete
// checkpoints, prune, and survive SIGKILL at any moment of a commit.
#include "server/checkpoint/checkpoint_dir.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "zlib.h"

namespace fusedps::checkpoint {
namespace {

namespace fs = std::filesystem;

uint32_t ZlibCrc32Of(const std::string& path) {  // zlib: a reference independent of ours.
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return static_cast<uint32_t>(
      crc32(0, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(bytes.size())));
}

class CheckpointDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = absl::StrCat(fs::temp_directory_path().string(), "/checkpoint_dir_test_", getpid(), "_",
                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  // A checkpoint of `version` with one safetensors file whose values are all `version`.
  absl::Status Write(uint64_t version, int keep = 3, int elements = 1000) {
    absl::StatusOr<PendingCheckpoint> pending = PendingCheckpoint::Begin(root_, version);
    if (!pending.ok()) return pending.status();
    const std::vector<float> values(static_cast<size_t>(elements), static_cast<float>(version));
    absl::StatusOr<safetensors::WriteResult> written = safetensors::WriteFile(
        pending->PathOf("params.safetensors"),
        {{"w",
          safetensors::DType::kF32,
          {elements},
          {reinterpret_cast<const uint8_t*>(values.data()), values.size() * 4}}},
        {{}, /*fsync=*/true});
    if (!written.ok()) return written.status();
    if (absl::Status s = pending->AddFile("params.safetensors", written->bytes, written->crc32);
        !s.ok()) {
      return s;
    }
    v1::CheckpointManifest body;
    body.set_server_version("test");
    return pending->Commit(body, keep).status();
  }

  std::string DirOf(uint64_t serial) const { return root_ + "/" + DirectoryName(serial); }

  // The newest checkpoint whose files all read back with their manifest's size and crc32.
  absl::StatusOr<Loaded> Load(std::vector<std::string>* skipped = nullptr) {
    return LoadLatestGood(
        root_,
        [](const Loaded& c) {
          for (const auto& [name, entry] : c.manifest.files()) {
            absl::StatusOr<uint32_t> expected = ExpectedCrc32(c, name);
            if (!expected.ok()) return expected.status();
            if (ZlibCrc32Of(c.directory + "/" + name) != *expected) {
              return absl::DataLossError(c.directory + "/" + name + " has another crc32");
            }
          }
          return absl::OkStatus();
        },
        [&](const std::string& dir, const absl::Status& why) {
          if (skipped != nullptr) skipped->push_back(absl::StrCat(dir, ": ", why.ToString()));
        });
  }

  std::string root_;
};

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST_F(CheckpointDirTest, CommitsAManifestWithChecksumsAndMovesLatest) {
  ASSERT_TRUE(Write(7).ok());
  absl::StatusOr<Loaded> loaded = Load();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->version, 7u);
  EXPECT_EQ(loaded->directory, DirOf(1)) << "the first serial";
  EXPECT_EQ(loaded->manifest.server_version(), "test");
  EXPECT_EQ(loaded->manifest.format(), "fusedps-checkpoint");
  EXPECT_EQ(loaded->manifest.format_version(), static_cast<uint32_t>(kFormatVersion));
  const std::string file = DirOf(1) + "/params.safetensors";
  ASSERT_EQ(loaded->manifest.files().size(), 1u);
  EXPECT_EQ(loaded->manifest.files().at("params.safetensors").crc32(), ZlibCrc32Of(file));
  EXPECT_EQ(loaded->manifest.files().at("params.safetensors").bytes(), fs::file_size(file));
  EXPECT_EQ(Slurp(root_ + "/latest"), DirectoryName(1));
  EXPECT_FALSE(fs::exists(DirOf(1) + "/manifest.json.tmp"));
}

TEST_F(CheckpointDirTest, DirectoriesAreNumberedBySerialAndTheManifestHoldsTheVersion) {
  // A rollback: version 9, then 5 (a server restored from an older checkpoint), then 5 again
  // (a registration without a step). The newest written is the newest loaded.
  ASSERT_TRUE(Write(9).ok());
  ASSERT_TRUE(Write(5).ok());
  ASSERT_TRUE(Write(5).ok());
  absl::StatusOr<Loaded> loaded = Load();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->serial, 3u);
  EXPECT_EQ(loaded->version, 5u);
  EXPECT_EQ(loaded->directory, root_ + "/" + DirectoryName(3));
  EXPECT_EQ(loaded->manifest.serial(), 3u);
  EXPECT_EQ(Slurp(root_ + "/latest"), DirectoryName(3));
}

TEST_F(CheckpointDirTest, KeepsTheNewestN) {
  for (uint64_t v = 1; v <= 5; ++v) ASSERT_TRUE(Write(v, /*keep=*/2).ok());
  const auto listed = ListCheckpoints(root_);
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0].first, 5u);
  EXPECT_EQ(listed[1].first, 4u);
}

TEST_F(CheckpointDirTest, AnIncompleteCheckpointIsSkippedAndReplaced) {
  ASSERT_TRUE(Write(1).ok());
  {  // Version 2 dies before its manifest.
    absl::StatusOr<PendingCheckpoint> pending = PendingCheckpoint::Begin(root_, 2);
    ASSERT_TRUE(pending.ok());
    std::ofstream(pending->PathOf("params.safetensors")) << "partial";
  }
  std::vector<std::string> skipped;
  absl::StatusOr<Loaded> loaded = Load(&skipped);
  ASSERT_TRUE(loaded.ok());
  EXPECT_EQ(loaded->version, 1u);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_NE(skipped[0].find(DirOf(2) + "/manifest.json"), std::string::npos) << skipped[0];
  ASSERT_TRUE(Write(2).ok());
  EXPECT_EQ(Load()->directory, DirOf(3)) << "the next checkpoint takes the next serial";
  EXPECT_FALSE(fs::exists(DirOf(2))) << "and its commit removes the incomplete one";
}

TEST_F(CheckpointDirTest, AFlippedByteIsDetectedNamingTheFileAndTheOlderOneIsUsed) {
  ASSERT_TRUE(Write(1).ok());
  ASSERT_TRUE(Write(2).ok());
  const std::string file = DirOf(2) + "/params.safetensors";
  std::string bytes = Slurp(file);
  bytes[bytes.size() - 3] ^= 0x10;  // Same size: only the checksum can tell.
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  std::vector<std::string> skipped;
  absl::StatusOr<Loaded> loaded = Load(&skipped);
  ASSERT_TRUE(loaded.ok());
  EXPECT_EQ(loaded->version, 1u);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_NE(skipped[0].find(file), std::string::npos) << skipped[0];
  EXPECT_NE(skipped[0].find("DATA_LOSS"), std::string::npos) << skipped[0];
}

TEST_F(CheckpointDirTest, ATruncatedManifestOrAMissingFileIsDetected) {
  ASSERT_TRUE(Write(1).ok());
  ASSERT_TRUE(Write(2).ok());
  ASSERT_TRUE(Write(3).ok());
  const std::string manifest = DirOf(3) + "/manifest.json";
  const std::string text = Slurp(manifest);
  std::ofstream(manifest, std::ios::trunc) << text.substr(0, text.size() / 2);
  fs::remove(DirOf(2) + "/params.safetensors");
  std::vector<std::string> skipped;
  absl::StatusOr<Loaded> loaded = Load(&skipped);
  ASSERT_TRUE(loaded.ok());
  EXPECT_EQ(loaded->version, 1u);
  ASSERT_EQ(skipped.size(), 2u);
  EXPECT_NE(skipped[0].find(manifest), std::string::npos) << skipped[0];
  EXPECT_NE(skipped[1].find(DirOf(2) + "/params.safetensors is missing"), std::string::npos)
      << skipped[1];
}

TEST_F(CheckpointDirTest, AnUnknownFormatVersionStopsTheSearchInsteadOfFallingBack) {
  ASSERT_TRUE(Write(1).ok());
  ASSERT_TRUE(Write(2).ok());
  const std::string manifest = DirOf(2) + "/manifest.json";
  std::string text = Slurp(manifest);
  const size_t at = text.find("\"format_version\": 4");
  ASSERT_NE(at, std::string::npos) << text;
  text.replace(at, 19, "\"format_version\": 5");
  std::ofstream(manifest, std::ios::trunc) << text;
  absl::StatusOr<Loaded> loaded = Load();
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kFailedPrecondition) << loaded.status();
  EXPECT_NE(loaded.status().message().find("format_version 5; this server reads 2 to 4"),
            std::string::npos)
      << loaded.status();
}

// Format 4's manifest is the message's JSON: a key the message lacks is damage (or a misread
// format), never ignored. The checkpoint is passed over naming the manifest and the key.
TEST_F(CheckpointDirTest, AnUnknownKeyInTheManifestIsDataLossNamingIt) {
  ASSERT_TRUE(Write(1).ok());
  ASSERT_TRUE(Write(2).ok());
  const std::string manifest = DirOf(2) + "/manifest.json";
  std::string text = Slurp(manifest);
  ASSERT_EQ(text[0], '{') << text;
  text.insert(1, "\"trained_on\": \"cluster-7\",");
  std::ofstream(manifest, std::ios::trunc) << text;
  std::vector<std::string> skipped;
  absl::StatusOr<Loaded> loaded = Load(&skipped);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->version, 1u);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_NE(skipped[0].find("DATA_LOSS"), std::string::npos) << skipped[0];
  EXPECT_NE(skipped[0].find(manifest), std::string::npos) << skipped[0];
  EXPECT_NE(skipped[0].find("trained_on"), std::string::npos) << skipped[0];
}

TEST_F(CheckpointDirTest, NothingLoadableIsNotFound) {
  EXPECT_EQ(Load().status().code(), absl::StatusCode::kNotFound);
  fs::create_directories(DirOf(4));
  EXPECT_EQ(Load().status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CheckpointDirTest, BadFileNamesAreRefused) {
  absl::StatusOr<PendingCheckpoint> pending = PendingCheckpoint::Begin(root_, 1);
  ASSERT_TRUE(pending.ok());
  for (const std::string name : {"", "a/b", "manifest.json", "manifest.json.tmp"}) {
    EXPECT_EQ(pending->AddFile(name, 0, 0).code(), absl::StatusCode::kInvalidArgument) << name;
  }
  ASSERT_TRUE(pending->AddFile("x", 0, 0).ok());
  EXPECT_EQ(pending->AddFile("x", 0, 0).code(), absl::StatusCode::kInvalidArgument);
}

// A child commits checkpoints 1, 2, 3, ... in a loop; the parent SIGKILLs it at a random moment,
// 50 times. Every time, the newest loadable checkpoint is the last one the child finished (it
// reports each through a pipe) or the one after it (killed between its manifest and the
// report), and it verifies. Files are 4 MB so that kills land inside writes too.
TEST_F(CheckpointDirTest, SigkillAtAnyMomentLeavesTheLastCompleteCheckpointLoadable) {
  std::mt19937 rng(20261122);
  uint64_t next = 1;
  for (int iteration = 0; iteration < 50; ++iteration) {
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    const uint64_t first = next;
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      close(fds[0]);
      for (uint64_t v = first;; ++v) {
        if (!Write(v, /*keep=*/2, /*elements=*/1 << 20).ok()) _exit(2);
        if (write(fds[1], &v, sizeof(v)) != sizeof(v)) _exit(3);
      }
    }
    close(fds[1]);
    std::this_thread::sleep_for(
        std::chrono::microseconds(std::uniform_int_distribution<int>(0, 60'000)(rng)));
    kill(child, SIGKILL);
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the child failed on its own: " << status;
    uint64_t finished = first - 1, v = 0;
    while (read(fds[0], &v, sizeof(v)) == sizeof(v)) finished = v;
    close(fds[0]);
    absl::StatusOr<Loaded> loaded = Load();
    if (finished == 0) {  // Killed before the first commit: maybe nothing yet.
      if (!loaded.ok()) continue;
    }
    ASSERT_TRUE(loaded.ok()) << "iteration " << iteration << ": " << loaded.status();
    EXPECT_TRUE(loaded->version == finished || loaded->version == finished + 1)
        << "iteration " << iteration << ": loaded " << loaded->version << ", finished " << finished;
    next = loaded->version + 1;
  }
}

}  // namespace
}  // namespace fusedps::checkpoint
