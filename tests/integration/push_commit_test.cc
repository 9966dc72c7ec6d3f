// Pushes whose grad_scale comes at the end (PushHeader.commit_at_end, PushCommit), on the CPU
// backend over real gRPC: the step waits for the commit and uses its scale; every way to get
// the commit wrong fails the push and leaves the shard bit-identical.
#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <thread>

#include "server/metrics/metrics_test_util.h"
#include "tests/integration/service_harness.h"

namespace fusedps::integration {
namespace {

const std::vector<TensorDef> kModel = {{"w", {64, 64}, ""}, {"b", {64}, ""}};

class PushCommitTest : public ServiceTest {
 protected:
  static v1::PushHeader CommitHeader(const std::string& client_id = "trainer",
                                     uint64_t sequence_number = 1, uint32_t part_index = 0,
                                     uint32_t part_count = 0) {
    v1::PushHeader header = MakePushHeader(v1::DTYPE_FLOAT32, client_id, sequence_number);
    header.set_commit_at_end(true);
    header.set_part_index(part_index);
    header.set_part_count(part_count);
    return header;
  }
  // A commit message, with a grad_scale when scale > 0.
  static v1::PushGradientsRequest Commit(float scale) {
    v1::PushGradientsRequest message;
    message.mutable_commit();  // Present even without a scale.
    if (scale > 0) message.mutable_commit()->set_grad_scale(scale);
    return message;
  }
  // header, one message per chunk, then `commit` when given.
  static std::vector<v1::PushGradientsRequest> WithCommit(
      const v1::PushHeader& header, const std::vector<v1::TensorChunk>& chunks,
      std::optional<v1::PushGradientsRequest> commit) {
    std::vector<v1::PushGradientsRequest> messages =
        Messages<v1::PushGradientsRequest>(header, chunks);
    if (commit.has_value()) messages.push_back(*std::move(commit));
    return messages;
  }
};

TEST_F(PushCommitTest, TheStepWaitsForTheCommitAndUsesItsScale) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(kModel));
  uint64_t sequence = 0;
  // No scale, a scale >= 1, and one < 1 (whose finiteness is checked again at the end).
  for (float scale : {0.0f, 4.0f, 0.25f}) {
    const auto grads = RandomGrads({"w", "b"}, 10 + ++sequence);
    auto [status, response] =
        Push(WithCommit(CommitHeader("trainer", sequence),
                        GradChunks(GradDType::kFloat32, grads, 4096), Commit(scale)));
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_FALSE(response.step_skipped());
    EXPECT_EQ(response.version(), sequence);
    for (const auto& [name, values] : grads) host_.Step(name, values, scale);
  }
  ExpectMatchesHost(3);
}

TEST_F(PushCommitTest, PartsApplyOnceTheCommitOfAnyPartHasCome) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(kModel));
  const auto grads = RandomGrads({"w", "b"}, 20);
  constexpr uint32_t kParts = 3;
  const auto shares = ShareChunks(GradChunks(GradDType::kFloat32, grads, 2048), kParts);
  std::vector<std::pair<grpc::Status, v1::PushGradientsResponse>> results(kParts);
  std::vector<std::thread> threads;
  for (uint32_t p = 0; p < kParts; ++p) {
    threads.emplace_back([&, p] {
      // Part 1 carries the commit, after its own chunks.
      results[p] = Push(WithCommit(CommitHeader("trainer", 5, p, kParts), shares[p],
                                   p == 1 ? std::optional(Commit(8.0f)) : std::nullopt));
    });
  }
  for (std::thread& t : threads) t.join();
  for (const auto& [status, response] : results) {
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.version(), 1u);
  }
  for (const auto& [name, values] : grads) host_.Step(name, values, 8.0f);
  ExpectMatchesHost(1);
}

