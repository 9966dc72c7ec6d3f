// The push data path on the CPU backend, over real gRPC: the staging pool's back-pressure, a
// client that cancels mid-push, and pushes interleaved chunk by chunk from many clients.
#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "fusedps/client.h"
#include "tests/integration/service_harness.h"

namespace fusedps::integration {
namespace {

// "w" has 4096 fp32 elements (16 KiB of fp32 grads), "b" 64.
const std::vector<TensorDef> kModel = {{"w", {64, 64}, ""}, {"b", {64}, ""}};
constexpr uint64_t kPushBytes = (4096 + 64) * 4;  // Both tensors' fp32 staging.

class DataPathTest : public ServiceTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = ServiceTest::Options();
    options.staging_pool_bytes = kPushBytes;  // Room for exactly one push at a time.
    return options;
  }

  // Opens a push stream and sends its first `messages_to_send` messages (the first carries the
  // header and one chunk); the caller finishes or cancels it.
  struct OpenPush {
    grpc::ClientContext context;
    v1::PushGradientsResponse response;
    std::unique_ptr<grpc::ClientWriter<v1::PushGradientsRequest>> writer;
    std::vector<v1::PushGradientsRequest> messages;
    size_t sent = 0;
  };
  std::unique_ptr<OpenPush> StartPush(const std::map<std::string, std::vector<float>>& grads,
                                      size_t messages_to_send) {
    auto push = std::make_unique<OpenPush>();
    SetDeadline(push->context);
    push->messages = Messages<v1::PushGradientsRequest>(
        MakePushHeader(v1::DTYPE_FLOAT32), GradChunks(GradDType::kFloat32, grads, 1024), 1);
    push->writer = stub_->PushGradients(&push->context, &push->response);
    for (; push->sent < messages_to_send; ++push->sent) {
      EXPECT_TRUE(push->writer->Write(push->messages[push->sent]));
    }
    return push;
  }
  grpc::Status FinishPush(OpenPush& push) {
    for (; push.sent < push.messages.size(); ++push.sent) {
      EXPECT_TRUE(push.writer->Write(push.messages[push.sent]));
    }
    push.writer->WritesDone();
    return push.writer->Finish();
  }
};

TEST_F(DataPathTest, FullPoolHoldsTheNextPushBackUntilStagingIsReleased) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(kModel));
  const auto grads_a = RandomGrads({"w", "b"}, 10);
  const auto grads_b = RandomGrads({"w", "b"}, 20);
  std::unique_ptr<OpenPush> a = StartPush(grads_a, 3);  // Holds the whole pool, half sent.
  ASSERT_TRUE(WaitUntil([&] { return server_->staging_pool().in_use() == kPushBytes; }));

  std::atomic<bool> b_done{false};
  grpc::Status b_status;
  std::thread b_thread([&] {
    std::unique_ptr<OpenPush> b = StartPush(grads_b, 0);
    b_status = FinishPush(*b);
    b_done = true;
  });
  ASSERT_TRUE(WaitUntil([&] { return server_->staging_pool().waiting() == 1; }));
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_FALSE(b_done.load());  // Its chunks sit unread: back-pressure.
  EXPECT_EQ(server_->engine().version(), 0u);
  EXPECT_LE(server_->staging_pool().in_use(), kPushBytes);  // Never more than the pool.
  // What an operator sees meanwhile on /metrics.
  const std::string text = server_->metrics().ScrapeText();
  for (const std::string& line :
       {absl::StrCat("fusedps_staging_pool_in_use_bytes ", kPushBytes, "\n"),
        absl::StrCat("fusedps_staging_pool_capacity_bytes ", kPushBytes, "\n"),
        std::string("fusedps_staging_pool_waiters 1\n")}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << "not in\n" << text;
  }

  ASSERT_TRUE(FinishPush(*a).ok());
  b_thread.join();
  ASSERT_TRUE(b_status.ok()) << b_status.error_message();
  EXPECT_EQ(server_->engine().version(), 2u);
  // Released when the server is done with each call, just after the client sees its status.
  ASSERT_TRUE(WaitUntil([&] { return server_->staging_pool().in_use() == 0; }));
  // Applied in arrival order: a, then b.
  for (const auto& grads : {grads_a, grads_b}) {
    for (const auto& [name, values] : grads) host_.Step(name, values, 0.0f);
  }
  ExpectMatchesHost(2);
}

