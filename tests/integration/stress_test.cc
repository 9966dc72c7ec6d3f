// A stress test of the shard core over real gRPC, in a bounded loop, for the sanitizers (ASan,
// UBSan, TSan): pushes in parts, cancellations mid-push, deadlines that expire while a push waits
// for staging, re-registrations, new registrations, pulls (some abandoned), listings and lr
// changes, all at once against a server with a small staging pool. Afterwards the server must
// be healthy, every byte of staging back, and the shard's version must count the pushes that
// were acknowledged as applied (plus at most those whose deadline expired after they were
// submitted: applied, but never acknowledged).
#include <atomic>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/integration/service_harness.h"

namespace fusedps::integration {
namespace {

constexpr int kRounds = 40;  // Per thread; bounded so that the test ends under TSan too.
const std::vector<TensorDef> kModel = {{"w", {64, 64}, ""}, {"b", {64}, ""}, {"e", {0}, ""}};
constexpr uint64_t kPushBytes = (4096 + 64) * 4;

class StressTest : public ServiceTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = ServiceTest::Options();
    options.staging_pool_bytes = 3 * kPushBytes;  // Back-pressure most of the time.
    options.push_part_wait = absl::Seconds(2);    // Part 0 cancelled before it joins: others wait.
    options.call_idle = absl::Milliseconds(500);
    return options;
  }

  // A stub on a TCP connection of its own, as each part of a real client's push has: pushes
  // waiting for staging are not read, and on one shared connection their data would fill
  // HTTP/2's connection window and hold back every other call on it.
  std::unique_ptr<v1::ParameterService::Stub> OwnConnection() {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    return v1::ParameterService::NewStub(grpc::CreateCustomChannel(
        "127.0.0.1:" + std::to_string(server_->port()), grpc::InsecureChannelCredentials(), args));
  }

  // Sends `messages` on a new call of its own connection; cancels it after `cancel_after`
  // messages when >= 0; a deadline of `deadline`. Returns the status and, when OK, the reply.
  std::pair<grpc::Status, v1::PushGradientsResponse> Send(
      const std::vector<v1::PushGradientsRequest>& messages, int cancel_after,
      absl::Duration deadline) {
    std::unique_ptr<v1::ParameterService::Stub> stub = OwnConnection();
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    v1::PushGradientsResponse response;
    auto writer = stub->PushGradients(&context, &response);
    for (size_t i = 0; i < messages.size(); ++i) {
      if (static_cast<int>(i) == cancel_after) {
        context.TryCancel();
        break;
      }
      if (!writer->Write(messages[i])) break;
    }
    writer->WritesDone();
    return {writer->Finish(), response};
  }

  std::atomic<uint64_t> applied_{0};
  std::atomic<uint64_t> expired_{0};  // Deadlines that expired: maybe applied, unacknowledged.
};