TEST_F(PushCommitTest, ACommitScaleThatOverflowsAGradientSkipsTheStep) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(kModel));
  const ShardState before = Snapshot();
  auto grads = RandomGrads({"w", "b"}, 30);
  grads["w"][17] = 3e38f;  // Finite, but not once divided by 0.01.
  auto [status, response] =
      Push(WithCommit(CommitHeader(), GradChunks(GradDType::kFloat32, grads, 4096), Commit(0.01f)));
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(response.step_skipped());
  EXPECT_EQ(response.skip_reason(), "non_finite_grad");
  ExpectSameState(before, Snapshot());
}

TEST_F(PushCommitTest, AMissingSecondOrMisplacedCommitFailsThePushAndChangesNothing) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(kModel));
  const ShardState before = Snapshot();
  const auto chunks = GradChunks(GradDType::kFloat32, RandomGrads({"w", "b"}, 40), 4096);
  struct Case {
    std::string what;
    std::vector<v1::PushGradientsRequest> messages;
    std::string message;  // A part of the error's message.
  };
  std::vector<Case> cases;
  cases.push_back({"no commit", WithCommit(CommitHeader("c", 1), chunks, std::nullopt),
                   "ended without its commit"});
  {
    auto messages = WithCommit(CommitHeader("c", 2), chunks, Commit(2.0f));
    messages.push_back(Commit(2.0f));
    cases.push_back({"two commits", messages, "after its commit"});
  }
  {
    auto messages = WithCommit(CommitHeader("c", 3), chunks, Commit(2.0f));
    std::swap(messages[1], messages.back());  // A chunk after the commit.
    cases.push_back({"a chunk after the commit", messages, "after its commit"});
  }
  {
    v1::PushHeader header = MakePushHeader(v1::DTYPE_FLOAT32, "c", 5);  // No commit_at_end.
    cases.push_back({"a commit without commit_at_end", WithCommit(header, chunks, Commit(2.0f)),
                     "commit_at_end is false"});
  }
  {
    v1::PushHeader header = CommitHeader("c", 6);
    header.set_grad_scale(2.0f);
    cases.push_back({"grad_scale with commit_at_end", WithCommit(header, chunks, Commit(2.0f)),
                     "header.grad_scale must be unset"});
  }
  for (float bad :
       {-1.0f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    v1::PushGradientsRequest commit;
    commit.mutable_commit()->set_grad_scale(bad);
    cases.push_back({"commit.grad_scale " + std::to_string(bad),
                     WithCommit(CommitHeader("c", 7), chunks, commit), "commit.grad_scale"});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    auto [status, response] = Push(c.messages);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_NE(status.error_message().find(c.message), std::string::npos) << status.error_message();
  }
  ExpectSameState(before, Snapshot());
  ASSERT_TRUE(WaitUntil([&] { return server_->staging_pool().in_use() == 0; }));
}

TEST_F(PushCommitTest, TwoPartsThatBothCommitFailThePush) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(kModel));
  const ShardState before = Snapshot();
  const auto shares =
      ShareChunks(GradChunks(GradDType::kFloat32, RandomGrads({"w", "b"}, 60), 2048), 2);
  std::pair<grpc::Status, v1::PushGradientsResponse> results[2];
  std::thread t(
      [&] { results[0] = Push(WithCommit(CommitHeader("c", 9, 0, 2), shares[0], Commit(2.0f))); });
  results[1] = Push(WithCommit(CommitHeader("c", 9, 1, 2), shares[1], Commit(2.0f)));
  t.join();
  // The later commit's part gets INVALID_ARGUMENT, the other part ABORTED.
  std::vector<grpc::StatusCode> codes = {results[0].first.error_code(),
                                         results[1].first.error_code()};
  std::sort(codes.begin(), codes.end());
  EXPECT_EQ(codes, (std::vector<grpc::StatusCode>{grpc::StatusCode::INVALID_ARGUMENT,
                                                  grpc::StatusCode::ABORTED}));
  for (const auto& [status, response] : results) {
    if (status.error_code() == grpc::StatusCode::INVALID_ARGUMENT) {
      EXPECT_NE(status.error_message().find("second commit"), std::string::npos)
          << status.error_message();
    }
  }
  ExpectSameState(before, Snapshot());
}

