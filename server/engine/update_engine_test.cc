// Tests of the update engine: one writer, queued steps, readers that never wait, registration in
// phases, faults that stop the shard, retries applied once.
#include "server/engine/update_engine.h"

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "common/notification.h"
#include "gtest/gtest.h"
#include "kernels/fault_injection.h"
#include "kernels/forwarding_backend.h"
#include "server/engine/engine_test_util.h"

namespace fusedps {
namespace {

// A CPU backend whose queued work "runs" until the test opens a gate: Wait blocks while the gate
// is closed, like a GPU still busy with a kernel.
class GatedBackend final : public ForwardingBackend {
 public:
  explicit GatedBackend(std::unique_ptr<OptimizerBackend> inner)
      : ForwardingBackend(std::move(inner)) {}
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  int steps_queued() const { return steps_queued_.load(); }
  int waiting() const { return waiting_.load(); }

  absl::StatusOr<StepOutcome> Step(const StepRequest& r) override {
    ++steps_queued_;
    absl::StatusOr<StepOutcome> outcome = ForwardingBackend::Step(r);
    if (outcome.ok() && outcome->marker == 0 && !outcome->skipped) {
      outcome->marker = *inner().Mark();
    }
    return outcome;
  }
  absl::StatusOr<WorkDone> Wait(Marker marker) override {
    ++waiting_;
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return open_; });
    --waiting_;
    return ForwardingBackend::Wait(marker);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
  std::atomic<int> steps_queued_{0}, waiting_{0};
};

class EngineTest : public ::testing::Test {
 protected:
  ShardFault fault_;
  RetryTable retries_{100};
};

TEST_F(EngineTest, StepsAdvanceTheVersionAndStepsInOrder) {
  UpdateEngine engine(MakeCpuBackend({.threads = 1}), &fault_, &retries_);
  const std::vector<uint64_t> sizes = {100, 7};
  const std::vector<uint32_t> tensors = Register(engine, sizes);
  std::vector<float> grads(AlignedNumel(100) + AlignedNumel(7), 0.5f);
  const ReadyPush first = PushOf(tensors, sizes, grads), second = PushOf(tensors, sizes, grads);
  std::vector<absl::StatusOr<StepResult>> results;
  std::mutex mu;
  Notification both;
  const auto done = [&](absl::StatusOr<StepResult> r) {
    std::lock_guard<std::mutex> lock(mu);
    results.push_back(r);
    if (results.size() == 2) both.Notify();
  };
  engine.Step(&first, done);
  engine.Step(&second, done);
  both.WaitForNotification();
  ASSERT_TRUE(results[0].ok() && results[1].ok());
  EXPECT_EQ(results[0]->reply.version, 1u);
  EXPECT_EQ(results[1]->reply.version, 2u);
  EXPECT_EQ(engine.version(), 2u);
  std::vector<int64_t> steps;
  EXPECT_EQ(engine.Steps(tensors, &steps), 2u);
  EXPECT_EQ(steps, (std::vector<int64_t>{2, 2}));
}

// Readers answer while a step's device work is still running, and later steps are queued before
// the first one is done: no host round trip between them. A retry of a step in flight gets that
// step's reply once it is done.
TEST_F(EngineTest, QueuedStepsRunWhileTheFirstIsStillOnTheDevice) {
  auto gated = std::make_unique<GatedBackend>(MakeCpuBackend({.threads = 1}));
  GatedBackend* backend = gated.get();
  UpdateEngine engine(std::move(gated), &fault_, &retries_);
  // Registration needs no marker, so the gate can stay closed from the start.
  const std::vector<uint64_t> sizes = {64};
  const std::vector<uint32_t> tensors = Register(engine, sizes);
  std::vector<float> grads(64, 0.25f);
  std::vector<ReadyPush> pushes(3, PushOf(tensors, sizes, grads, "c", 1));
  pushes[1].sequence_number = 2;
  pushes[2].sequence_number = 3;
  std::atomic<int> acknowledged{0};
  for (const ReadyPush& push : pushes) {
    engine.Step(&push, [&](absl::StatusOr<StepResult> r) {
      EXPECT_TRUE(r.ok()) << r.status();
      ++acknowledged;
    });
  }
  absl::StatusOr<StepResult> retry;
  Notification retried;
  engine.Step(&pushes[0], [&](absl::StatusOr<StepResult> r) {
    retry = r;
    retried.Notify();
  });
  // All three are queued on the backend although the first has not finished on the device.
  for (int i = 0; i < 1000 && (backend->steps_queued() < 3 || backend->waiting() < 1); ++i) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  EXPECT_EQ(backend->steps_queued(), 3);
  EXPECT_EQ(backend->waiting(), 1);  // The completion path waits for the first.
  EXPECT_EQ(acknowledged.load(), 0);
  // Readers answer meanwhile, with the last completed state.
  EXPECT_EQ(engine.version(), 0u);
  std::vector<int64_t> steps;
  EXPECT_EQ(engine.Steps(tensors, &steps), 0u);
  EXPECT_EQ(steps[0], 0);
  EXPECT_EQ(engine.view()->tensor_count(), 1u);
  EXPECT_FALSE(retried.HasBeenNotified());
  backend->Open();
  for (int i = 0; i < 1000 && acknowledged.load() < 3; ++i) absl::SleepFor(absl::Milliseconds(2));
  EXPECT_EQ(acknowledged.load(), 3);
  EXPECT_EQ(engine.version(), 3u);
  retried.WaitForNotification();
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_TRUE(retry->reply.duplicate);
  EXPECT_EQ(retry->reply.version, 1u);
  EXPECT_EQ(backend->steps_queued(), 3);  // The retry queued nothing.
}

TEST_F(EngineTest, RegistrationIsInvisibleUntilCommittedAndAbortRemovesIt) {
  UpdateEngine engine(MakeCpuBackend({.threads = 1}), &fault_, &retries_);
  const std::vector<TensorMeta> metas = {{"a", {4}, 0, 4}};
  ASSERT_EQ(
      *Sync<uint32_t>([&](UpdateEngine::Done<uint32_t> d) { engine.BeginRegistration(metas, d); }),
      0u);
  EXPECT_EQ(engine.view()->tensor_count(), 0u);
  // One registration at a time.
  EXPECT_EQ(Sync<uint32_t>([&](UpdateEngine::Done<uint32_t> d) {
              engine.BeginRegistration({{"b", {1}, 0, 1}}, d);
            })
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(Sync<bool>([&](UpdateEngine::Done<bool> d) { engine.AbortRegistration(d); }).ok());
  EXPECT_EQ(engine.view()->tensor_count(), 0u);
  // The slot is free again, and the next registration gets index 0.
  EXPECT_EQ(Register(engine, {8}), std::vector<uint32_t>{0});
  EXPECT_EQ(engine.view()->tensor(0).name, "t0");
}

// Registration is all or nothing: when the device runs out of memory nothing is added, and the
// next registration gets the indices the view expects.
TEST_F(EngineTest, OutOfMemoryAddsNothing) {
  InjectedFaults faults;
  faults.add_tensors = 1;
  UpdateEngine engine(MakeFaultInjectingBackend(MakeCpuBackend({.threads = 1}), faults), &fault_,
                      &retries_);
  absl::StatusOr<uint32_t> first = Sync<uint32_t>([&](UpdateEngine::Done<uint32_t> d) {
    engine.BeginRegistration({{"big", {1000}, 0, 1000}}, d);
  });
  EXPECT_EQ(first.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(fault_.faulted());
  EXPECT_EQ(Register(engine, {5, 6}), (std::vector<uint32_t>{0, 1}));
  std::vector<float> grads(16, 1.0f);
  const ReadyPush push = PushOf({0, 1}, {5, 6}, grads);
  EXPECT_TRUE(
      Sync<StepResult>([&](UpdateEngine::Done<StepResult> d) { engine.Step(&push, d); }).ok());
}

TEST_F(EngineTest, ADeviceFaultStopsTheShard) {
  InjectedFaults faults;
  faults.step_wait = 2;  // The second step's kernel fails.
  UpdateEngine engine(MakeFaultInjectingBackend(MakeCpuBackend({.threads = 1}), faults), &fault_,
                      &retries_);
  std::atomic<int> observed{0};
  fault_.OnFault([&](const absl::Status&) { ++observed; });
  const std::vector<uint32_t> tensors = Register(engine, {8});
  std::vector<float> grads(8, 1.0f);
  const ReadyPush push = PushOf(tensors, {8}, grads, "c", 1),
                  again = PushOf(tensors, {8}, grads, "c", 2),
                  after = PushOf(tensors, {8}, grads, "c", 3);
  const auto step = [&](const ReadyPush* p) {
    return Sync<StepResult>([&](UpdateEngine::Done<StepResult> d) { engine.Step(p, d); });
  };
  EXPECT_TRUE(step(&push).ok());
  EXPECT_EQ(step(&again).status().code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(fault_.faulted());
  EXPECT_EQ(observed.load(), 1);
  EXPECT_EQ(step(&after).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(Sync<bool>([&](UpdateEngine::Done<bool> d) {
              engine.RegisterParamGroup({"g", {}}, d);
            })
                .status()
                .code(),
            absl::StatusCode::kUnavailable);
  // What readers see stays the last good state.
  EXPECT_EQ(engine.version(), 1u);
}

TEST_F(EngineTest, ALaunchFailureIsAFaultToo) {
  InjectedFaults faults;
  faults.step = 1;
  UpdateEngine engine(MakeFaultInjectingBackend(MakeCpuBackend({.threads = 1}), faults), &fault_,
                      &retries_);
  const std::vector<uint32_t> tensors = Register(engine, {8});
  std::vector<float> grads(8, 1.0f);
  const ReadyPush push = PushOf(tensors, {8}, grads);
  EXPECT_EQ(Sync<StepResult>([&](UpdateEngine::Done<StepResult> d) { engine.Step(&push, d); })
                .status()
                .code(),
            absl::StatusCode::kInternal);
  EXPECT_TRUE(fault_.faulted());
  EXPECT_EQ(fault_.status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(EngineTest, ARetryIsAppliedOnceAndGetsTheFirstReply) {
  UpdateEngine engine(MakeCpuBackend({.threads = 1}), &fault_, &retries_);
  const std::vector<uint32_t> tensors = Register(engine, {8});
  std::vector<float> grads(8, 1.0f);
  const ReadyPush push = PushOf(tensors, {8}, grads, "trainer", 5);
  const auto step = [&](const ReadyPush* p) {
    return Sync<StepResult>([&](UpdateEngine::Done<StepResult> d) { engine.Step(p, d); });
  };
  absl::StatusOr<StepResult> first = step(&push);
  ASSERT_TRUE(first.ok());
  EXPECT_FALSE(first->reply.duplicate);
  absl::StatusOr<StepResult> retry = step(&push);
  ASSERT_TRUE(retry.ok());
  EXPECT_TRUE(retry->reply.duplicate);
  EXPECT_EQ(retry->reply.version, first->reply.version);
  std::vector<int64_t> steps;
  engine.Steps(tensors, &steps);
  EXPECT_EQ(steps[0], 1);
  const ReadyPush older = PushOf(tensors, {8}, grads, "trainer", 4);
  EXPECT_EQ(step(&older).status().code(), absl::StatusCode::kAborted);
}

TEST_F(EngineTest, AReadSeesTheStepsQueuedBeforeIt) {
  UpdateEngine engine(MakeCpuBackend({.threads = 1}), &fault_, &retries_);
  const std::vector<uint32_t> tensors = Register(engine, {4});
  std::vector<float> grads(8, 1.0f);
  const ReadyPush push = PushOf(tensors, {4}, grads);
  engine.Step(&push, [](absl::StatusOr<StepResult>) {});
  std::vector<float> before_second(4);
  ReadJob job;
  job.tensors = tensors;
  job.dst_offsets = {0};
  job.dst = before_second.data();
  absl::StatusOr<ReadResult> read =
      Sync<ReadResult>([&](UpdateEngine::Done<ReadResult> d) { engine.Read(job, d); });
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(read->version, 1u);
  EXPECT_EQ(read->steps, std::vector<int64_t>{1});
  EXPECT_NE(before_second[0], 1.0f);  // The step ran before the read.
  // Into a snapshot: the values at the read's point, whatever runs after.
  job.snapshot_bytes = 16;
  absl::StatusOr<ReadResult> snap =
      Sync<ReadResult>([&](UpdateEngine::Done<ReadResult> d) { engine.Read(job, d); });
  ASSERT_TRUE(snap.ok());
  ASSERT_NE(snap->snapshot, nullptr);
  ASSERT_TRUE(
      Sync<StepResult>([&](UpdateEngine::Done<StepResult> d) { engine.Step(&push, d); }).ok());
  std::vector<float> from_snapshot(4);
  ASSERT_TRUE(engine.CopyFromSnapshot(snap->snapshot, 0, 16, from_snapshot.data()).ok());
  EXPECT_EQ(from_snapshot, before_second);
  engine.FreeSnapshot(snap->snapshot);
}

TEST_F(EngineTest, TheDestructorRunsEverySubmittedJobsCallback) {
  std::atomic<int> done{0};
  std::vector<float> grads(8, 1.0f);
  std::vector<ReadyPush> pushes;
  {
    UpdateEngine engine(MakeCpuBackend({.threads = 1}), &fault_, &retries_);
    const std::vector<uint32_t> tensors = Register(engine, {8});
    pushes.assign(50, PushOf(tensors, {8}, grads));
    for (const ReadyPush& push : pushes) {
      engine.Step(&push, [&](absl::StatusOr<StepResult> r) {
        EXPECT_TRUE(r.ok());
        ++done;
      });
    }
  }
  EXPECT_EQ(done.load(), 50);
}

}  // namespace
}  // namespace fusedps
