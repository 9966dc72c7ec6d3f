#include "server/engine/update_engine.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace fusedps {
namespace {

// Backend errors a caller can cause or expect; anything else means the device failed.
bool Expected(const absl::Status& s) {
  return absl::IsResourceExhausted(s) || absl::IsInvalidArgument(s) ||
         absl::IsFailedPrecondition(s) || absl::IsAlreadyExists(s) || absl::IsNotFound(s) ||
         absl::IsUnimplemented(s);
}

absl::Status ShuttingDown() { return absl::UnavailableError("the server is shutting down"); }

}  // namespace

UpdateEngine::UpdateEngine(std::unique_ptr<OptimizerBackend> backend, ShardFault* fault,
                           RetryTable* retries, ConsistencyOptions consistency,
                           ConsistencyObserver* observer)
    : backend_(std::move(backend)),
      fault_(fault),
      retries_(retries),
      consistency_(consistency),
      observer_(observer),
      view_(ShardView::Initial()),
      buffers_(BufferSet::Empty()) {
  // "default" exists from the start, as the initial view says (torch.optim.AdamW's defaults).
  if (absl::Status s = backend_->SetParamGroup(0, view_->groups()[0].hyperparameters); !s.ok()) {
    fault_->Report(
        absl::InternalError(absl::StrCat("cannot create the default param group: ", s.ToString())));
  }
  completion_thread_ = std::thread([this] { RunCompletions(); });
  engine_thread_ = std::thread([this] { RunJobs(); });
  if (consistency_.mode == ConsistencyMode::kSync &&
      consistency_.round_timeout > absl::ZeroDuration()) {
    timer_thread_ = std::thread([this] { RunRoundTimer(); });
  }
}

UpdateEngine::~UpdateEngine() {
  {
    // First the timer, which submits jobs.
    MutexLock lock(&timer_mu_);
    timer_stop_ = true;
  }
  timer_cv_.SignalAll();
  if (timer_thread_.joinable()) timer_thread_.join();
  {
    MutexLock lock(&jobs_mu_);
    stopping_ = true;
  }
  jobs_cv_.SignalAll();
  engine_thread_.join();  // Runs every job submitted, then marks the completions finished.
  completion_thread_.join();
}

std::shared_ptr<const ShardView> UpdateEngine::view() const {
  MutexLock lock(&view_mu_);
  return view_;
}

uint64_t UpdateEngine::version() const {
  ReaderMutexLock lock(&progress_mu_);
  return version_;
}

uint64_t UpdateEngine::HashedRowsInUse(uint32_t tensor) const {
  ReaderMutexLock lock(&progress_mu_);
  const auto it = hashed_rows_in_use_.find(tensor);
  return it == hashed_rows_in_use_.end() ? 0 : it->second;
}

uint64_t UpdateEngine::Steps(absl::Span<const uint32_t> tensors,
                             std::vector<int64_t>* steps) const {
  ReaderMutexLock lock(&progress_mu_);
  steps->resize(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) (*steps)[i] = steps_[tensors[i]];
  return version_;
}

void UpdateEngine::Publish(uint64_t version, absl::Span<const uint32_t> stepped) {
  WriterMutexLock lock(&progress_mu_);
  version_ = version;
  for (uint32_t t : stepped) ++steps_[t];
}

void UpdateEngine::Submit(Work work, const std::function<void(const absl::Status&)>& fail) {
  {
    MutexLock lock(&jobs_mu_);
    if (!stopping_) {
      jobs_.push_back(std::move(work));
      jobs_cv_.Signal();
      return;
    }
  }
  fail(ShuttingDown());
}

void UpdateEngine::Complete(Completion completion) {
  MutexLock lock(&completions_mu_);
  completions_.push_back(std::move(completion));
  completions_cv_.Signal();
}

absl::Status UpdateEngine::Checked(absl::Status status, bool expected_ok) {
  if (status.ok() || (expected_ok && Expected(status))) return status;
  fault_->Report(status);
  return absl::InternalError(absl::StrCat("device fault: ", status.message()));
}

void UpdateEngine::RunJobs() {
  for (;;) {
    Work work;
    {
      MutexLock lock(&jobs_mu_);
      while (!stopping_ && jobs_.empty()) jobs_cv_.Wait(&jobs_mu_);
      if (jobs_.empty()) break;  // Stopping, and every job submitted has run.
      work = std::move(jobs_.front());
      jobs_.pop_front();
    }
    work();
  }
  FailRound(ShuttingDown());
  MutexLock lock(&completions_mu_);
  jobs_done_ = true;
  completions_cv_.Signal();
}