TEST_F(DataPathTest, PushLargerThanThePoolIsResourceExhausted) {
  // Each tensor registers on its own (its values fit the pool); a push of both does not fit.
  ASSERT_NO_FATAL_FAILURE(RegisterTensors({{"p", {kPushBytes / 8}, ""}}));
  ASSERT_NO_FATAL_FAILURE(RegisterTensors({{"q", {kPushBytes / 8 + 8}, ""}}));
  const ShardState before = Snapshot();
  auto [status, response] = Push(Messages<v1::PushGradientsRequest>(
      MakePushHeader(v1::DTYPE_FLOAT32),
      GradChunks(GradDType::kFloat32, RandomGrads({"p", "q"}, 5))));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(status.error_message().find("--staging-pool-bytes"), std::string::npos);
  ExpectSameState(before, Snapshot());
}

TEST_F(DataPathTest, CancelledPushAppliesNothingAndReleasesItsStaging) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(kModel));
  ASSERT_NO_FATAL_FAILURE(PushAndStep(MakePushHeader(v1::DTYPE_FLOAT32), GradDType::kFloat32,
                                      RandomGrads({"w", "b"}, 1)));
  const ShardState before = Snapshot();
  // Cancelled after the header (and its first chunk), and after a few more chunks.
  for (size_t sent : {size_t{1}, size_t{3}}) {
    std::unique_ptr<OpenPush> push = StartPush(RandomGrads({"w", "b"}, 30), sent);
    ASSERT_TRUE(WaitUntil([&] { return server_->staging_pool().in_use() == kPushBytes; }));
    push->context.TryCancel();
    EXPECT_EQ(push->writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
    ASSERT_TRUE(WaitUntil([&] { return server_->staging_pool().in_use() == 0; }));
    ExpectSameState(before, Snapshot());
  }
  // The pool is whole again: the next push goes through.
  ASSERT_NO_FATAL_FAILURE(PushAndStep(MakePushHeader(v1::DTYPE_FLOAT32), GradDType::kFloat32,
                                      RandomGrads({"w", "b"}, 2)));
  ExpectMatchesHost(2);
}

// Many clients push at once in 1 KiB messages, so their chunks interleave on the server; each
// push is still one atomic step. Same gradients in every push, so the result does not depend
// on the order: 24 steps.
class InterleavedPushTest : public ServiceTest {};

TEST_F(InterleavedPushTest, PushesFromManyClientsAreEachAppliedAtomically) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(kModel));
  const auto grads = RandomGrads({"w", "b"}, 40);
  const std::vector<v1::TensorChunk> chunks = GradChunks(GradDType::kFloat32, grads, 1024);
  constexpr int kClients = 8, kPushesEach = 3;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      for (int i = 0; i < kPushesEach; ++i) {
        grpc::ClientContext context;
        SetDeadline(context);
        v1::PushGradientsResponse response;
        auto writer = stub_->PushGradients(&context, &response);
        for (const auto& m : Messages<v1::PushGradientsRequest>(
                 MakePushHeader(v1::DTYPE_FLOAT32, "client-" + std::to_string(c), i + 1), chunks,
                 1)) {
          writer->Write(m);
          std::this_thread::yield();
        }
        writer->WritesDone();
        if (!writer->Finish().ok() || response.step_skipped()) ++failures;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  for (int n = 0; n < kClients * kPushesEach; ++n) {
    for (const auto& [name, values] : grads) host_.Step(name, values, 0.0f);
  }
  ExpectMatchesHost(kClients * kPushesEach);
}

}  // namespace
}  // namespace fusedps::integration

namespace fusedps::integration {
namespace {

// Pushes in parts: one push over several concurrent calls (PushHeader.part_index/part_count).
class PushPartsTest : public ServiceTest {
 protected:
  static constexpr absl::Duration kPartWait = absl::Milliseconds(400);

  ServerOptions Options() const override {
    ServerOptions options = ServiceTest::Options();
    options.push_part_wait = kPartWait;
    return options;
  }

  // Sends part `index` of `count` carrying `chunks`, and returns its status and reply.
  std::pair<grpc::Status, v1::PushGradientsResponse> SendPart(
      uint32_t index, uint32_t count, const std::vector<v1::TensorChunk>& chunks,
      const std::string& client_id = "trainer", uint64_t sequence_number = 7) {
    v1::PushHeader header = MakePushHeader(v1::DTYPE_FLOAT32, client_id, sequence_number);
    header.set_part_index(index);
    header.set_part_count(count);
    return Push(Messages<v1::PushGradientsRequest>(header, chunks));
  }
};

TEST_F(PushPartsTest, PartsFromConcurrentCallsAreAppliedOnceWithOneReply) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(kModel));
  const auto grads = RandomGrads({"w", "b"}, 50);
  constexpr uint32_t kParts = 3;
  const auto shares = ShareChunks(GradChunks(GradDType::kFloat32, grads, 1024), kParts);
  std::vector<std::pair<grpc::Status, v1::PushGradientsResponse>> results(kParts);
  std::vector<std::thread> threads;
  for (uint32_t p = 0; p < kParts; ++p) {
    threads.emplace_back([&, p] { results[p] = SendPart(p, kParts, shares[p]); });
  }
  for (std::thread& t : threads) t.join();
  for (const auto& [status, response] : results) {
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.version(), 1u);  // The same step for every part.
    EXPECT_EQ(response.tensors_updated(), 2u);
  }
  for (const auto& [name, values] : grads) host_.Step(name, values, 0.0f);
  ExpectMatchesHost(1);
}

