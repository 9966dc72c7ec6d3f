// Tests of a push header's admission against a real engine, view, retry table and workspaces:
// each verdict, each refusal, the order of the checks, and the waiter's exactly-once rule.
#include "server/ingest/push_admission.h"

#include <sys/stat.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "common/temp_dir.h"
#include "gtest/gtest.h"
#include "server/engine/engine_test_util.h"

namespace fusedps {
namespace {

using Kind = PushVerdict::Kind;

// A waiter that counts its runs and keeps what it was given.
struct WaiterLog {
  std::atomic<int> runs{0};
  absl::StatusOr<PushReply> reply = absl::UnknownError("never ran");
  RetryTable::Waiter Waiter() {
    return [this](absl::StatusOr<PushReply> r) {
      reply = std::move(r);
      runs.fetch_add(1);
    };
  }
};

class PushAdmissionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    workspaces_ = std::make_unique<WorkspaceTable>(WorkspaceOptions{dir_.path(), 1 << 20}, nullptr);
    Make({});
  }
  void TearDown() override {
    engine_.reset();
    workspaces_.reset();
  }

  // A fresh engine in `consistency` mode, with tensors t0 (10 elements) and t1 (3).
  void Make(ConsistencyOptions consistency) {
    engine_.reset();
    engine_ = std::make_unique<UpdateEngine>(MakeCpuBackend({.threads = 1}), &fault_, &retries_,
                                             consistency);
    tensors_ = Register(*engine_, {10, 3});
  }

  PushVerdict Admit(const v1::PushHeader& header, WaiterLog* log,
                    absl::string_view owner = "alice") {
    return AdmitPushHeader(header, {engine_.get(), &retries_, workspaces_.get(), owner},
                           log->Waiter());
  }

  static v1::PushHeader Header(std::string client_id, uint64_t sequence_number) {
    v1::PushHeader header;
    header.set_client_id(std::move(client_id));
    header.set_sequence_number(sequence_number);
    header.set_grad_dtype(v1::DTYPE_FLOAT32);
    return header;
  }

  // The retry table remembers client "c"'s push 7 as applied at version 5.
  void Remember() {
    ASSERT_EQ(retries_.Begin("c", 7).kind, RetryTable::Kind::kNew);
    PushReply reply;
    reply.version = 5;
    reply.tensors_updated = 2;
    reply.grad_bytes = 52;
    retries_.Finish("c", 7, reply);
  }

  TempDir dir_{"fusedps-admission-test"};
  ShardFault fault_;
  RetryTable retries_{100};
  std::unique_ptr<WorkspaceTable> workspaces_;
  std::unique_ptr<UpdateEngine> engine_;
  std::vector<uint32_t> tensors_;
};

TEST_F(PushAdmissionTest, ANewPushIsAdmittedWithItsViewAndCheckedHeader) {
  v1::PushHeader header = Header("c", 1);
  header.add_tensors("t1");
  header.set_grad_dtype(v1::DTYPE_BFLOAT16);
  header.set_part_count(2);
  WaiterLog log;
  const PushVerdict v = Admit(header, &log);
  ASSERT_EQ(v.kind, Kind::kAdmitted) << v.status;
  EXPECT_EQ(v.view, engine_->view());  // The view the header's indices belong to.
  EXPECT_EQ(v.checked.tensors, (std::vector<uint32_t>{tensors_[1]}));
  EXPECT_EQ(v.checked.dtype, GradDType::kBFloat16);
  EXPECT_EQ(v.checked.part_count, 2u);
  EXPECT_EQ(v.checked.workspace, nullptr);
  EXPECT_EQ(log.runs.load(), 0);
  // Admission marks nothing: the engine begins the push when it queues the step.
  EXPECT_EQ(retries_.Lookup("c", 1).kind, RetryTable::Kind::kNew);
}

TEST_F(PushAdmissionTest, AnUntrackedPushIsAdmittedForEveryTensor) {
  WaiterLog log;
  const PushVerdict v = Admit(Header("", 0), &log);
  ASSERT_EQ(v.kind, Kind::kAdmitted) << v.status;
  EXPECT_EQ(v.checked.tensors, tensors_);
  EXPECT_EQ(v.checked.dtype, GradDType::kFloat32);
  EXPECT_EQ(log.runs.load(), 0);
}

