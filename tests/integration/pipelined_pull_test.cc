// PipelinedPull (fusedps/pipelined_pull.h): groups of tensors pulled on the pull's own threads,
// waited for group by group, against a real in-process server on the CPU backend. The bytes
// must equal the host-side AdamW's; a failed group must fail its wait and stop the later ones;
// a pull destroyed before anyone waited must finish its calls first (ASan and TSan run these).
#include "fusedps/pipelined_pull.h"

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fusedps/client.h"
#include "tests/integration/service_harness.h"

namespace fusedps::integration {
namespace {

constexpr int kTensors = 12;

std::vector<TensorDef> Model() {
  std::vector<TensorDef> defs;
  for (int i = 0; i < kTensors; ++i) defs.push_back({"t" + std::to_string(i), {32, 8 + i}, ""});
  return defs;
}

class PipelinedPullTest : public ServiceTest {
 protected:
  std::unique_ptr<client::Client> MakeClient(int streams) {
    client::ClientOptions options;
    options.streams = streams;
    options.max_chunk_bytes = 512;  // Several messages per tensor.
    auto made = client::Client::Create("127.0.0.1:" + std::to_string(server_->port()), options);
    EXPECT_TRUE(made.ok()) << made.status();
    return made.ok() ? *std::move(made) : nullptr;
  }

  // Groups of `per_group` tensors, in order, each landing in its own slot of `buffer`.
  std::vector<client::PipelinedPull::Group> Groups(std::vector<float>* buffer, int per_group) {
    size_t total = 0;
    for (const TensorDef& def : Model()) total += def.shape[0] * def.shape[1];
    buffer->assign(total, -1.0f);
    std::vector<client::PipelinedPull::Group> groups;
    size_t at = 0;
    for (int i = 0; i < kTensors; ++i) {
      if (i % per_group == 0) groups.push_back({{0, {}}});
      const uint64_t numel = host_.tensor("t" + std::to_string(i)).numel;
      groups.back()[0].second.push_back({"t" + std::to_string(i), buffer->data() + at, numel});
      at += numel;
    }
    return groups;
  }

  void ExpectHostValues(const std::vector<float>& buffer, int upto_tensor) {
    size_t at = 0;
    for (int i = 0; i < upto_tensor; ++i) {
      const std::vector<float>& want = host_.tensor("t" + std::to_string(i)).param;
      EXPECT_EQ(std::memcmp(buffer.data() + at, want.data(), want.size() * 4), 0) << "t" << i;
      at += want.size();
    }
  }
};

TEST_F(PipelinedPullTest, EveryGroupLandsAndIsWaitedForInOrder) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(Model()));
  std::vector<std::string> names;
  for (int i = 0; i < kTensors; ++i) names.push_back("t" + std::to_string(i));
  ASSERT_NO_FATAL_FAILURE(
      PushAndStep(MakePushHeader(v1::DTYPE_FLOAT32), GradDType::kFloat32, RandomGrads(names, 3)));
  std::unique_ptr<client::Client> trainer = MakeClient(3);
  ASSERT_NE(trainer, nullptr);
  for (int threads : {1, 4}) {
    SCOPED_TRACE(threads);
    std::vector<float> buffer;
    client::PipelinedPull pull({trainer.get()}, {}, Groups(&buffer, 2), threads);
    ASSERT_EQ(pull.groups(), kTensors / 2);
    ASSERT_TRUE(pull.WaitUpTo(0).ok());
    EXPECT_GE(pull.LandedPrefix(), 1);
    ExpectHostValues(buffer, 2);
    ASSERT_TRUE(pull.WaitUpTo(1000).ok());  // Past the last: all of them.
    EXPECT_EQ(pull.LandedPrefix(), pull.groups());
    ExpectHostValues(buffer, kTensors);
    EXPECT_EQ(pull.Version(0), 1u);
    EXPECT_EQ(pull.Version(1), 0u);  // No such client.
    EXPECT_GT(pull.Seconds(), 0.0);
  }
}

TEST_F(PipelinedPullTest, AFailedGroupFailsItsWaitAndTheGroupsNotYetStarted) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(Model()));
  std::unique_ptr<client::Client> trainer = MakeClient(2);
  ASSERT_NE(trainer, nullptr);
  std::vector<float> buffer;
  std::vector<client::PipelinedPull::Group> groups = Groups(&buffer, 1);
  groups[2][0].second[0].name = "no_such";
  client::PipelinedPull pull({trainer.get()}, {}, std::move(groups), /*threads=*/1);
  EXPECT_TRUE(pull.WaitUpTo(1).ok());
  ExpectHostValues(buffer, 2);
  const absl::Status failed = pull.WaitUpTo(2);
  EXPECT_EQ(failed.code(), absl::StatusCode::kNotFound) << failed;
  // One thread: group 3 starts after group 2 failed, so it is not pulled.
  const absl::Status later = pull.WaitUpTo(3);
  EXPECT_EQ(later.code(), absl::StatusCode::kNotFound) << later;  // The first error up to 3.
  EXPECT_GE(pull.LandedPrefix(), 4);
  EXPECT_EQ(pull.WaitUpTo(pull.groups() - 1).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(pull.LandedPrefix(), pull.groups());
  size_t at = 0;
  for (int i = 0; i < 3; ++i) at += host_.tensor("t" + std::to_string(i)).numel;
  EXPECT_EQ(buffer[at + 1], -1.0f);  // Group 3's first tensor was not written.
  // A client index out of range fails its group, named.
  std::vector<float> other;
  std::vector<client::PipelinedPull::Group> bad = Groups(&other, kTensors);
  bad[0][0].first = 5;
  client::PipelinedPull wrong({trainer.get()}, {}, std::move(bad), 2);
  const absl::Status status = wrong.WaitUpTo(0);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("names client 5 of 1"), std::string::npos) << status;
}

TEST_F(PipelinedPullTest, DestroyedUnwaitedWhilePushesRunFromOtherThreads) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors(Model()));
  std::unique_ptr<client::Client> trainer = MakeClient(4);
  ASSERT_NE(trainer, nullptr);
  std::atomic<bool> stop{false};
  std::thread pusher([&] {
    std::vector<float> grads(32 * (8 + kTensors), 0.01f);
    while (!stop.load()) {
      client::PushOptions options;
      options.grad_dtype = client::DType::kFloat32;
      std::vector<client::TensorGrad> tensors;
      for (int i = 0; i < kTensors; ++i) {
        tensors.push_back(
            {"t" + std::to_string(i),
             absl::MakeConstSpan(grads.data(), host_.tensor("t" + std::to_string(i)).numel)});
      }
      ASSERT_TRUE(trainer->PushGradients(options, tensors).ok());
    }
  });
  std::vector<std::thread> pullers;
  for (int p = 0; p < 3; ++p) {
    pullers.emplace_back([&, p] {
      for (int round = 0; round < 10; ++round) {
        std::vector<float> buffer;
        client::PipelinedPull pull({trainer.get()}, {}, Groups(&buffer, 1 + p), 3);
        if (round % 2 == 0) {
          const absl::Status status = pull.WaitUpTo(pull.groups() - 1);
          EXPECT_TRUE(status.ok()) << status;
        }
        // Odd rounds: destroyed at once, its groups still in flight.
      }
    });
  }
  for (std::thread& t : pullers) t.join();
  stop = true;
  pusher.join();
}

}  // namespace
}  // namespace fusedps::integration
