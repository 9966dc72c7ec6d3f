// The C++ client's PushTransaction (pieces written as they come, committed with the step's
// scale) and PullInto (raw elements into the caller's memory), against a real in-process
// server on the CPU backend; the results must equal the host-side AdamW bit for bit.
#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "fusedps/client.h"
#include "server/metrics/metrics_test_util.h"
#include "tests/integration/service_harness.h"

namespace fusedps::integration {
namespace {

const std::vector<TensorDef> kModel = {{"w", {64, 64}, ""}, {"b", {64}, ""}};

class PushTransactionTest : public ServiceTest {
 protected:
  std::unique_ptr<client::Client> MakeClient(int streams) {
    client::ClientOptions options;
    options.streams = streams;
    options.max_chunk_bytes = 2048;  // Many messages, so that every part carries some.
    auto made = client::Client::Create("127.0.0.1:" + std::to_string(server_->port()), options);
    EXPECT_TRUE(made.ok()) << made.status();
    return made.ok() ? *std::move(made) : nullptr;
  }
  static std::vector<client::TensorSize> Sizes() { return {{"w", 4096}, {"b", 64}}; }
  static constexpr uint64_t kWorkspaceBytes = 64 << 10;
  // Registers kModel and opens a workspace of kWorkspaceBytes; null (the failure recorded)
  // when either fails.
  std::unique_ptr<MappedWorkspace> RegisterAndOpenWorkspace() {
    RegisterTensors(kModel);
    if (HasFatalFailure()) return nullptr;
    std::unique_ptr<MappedWorkspace> workspace = MappedWorkspace::Open(*stub_, kWorkspaceBytes);
    EXPECT_NE(workspace->memory, nullptr) << workspace->status.error_message();
    return workspace->memory != nullptr ? std::move(workspace) : nullptr;
  }
};

TEST_F(PushTransactionTest, PiecesWrittenInAnyOrderAreOneStepWithTheCommitsScale) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(kModel));
  for (int streams : {1, 3}) {
    SCOPED_TRACE(streams);
    std::unique_ptr<client::Client> trainer = MakeClient(streams);
    ASSERT_NE(trainer, nullptr);
    for (GradDType dtype : {GradDType::kFloat32, GradDType::kBFloat16}) {
      const auto grads = RandomGrads({"w", "b"}, 100 + streams * 10 + static_cast<int>(dtype));
      const std::string w = Encode(dtype, grads.at("w")), b = Encode(dtype, grads.at("b"));
      const size_t half = 2048 * ElementSize(dtype);
      client::PushOptions options;
      options.grad_dtype =
          dtype == GradDType::kFloat32 ? client::DType::kFloat32 : client::DType::kBFloat16;
      auto push = trainer->BeginPush(options, Sizes());
      ASSERT_TRUE(push.ok()) << push.status();
      // The second half of w, then b, then the first half: pieces come as backward makes them.
      ASSERT_TRUE((*push)->Write({{0, 2048, 2048, w.data() + half}}).ok());
      ASSERT_TRUE((*push)->Write({{1, 0, 64, b.data()}, {0, 0, 2048, w.data()}}).ok());
      EXPECT_EQ((*push)->bytes_written(), w.size() + b.size());
      const float scale = dtype == GradDType::kFloat32 ? 0.5f : 3.0f;
      absl::StatusOr<client::PushResult> result = (*push)->Commit(scale);
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_FALSE(result->step_skipped);
      EXPECT_EQ(result->grad_bytes, w.size() + b.size());
      for (const auto& [name, values] : grads) host_.Step(name, RoundTrip(dtype, values), scale);
      EXPECT_EQ(result->version, server_->engine().version());
    }
  }
  ExpectMatchesHost(4);
}

TEST_F(PushTransactionTest, CancelledOrDestroyedTransactionsApplyNothing) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(kModel));
  const ShardState before = Snapshot();
  std::unique_ptr<client::Client> trainer = MakeClient(2);
  ASSERT_NE(trainer, nullptr);
  const std::string w = Encode(GradDType::kFloat32, RandomGrads({"w"}, 7).at("w"));
  client::PushOptions options;
  options.grad_dtype = client::DType::kFloat32;
  {
    auto push = trainer->BeginPush(options, Sizes());
    ASSERT_TRUE(push.ok()) << push.status();
    ASSERT_TRUE((*push)->Write({{0, 0, 4096, w.data()}}).ok());
    (*push)->Cancel();
    EXPECT_EQ((*push)->Write({{1, 0, 64, w.data()}}).code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ((*push)->Commit(std::nullopt).status().code(), absl::StatusCode::kFailedPrecondition);
  }
  {
    auto push = trainer->BeginPush(options, Sizes());
    ASSERT_TRUE(push.ok()) << push.status();
    ASSERT_TRUE((*push)->Write({{0, 0, 4096, w.data()}}).ok());
  }  // Destroyed uncommitted.
  ASSERT_TRUE(WaitUntil([&] { return server_->staging_pool().in_use() == 0; }));
  ExpectSameState(before, Snapshot());
}