void UpdateEngine::RunCompletions() {
  for (;;) {
    Completion completion;
    {
      MutexLock lock(&completions_mu_);
      while (!jobs_done_ && completions_.empty()) completions_cv_.Wait(&completions_mu_);
      if (completions_.empty()) return;
      completion = std::move(completions_.front());
      completions_.pop_front();
    }
    absl::StatusOr<WorkDone> work = backend_->Wait(completion.marker);
    if (!work.ok()) work = Checked(work.status());
    completion.finish(std::move(work));
  }
}

void UpdateEngine::Step(const ReadyPush* push, Done<StepResult> done,
                        std::function<void()> consumed) {
  Submit(
      [this, push, done, consumed] {
        if (consistency_.mode == ConsistencyMode::kSync) return Contribute(push, done, consumed);
        StepJob(push, done, consumed);
      },
      [done, consumed](const absl::Status& s) {
        if (consumed) consumed();
        done(s);
      });
}

StepRequest GradsOf(const ReadyPush& push) {
  StepRequest request;
  request.tensors = push.tensors;
  request.grad_offsets = push.grad_offsets;
  request.grads = push.grads;
  request.grad_dtype = push.grad_dtype;
  request.grad_scale = push.grad_scale;
  request.grads_checked = true;
  request.grads_finite = push.grads_finite;
  return request;
}

void UpdateEngine::Answer(const Done<StepResult>& done, const std::function<void()>& consumed,
                          absl::StatusOr<StepResult> result) {
  Complete({0, [done, consumed, result](absl::StatusOr<WorkDone>) {
              if (consumed) consumed();
              done(result);
            }});
}

bool UpdateEngine::BeginPush(const ReadyPush* push, const Done<StepResult>& done,
                             const std::function<void()>& consumed) {
  if (absl::Status s = fault_->status(); !s.ok()) {
    Answer(done, consumed, s);
    return false;
  }
  RetryTable::Waiter waiter;  // Only for a tracked push: most are not.
  if (RetryTable::Tracked(push->client_id, push->sequence_number)) {
    waiter = [done, consumed](absl::StatusOr<PushReply> reply) {
      if (consumed) consumed();
      if (!reply.ok()) return done(reply.status());
      done(StepResult{*reply, 0, 0});
    };
  }
  const RetryTable::Verdict verdict =
      retries_->Begin(push->client_id, push->sequence_number, std::move(waiter));
  switch (verdict.kind) {
    case RetryTable::Kind::kInFlight:
      return false;  // The same push is being applied: the waiter answers with its reply.
    case RetryTable::Kind::kDone:
      Answer(done, consumed, StepResult{verdict.reply, 0, 0});
      return false;
    case RetryTable::Kind::kStale:
      Answer(done, consumed, StalePushError(push->sequence_number, verdict.highest));
      return false;
    default:
      return true;
  }
}