TEST_F(PushAdmissionTest, ABadHeaderIsRefusedBeforeTheRetryTableIsAsked) {
  Remember();  // Push 7 of "c" would be answered: the header's checks come first.
  struct Case {
    const char* what;
    std::function<void(v1::PushHeader*)> edit;
    absl::StatusCode code;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"unknown tensor", [](v1::PushHeader* h) { h->add_tensors("nope"); },
       absl::StatusCode::kNotFound, "tensor 'nope' is not registered"},
      {"tensor twice",
       [](v1::PushHeader* h) {
         h->add_tensors("t0");
         h->add_tensors("t0");
       },
       absl::StatusCode::kInvalidArgument, "'t0'"},
      {"dtype", [](v1::PushHeader* h) { h->set_grad_dtype(static_cast<v1::DType>(9)); },
       absl::StatusCode::kInvalidArgument, "header.grad_dtype = 9"},
      {"grad_scale", [](v1::PushHeader* h) { h->set_grad_scale(-1); },
       absl::StatusCode::kInvalidArgument, "header.grad_scale = -1 must be finite and > 0"},
      {"parts", [](v1::PushHeader* h) { h->set_part_index(3); }, absl::StatusCode::kInvalidArgument,
       "header.part_index = 3"},
      {"worker_count", [](v1::PushHeader* h) { h->set_worker_count(2); },
       absl::StatusCode::kUnimplemented, "header.worker_count = 2"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    v1::PushHeader header = Header("c", 7);
    c.edit(&header);
    WaiterLog log;
    const PushVerdict v = Admit(header, &log);
    ASSERT_EQ(v.kind, Kind::kRefused);
    EXPECT_EQ(v.status.code(), c.code) << v.status;
    EXPECT_TRUE(absl::StrContains(v.status.message(), c.message)) << v.status;
    EXPECT_EQ(log.runs.load(), 0);
  }
}

TEST_F(PushAdmissionTest, AWorkspaceMustBeOneOfTheCallersOpenOnes) {
  absl::StatusOr<std::shared_ptr<const Workspace>> mine = workspaces_->Open("alice", 4096);
  ASSERT_TRUE(mine.ok()) << mine.status();
  Remember();
  v1::PushHeader header = Header("c", 7);  // A remembered retry: the workspace comes first.
  WaiterLog log;
  header.set_workspace("0123456789abcdef0123456789abcdef");
  PushVerdict v = Admit(header, &log);
  ASSERT_EQ(v.kind, Kind::kRefused);
  EXPECT_EQ(v.status.code(), absl::StatusCode::kNotFound) << v.status;
  EXPECT_TRUE(absl::StrContains(v.status.message(), "is not open")) << v.status;

  header.set_workspace((*mine)->id());
  v = Admit(header, &log, "bob");  // Another caller's: not told apart from one not open.
  ASSERT_EQ(v.kind, Kind::kRefused);
  EXPECT_EQ(v.status.code(), absl::StatusCode::kNotFound) << v.status;

  header.set_sequence_number(8);
  v = Admit(header, &log, "alice");
  ASSERT_EQ(v.kind, Kind::kAdmitted) << v.status;
  EXPECT_EQ(v.checked.workspace, *mine);  // Held by the verdict, then by the assembly.
  EXPECT_EQ(log.runs.load(), 0);
}

TEST_F(PushAdmissionTest, ARememberedRetryIsAnsweredWithItsReply) {
  Remember();
  WaiterLog log;
  const PushVerdict v = Admit(Header("c", 7), &log);
  ASSERT_EQ(v.kind, Kind::kAnswered) << v.status;
  EXPECT_EQ(v.reply.version, 5u);
  EXPECT_EQ(v.reply.tensors_updated, 2u);
  EXPECT_EQ(v.reply.grad_bytes, 52u);
  EXPECT_TRUE(v.reply.duplicate);
  EXPECT_EQ(log.runs.load(), 0);
}

TEST_F(PushAdmissionTest, AForgottenOldSequenceNumberIsStale) {
  Remember();
  WaiterLog log;
  const PushVerdict v = Admit(Header("c", 3), &log);
  ASSERT_EQ(v.kind, Kind::kRefused);
  EXPECT_EQ(v.status, StalePushError(3, 7));
  EXPECT_EQ(log.runs.load(), 0);
}

TEST_F(PushAdmissionTest, ARetryOfAPushInFlightWaitsForItsReply) {
  ASSERT_EQ(retries_.Begin("c", 7).kind, RetryTable::Kind::kNew);
  WaiterLog log;
  const PushVerdict v = Admit(Header("c", 7), &log);
  ASSERT_EQ(v.kind, Kind::kWaiting) << v.status;
  EXPECT_EQ(log.runs.load(), 0);  // Not before the original is done.
  PushReply reply;
  reply.version = 9;
  retries_.Finish("c", 7, reply);
  ASSERT_EQ(log.runs.load(), 1);
  ASSERT_TRUE(log.reply.ok()) << log.reply.status();
  EXPECT_EQ(log.reply->version, 9u);
  EXPECT_TRUE(log.reply->duplicate);
}

TEST_F(PushAdmissionTest, ARetryOfAPushThatFailsGetsItsError) {
  ASSERT_EQ(retries_.Begin("c", 7).kind, RetryTable::Kind::kNew);
  WaiterLog log;
  ASSERT_EQ(Admit(Header("c", 7), &log).kind, Kind::kWaiting);
  retries_.Abandon("c", 7, absl::InternalError("device lost"));
  ASSERT_EQ(log.runs.load(), 1);
  EXPECT_EQ(log.reply.status(), absl::InternalError("device lost"));
}

