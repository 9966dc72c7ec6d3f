// Tests of the consistency modes in the engine (consistency.h) on the CPU backend: sync rounds
// (K of N, the mean as one step, stale and repeated pushes, the timeout, non-finite gradients,
// staging handed back before the round ends) and bounded staleness (the bound, lr / (1 + tau)).
// The oracle is kernels/adamw_reference.h in float64; tests/e2e/test_sync.py checks against
// torch.optim.AdamW end to end.
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/notification.h"
#include "gtest/gtest.h"
#include "kernels/adamw_reference.h"
#include "server/engine/engine_test_util.h"
#include "server/engine/update_engine.h"

namespace fusedps {
namespace {

// Records what the engine reports.
class RecordingObserver final : public ConsistencyObserver {
 public:
  void OnStaleness(uint64_t tau) override {
    std::lock_guard<std::mutex> lock(mu);
    staleness.push_back(tau);
  }
  void OnDropped(absl::string_view reason) override {
    std::lock_guard<std::mutex> lock(mu);
    dropped.emplace_back(reason);
  }
  void OnRound(const RoundStats& round) override {
    std::lock_guard<std::mutex> lock(mu);
    rounds.push_back(round);
  }
  std::mutex mu;
  std::vector<uint64_t> staleness;
  std::vector<std::string> dropped;
  std::vector<RoundStats> rounds;
};

std::vector<float> Params(UpdateEngine& engine, uint32_t tensor, uint64_t numel) {
  std::vector<float> values(AlignedNumel(numel));
  ReadJob job;
  job.tensors = {tensor};
  job.dst_offsets = {0};
  job.dst = values.data();
  EXPECT_TRUE(
      Sync<ReadResult>([&](UpdateEngine::Done<ReadResult> d) { engine.Read(job, d); }).ok());
  values.resize(numel);
  return values;
}

class RoundsTest : public ::testing::Test {
 protected:
  ShardFault fault_;
  RetryTable retries_{100};
  RecordingObserver observer_;
};

// Members may push any subset of the tensors (a frozen or unused parameter has no gradient):
// a tensor some members did not push is averaged over all of them, theirs counting as zero
// (DistributedDataParallel's rule for unused parameters); a tensor nobody pushed is not stepped
// (torch.optim's rule for grad None): its values and its step stay.
TEST_F(RoundsTest, MembersMayPushSubsetsAsDdpAveragesUnusedParameters) {
  UpdateEngine engine(MakeCpuBackend({.threads = 2}), &fault_, &retries_, SyncMode(2, 2),
                      &observer_);
  const std::vector<uint32_t> tensors = Register(engine, {21, 13, 8});
  // a pushes t0 and t1, b pushes t1 only; nobody pushes t2.
  std::vector<float> ga(AlignedNumel(21) + AlignedNumel(13)), gb(AlignedNumel(13));
  for (int i = 0; i < 21; ++i) ga[i] = 0.05f * (i % 7) - 0.1f;
  for (int i = 0; i < 13; ++i) ga[AlignedNumel(21) + i] = 0.2f - 0.03f * i;
  for (int i = 0; i < 13; ++i) gb[i] = 0.01f * i + 0.3f;
  ReadyPush a = PushOf({tensors[0], tensors[1]}, {21, 13}, ga, "a", 1);
  ReadyPush b = PushOf({tensors[1]}, {13}, gb, "b", 1);
  PushOutcome oa, ob;
  PushAsync(engine, &b, &ob);  // b first: t1 is new to the round with b, added to with a.
  PushAsync(engine, &a, &oa);
  for (PushOutcome* o : {&oa, &ob}) {
    ASSERT_TRUE(o->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    ASSERT_TRUE(o->result.ok()) << o->result.status();
    EXPECT_EQ(o->result->reply.round_workers, 2u);
    EXPECT_EQ(o->result->reply.tensors_updated, 2u);
  }
  const AdamWHyperparameters h;
  const std::vector<float> p0 = Params(engine, tensors[0], 21);
  for (int i = 0; i < 21; ++i) {
    ReferenceAdamW ref{1.0};
    ref.Step(h, (double{ga[i]} + 0.0) / 2.0, 1, 0);
    EXPECT_NEAR(p0[i], ref.param, 1e-6) << i;
  }
  const std::vector<float> p1 = Params(engine, tensors[1], 13);
  for (int i = 0; i < 13; ++i) {
    ReferenceAdamW ref{1.0};
    ref.Step(h, (double{ga[AlignedNumel(21) + i]} + gb[i]) / 2.0, 1, 0);
    EXPECT_NEAR(p1[i], ref.param, 1e-6) << i;
  }
  EXPECT_EQ(Params(engine, tensors[2], 8), std::vector<float>(8, 1.0f));
  std::vector<int64_t> steps;
  engine.Steps(tensors, &steps);
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 1, 0}));