TEST_F(PushCommitTest, ACancelledPushIsNeverApplied) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(kModel));
  const ShardState before = Snapshot();
  const auto messages =
      WithCommit(CommitHeader(), GradChunks(GradDType::kFloat32, RandomGrads({"w", "b"}, 50), 4096),
                 std::nullopt);
  grpc::ClientContext context;
  SetDeadline(context);
  v1::PushGradientsResponse response;
  auto writer = stub_->PushGradients(&context, &response);
  for (const auto& m : messages) ASSERT_TRUE(writer->Write(m));
  // Every chunk is staged; the trainer decides not to commit (a local inf, say).
  ASSERT_TRUE(WaitUntil([&] { return server_->staging_pool().in_use() > 0; }));
  context.TryCancel();
  EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  ASSERT_TRUE(WaitUntil([&] { return server_->staging_pool().in_use() == 0; }));
  ExpectSameState(before, Snapshot());
}

// A commit that carries a pull (PushCommit.pull) through the push's workspace: the reply comes
// once the step's params are there, with the version read; every bad pull is refused as the
// commit arrives, naming commit.pull's field, and nothing is applied.
class CommitPullTest : public PushCommitTest {
 protected:
  static constexpr uint64_t kBytes = 64 << 10;
  static constexpr uint64_t kInto = 32 << 10;  // Where the pulls land in the workspace.
  // A commit with a pull of w and b in `dtype` at kInto (b right after w).
  static v1::PushGradientsRequest CommitPulling(v1::DType dtype = v1::DTYPE_FLOAT32) {
    v1::PushGradientsRequest message = Commit(0.0f);
    v1::PullParametersRequest* pull = message.mutable_commit()->mutable_pull();
    pull->set_dtype(dtype);
    pull->add_tensors("w");
    pull->add_tensors("b");
    pull->add_workspace_offsets_bytes(kInto);
    pull->add_workspace_offsets_bytes(kInto + 4096 * 4);
    return message;
  }
};

TEST_F(CommitPullTest, TheReplyComesWithTheStepsParamsInTheWorkspace) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(kModel));
  const std::unique_ptr<MappedWorkspace> workspace = MappedWorkspace::Open(*stub_, kBytes);
  ASSERT_NE(workspace->memory, nullptr) << workspace->status.error_message();
  char* into = workspace->memory + kInto;
  const auto metric = [&](const std::string& series) {
    return Sample(server_->metrics().ScrapeText(), series);
  };
  const auto pulled_bytes = [&] { return metric("fusedps_pull_bytes_total"); };
  const auto pulls = [&] { return metric("fusedps_pull_requests_total{code=\"OK\"}"); };
  for (uint64_t sequence = 1; sequence <= 2; ++sequence) {
    const auto grads = RandomGrads({"w", "b"}, 60 + static_cast<int>(sequence));
    std::memset(into, 0xff, (4096 + 64) * 4);
    const double bytes_before = pulled_bytes(), pulls_before = pulls();
    v1::PushHeader header = CommitHeader("trainer", sequence);
    header.set_workspace(workspace->opened.workspace_id());
    auto [status, response] =
        Push(WithCommit(header, GradChunks(GradDType::kFloat32, grads, 4096), CommitPulling()));
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.version(), sequence);
    EXPECT_EQ(response.pulled_version(), sequence);
    for (const auto& [name, values] : grads) host_.Step(name, values, 0.0f);
    EXPECT_EQ(std::memcmp(into, host_.tensor("w").param.data(), 4096 * 4), 0);
    EXPECT_EQ(std::memcmp(into + 4096 * 4, host_.tensor("b").param.data(), 64 * 4), 0);
    // What the commit wrote counts as pulled bytes (/metrics), in no pull call.
    EXPECT_EQ(pulled_bytes() - bytes_before, (4096 + 64) * 4);
    EXPECT_EQ(pulls(), pulls_before);
  }
  ExpectMatchesHost(2);
  // A retry of the last push is answered from the retry table: no pull, pulled_version 0.
  v1::PushHeader header = CommitHeader("trainer", 2);
  header.set_workspace(workspace->opened.workspace_id());
  auto [status, response] = Push(WithCommit(
      header, GradChunks(GradDType::kFloat32, RandomGrads({"w", "b"}, 62), 4096), CommitPulling()));
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(response.duplicate());
  EXPECT_EQ(response.pulled_version(), 0u);
  ExpectMatchesHost(2);
}