TEST_F(PushPartsTest, ClientWithSeveralStreamsPushesInPartsAppliedOnce) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(kModel));
  client::ClientOptions options;
  options.streams = 3;
  options.max_chunk_bytes = 2048;  // Many messages, so that every part carries some.
  auto trainer = client::Client::Create("127.0.0.1:" + std::to_string(server_->port()), options);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  for (uint32_t step = 1; step <= 2; ++step) {
    const auto grads = RandomGrads({"w", "b"}, 80 + step);
    std::vector<client::TensorGrad> tensors;
    for (const auto& [name, values] : grads) tensors.push_back({name, values});
    client::PushOptions push;
    push.grad_dtype = client::DType::kFloat32;  // What host_ steps with.
    auto result = (*trainer)->PushGradients(push, tensors);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->version, step);
    EXPECT_EQ(result->grad_bytes, (4096 + 64) * 4u);
    for (const auto& [name, values] : grads) host_.Step(name, values, 0.0f);
  }
  ExpectMatchesHost(2);
}

TEST_F(PushPartsTest, AFailingPartAbortsTheOthersAndAppliesNothing) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(kModel));
  const ShardState before = Snapshot();
  auto shares = ShareChunks(GradChunks(GradDType::kFloat32, RandomGrads({"w", "b"}, 60), 1024), 2);
  shares[1].push_back(shares[1].front());  // An overlapping chunk in part 1.
  std::pair<grpc::Status, v1::PushGradientsResponse> first, second;
  std::thread t([&] { first = SendPart(0, 2, shares[0]); });
  second = SendPart(1, 2, shares[1]);
  t.join();
  EXPECT_EQ(second.first.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(first.first.error_code(), grpc::StatusCode::ABORTED);
  ExpectSameState(before, Snapshot());
}

TEST_F(PushPartsTest, APartThatNeverComesFailsThePushAndFreesItsStaging) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(kModel));
  const ShardState before = Snapshot();
  const auto shares =
      ShareChunks(GradChunks(GradDType::kFloat32, RandomGrads({"w", "b"}, 90), 1024), 3);
  // Parts 0 and 1 of 3 come (their calls have no deadline); part 2 never does.
  std::pair<grpc::Status, v1::PushGradientsResponse> first, second;
  const absl::Time start = absl::Now();
  std::thread t([&] { first = SendPart(0, 3, shares[0], "trainer", 11); });
  second = SendPart(1, 3, shares[1], "trainer", 11);
  t.join();
  const absl::Duration waited = absl::Now() - start;
  EXPECT_EQ(first.first.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(second.first.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(second.first.error_message(),
            "only 2 of the push's 3 parts arrived within 400ms of its first "
            "(--push-part-wait-seconds)");
  EXPECT_GE(waited, kPartWait);
  WaitUntil([&] { return server_->staging_pool().in_use() == 0; });
  EXPECT_EQ(server_->staging_pool().in_use(), 0u);
  // Late, part 2 is ABORTED: the push under that name failed.
  EXPECT_EQ(SendPart(2, 3, shares[2], "trainer", 11).first.error_code(), grpc::StatusCode::ABORTED);
  ExpectSameState(before, Snapshot());
}

TEST_F(PushPartsTest, PartHeadersMustAgreeAndNameThePush) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(kModel));
  const ShardState before = Snapshot();
  const auto chunks = GradChunks(GradDType::kFloat32, RandomGrads({"w", "b"}, 70), 1024);
  EXPECT_EQ(SendPart(0, 2, chunks, /*client_id=*/"").first.error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(SendPart(2, 2, chunks).first.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(SendPart(0, 65, chunks).first.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Part 1 says 3 parts where part 0 said 2: both fail, nothing is applied.
  std::pair<grpc::Status, v1::PushGradientsResponse> a;
  std::thread t([&] { a = SendPart(0, 2, ShareChunks(chunks, 2)[0], "trainer", 9); });
  absl::SleepFor(absl::Milliseconds(100));
  const auto b = SendPart(1, 3, ShareChunks(chunks, 2)[1], "trainer", 9);
  t.join();
  EXPECT_EQ(b.first.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(a.first.error_code(), grpc::StatusCode::ABORTED);
  ExpectSameState(before, Snapshot());
}

}  // namespace
}  // namespace fusedps::integration