  // The next round starts afresh: t1's sum is overwritten, not added to the last round's.
  ReadyPush a2 = PushOf({tensors[1]}, {13}, gb, "a", 2);
  ReadyPush b2 = PushOf({tensors[1]}, {13}, gb, "b", 2);
  a2.base_version = b2.base_version = 1;
  PushOutcome oa2, ob2;
  PushAsync(engine, &a2, &oa2);
  PushAsync(engine, &b2, &ob2);
  ASSERT_TRUE(ob2.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(ob2.result.ok()) << ob2.result.status();
  const std::vector<float> p1b = Params(engine, tensors[1], 13);
  for (int i = 0; i < 13; ++i) {
    ReferenceAdamW ref{1.0};
    ref.Step(h, (double{ga[AlignedNumel(21) + i]} + gb[i]) / 2.0, 1, 0);
    ref.Step(h, gb[i], 2, 0);
    EXPECT_NEAR(p1b[i], ref.param, 1e-6) << i;
  }
}

TEST_F(RoundsTest, KPushesAreAveragedIntoOneStepAndAnsweredTogether) {
  UpdateEngine engine(MakeCpuBackend({.threads = 2}), &fault_, &retries_, SyncMode(3, 3),
                      &observer_);
  const std::vector<uint64_t> sizes = {37};
  const std::vector<uint32_t> tensors = Register(engine, sizes);
  std::vector<std::vector<float>> grads(3, std::vector<float>(AlignedNumel(37)));
  for (int w = 0; w < 3; ++w) {
    for (int i = 0; i < 37; ++i) grads[w][i] = 0.1f * (w + 1) * (i % 5 - 2) + 0.01f * w;
  }
  std::vector<ReadyPush> pushes;
  for (int w = 0; w < 3; ++w) {
    pushes.push_back(PushOf(tensors, sizes, grads[w], "w" + std::to_string(w), 1));
    pushes.back().grad_scale = w == 1 ? 4.0f : 0.0f;  // Each push's own loss scale.
  }
  for (int i = 0; i < 37; ++i) grads[1][i] *= 4.0f;
  PushOutcome out[3];
  PushAsync(engine, &pushes[0], &out[0]);
  PushAsync(engine, &pushes[1], &out[1]);
  // Summed, so their staging is back, but not answered: the round waits for its third.
  ASSERT_TRUE(out[0].consumed.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(out[1].consumed.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_FALSE(out[0].done.WaitForNotificationWithTimeout(absl::Milliseconds(100)));
  EXPECT_EQ(engine.version(), 0u);
  PushAsync(engine, &pushes[2], &out[2]);
  for (PushOutcome& o : out) {
    ASSERT_TRUE(o.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    ASSERT_TRUE(o.result.ok()) << o.result.status();
    EXPECT_EQ(o.result->reply.version, 1u);
    EXPECT_EQ(o.result->reply.round_workers, 3u);
    EXPECT_FALSE(o.result->reply.skipped);
  }
  EXPECT_TRUE(out[0].result->counts_step);
  EXPECT_FALSE(out[1].result->counts_step || out[2].result->counts_step);
  EXPECT_EQ(engine.version(), 1u);

  const std::vector<float> params = Params(engine, tensors[0], 37);
  const AdamWHyperparameters h;
  for (int i = 0; i < 37; ++i) {
    ReferenceAdamW ref{1.0};
    const double mean = (double{grads[0][i]} + grads[1][i] / 4.0 + grads[2][i]) / 3.0;
    ref.Step(h, mean, 1, 0);
    EXPECT_NEAR(params[i], ref.param, 1e-6) << i;
  }
  std::lock_guard<std::mutex> lock(observer_.mu);
  ASSERT_EQ(observer_.rounds.size(), 1u);
  EXPECT_EQ(observer_.rounds[0].workers, 3u);
  EXPECT_FALSE(observer_.rounds[0].timed_out);
  EXPECT_EQ(observer_.staleness, (std::vector<uint64_t>{0, 0, 0}));
  const auto counts = engine.launch_counts();
  EXPECT_EQ(counts.at("cpu_grad_accumulate"), 3u);
  EXPECT_EQ(counts.at("cpu_adamw_apply"), 1u);
}

TEST_F(RoundsTest, StalePushesAndASecondPushOfOneClientAreAborted) {
  UpdateEngine engine(MakeCpuBackend({.threads = 1}), &fault_, &retries_, SyncMode(2, 3),
                      &observer_);
  const std::vector<uint64_t> sizes = {8};
  const std::vector<uint32_t> tensors = Register(engine, sizes);
  std::vector<float> grads(8, 0.5f);
  ReadyPush a = PushOf(tensors, sizes, grads, "a", 1), a2 = PushOf(tensors, sizes, grads, "a", 2);
  ReadyPush b = PushOf(tensors, sizes, grads, "b", 1), late = PushOf(tensors, sizes, grads, "c", 1);
  PushOutcome oa, oa2, ob, olate;
  PushAsync(engine, &a, &oa);
  PushAsync(engine, &a2, &oa2);  // The same client again in the round.
  ASSERT_TRUE(oa2.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(absl::IsAborted(oa2.result.status())) << oa2.result.status();
  EXPECT_TRUE(oa2.consumed.HasBeenNotified());
  PushAsync(engine, &b, &ob);
  ASSERT_TRUE(ob.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(oa.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(ob.result->reply.version, 1u);
  PushAsync(engine, &late, &olate);  // A backup's push for version 0, after the round closed.
  ASSERT_TRUE(olate.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(absl::IsAborted(olate.result.status()));
  EXPECT_NE(olate.result.status().message().find("shard version 1"), std::string::npos)
      << olate.result.status();
  EXPECT_TRUE(absl::IsAborted(engine.AdmitPush("c", 0)));
  EXPECT_TRUE(engine.AdmitPush("c", 1).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(engine.AdmitPush("", 1)));
  // The retry of a push answered already gets its reply, whatever its version.
  PushOutcome retry;
  PushAsync(engine, &b, &retry);
  ASSERT_TRUE(retry.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(retry.result.ok());
  EXPECT_TRUE(retry.result->reply.duplicate);
  std::lock_guard<std::mutex> lock(observer_.mu);
  EXPECT_EQ(observer_.dropped,
            (std::vector<std::string>{"client_in_round", "stale_version", "stale_version"}));
}

TEST_F(RoundsTest, ARoundThatTimesOutAppliesThePushesItHas) {
  UpdateEngine engine(MakeCpuBackend({.threads = 1}), &fault_, &retries_,
                      SyncMode(2, 2, absl::Milliseconds(200)), &observer_);
  const std::vector<uint64_t> sizes = {5};
  const std::vector<uint32_t> tensors = Register(engine, sizes);
  std::vector<float> grads = {0.5f, -1, 2, 0, 3, 0, 0, 0};
  ReadyPush a = PushOf(tensors, sizes, grads, "a", 1);
  a.arrived = absl::Now();
  PushOutcome oa;
  PushAsync(engine, &a, &oa);
  ASSERT_TRUE(oa.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_GE(absl::Now() - a.arrived, absl::Milliseconds(200));
  ASSERT_TRUE(oa.result.ok()) << oa.result.status();
  EXPECT_EQ(oa.result->reply.round_workers, 1u);
  EXPECT_EQ(oa.result->reply.version, 1u);
  const std::vector<float> params = Params(engine, tensors[0], 5);
  for (int i = 0; i < 5; ++i) {
    ReferenceAdamW ref{1.0};
    ref.Step(AdamWHyperparameters{}, grads[i], 1, 0);
    EXPECT_NEAR(params[i], ref.param, 1e-6);
  }
  std::lock_guard<std::mutex> lock(observer_.mu);
  ASSERT_EQ(observer_.rounds.size(), 1u);
  EXPECT_TRUE(observer_.rounds[0].timed_out);
}

// A trainer that stops pushing (it died) makes the next round time out: its replies say so
// and name the replica it waited for, which pushed to an earlier round and not to this one.
// A full round names nobody.
TEST_F(RoundsTest, ARoundThatTimesOutNamesTheReplicasItWaitedFor) {
  UpdateEngine engine(MakeCpuBackend({.threads = 1}), &fault_, &retries_,
                      SyncMode(2, 2, absl::Milliseconds(200)), &observer_);
  const std::vector<uint64_t> sizes = {5};
  const std::vector<uint32_t> tensors = Register(engine, sizes);
  std::vector<float> grads(8, 0.25f);
  ReadyPush a1 = PushOf(tensors, sizes, grads, "trainer-a", 1);
  ReadyPush b1 = PushOf(tensors, sizes, grads, "trainer-b", 1);
  ReadyPush a2 = PushOf(tensors, sizes, grads, "trainer-a", 2);
  a2.base_version = 1;
  PushOutcome oa1, ob1, oa2;
  a1.arrived = absl::Now();
  PushAsync(engine, &a1, &oa1);
  PushAsync(engine, &b1, &ob1);
  for (PushOutcome* o : {&oa1, &ob1}) {
    ASSERT_TRUE(o->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    ASSERT_TRUE(o->result.ok()) << o->result.status();
    EXPECT_FALSE(o->result->reply.round_timed_out);
    EXPECT_TRUE(o->result->reply.missing_replicas.empty());
  }
  a2.arrived = absl::Now();
  PushAsync(engine, &a2, &oa2);  // trainer-b is gone.
  ASSERT_TRUE(oa2.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(oa2.result.ok()) << oa2.result.status();
  EXPECT_EQ(oa2.result->reply.version, 2u);
  EXPECT_EQ(oa2.result->reply.round_workers, 1u);
  EXPECT_TRUE(oa2.result->reply.round_timed_out);
  EXPECT_EQ(oa2.result->reply.missing_replicas, (std::vector<std::string>{"trainer-b"}));
  // The retry table keeps the reply whole (a retry after a restart gets it too).
  PushOutcome retry;
  PushAsync(engine, &a2, &retry);
  ASSERT_TRUE(retry.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(retry.result.ok());
  EXPECT_TRUE(retry.result->reply.duplicate);
  EXPECT_EQ(retry.result->reply.missing_replicas, (std::vector<std::string>{"trainer-b"}));
}

TEST_F(RoundsTest, ANonFiniteGradientSkipsTheWholeRound) {
  UpdateEngine engine(MakeCpuBackend({.threads = 1}), &fault_, &retries_, SyncMode(2, 2),
                      &observer_);
  const std::vector<uint64_t> sizes = {8};
  const std::vector<uint32_t> tensors = Register(engine, sizes);
  std::vector<float> grads(8, 0.5f);
  ReadyPush a = PushOf(tensors, sizes, grads, "a", 1), b = PushOf(tensors, sizes, grads, "b", 1);
  b.grads_finite = false;
  PushOutcome oa, ob;
  PushAsync(engine, &a, &oa);
  PushAsync(engine, &b, &ob);
  for (PushOutcome* o : {&oa, &ob}) {
    ASSERT_TRUE(o->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    ASSERT_TRUE(o->result.ok());
    EXPECT_TRUE(o->result->reply.skipped);
    EXPECT_EQ(o->result->reply.version, 0u);
  }
  EXPECT_EQ(Params(engine, tensors[0], 8), std::vector<float>(8, 1.0f));
  // The next round is at version 0 again.
  ReadyPush a2 = PushOf(tensors, sizes, grads, "a", 2), b2 = PushOf(tensors, sizes, grads, "b", 2);
  PushOutcome oa2, ob2;
  PushAsync(engine, &a2, &oa2);
  PushAsync(engine, &b2, &ob2);
  ASSERT_TRUE(ob2.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(ob2.result.ok());
  EXPECT_EQ(ob2.result->reply.version, 1u);
}

TEST_F(RoundsTest, AnOpenRoundFailsWhenTheEngineStops) {
  PushOutcome oa;
  std::vector<float> grads(8, 0.5f);
  ReadyPush a;
  {
    UpdateEngine engine(MakeCpuBackend({.threads = 1}), &fault_, &retries_, SyncMode(2, 2));
    const std::vector<uint64_t> sizes = {8};
    a = PushOf(Register(engine, sizes), sizes, grads, "a", 1);
    PushAsync(engine, &a, &oa);
  }
  ASSERT_TRUE(oa.done.HasBeenNotified());
  EXPECT_TRUE(absl::IsUnavailable(oa.result.status())) << oa.result.status();
}

// Stress (run under ASan and TSan too): trainers race for rounds that close by quorum and by
// timeout at once. Every push is answered once, its staging handed back once before, and the
// versions the replies name are each one round's.
TEST_F(RoundsTest, TrainersRacingRoundsAndTimeoutsAreEachAnsweredOnce) {
  constexpr int kTrainers = 8, kPushes = 40;
  auto owned =
      std::make_unique<UpdateEngine>(MakeCpuBackend({.threads = 1}), &fault_, &retries_,
                                     SyncMode(6, kTrainers, absl::Milliseconds(2)), &observer_);
  UpdateEngine& engine = *owned;
  const std::vector<uint64_t> sizes = {64, 3};
  const std::vector<uint32_t> tensors = Register(engine, sizes);
  const std::vector<float> grads(AlignedNumel(64) + AlignedNumel(3), 0.01f);
  std::mutex mu;
  std::map<uint64_t, uint32_t> workers_of;  // Reply version -> round_workers.
  std::map<uint64_t, int> answers_of;       // Reply version -> replies naming it.
  std::atomic<int> consumed{0}, answered{0}, aborted{0};
  std::vector<std::thread> trainers;
  for (int w = 0; w < kTrainers; ++w) {
    trainers.emplace_back([&, w] {
      for (int k = 1; k <= kPushes; ++k) {
        ReadyPush push = PushOf(tensors, sizes, grads, "w" + std::to_string(w), k);
        push.base_version = engine.version();
        push.arrived = push.received = absl::Now();
        PushOutcome out;
        int consumed_here = 0;
        engine.Step(
            &push,
            [&](absl::StatusOr<StepResult> r) {
              EXPECT_EQ(consumed_here, 1);
              out.result = std::move(r);
              out.done.Notify();
            },
            [&] { ++consumed_here; });
        out.done.WaitForNotification();
        consumed += consumed_here;
        ++answered;
        if (!out.result.ok()) {
          EXPECT_TRUE(absl::IsAborted(out.result.status())) << out.result.status();
          ++aborted;
          continue;
        }
        std::lock_guard<std::mutex> lock(mu);
        const PushReply& reply = out.result->reply;
        const auto [it, added] = workers_of.emplace(reply.version, reply.round_workers);
        EXPECT_EQ(it->second, reply.round_workers);
        ++answers_of[reply.version];
      }
    });
  }
  for (std::thread& t : trainers) t.join();
  EXPECT_EQ(answered.load(), kTrainers * kPushes);
  EXPECT_EQ(consumed.load(), kTrainers * kPushes);
  // Every version from 1 to the last was one round, answered to exactly its workers.
  const uint64_t last_version = engine.version();
  EXPECT_EQ(workers_of.size(), last_version);
  for (const auto& [version, workers] : workers_of) {
    EXPECT_GE(workers, 1u);
    EXPECT_LE(workers, 6u);
    EXPECT_EQ(answers_of[version], static_cast<int>(workers)) << "version " << version;
  }
  // A round reports to the observer after answering its workers (its ack time is measured up
  // to then), so the last report may still be on its way: stopping the engine joins it.
  owned.reset();
  std::lock_guard<std::mutex> lock(observer_.mu);
  EXPECT_EQ(observer_.rounds.size(), last_version);
  EXPECT_EQ(observer_.dropped.size(), static_cast<size_t>(aborted.load()));
}

TEST_F(RoundsTest, BoundedModeRefusesStalePushesAndScalesTheLr) {
  ConsistencyOptions c;
  c.mode = ConsistencyMode::kBounded;
  c.max_staleness = 1;
  c.staleness_lr_scaling = true;
  UpdateEngine engine(MakeCpuBackend({.threads = 1}), &fault_, &retries_, c, &observer_);
  const std::vector<uint64_t> sizes = {8};
  const std::vector<uint32_t> tensors = Register(engine, sizes);
  std::vector<float> grads(8, 0.25f);
  std::vector<ReadyPush> pushes;
  for (uint64_t base : {0, 1, 0, 1}) {  // tau = 0, 0, 2 (refused), 1.
    pushes.push_back(PushOf(tensors, sizes, grads));
    pushes.back().base_version = base;
  }
  std::vector<absl::StatusOr<StepResult>> results;
  for (const ReadyPush& p : pushes) {
    results.push_back(UpdateEngine::Wait<StepResult>(
        [&](UpdateEngine::Done<StepResult> d) { engine.Step(&p, d); }));
  }
  EXPECT_TRUE(results[0].ok() && results[1].ok() && results[3].ok());
  EXPECT_TRUE(absl::IsAborted(results[2].status())) << results[2].status();
  EXPECT_EQ(engine.version(), 3u);
  // Three steps: lr, lr / (1 + 0)... the third at tau = 1 with lr / 2.
  const std::vector<float> params = Params(engine, tensors[0], 8);
  ReferenceAdamW ref{1.0};
  AdamWHyperparameters h;
  ref.Step(h, 0.25, 1, 0);
  ref.Step(h, 0.25, 2, 0);
  h.lr /= 2;
  ref.Step(h, 0.25, 3, 0);
  EXPECT_NEAR(params[0], ref.param, 1e-6);
  std::lock_guard<std::mutex> lock(observer_.mu);
  EXPECT_EQ(observer_.staleness, (std::vector<uint64_t>{0, 0, 2, 1}));
  EXPECT_EQ(observer_.dropped, (std::vector<std::string>{"staleness_exceeded"}));
}

}  // namespace
}  // namespace fusedps