TEST_F(PushTransactionTest, BadPiecesAndMissingOnesFailWithoutApplying) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(kModel));
  const ShardState before = Snapshot();
  std::unique_ptr<client::Client> trainer = MakeClient(2);
  ASSERT_NE(trainer, nullptr);
  const std::string w = Encode(GradDType::kFloat32, RandomGrads({"w"}, 8).at("w"));
  client::PushOptions options;
  options.grad_dtype = client::DType::kFloat32;
  auto push = trainer->BeginPush(options, Sizes());
  ASSERT_TRUE(push.ok()) << push.status();
  EXPECT_EQ((*push)->Write({{2, 0, 1, w.data()}}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*push)->Write({{1, 60, 5, w.data()}}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*push)->Write({{1, 0, 5, nullptr}}).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE((*push)->Write({{0, 0, 4096, w.data()}}).ok());
  // b never comes: the server finds it missing at the commit.
  const absl::StatusOr<client::PushResult> result = (*push)->Commit(std::nullopt);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
  EXPECT_NE(result.status().message().find("'b'"), std::string::npos) << result.status();

  client::PushOptions scaled = options;
  scaled.grad_scale = 2.0f;
  EXPECT_EQ(trainer->BeginPush(scaled, Sizes()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(trainer->BeginPush(options, {}).status().code(), absl::StatusCode::kInvalidArgument);
  // An unknown tensor: the server refuses the header, and Write or Commit says so.
  auto unknown = trainer->BeginPush(options, {{"nope", 4}});
  ASSERT_TRUE(unknown.ok());
  const float grads[4] = {1, 2, 3, 4};
  absl::Status status = (*unknown)->Write({{0, 0, 4, grads}});
  if (status.ok()) status = (*unknown)->Commit(std::nullopt).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  ExpectSameState(before, Snapshot());
}

TEST_F(PushTransactionTest, PullIntoWritesRawElementsOfOneVersion) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(kModel));
  ASSERT_NO_FATAL_FAILURE(PushAndStep(MakePushHeader(v1::DTYPE_FLOAT32), GradDType::kFloat32,
                                      RandomGrads({"w", "b"}, 9)));
  std::unique_ptr<client::Client> trainer = MakeClient(2);
  ASSERT_NE(trainer, nullptr);
  for (GradDType dtype : {GradDType::kFloat32, GradDType::kBFloat16}) {
    SCOPED_TRACE(static_cast<int>(dtype));
    const size_t size = ElementSize(dtype);
    std::string w(4096 * size, '\0'), b(64 * size, '\0');
    client::PullOptions options;
    options.dtype =
        dtype == GradDType::kFloat32 ? client::DType::kFloat32 : client::DType::kBFloat16;
    for (int stream : {0, 1}) {
      auto pulled =
          trainer->PullInto(options, {{"b", b.data(), 64}, {"w", w.data(), 4096}}, stream);
      ASSERT_TRUE(pulled.ok()) << pulled.status();
      EXPECT_EQ(pulled->version, 1u);
      EXPECT_EQ(pulled->steps, (std::vector<int64_t>{1, 1}));
      ExpectSameBytes(w, Encode(dtype, host_.tensor("w").param), static_cast<int>(size), "w");
      ExpectSameBytes(b, Encode(dtype, host_.tensor("b").param), static_cast<int>(size), "b");
    }
  }
  // Optimizer state too, and a target of the wrong size is named.
  std::vector<float> exp_avg(64);
  auto state = trainer->PullInto({{}, client::DType::kFloat32, client::TensorField::kExpAvg},
                                 {{"b", exp_avg.data(), 64}});
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(std::memcmp(exp_avg.data(), host_.tensor("b").exp_avg.data(), 64 * 4), 0);
  std::vector<float> small(10);
  auto wrong = trainer->PullInto({}, {{"b", small.data(), 10}});
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wrong.status().message().find("tensor b has 64 elements"), std::string::npos)
      << wrong.status();
  EXPECT_EQ(trainer->PullInto({}, {{"nope", small.data(), 10}}).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(PushTransactionTest, WaitForReadyConnectsEveryStreamOrSaysHowManyDid) {
  std::unique_ptr<client::Client> trainer = MakeClient(3);
  ASSERT_NE(trainer, nullptr);
  EXPECT_TRUE(trainer->WaitForReady(absl::Seconds(10)).ok());
  // A port nobody listens on (the server's, once it has stopped).
  const int port = server_->port();
  server_->Shutdown(absl::Seconds(5));
  server_.reset();
  client::ClientOptions options;
  options.streams = 2;
  auto orphan = client::Client::Create("127.0.0.1:" + std::to_string(port), options);
  ASSERT_TRUE(orphan.ok());
  const absl::Status status = (*orphan)->WaitForReady(absl::Milliseconds(300));
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_NE(status.message().find("0 of 2 channels connected"), std::string::npos) << status;
}

// Many trainers at once, each committing, cancelling or dropping its transactions: every
// commit is one step, nothing else is applied, and every call ends (the sanitizers' stress of
// RawCall's hold, write queue and slice tracking).
TEST_F(PushTransactionTest, ManyConcurrentTransactionsCommitCancelOrDropCleanly) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(kModel));
  const auto grads = RandomGrads({"w", "b"}, 11);
  const std::string w = Encode(GradDType::kFloat32, grads.at("w"));
  const std::string b = Encode(GradDType::kFloat32, grads.at("b"));
  constexpr int kTrainers = 6, kRounds = 8;
  std::atomic<int> commits{0}, failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kTrainers; ++t) {
    threads.emplace_back([&, t] {
      std::unique_ptr<client::Client> trainer = MakeClient(1 + t % 3);
      if (trainer == nullptr) return;
      client::PushOptions options;
      options.grad_dtype = client::DType::kFloat32;
      for (int round = 0; round < kRounds; ++round) {
        auto push = trainer->BeginPush(options, Sizes());
        if (!push.ok()) {
          ++failures;
          continue;
        }
        const int fate = (t + round) % 3;  // 0: commit, 1: cancel midway, 2: drop midway
        if (!(*push)->Write({{0, 0, 2048, w.data()}}).ok()) ++failures;
        if (fate == 1) {
          (*push)->Cancel();
          continue;
        }
        if (fate == 2) continue;  // Destroyed here, uncommitted.
        if (!(*push)->Write({{0, 2048, 2048, w.data() + 2048 * 4}, {1, 0, 64, b.data()}}).ok()) {
          ++failures;
        }
        if ((*push)->Commit(std::nullopt).ok()) {
          ++commits;
        } else {
          ++failures;
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  ASSERT_TRUE(WaitUntil([&] { return server_->staging_pool().in_use() == 0; }));
  for (int n = 0; n < commits.load(); ++n) {
    for (const auto& [name, values] : grads) host_.Step(name, values, 0.0f);
  }
  ExpectMatchesHost(static_cast<uint64_t>(commits.load()));
}

// Through a same-host workspace (Client::SetWorkspace): the pieces and the pull's targets lie
// in the shared memory, the messages carry their places only, and the results are the same
// bit for bit. A piece outside the workspace still travels as bytes in the same push.
TEST_F(PushTransactionTest, PushesAndPullsThroughAWorkspaceAreTheSameStep) {
  const std::unique_ptr<MappedWorkspace> workspace = RegisterAndOpenWorkspace();
  ASSERT_NE(workspace, nullptr);
  char* memory = workspace->memory;
  constexpr uint64_t kBytes = kWorkspaceBytes;
  for (int streams : {1, 3}) {
    SCOPED_TRACE(streams);
    std::unique_ptr<client::Client> trainer = MakeClient(streams);
    ASSERT_NE(trainer, nullptr);
    trainer->SetWorkspace({workspace->opened.workspace_id(), memory, kBytes});
    const auto grads = RandomGrads({"w", "b"}, 300 + streams);
    const std::string w = Encode(GradDType::kFloat32, grads.at("w"));
    const std::string b = Encode(GradDType::kFloat32, grads.at("b"));
    std::memcpy(memory, w.data(), w.size());  // w in the workspace; b in the caller's memory.
    client::PushOptions options;
    options.grad_dtype = client::DType::kFloat32;
    auto push = trainer->BeginPush(options, Sizes());
    ASSERT_TRUE(push.ok()) << push.status();
    ASSERT_TRUE((*push)->Write({{0, 0, 4096, memory}, {1, 0, 64, b.data()}}).ok());
    EXPECT_EQ((*push)->bytes_written(), w.size() + b.size());
    absl::StatusOr<client::PushResult> result = (*push)->Commit(std::nullopt);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->grad_bytes, w.size() + b.size());
    for (const auto& [name, values] : grads) host_.Step(name, values, 0.0f);

    // Pulled into the workspace (at 32 KiB), and over gRPC: the same bytes.
    char* into = memory + (32 << 10);
    std::memset(into, 0xff, 4096 * 4 + 64 * 4);
    const std::vector<client::PullTarget> targets = {{"w", into, 4096}, {"b", into + 4096 * 4, 64}};
    absl::StatusOr<client::PullIntoResult> pulled = trainer->PullInto({}, targets);
    ASSERT_TRUE(pulled.ok()) << pulled.status();
    EXPECT_EQ(pulled->version, result->version);
    EXPECT_EQ(std::memcmp(into, host_.tensor("w").param.data(), 4096 * 4), 0);
    EXPECT_EQ(std::memcmp(into + 4096 * 4, host_.tensor("b").param.data(), 64 * 4), 0);
    trainer->SetWorkspace({});
  }
  ExpectMatchesHost(2);
}

// Commit with a pull (then_pull): when it returns, the step's params are at the targets in the
// workspace, and pulled_version is the step's version. A target outside the workspace, or a
// push without one, is refused before anything is sent; the push can then be cancelled.
TEST_F(PushTransactionTest, ACommitCarriesItsPullIntoTheWorkspace) {
  const std::unique_ptr<MappedWorkspace> workspace = RegisterAndOpenWorkspace();
  ASSERT_NE(workspace, nullptr);
  char* memory = workspace->memory;
  constexpr uint64_t kBytes = kWorkspaceBytes;
  char* into = memory + (32 << 10);
  const std::vector<client::PullTarget> targets = {{"w", into, 4096}, {"b", into + 4096 * 4, 64}};
  std::unique_ptr<client::Client> trainer = MakeClient(3);
  ASSERT_NE(trainer, nullptr);
  client::PushOptions options;
  options.grad_dtype = client::DType::kFloat32;
  {  // Without a workspace.
    auto push = trainer->BeginPush(options, Sizes());
    ASSERT_TRUE(push.ok()) << push.status();
    const std::string w(4096 * 4, '\0'), b(64 * 4, '\0');
    ASSERT_TRUE((*push)->Write({{0, 0, 4096, w.data()}, {1, 0, 64, b.data()}}).ok());
    absl::StatusOr<client::PushResult> refused =
        (*push)->Commit(std::nullopt, client::DType::kFloat32, targets);
    EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
    EXPECT_NE(refused.status().message().find("without one"), std::string::npos);
    (*push)->Cancel();
  }
  trainer->SetWorkspace({workspace->opened.workspace_id(), memory, kBytes});
  for (int step = 1; step <= 2; ++step) {
    const auto grads = RandomGrads({"w", "b"}, 400 + step);
    const std::string w = Encode(GradDType::kFloat32, grads.at("w"));
    const std::string b = Encode(GradDType::kFloat32, grads.at("b"));
    std::memcpy(memory, w.data(), w.size());
    std::memcpy(memory + w.size(), b.data(), b.size());
    std::memset(into, 0xff, (4096 + 64) * 4);
    auto push = trainer->BeginPush(options, Sizes());
    ASSERT_TRUE(push.ok()) << push.status();
    ASSERT_TRUE((*push)->Write({{0, 0, 4096, memory}, {1, 0, 64, memory + w.size()}}).ok());
    absl::StatusOr<client::PushResult> result =
        (*push)->Commit(2.0f, client::DType::kFloat32, targets);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->pulled_version, result->version);
    for (const auto& [name, values] : grads) host_.Step(name, values, 2.0f);
    EXPECT_EQ(std::memcmp(into, host_.tensor("w").param.data(), 4096 * 4), 0);
    EXPECT_EQ(std::memcmp(into + 4096 * 4, host_.tensor("b").param.data(), 64 * 4), 0);
  }
  {  // A target outside the workspace: nothing sent, nothing applied.
    auto push = trainer->BeginPush(options, Sizes());
    ASSERT_TRUE(push.ok()) << push.status();
    ASSERT_TRUE((*push)->Write({{0, 0, 4096, memory}, {1, 0, 64, memory + 4096 * 4}}).ok());
    std::vector<float> outside(64);
    const std::vector<client::PullTarget> bad = {{"w", into, 4096}, {"b", outside.data(), 64}};
    absl::StatusOr<client::PushResult> refused =
        (*push)->Commit(std::nullopt, client::DType::kFloat32, bad);
    EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
    EXPECT_NE(refused.status().message().find("target b"), std::string::npos);
    (*push)->Cancel();
  }
  trainer->SetWorkspace({});
  ExpectMatchesHost(2);
}

// PushOptions::max_parts caps the calls a push travels as (one per stream by default), and
// the step is the same: a transaction through a workspace, with a piece outside it too, and a
// PushGradients of the same grads. The server counts calls, each part one
// (fusedps_push_requests_total).
TEST_F(PushTransactionTest, MaxPartsCapsTheCallsAPushTravelsAs) {
  const std::unique_ptr<MappedWorkspace> workspace = RegisterAndOpenWorkspace();
  ASSERT_NE(workspace, nullptr);
  char* memory = workspace->memory;
  const auto ok_calls = [&] {
    return static_cast<int>(
        Sample(server_->metrics().ScrapeText(), "fusedps_push_requests_total{code=\"OK\"}"));
  };
  std::unique_ptr<client::Client> trainer = MakeClient(3);
  ASSERT_NE(trainer, nullptr);
  trainer->SetWorkspace({workspace->opened.workspace_id(), memory, kWorkspaceBytes});
  int step = 0;
  for (const uint32_t max_parts : {0u, 1u, 2u, 7u}) {
    SCOPED_TRACE(absl::StrCat("max_parts ", max_parts));
    const int expected_calls = max_parts == 0 || max_parts > 3 ? 3 : static_cast<int>(max_parts);
    client::PushOptions options;
    options.grad_dtype = client::DType::kFloat32;
    options.max_parts = max_parts;
    {  // A transaction: w in the workspace, b in the caller's memory.
      const auto grads = RandomGrads({"w", "b"}, 500 + ++step);
      const std::string w = Encode(GradDType::kFloat32, grads.at("w"));
      const std::string b = Encode(GradDType::kFloat32, grads.at("b"));
      std::memcpy(memory, w.data(), w.size());
      const int before = ok_calls();
      auto push = trainer->BeginPush(options, Sizes());
      ASSERT_TRUE(push.ok()) << push.status();
      ASSERT_TRUE((*push)->Write({{0, 0, 4096, memory}, {1, 0, 64, b.data()}}).ok());
      absl::StatusOr<client::PushResult> result = (*push)->Commit(std::nullopt);
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_EQ(result->grad_bytes, w.size() + b.size());
      EXPECT_EQ(ok_calls() - before, expected_calls);
      for (const auto& [name, values] : grads) host_.Step(name, values, 0.0f);
    }
    {  // PushGradients (2048-byte chunks: 9 of them, enough for every part).
      const auto grads = RandomGrads({"w", "b"}, 500 + ++step);
      const int before = ok_calls();
      absl::StatusOr<client::PushResult> result =
          trainer->PushGradients(options, {{"w", grads.at("w")}, {"b", grads.at("b")}});
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_EQ(ok_calls() - before, expected_calls);
      for (const auto& [name, values] : grads) host_.Step(name, values, 0.0f);
    }
  }
  trainer->SetWorkspace({});
  ExpectMatchesHost(step);
}

// A device workspace is the GPU server's: this CPU server refuses one, and names why; a memory
// kind it does not know is INVALID_ARGUMENT. Neither holds any of the budget.
TEST_F(PushTransactionTest, ADeviceWorkspaceFromACpuServerIsFailedPrecondition) {
  for (const int memory : {static_cast<int>(v1::WORKSPACE_MEMORY_DEVICE), 7}) {
    grpc::ClientContext context;
    SetDeadline(context);
    v1::OpenWorkspaceRequest request;
    request.set_bytes(4096);
    request.set_memory(static_cast<v1::WorkspaceMemory>(memory));
    std::unique_ptr<grpc::ClientReader<v1::OpenWorkspaceResponse>> reader =
        stub_->OpenWorkspace(&context, request);
    v1::OpenWorkspaceResponse opened;
    EXPECT_FALSE(reader->Read(&opened));
    const grpc::Status status = reader->Finish();
    if (memory == 7) {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
      EXPECT_NE(status.error_message().find("memory = 7"), std::string::npos);
    } else {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
          << status.error_message();
      EXPECT_NE(status.error_message().find("cpu backend"), std::string::npos)
          << status.error_message();
    }
  }
  const std::unique_ptr<MappedWorkspace> host = MappedWorkspace::Open(*stub_, 4096);
  EXPECT_NE(host->memory, nullptr) << host->status.error_message();
}

}  // namespace
}  // namespace fusedps::integration