void UpdateEngine::StepJob(const ReadyPush* push, const Done<StepResult>& done,
                           const std::function<void()>& consumed) {
  if (!BeginPush(push, done, consumed)) return;
  const auto finish = [done, consumed](absl::StatusOr<StepResult> result) {
    if (consumed) consumed();
    done(std::move(result));
  };
  const auto fail = [this, done, consumed](absl::Status s) { Answer(done, consumed, s); };
  StepRequest request = GradsOf(*push);
  // Staleness against the version the queue has reached: the one this step applies on.
  const uint64_t tau =
      push->base_version <= queued_version_ ? queued_version_ - push->base_version : 0;
  if (consistency_.mode == ConsistencyMode::kBounded) {
    absl::Status refused = push->base_version > queued_version_
                               ? StaleVersionError("base_version is ahead of the shard",
                                                   push->base_version, queued_version_)
                               : CheckStaleness(consistency_, push->base_version, queued_version_);
    if (!refused.ok()) {
      Dropped(tau, kDropStalenessExceeded);
      retries_->Abandon(push->client_id, push->sequence_number, refused);
      return fail(refused);
    }
    if (consistency_.staleness_lr_scaling) request.lr_divisor = 1.0 + static_cast<double>(tau);
  }
  if (observer_ != nullptr) observer_->OnStaleness(tau);
  // The tables' rows (in the push, alive until `done`; hashed slots in `tables.hashed`, held
  // by the completion), and with tables every tensor the step advances (without,
  // push->tensors: no copy on the dense path).
  TablesStep tables;
  std::vector<uint32_t> stepped;
  if (!push->tables.empty()) {
    absl::StatusOr<TablesStep> planned = PlanTables(push->tables);
    if (!planned.ok()) {
      const absl::Status s = Checked(planned.status(), /*expected_ok=*/true);
      retries_->Abandon(push->client_id, push->sequence_number, s);
      return fail(s);
    }
    tables = *std::move(planned);
    stepped = push->tensors;
    stepped.insert(stepped.end(), tables.tensors.begin(), tables.tensors.end());
    request.table_rows = tables.rows;
  }
  absl::StatusOr<StepOutcome> outcome = backend_->Step(request);
  if (!outcome.ok()) {
    // A dense push was checked as it arrived: its step cannot fail but for the device. Table
    // rows are checked by the backend (keys against rows): their errors are the push's.
    const absl::Status s = Checked(outcome.status(), /*expected_ok=*/!push->tables.empty());
    retries_->Abandon(push->client_id, push->sequence_number, s);
    return fail(s);
  }
  // The step is queued and applied: the hashed tables' slots are theirs now.
  std::vector<uint64_t> evictions = outcome->skipped ? std::vector<uint64_t>(push->tables.size())
                                                     : CommitTables(tables, push->tables.size());
  PushReply reply = Advance(*outcome);
  reply.grad_bytes = push->grad_bytes;
  Complete(
      {outcome->marker,
       [this, push, finish, reply, hashed = tables.hashed, evictions = std::move(evictions),
        stepped = std::move(stepped)](absl::StatusOr<WorkDone> work) {
         if (!work.ok()) {
           retries_->Abandon(push->client_id, push->sequence_number, work.status());
           return finish(work.status());
         }
         if (!reply.skipped) {
           Publish(reply.version, push->tables.empty() ? absl::Span<const uint32_t>(push->tensors)
                                                       : absl::Span<const uint32_t>(stepped));
         }
         retries_->Finish(push->client_id, push->sequence_number, reply);
         StepResult result{reply, work->device_seconds, work->copy_wait_seconds, true, evictions};
         finish(std::move(result));
       }});
}

PushReply UpdateEngine::Advance(const StepOutcome& outcome) {
  if (!outcome.skipped) ++queued_version_;
  ++generation_;
  PushReply reply;
  reply.version = queued_version_;
  reply.skipped = outcome.skipped;
  reply.tensors_updated = outcome.tensors_updated;
  return reply;
}

void UpdateEngine::Dropped(uint64_t tau, absl::string_view reason) const {
  if (observer_ == nullptr) return;
  observer_->OnStaleness(tau);
  observer_->OnDropped(reason);
}

absl::Status UpdateEngine::AdmitPush(absl::string_view client_id, uint64_t base_version) const {
  const uint64_t published = version();
  if (consistency_.mode == ConsistencyMode::kSync) {
    if (absl::Status s = CheckSyncPush(client_id); !s.ok()) {
      return s;
    }
    if (base_version < published) {
      Dropped(published - base_version, kDropStaleVersion);
      return StaleVersionError("sync round closed", base_version, published);
    }
  }
  if (consistency_.mode == ConsistencyMode::kBounded) {
    if (absl::Status s = CheckStaleness(consistency_, base_version, published); !s.ok()) {
      Dropped(published - base_version, kDropStalenessExceeded);
      return s;
    }
  }
  return absl::OkStatus();
}

std::shared_ptr<const BufferSet> UpdateEngine::buffers() const {
  MutexLock lock(&view_mu_);
  return buffers_;
}

void UpdateEngine::WriteBuffers(std::vector<BufferValue> writes, Done<uint64_t> done) {
  Submit(
      [this, writes = std::move(writes), done]() mutable {
        if (absl::Status s = fault_->status(); !s.ok()) return done(s);
        absl::StatusOr<std::shared_ptr<const BufferSet>> next =
            buffers()->Merged(std::move(writes));
        if (!next.ok()) return done(next.status());
        {
          MutexLock lock(&view_mu_);
          buffers_ = *std::move(next);
        }
        ++generation_;
        done(queued_version_);
      },
      [done](const absl::Status& s) { done(s); });
}