TEST_F(PushAdmissionTest, TheConsistencyModeRefusesOnlyAfterTheRetries) {
  ConsistencyOptions bounded;
  bounded.mode = ConsistencyMode::kBounded;
  bounded.max_staleness = 0;
  Make(bounded);
  std::vector<float> grads(AlignedNumel(10) + AlignedNumel(3), 0.5f);
  const ReadyPush push = PushOf(tensors_, {10, 3}, grads);
  ASSERT_TRUE(
      Sync<StepResult>([&](UpdateEngine::Done<StepResult> d) { engine_->Step(&push, d); }).ok());
  ASSERT_EQ(engine_->version(), 1u);
  Remember();  // Push 7 of "c", whatever its base_version.
  WaiterLog log;
  v1::PushHeader header = Header("c", 8);  // base_version 0: one step behind, bound 0.
  PushVerdict v = Admit(header, &log);
  ASSERT_EQ(v.kind, Kind::kRefused);
  EXPECT_EQ(v.status.code(), absl::StatusCode::kAborted) << v.status;
  header.set_sequence_number(7);
  v = Admit(header, &log);
  EXPECT_EQ(v.kind, Kind::kAnswered) << v.status;
  header.set_sequence_number(8);
  header.set_base_version(1);
  v = Admit(header, &log);
  EXPECT_EQ(v.kind, Kind::kAdmitted) << v.status;
  EXPECT_EQ(log.runs.load(), 0);
}

// The waiter runs exactly once for every kWaiting verdict and never for another, while the
// originals finish on another thread (as on the engine's completion thread): the rule the push
// reactor's hold counting rests on.
TEST_F(PushAdmissionTest, TheWaiterRunsOnceExactlyWhenTheVerdictIsWaiting) {
  constexpr uint64_t kPushes = 300;
  constexpr int kRetriers = 3;
  std::atomic<uint64_t> begun{0};
  // By sequence number: how many retriers have their verdict. An odd push is finished only once
  // one has (so at least one waits for it); an even one at once, racing the retriers.
  std::vector<std::atomic<int>> asked(kPushes + 1);
  std::thread original([&] {
    for (uint64_t seq = 1; seq <= kPushes; ++seq) {
      ASSERT_EQ(retries_.Begin("c", seq).kind, RetryTable::Kind::kNew);
      begun.store(seq, std::memory_order_release);
      while (seq % 2 == 1 && asked[seq].load(std::memory_order_acquire) == 0) {
        std::this_thread::yield();
      }
      PushReply reply;
      reply.version = seq;
      retries_.Finish("c", seq, reply);
    }
  });
  // Per retrier, per push: the verdict's kind and the waiter's log.
  std::vector<std::vector<Kind>> kinds(kRetriers);
  std::vector<std::vector<std::unique_ptr<WaiterLog>>> logs(kRetriers);
  std::vector<std::thread> retriers;
  for (int r = 0; r < kRetriers; ++r) {
    retriers.emplace_back([&, r] {
      for (uint64_t seq = 1; seq <= kPushes; ++seq) {
        while (begun.load(std::memory_order_acquire) < seq) std::this_thread::yield();
        logs[r].push_back(std::make_unique<WaiterLog>());
        const PushVerdict v = Admit(Header("c", seq), logs[r].back().get());
        kinds[r].push_back(v.kind);
        asked[seq].fetch_add(1, std::memory_order_release);
        // Waiting for the original, answered once it is done, or stale once the client's
        // last kRepliesPerClient pushes no longer include it.
        if (v.kind == Kind::kAnswered) {
          EXPECT_EQ(v.reply.version, seq);
        } else if (v.kind == Kind::kRefused) {
          EXPECT_EQ(v.status.code(), absl::StatusCode::kAborted) << v.status;
        } else {
          EXPECT_EQ(v.kind, Kind::kWaiting);
        }
      }
    });
  }
  for (std::thread& t : retriers) t.join();
  original.join();  // Every Finish has returned, so every waiter it took has run.
  int waited = 0;
  for (int r = 0; r < kRetriers; ++r) {
    for (uint64_t i = 0; i < kPushes; ++i) {
      SCOPED_TRACE(testing::Message() << "retrier " << r << ", push " << i + 1);
      const WaiterLog& log = *logs[r][i];
      if (kinds[r][i] != Kind::kWaiting) {
        EXPECT_EQ(log.runs.load(), 0);
        continue;
      }
      ++waited;
      ASSERT_EQ(log.runs.load(), 1);
      ASSERT_TRUE(log.reply.ok()) << log.reply.status();
      EXPECT_EQ(log.reply->version, i + 1);
      EXPECT_TRUE(log.reply->duplicate);
    }
  }
  // How many waited depends on the schedule, but every odd push had one.
  EXPECT_GE(waited, static_cast<int>(kPushes / 2));
  std::printf("%d of %d retries waited for their original\n", waited,
              static_cast<int>(kPushes) * kRetriers);
}

}  // namespace
}  // namespace fusedps