TEST_F(StressTest, EverythingAtOnceLeavesAConsistentShard) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(kModel));
  std::atomic<int> failures{0};
  const auto count = [&](const grpc::Status& status, const v1::PushGradientsResponse& reply) {
    if (status.ok() && !reply.step_skipped() && !reply.duplicate()) ++applied_;
  };
  std::vector<std::thread> threads;
  // Pushes in parts, some with a part cancelled, each retried once under the same key.
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(100 + t);
      for (int round = 0; round < kRounds; ++round) {
        const uint32_t parts = 1 + rng() % 3;
        const uint64_t sequence = round + 1;
        const auto shares = ShareChunks(
            GradChunks(GradDType::kFloat32, RandomGrads({"w", "b"}, rng()), 1024), parts);
        std::vector<std::thread> senders;
        const bool cancel_one = rng() % 4 == 0;
        for (uint32_t p = 0; p < parts; ++p) {
          const std::vector<v1::TensorChunk>& share = shares[p];
          // Named: the registrations below add tensors, which "every tensor" would include.
          v1::PushHeader header =
              MakePushHeader(v1::DTYPE_FLOAT32, absl::StrCat("parts-", t), sequence, {"w", "b"});
          header.set_part_index(p);
          header.set_part_count(parts);
          senders.emplace_back([&, p, header, share] {
            const auto messages = Messages<v1::PushGradientsRequest>(header, share, 1);
            auto [status, reply] = Send(messages, cancel_one && p == 0 ? 2 : -1, absl::Seconds(10));
            if (p == 0) count(status, reply);
          });
        }
        for (std::thread& s : senders) s.join();
      }
    });
  }
  // Single-call pushes with deadlines short enough to expire while waiting for staging.
  threads.emplace_back([&] {
    std::mt19937 rng(7);
    for (int round = 0; round < kRounds; ++round) {
      const auto messages = Messages<v1::PushGradientsRequest>(
          MakePushHeader(v1::DTYPE_BFLOAT16, "", 0, {"w", "b"}),
          GradChunks(GradDType::kBFloat16, RandomGrads({"w", "b"}, rng()), 2048), 1);
      auto [status, reply] = Send(messages, -1, absl::Milliseconds(1 + rng() % 20));
      count(status, reply);
      if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) ++expired_;
    }
  });
  // Registrations: the model again (no staging), and new tensors.
  threads.emplace_back([&] {
    for (int round = 0; round < kRounds; ++round) {
      v1::RegisterTensorsResponse response;
      std::vector<v1::TensorChunk> chunks;
      v1::RegisterTensorsHeader header;
      for (const TensorDef& d : kModel) {
        v1::TensorSpec* spec = header.add_tensors();
        spec->set_name(d.name);
        for (int64_t s : d.shape) spec->add_shape(s);
      }
      v1::TensorSpec* fresh = header.add_tensors();
      fresh->set_name(absl::StrCat("fresh-", round));
      fresh->add_shape(100 + round);
      const std::vector<float> values(100 + round, 0.5f);
      chunks.push_back(Chunk(fresh->name(), 0, Encode(GradDType::kFloat32, values)));
      if (RegisterTensors(Messages<v1::RegisterTensorsRequest>(header, chunks), &response).ok()) {
        EXPECT_EQ(response.tensors_existing(), kModel.size());
      } else {
        ++failures;
      }
    }
  });
  // Pulls, some abandoned after their first message; listings; lr changes.
  threads.emplace_back([&] {
    for (int round = 0; round < kRounds; ++round) {
      grpc::ClientContext context;
      SetDeadline(context);
      v1::PullParametersRequest request;
      request.set_max_chunk_bytes(1024);
      auto reader = stub_->PullParameters(&context, request);
      v1::PullParametersResponse message;
      reader->Read(&message);
      if (round % 3 == 0) context.TryCancel();
      while (reader->Read(&message)) {
      }
      reader->Finish().IgnoreError();
      grpc::ClientContext list_context;
      SetDeadline(list_context);
      v1::ListTensorsResponse list;
      if (!stub_->ListTensors(&list_context, {}, &list).ok()) ++failures;
      grpc::ClientContext lr_context;
      SetDeadline(lr_context);
      v1::SetHyperparametersRequest lr;
      lr.mutable_hyperparameters()->set_lr(1e-3 * (1 + round % 3));
      v1::SetHyperparametersResponse changed;
      if (!stub_->SetHyperparameters(&lr_context, lr, &changed).ok()) ++failures;
    }
  });
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);

  // Everything given back; the version counts exactly the pushes acknowledged as applied.
  WaitUntil([&] { return server_->staging_pool().in_use() == 0; }, absl::Seconds(20));
  EXPECT_EQ(server_->staging_pool().in_use(), 0u);
  EXPECT_TRUE(server_->staging_pool().CheckInvariants().ok());
  EXPECT_FALSE(server_->fault().faulted());
  const v1::GetInfoResponse info = GetInfo();
  EXPECT_GE(info.version(), applied_.load());
  EXPECT_LE(info.version(), applied_.load() + expired_.load());
  EXPECT_GT(applied_.load(), 0u);
  EXPECT_EQ(info.tensor_count(), kModel.size() + kRounds);
}

}  // namespace
}  // namespace fusedps::integration