void UpdateEngine::RegisterParamGroup(ParamGroupSpec group, Done<bool> done) {
  Submit(
      [this, group = std::move(group), done]() mutable {
        if (absl::Status s = fault_->status(); !s.ok()) return done(s);
        if (absl::Status s = CheckName(group.name, kMaxGroupNameBytes, "param_group.name");
            !s.ok()) {
          return done(s);
        }
        if (absl::Status s = ValidateHyperparameters(group.hyperparameters); !s.ok()) {
          return done(s);
        }
        std::shared_ptr<const ShardView> current = view();
        if (std::optional<uint32_t> existing = current->FindGroup(group.name)) {
          if (SameHyperparameters(current->groups()[*existing].hyperparameters,
                                  group.hyperparameters)) {
            return done(false);
          }
          return done(absl::AlreadyExistsError(
              absl::StrCat("param group ", QuoteName(group.name),
                           " is registered with other hyperparameters; change them with "
                           "SetHyperparameters")));
        }
        const uint32_t index = static_cast<uint32_t>(current->groups().size());
        if (absl::Status s = Checked(backend_->SetParamGroup(index, group.hyperparameters), true);
            !s.ok()) {
          return done(s);
        }
        {
          MutexLock lock(&view_mu_);
          view_ = view_->WithGroup(index, std::move(group));
        }
        ++generation_;
        done(true);
      },
      [done](const absl::Status& s) { done(s); });
}

void UpdateEngine::SetHyperparameters(std::string group, v1::Hyperparameters update,
                                      Done<ParamGroupSpec> done) {
  Submit(
      [this, group = std::move(group), update = std::move(update), done] {
        if (absl::Status s = fault_->status(); !s.ok()) return done(s);
        std::shared_ptr<const ShardView> current = view();
        const std::string& name = group.empty() ? std::string(kDefaultParamGroup) : group;
        std::optional<uint32_t> index = current->FindGroup(name);
        if (!index.has_value()) {
          return done(absl::NotFoundError(
              absl::StrCat("param group ", QuoteName(name), " is not registered")));
        }
        ParamGroupSpec changed = current->groups()[*index];
        absl::StatusOr<AdamWHyperparameters> h =
            UpdatedHyperparameters(changed.hyperparameters, update);
        if (!h.ok()) return done(h.status());
        changed.hyperparameters = *h;
        if (absl::Status s = Checked(backend_->SetParamGroup(*index, *h), true); !s.ok()) {
          return done(s);
        }
        {
          MutexLock lock(&view_mu_);
          view_ = view_->WithGroup(*index, changed);
        }
        ++generation_;
        done(changed);
      },
      [done](const absl::Status& s) { done(s); });
}

void UpdateEngine::BeginRegistration(std::vector<TensorMeta> tensors, Done<uint32_t> done) {
  Submit(
      [this, tensors = std::move(tensors), done]() mutable {
        if (absl::Status s = fault_->status(); !s.ok()) return done(s);
        if (!pending_tensors_.empty()) {
          return done(absl::FailedPreconditionError("another registration is in progress"));
        }
        std::shared_ptr<const ShardView> current = view();
        std::vector<NewTensor> added;
        for (const TensorMeta& t : tensors) {
          if (current->FindTensor(t.name).has_value()) {
            return done(absl::AlreadyExistsError(
                absl::StrCat("tensor ", QuoteName(t.name), " is registered already")));
          }
          added.push_back(
              {t.numel, t.group, TensorRoundingKey(t.name.data(), t.name.size()), t.table_dim()});
        }
        absl::StatusOr<uint32_t> first = backend_->AddTensors(added);
        if (!first.ok()) return done(Checked(first.status(), true));
        if (*first != current->tensor_count()) {
          return done(Checked(
              absl::InternalError(absl::StrCat("the backend added tensors at ", *first,
                                               ", the view has ", current->tensor_count()))));
        }
        pending_first_ = *first;
        pending_tensors_ = std::move(tensors);
        done(*first);
      },
      [done](const absl::Status& s) { done(s); });
}

void UpdateEngine::WriteParams(std::vector<ParamWrite> writes, Done<bool> done) {
  Submit(
      [this, writes = std::move(writes), done] {
        if (absl::Status s = fault_->status(); !s.ok()) return done(s);
        for (const ParamWrite& w : writes) {
          const bool pending =
              w.tensor >= pending_first_ && w.tensor - pending_first_ < pending_tensors_.size();
          if (!pending || w.offset + w.count > pending_tensors_[w.tensor - pending_first_].numel) {
            return done(absl::InternalError(
                absl::StrCat("a write of ", w.count, " values at ", w.offset, " to tensor ",
                             w.tensor, ", which no registration in progress holds")));
          }
          if (absl::Status s = Checked(backend_->WriteParams(
                  w.tensor, w.offset, absl::MakeConstSpan(w.values, w.count)));
              !s.ok()) {
            return done(s);
          }
        }
        done(true);
      },
      [done](const absl::Status& s) { done(s); });
}

