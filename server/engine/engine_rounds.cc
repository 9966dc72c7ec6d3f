// engine_rounds.cc: sync mode's rounds (consistency.h), on the engine's threads.
//
// A round lives in round_ on the engine thread. Each push that joins it is summed into the
// backend's accumulator at once (Accumulate: one launch for the tensors the round sees for the
// first time, which overwrite, one for those it has, which add), and its staging is handed back
// when that sum has run: staging holds one push per pusher in flight, never a round's K. The
// push's reply waits in the round. The K-th distinct client_id closes the round: one Step from
// the accumulator with grad_scale = the member count, and every member is answered from that
// step's completion. A push may name any subset of the tensors (a model's frozen or unused
// parameters have no gradient): a tensor some members did not push is averaged over all the
// members, theirs counting as zero, as DistributedDataParallel averages unused parameters; a
// // tensor no member pushed is not stepped (torch.optim skips a parameter whose grad is None).
// The round timer closes a round that waited round_timeout since its first push, with the
// members it has, through a job (so in stream order like any other); its replies say so and
// name the replicas it waited for in vain: those that pushed to one of the last
// kReplicaRounds rounds but not to this one (a trainer that died, or is stuck).
//
// Lifetimes: a member's ReadyPush and `done` stay with the round until it is answered (the
// caller keeps the push alive until `done`, update_engine.h). The round's step completion owns
// the members from CloseRound on. A round still open when the engine stops is failed with
// UNAVAILABLE after the last job (RunJobs).
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/mutex.h"
#include "server/engine/update_engine.h"