TEST_F(CommitPullTest, ABadPullIsRefusedAtTheCommitAndNothingIsApplied) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(kModel));
  const std::unique_ptr<MappedWorkspace> workspace = MappedWorkspace::Open(*stub_, kBytes);
  ASSERT_NE(workspace->memory, nullptr) << workspace->status.error_message();
  const ShardState before = Snapshot();
  const auto chunks = GradChunks(GradDType::kFloat32, RandomGrads({"w", "b"}, 70), 4096);
  struct Case {
    std::string what;
    bool through_workspace;
    v1::PushGradientsRequest commit;
    grpc::StatusCode code;
    std::string message;  // A part of the error's message.
  };
  std::vector<Case> cases;
  cases.push_back({"no workspace", false, CommitPulling(), grpc::StatusCode::INVALID_ARGUMENT,
                   "commit.pull in a push without a workspace"});
  {
    v1::PushGradientsRequest commit = CommitPulling();
    commit.mutable_commit()->mutable_pull()->set_workspace("another");
    cases.push_back({"another workspace", true, commit, grpc::StatusCode::INVALID_ARGUMENT,
                     "commit.pull.workspace = 'another'"});
  }
  {
    v1::PushGradientsRequest commit = CommitPulling();
    commit.mutable_commit()->mutable_pull()->set_model("other");
    cases.push_back({"another model", true, commit, grpc::StatusCode::INVALID_ARGUMENT,
                     "commit.pull.model = 'other'"});
  }
  {
    v1::PushGradientsRequest commit = CommitPulling();
    commit.mutable_commit()->mutable_pull()->set_tensors(1, "nope");
    cases.push_back(
        {"an unknown tensor", true, commit, grpc::StatusCode::NOT_FOUND, "commit.pull: "});
  }
  {
    v1::PushGradientsRequest commit = CommitPulling();
    commit.mutable_commit()->mutable_pull()->set_workspace_offsets_bytes(1, kInto + 4);
    cases.push_back({"overlapping targets", true, commit, grpc::StatusCode::INVALID_ARGUMENT,
                     "commit.pull: workspace_offsets_bytes[1] overlaps"});
  }
  {
    v1::PushGradientsRequest commit = CommitPulling();
    commit.mutable_commit()->mutable_pull()->set_workspace_offsets_bytes(0, kBytes - 4);
    cases.push_back({"past the workspace", true, commit, grpc::StatusCode::INVALID_ARGUMENT,
                     "commit.pull: workspace_offsets_bytes[0]"});
  }
  cases.push_back({"bf16 of fp32 values", true, CommitPulling(v1::DTYPE_BFLOAT16),
                   grpc::StatusCode::FAILED_PRECONDITION, "commit.pull.dtype asks for 16-bit"});
  uint64_t sequence = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    v1::PushHeader header = CommitHeader("c", ++sequence);
    if (c.through_workspace) header.set_workspace(workspace->opened.workspace_id());
    auto [status, response] = Push(WithCommit(header, chunks, c.commit));
    EXPECT_EQ(status.error_code(), c.code) << status.error_message();
    EXPECT_NE(status.error_message().find(c.message), std::string::npos) << status.error_message();
  }
  ExpectSameState(before, Snapshot());
  ASSERT_TRUE(WaitUntil([&] { return server_->staging_pool().in_use() == 0; }));
}

}  // namespace
}  // namespace fusedps::integration
