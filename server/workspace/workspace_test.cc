#include "server/workspace/workspace.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "common/temp_dir.h"
#include "common/workspace_range.h"
#include "gtest/gtest.h"

namespace fusedps {
namespace {

class WorkspaceTest : public ::testing::Test {
 protected:
  WorkspaceOptions Options(uint64_t budget = 1 << 20) const { return {dir_.path(), budget}; }
  TempDir dir_{"fusedps-ws-test"};
};

bool Exists(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0;
}

// The caller's side: maps the file by its path, as a trainer does.
char* MapAsCaller(const Workspace& w) {
  const int fd = open(w.path().c_str(), O_RDWR);
  if (fd < 0) return nullptr;
  void* data = mmap(nullptr, w.memory().size(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  return data == MAP_FAILED ? nullptr : static_cast<char*>(data);
}

TEST_F(WorkspaceTest, BothSidesSeeTheSameBytes) {
  WorkspaceTable table(Options(), nullptr);
  absl::StatusOr<std::shared_ptr<const Workspace>> w = table.Open("alice", 4096);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ((*w)->id().size(), 32u);
  EXPECT_EQ((*w)->memory().size(), 4096u);
  struct stat st {};
  ASSERT_EQ(stat((*w)->path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);  // Only the server's user may map it.
  EXPECT_EQ(st.st_ino, (*w)->file_inode());
  EXPECT_EQ(st.st_dev, (*w)->file_device());
  char* caller = MapAsCaller(**w);
  ASSERT_NE(caller, nullptr);
  std::memcpy(caller + 100, "gradients", 9);
  EXPECT_EQ(std::string((*w)->memory().data() + 100, 9), "gradients");
  std::memcpy((*w)->memory().data() + 2000, "params", 6);
  EXPECT_EQ(std::string(caller + 2000, 6), "params");
  munmap(caller, 4096);
}

TEST_F(WorkspaceTest, CloseEndsFindAndTheFileButNotAHoldersMemory) {
  WorkspaceTable table(Options(), nullptr);
  std::shared_ptr<const Workspace> w = *table.Open("alice", 4096);
  ASSERT_TRUE(table.Find(w->id(), "alice").ok());
  EXPECT_EQ(table.open_count(), 1u);
  EXPECT_EQ(table.open_bytes(), 4096u);
  table.Close(w->id());
  EXPECT_EQ(table.Find(w->id(), "alice").status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(Exists(w->path()));
  EXPECT_EQ(table.open_count(), 0u);
  EXPECT_EQ(table.open_bytes(), 0u);
  // A push still holding it reads on.
  w->memory()[4095] = 7;
  EXPECT_EQ(w->memory()[4095], 7);
  table.Close(w->id());  // Closing twice changes nothing.
}

TEST_F(WorkspaceTest, AnotherOwnerCannotFindIt) {
  WorkspaceTable table(Options(), nullptr);
  std::shared_ptr<const Workspace> w = *table.Open("alice", 64);
  const absl::Status s = table.Find(w->id(), "mallory").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(table.Find("0123", "alice").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(WorkspaceTest, TheBudgetBoundsOpenWorkspaces) {
  WorkspaceTable table(Options(/*budget=*/10000), nullptr);
  std::shared_ptr<const Workspace> a = *table.Open("", 6000);
  const absl::Status over = table.Open("", 5000).status();
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(over.message().find("--workspace-budget-bytes = 10000"), std::string::npos) << over;
  table.Close(a->id());
  EXPECT_TRUE(table.Open("", 5000).ok());  // Closing gave the bytes back.
  EXPECT_EQ(table.Open("", 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(WorkspaceTest, OffAndMissingDirectoriesAreErrors) {
  WorkspaceTable off({"", 1 << 20}, nullptr);
  EXPECT_FALSE(off.enabled());
  EXPECT_EQ(off.Open("", 64).status().code(), absl::StatusCode::kFailedPrecondition);
  WorkspaceTable missing({dir_.path() + "/nope", 1 << 20}, nullptr);
  const absl::Status s = missing.Open("", 64).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find(dir_.path() + "/nope"), std::string::npos) << s;
  EXPECT_EQ(missing.open_bytes(), 0u);  // The failed open gave its bytes back.
}

TEST_F(WorkspaceTest, TheTableRemovesTheFilesOfDeadServersOnly) {
  // A pid that is surely gone: a child that has exited and been reaped.
  const pid_t child = fork();
  if (child == 0) _exit(0);
  int status = 0;
  waitpid(child, &status, 0);
  const std::string dead = dir_.path() + "/fusedps-ws-" + std::to_string(child) + "-abc";
  const std::string alive = dir_.path() + "/fusedps-ws-" + std::to_string(getpid()) + "-def";
  const std::string other = dir_.path() + "/someone-else";
  for (const std::string& path : {dead, alive, other}) std::ofstream(path) << "x";
  WorkspaceTable table(Options(), nullptr);
  EXPECT_FALSE(Exists(dead));
  EXPECT_TRUE(Exists(alive));
  EXPECT_TRUE(Exists(other));
}

TEST_F(WorkspaceTest, TheTableClosesWhatIsOpenWhenItGoes) {
  std::string path;
  {
    WorkspaceTable table(Options(), nullptr);
    path = (*table.Open("", 64))->path();
    EXPECT_TRUE(Exists(path));
  }
  EXPECT_FALSE(Exists(path));
}

TEST(IsLocalPeerTest, LoopbackAndUnixSocketsOnly) {
  EXPECT_TRUE(IsLocalPeer("ipv4:127.0.0.1:5000"));
  EXPECT_TRUE(IsLocalPeer("ipv4:127.1.2.3:5000"));
  EXPECT_TRUE(IsLocalPeer("ipv6:[::1]:5000"));
  EXPECT_TRUE(IsLocalPeer("ipv6:[::ffff:127.0.0.1]:5000"));
  EXPECT_TRUE(IsLocalPeer("unix:/tmp/fusedps.sock"));
  EXPECT_TRUE(IsLocalPeer("unix-abstract:fusedps"));
  EXPECT_FALSE(IsLocalPeer("ipv4:10.0.0.7:5000"));
  EXPECT_FALSE(IsLocalPeer("ipv4:128.0.0.1:5000"));
  EXPECT_FALSE(IsLocalPeer("ipv6:[::ffff:10.0.0.7]:5000"));
  EXPECT_FALSE(IsLocalPeer("ipv6:[2001:db8::1]:5000"));
  EXPECT_FALSE(IsLocalPeer(""));
}

TEST(CheckWorkspaceRangeTest, NamesTheFieldAndTheEnd) {
  EXPECT_TRUE(CheckWorkspaceRange(0, 100, 100, "f").ok());
  EXPECT_TRUE(CheckWorkspaceRange(100, 0, 100, "f").ok());
  const absl::Status s = CheckWorkspaceRange(60, 50, 100, "chunks.workspace_bytes");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("chunks.workspace_bytes"), std::string::npos) << s;
  EXPECT_NE(s.message().find("(100 bytes)"), std::string::npos) << s;
  // No wrap-around past 2^64.
  EXPECT_FALSE(CheckWorkspaceRange(50, UINT64_MAX, 100, "f").ok());
  EXPECT_FALSE(CheckWorkspaceRange(UINT64_MAX, 2, 100, "f").ok());
}

// Device memory needs a backend with a device: without one, or with the CPU backend, Open is
// FAILED_PRECONDITION and holds none of the budget. (The CUDA backend's side is in
// kernels/cuda_device_staging_test.cc; the whole path in tests/e2e.)
TEST_F(WorkspaceTest, DeviceMemoryNeedsABackendWithADevice) {
  WorkspaceTable without(Options(), nullptr);
  absl::StatusOr<std::shared_ptr<const Workspace>> none =
      without.Open("alice", 4096, WorkspaceMemory::kDevice);
  EXPECT_TRUE(absl::IsFailedPrecondition(none.status())) << none.status();
  const std::unique_ptr<OptimizerBackend> cpu = MakeCpuBackend(BackendOptions());
  WorkspaceTable on_cpu(Options(), cpu.get());
  absl::StatusOr<std::shared_ptr<const Workspace>> refused =
      on_cpu.Open("alice", 4096, WorkspaceMemory::kDevice);
  EXPECT_TRUE(absl::IsFailedPrecondition(refused.status())) << refused.status();
  EXPECT_NE(refused.status().message().find("cpu"), absl::string_view::npos) << refused.status();
  EXPECT_EQ(on_cpu.open_bytes(), 0u);
  EXPECT_EQ(on_cpu.open_count(), 0u);
  // The host kind still opens beside it.
  absl::StatusOr<std::shared_ptr<const Workspace>> host = on_cpu.Open("alice", 4096);
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_FALSE((*host)->on_device());
}

}  // namespace
}  // namespace fusedps