void UpdateEngine::CommitRegistration(std::string plan_hash, Done<uint64_t> done) {
  Submit(
      [this, plan_hash = std::move(plan_hash), done] {
        if (absl::Status s = fault_->status(); !s.ok()) return done(s);
        {
          // Steps first: a reader that finds the new tensors in the view finds their steps.
          WriterMutexLock lock(&progress_mu_);
          steps_.resize(pending_first_ + pending_tensors_.size(), 0);
        }
        for (size_t i = 0; i < pending_tensors_.size(); ++i) {
          const TensorMeta& t = pending_tensors_[i];
          if (t.hashed.has_value()) {
            hashed_.emplace(pending_first_ + static_cast<uint32_t>(i), HashedRowIndex(t.shape[0]));
          }
        }
        {
          MutexLock lock(&view_mu_);
          view_ = view_->WithTensors(std::move(pending_tensors_));
          if (view_->plan_hash().empty() && !plan_hash.empty()) {
            view_ = view_->WithPlanHash(plan_hash);
          }
        }
        pending_tensors_.clear();
        ++generation_;
        done(queued_version_);
      },
      [done](const absl::Status& s) { done(s); });
}

void UpdateEngine::AbortRegistration(Done<bool> done) {
  Submit(
      [this, done] {
        if (pending_tensors_.empty()) return done(true);
        pending_tensors_.clear();
        if (absl::Status s = fault_->status(); !s.ok()) return done(s);
        if (absl::Status s = Checked(backend_->TruncateTensors(pending_first_)); !s.ok()) {
          return done(s);
        }
        done(true);
      },
      [done](const absl::Status& s) { done(s); });
}

void UpdateEngine::Read(ReadJob job, Done<ReadResult> done) {
  Submit(
      [this, job = std::move(job), done] {
        const auto fail = [this, done](absl::Status s) {
          Complete({0, [done, s](absl::StatusOr<WorkDone>) { done(s); }});
        };
        if (absl::Status s = fault_->status(); !s.ok()) return fail(s);
        ReadResult result;
        ReadRequest request;
        request.field = job.field;
        request.param_copy = job.param_copy;
        request.stored = job.stored;
        request.tensors = job.tensors;
        request.dst_offsets = job.dst_offsets;
        request.dst = job.dst;
        request.dst_on_device = job.dst_on_device;
        if (job.snapshot_bytes > 0) {
          absl::StatusOr<void*> snapshot = backend_->AllocateSnapshot(job.snapshot_bytes);
          if (!snapshot.ok()) return fail(Checked(snapshot.status(), true));
          result.snapshot = request.dst = *snapshot;
          request.dst_is_snapshot = true;
        }
        if (absl::Status s = Checked(backend_->Read(request), true); !s.ok()) {
          if (result.snapshot != nullptr) {
            Checked(backend_->FreeSnapshot(result.snapshot)).IgnoreError();  // A fault reports.
          }
          return fail(s);
        }
        absl::StatusOr<Marker> marker = backend_->Mark();
        if (!marker.ok()) return fail(Checked(marker.status()));
        result.version = queued_version_;
        result.steps.reserve(job.tensors.size());
        for (uint32_t t : job.tensors) result.steps.push_back(backend_->step(t));
        Complete({*marker, [done, result](absl::StatusOr<WorkDone> work) {
                    if (!work.ok()) return done(work.status());
                    done(result);
                  }});
      },
      [done](const absl::Status& s) { done(s); });
}

void UpdateEngine::FreeSnapshot(void* snapshot) {
  Submit([this, snapshot] { Checked(backend_->FreeSnapshot(snapshot)).IgnoreError(); },
         // Shutting down: the backend frees what is left when it goes.
         [](const absl::Status&) {});
}

absl::Status UpdateEngine::CopyStagingToDevice(uint64_t offset, uint64_t bytes) {
  return Checked(backend_->CopyStagingToDevice(offset, bytes));
}

absl::StatusOr<GradCheck> UpdateEngine::CopyDeviceToStaging(
    absl::Span<const DeviceStagingCopy> copies, GradDType dtype) {
  absl::StatusOr<GradCheck> check = backend_->CopyDeviceToStaging(copies, dtype);
  if (!check.ok()) return Checked(check.status(), /*expected_ok=*/true);
  return check;
}

absl::Status UpdateEngine::CopyFromSnapshot(const void* snapshot, uint64_t offset, uint64_t bytes,
                                            void* dst) {
  return Checked(backend_->CopyFromSnapshot(snapshot, offset, bytes, dst));
}

}  // namespace fusedps
