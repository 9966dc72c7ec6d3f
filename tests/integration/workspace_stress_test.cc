// A stress test of same-host workspaces over real gRPC, in a bounded loop, for the sanitizers
// (ASan, UBSan, TSan): trainers open workspaces, push through them and pull into them, while
// their leases end at any moment (before a push, in the middle of one, during a pull), and a
// budget too small for all of them at once refuses some. Afterwards: every push acknowledged
// as applied counts in the version, none that was refused does, the staging and the budget are
// all back, and no workspace file is left in the directory.
#include <dirent.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "tests/integration/service_harness.h"

namespace fusedps::integration {
namespace {

constexpr int kThreads = 4;
constexpr int kRounds = 25;  // Per thread; bounded so that the test ends under TSan too.
constexpr uint64_t kNumel = 64 * 64;
constexpr uint64_t kWorkspaceBytes = 3 * kNumel * 4;  // Gradients, then a pull's values.

class WorkspaceStressTest : public ServiceTest {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/fusedps-ws-stress-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
    ServiceTest::SetUp();
  }
  void TearDown() override {
    ServiceTest::TearDown();
    std::system(("rm -rf " + dir_).c_str());
  }
  ServerOptions Options() const override {
    ServerOptions options = ServiceTest::Options();
    options.workspaces.dir = dir_;
    options.workspaces.budget_bytes = 3 * kWorkspaceBytes;  // Four trainers, room for three.
    return options;
  }

  int FilesLeft() const {
    int files = 0;
    if (DIR* dir = opendir(dir_.c_str())) {
      while (const dirent* entry = readdir(dir)) files += entry->d_name[0] != '.';
      closedir(dir);
    }
    return files;
  }

  std::string dir_;
};

TEST_F(WorkspaceStressTest, LeasesEndingAnywhereLeaveAConsistentShardAndNoFiles) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors({{"w", {64, 64}, ""}}));
  std::atomic<uint64_t> applied{0}, refused{0}, opened{0};
  std::atomic<int> unexpected{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(500 + t);
      for (int round = 0; round < kRounds; ++round) {
        const std::unique_ptr<MappedWorkspace> mapped =
            MappedWorkspace::Open(*stub_, kWorkspaceBytes);
        if (mapped->reader == nullptr) {
          if (mapped->status.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) {
            ADD_FAILURE() << "OpenWorkspace: " << mapped->status.error_message();
            ++unexpected;
          }
          continue;
        }
        ++opened;
        ASSERT_NE(mapped->memory, nullptr);
        char* memory = mapped->memory;
        grpc::ClientContext& lease = mapped->lease;
        const v1::OpenWorkspaceResponse& workspace = mapped->opened;
        const std::string grads = Encode(GradDType::kFloat32, RandomValues(kNumel, rng(), 1e-3f));
        std::memcpy(memory, grads.data(), grads.size());

        // The lease ends before the push (0), during it (1), after it (2 and 3).
        const int end_at = static_cast<int>(rng() % 4);
        std::thread ender;
        if (end_at == 0) lease.TryCancel();
        if (end_at == 1) ender = std::thread([&] { lease.TryCancel(); });
        v1::PushHeader header = MakePushHeader(v1::DTYPE_FLOAT32, "", 0, {"w"});
        header.set_workspace(workspace.workspace_id());
        std::vector<v1::PushGradientsRequest> messages(4);
        *messages[0].mutable_header() = header;
        for (uint64_t piece = 0; piece < 4; ++piece) {
          v1::TensorChunk* chunk = messages[piece].add_chunks();
          chunk->set_tensor("w");
          chunk->set_offset(piece * kNumel / 4);
          chunk->set_workspace_offset_bytes(piece * kNumel);
          chunk->set_workspace_bytes(kNumel);
        }
        auto [status, reply] = Push(messages);
        if (ender.joinable()) ender.join();
        if (status.ok() && !reply.step_skipped()) {
          ++applied;
        } else if (status.error_code() == grpc::StatusCode::NOT_FOUND) {
          ++refused;
        } else {
          ADD_FAILURE() << "push: " << status.error_message();
          ++unexpected;
        }
        if (end_at == 2) {  // A pull into the workspace while the lease ends.
          std::thread pull_ender([&] { lease.TryCancel(); });
          v1::PullParametersRequest pull;
          pull.add_tensors("w");
          pull.set_workspace(workspace.workspace_id());
          pull.add_workspace_offsets_bytes(kNumel * 4);
          const Pulled pulled = Pull(pull);
          pull_ender.join();
          if (!pulled.status.ok() && pulled.status.error_code() != grpc::StatusCode::NOT_FOUND) {
            ADD_FAILURE() << "pull: " << pulled.status.error_message();
            ++unexpected;
          }
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(unexpected.load(), 0);
  EXPECT_GT(applied.load(), 0u);
  EXPECT_GT(opened.load(), 0u);
  EXPECT_EQ(GetInfo().version(), applied.load());  // Refused pushes applied nothing.
  EXPECT_TRUE(WaitUntil([&] { return FilesLeft() == 0; })) << FilesLeft() << " files left";
  EXPECT_TRUE(WaitUntil([&] { return server_->staging_pool().in_use() == 0; }));
  EXPECT_FALSE(server_->fault().faulted());
}

}  // namespace
}  // namespace fusedps::integration