namespace fusedps {

void UpdateEngine::Contribute(const ReadyPush* push, const Done<StepResult>& done,
                              const std::function<void()>& consumed) {
  if (!BeginPush(push, done, consumed)) return;
  const auto refuse = [&](absl::Status s) {
    retries_->Abandon(push->client_id, push->sequence_number, s);
    Answer(done, consumed, std::move(s));
  };
  const uint32_t tensor_count = view()->tensor_count();
  if (absl::Status s = CheckSyncPush(push->client_id); !s.ok()) return refuse(s);
  const uint64_t tau =
      push->base_version <= queued_version_ ? queued_version_ - push->base_version : 0;
  if (push->base_version != queued_version_) {
    Dropped(tau, kDropStaleVersion);
    return refuse(StaleVersionError(
        push->base_version < queued_version_ ? "sync round closed" : "no sync round yet",
        push->base_version, queued_version_));
  }
  for (const RoundMember& m : round_.members) {
    if (m.push->client_id == push->client_id) {
      Dropped(tau, kDropClientInRound);
      return refuse(absl::AbortedError(absl::StrCat(
          "client_id ", push->client_id, " already pushed to the sync round at version ",
          queued_version_, " (sequence_number ", m.push->sequence_number,
          "); one push per client_id per round")));
    }
  }
  const bool first = round_.members.empty();
  if (!first && round_.tensor_count != tensor_count) {
    return refuse(absl::FailedPreconditionError(absl::StrCat(
        "tensors were registered during the sync round at version ", queued_version_)));
  }
  // A hashed table's keys are checked now and recorded once the push has joined.
  absl::StatusOr<RoundKeys> keys = CheckRoundKeys(*push);
  if (!keys.ok()) return refuse(keys.status());
  if (observer_ != nullptr) observer_->OnStaleness(tau);
  if (first) {
    round_.tensor_count = tensor_count;
    round_.pushed.assign(tensor_count, false);
  }

  // The tensors new to the round overwrite their sums, the others add to them.
  const StepRequest all = GradsOf(*push);
  std::vector<uint32_t> tensors[2];
  std::vector<uint64_t> offsets[2];
  for (size_t i = 0; i < push->tensors.size(); ++i) {
    const uint32_t t = push->tensors[i];
    const int seen = round_.pushed[t] ? 1 : 0;
    tensors[seen].push_back(t);
    offsets[seen].push_back(push->grad_offsets[i]);
  }
  absl::StatusOr<Marker> summed = Marker{0};
  for (int seen = 0; seen < 2 && summed.ok(); ++seen) {
    if (tensors[seen].empty()) continue;
    StepRequest part = all;
    part.tensors = tensors[seen];
    part.grad_offsets = offsets[seen];
    // The completion path waits for every marker, in order; the push's is the last.
    if (*summed != 0) Complete({*summed, [](absl::StatusOr<WorkDone>) {}});
    summed = backend_->Accumulate(part, /*first=*/seen == 0);
  }
  if (!summed.ok()) return refuse(Checked(summed.status(), /*expected_ok=*/true));
  AddRoundKeys(*std::move(keys));
  for (uint32_t t : tensors[0]) round_.pushed[t] = true;
  Complete({*summed, [this, consumed](absl::StatusOr<WorkDone>) {
              // A device error here fails the round's step too (the fault stops the shard).
              last_accumulated_ = absl::Now();
              if (consumed) consumed();
            }});
  if (first && consistency_.round_timeout > absl::ZeroDuration()) {
    ArmRoundTimer(round_.id, push->arrived + consistency_.round_timeout);
  }
  round_.members.push_back({push, done});
  if (round_.members.size() >= consistency_.replicas_to_aggregate) CloseRound(false);
}

std::vector<std::string> UpdateEngine::MissingReplicas(const std::vector<RoundMember>& members) {
  const uint64_t round = round_.id;
  for (const RoundMember& m : members) replica_rounds_[m.push->client_id] = round;
  std::vector<std::string> missing;
  for (auto it = replica_rounds_.begin(); it != replica_rounds_.end();) {
    if (it->second + kReplicaRounds <= round) {
      it = replica_rounds_.erase(it);  // Not seen for kReplicaRounds rounds: gone.
      continue;
    }
    if (it->second != round && missing.size() < 64) missing.push_back(it->first);
    ++it;
  }
  return missing;
}

std::shared_ptr<std::vector<ReadyTableRows>> UpdateEngine::RoundTables(
    const std::vector<RoundMember>& members) {
  std::map<uint32_t, ReadyTableRows> tables;
  for (const RoundMember& m : members) {
    const float scale = m.push->grad_scale > 0.0f ? m.push->grad_scale : 1.0f;
    for (const ReadyTableRows& t : m.push->tables) {
      ReadyTableRows& into = tables[t.tensor];
      into.tensor = t.tensor;
      into.keys.insert(into.keys.end(), t.keys.begin(), t.keys.end());
      into.grads.reserve(into.grads.size() + t.grads.size());
      for (const float g : t.grads) into.grads.push_back(g / scale);
    }
  }
  auto merged = std::make_shared<std::vector<ReadyTableRows>>();
  merged->reserve(tables.size());
  for (auto& [tensor, rows] : tables) merged->push_back(std::move(rows));
  return merged;
}

std::vector<std::vector<uint64_t>> UpdateEngine::MemberEvictions(
    const std::vector<RoundMember>& members, const std::vector<ReadyTableRows>& merged,
    const std::vector<uint64_t>& evictions) {
  std::map<uint32_t, uint64_t> left;  // Per table, not yet counted.
  for (size_t i = 0; i < merged.size(); ++i) left[merged[i].tensor] = evictions[i];
  std::vector<std::vector<uint64_t>> out(members.size());
  for (size_t i = 0; i < members.size(); ++i) {
    for (const ReadyTableRows& t : members[i].push->tables) {
      uint64_t& count = left[t.tensor];
      out[i].push_back(count);
      count = 0;
    }
  }
  return out;
}

void UpdateEngine::CloseRound(bool timed_out) {
  std::vector<std::string> missing = MissingReplicas(round_.members);
  std::vector<RoundMember> members = std::move(round_.members);
  std::vector<bool> pushed = std::move(round_.pushed);
  round_ = NextRound(round_);
  if (members.empty()) return;
  // The tensors some member pushed, in index order.
  auto tensors = std::make_shared<std::vector<uint32_t>>();
  for (uint32_t t = 0; t < pushed.size(); ++t) {
    if (pushed[t]) tensors->push_back(t);
  }
  bool finite = true;
  for (const RoundMember& m : members) finite = finite && m.push->grads_finite;
  StepRequest request;
  request.tensors = *tensors;
  request.from_accumulator = !tensors->empty();  // Else no Accumulate ran: no sums to read.
  request.grad_scale = static_cast<float>(members.size());
  request.grads_checked = true;
  request.grads_finite = finite;
  const absl::Time closed = absl::Now();
  // The members' table rows, concatenated per table (the backend sums duplicate keys and
  // divides by grad_scale, the member count, as for the dense sums).
  const std::shared_ptr<std::vector<ReadyTableRows>> merged = RoundTables(members);
  absl::StatusOr<TablesStep> tables = PlanTables(*merged);
  if (tables.ok()) request.table_rows = tables->rows;
  absl::StatusOr<StepOutcome> outcome =
      tables.ok() ? backend_->Step(request) : absl::StatusOr<StepOutcome>(tables.status());
  if (!outcome.ok()) {
    const absl::Status s = Checked(outcome.status(), /*expected_ok=*/true);
    for (RoundMember& m : members) {
      retries_->Abandon(m.push->client_id, m.push->sequence_number, s);
      Complete({0, [done = std::move(m.done), s](absl::StatusOr<WorkDone>) { done(s); }});
    }
    return;
  }
  const std::vector<uint64_t> evictions = outcome->skipped ? std::vector<uint64_t>(merged->size())
                                                           : CommitTables(*tables, merged->size());
  std::vector<std::vector<uint64_t>> member_evictions =
      MemberEvictions(members, *merged, evictions);
  for (const uint32_t t : tables->tensors) tensors->push_back(t);  // Published with the rest.
  PushReply reply = Advance(*outcome);
  reply.round_workers = static_cast<uint32_t>(members.size());
  reply.round_timed_out = timed_out;
  if (timed_out) reply.missing_replicas = std::move(missing);
  absl::Time opened = members.front().push->arrived, received = opened;
  for (const RoundMember& m : members) {
    opened = std::min(opened, m.push->arrived);
    received = std::max(received, m.push->received);
  }
  Complete({outcome->marker,
            [this, members = std::move(members), reply, tensors, timed_out, opened, received,
             closed, merged, hashed = tables->hashed,
             member_evictions = std::move(member_evictions)](absl::StatusOr<WorkDone> work) {
              const absl::Time applied = absl::Now();
              if (work.ok() && !reply.skipped) Publish(reply.version, *tensors);
              for (size_t i = 0; i < members.size(); ++i) {
                const ReadyPush& push = *members[i].push;
                if (!work.ok()) {
                  retries_->Abandon(push.client_id, push.sequence_number, work.status());
                  members[i].done(work.status());
                  continue;
                }
                PushReply mine = reply;
                mine.grad_bytes = push.grad_bytes;
                retries_->Finish(push.client_id, push.sequence_number, mine);
                StepResult result{mine, work->device_seconds, work->copy_wait_seconds};
                result.counts_step = i == 0;
                result.table_evictions = member_evictions[i];
                members[i].done(result);
              }
              if (!work.ok() || observer_ == nullptr) return;
              const absl::Time acked = absl::Now();
              const absl::Time summed = std::max(last_accumulated_, received);
              RoundStats stats;
              stats.workers = reply.round_workers;
              stats.timed_out = timed_out;
              stats.duration = absl::ToDoubleSeconds(acked - opened);
              stats.receive = absl::ToDoubleSeconds(received - opened);
              stats.accumulate = absl::ToDoubleSeconds(summed - received);
              stats.apply = absl::ToDoubleSeconds(applied - std::max(summed, closed));
              stats.ack = absl::ToDoubleSeconds(acked - applied);
              observer_->OnRound(stats);
            }});
}

void UpdateEngine::FailRound(const absl::Status& status) {
  std::vector<RoundMember> members = std::move(round_.members);
  round_ = NextRound(round_);
  for (RoundMember& m : members) {
    retries_->Abandon(m.push->client_id, m.push->sequence_number, status);
    Complete({0, [done = std::move(m.done), status](absl::StatusOr<WorkDone>) { done(status); }});
  }
}

void UpdateEngine::ArmRoundTimer(uint64_t round, absl::Time deadline) {
  {
    MutexLock lock(&timer_mu_);
    timer_round_ = round + 1;  // 0 means none armed.
    timer_deadline_ = deadline;
  }
  timer_cv_.SignalAll();
}

void UpdateEngine::RunRoundTimer() {
  timer_mu_.Lock();
  while (!timer_stop_) {
    if (timer_round_ == 0) {
      timer_cv_.Wait(&timer_mu_);
      continue;
    }
    const absl::Time now = absl::Now();
    if (now < timer_deadline_) {
      timer_cv_.WaitWithTimeout(&timer_mu_, timer_deadline_ - now);
      continue;
    }
    const uint64_t round = timer_round_ - 1;
    timer_round_ = 0;
    timer_mu_.Unlock();
    // A job, so that the round closes in stream order; a no-op if it closed meanwhile.
    Submit(
        [this, round] {
          if (round_.id == round && !round_.members.empty()) CloseRound(/*timed_out=*/true);
        },
        [](const absl::Status&) {});
    timer_mu_.Lock();
  }
  timer_mu_.Unlock();
}

}  // namespace fusedps
