#include "server/ingest/push_assembly.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "google/protobuf/util/message_differencer.h"
#include "kernels/grad_check.h"

namespace fusedps {
namespace {

constexpr absl::Duration kFailedMemory = absl::Minutes(1);

std::vector<ChunkAssembler::Expected> ExpectedOf(const ShardView& view,
                                                 const std::vector<uint32_t>& tensors) {
  std::vector<ChunkAssembler::Expected> expected;
  expected.reserve(tensors.size());
  for (uint32_t t : tensors) expected.push_back({view.tensor(t).name, view.tensor(t).numel});
  return expected;
}

}  // namespace

absl::StatusOr<GradDType> GradDTypeFromProto(v1::DType d, absl::string_view field) {
  switch (d) {
    case v1::DTYPE_FLOAT32:
      return GradDType::kFloat32;
    case v1::DTYPE_BFLOAT16:
      return GradDType::kBFloat16;
    case v1::DTYPE_FLOAT16:
      return GradDType::kFloat16;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, " = ", static_cast<int>(d), " must be FLOAT32, BFLOAT16 or FLOAT16"));
  }
}

absl::StatusOr<CheckedPushHeader> CheckPushHeader(const v1::PushHeader& header,
                                                  const ShardView& view) {
  CheckedPushHeader checked;
  absl::StatusOr<GradDType> dtype = GradDTypeFromProto(header.grad_dtype(), "header.grad_dtype");
  if (!dtype.ok()) return dtype.status();
  checked.dtype = *dtype;
  if (header.has_grad_scale() && !(std::isfinite(header.grad_scale()) && header.grad_scale() > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.grad_scale = ", header.grad_scale(), " must be finite and > 0"));
  }
  if (header.commit_at_end() && header.has_grad_scale()) {
    return absl::InvalidArgumentError(
        "header.grad_scale must be unset with header.commit_at_end: the push's commit carries "
        "its grad_scale");
  }
  if (header.worker_count() > 1) {
    return absl::UnimplementedError(
        absl::StrCat("header.worker_count = ", header.worker_count(),
                     ": synchronous aggregation is not implemented; use 0 or 1"));
  }
  if (header.client_id().size() > RetryTable::kMaxClientIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("header.client_id has ",
                                                   header.client_id().size(), " bytes; at most ",
                                                   RetryTable::kMaxClientIdBytes));
  }
  checked.part_count = std::max<uint32_t>(1, header.part_count());
  if (checked.part_count > kMaxPushParts || header.part_index() >= checked.part_count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.part_index = ", header.part_index(), " and header.part_count = ",
        header.part_count(), " must satisfy part_index < part_count <= ", kMaxPushParts));
  }
  if (checked.part_count > 1 &&
      !RetryTable::Tracked(header.client_id(), header.sequence_number())) {
    return absl::InvalidArgumentError(
        "a push in parts needs header.client_id and header.sequence_number");
  }
  absl::flat_hash_set<absl::string_view> seen;
  for (int i = 0; i < header.tensors_size(); ++i) {
    if (!seen.insert(header.tensors(i)).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header.tensors[", i, "] names tensor ", QuoteName(header.tensors(i)), " a second time"));
    }
  }
  if (absl::Status s =
          CheckPlanHash(view, header.plan_hash(), "header.plan_hash", /*registering=*/false);
      !s.ok()) {
    return s;
  }
  absl::flat_hash_set<absl::string_view> tables_seen;
  for (int i = 0; i < header.tables_size(); ++i) {
    const std::string field = absl::StrCat("header.tables[", i, "]");
    if (!tables_seen.insert(header.tables(i)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " names table ", QuoteName(header.tables(i)), " a second time"));
    }
    std::optional<uint32_t> table = view.FindTensor(header.tables(i));
    if (!table.has_value()) {
      return absl::NotFoundError(
          absl::StrCat(field, ": tensor ", QuoteName(header.tables(i)), " is not registered"));
    }
    if (!view.tensor(*table).table) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": tensor ", QuoteName(header.tables(i)),
          " is not an embedding table (push its gradient as chunks, in header.tensors)"));
    }
    checked.tables.push_back(*table);
  }
  if (header.tensors().empty()) {  // Every tensor but the tables; none when tables are named.
    if (header.tables().empty()) {
      for (uint32_t t = 0; t < view.tensor_count(); ++t) {
        if (!view.tensor(t).table) checked.tensors.push_back(t);
      }
    }
    return checked;
  }
  const std::vector<std::string> names(header.tensors().begin(), header.tensors().end());
  absl::StatusOr<std::vector<uint32_t>> tensors = view.Resolve(names);
  if (!tensors.ok()) return tensors.status();
  for (size_t i = 0; i < tensors->size(); ++i) {
    if (view.tensor((*tensors)[i]).table) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header.tensors[", i, "]: ", QuoteName(names[i]),
          " is an embedding table: push its rows (header.tables, table_rows), not chunks"));
    }
  }
  checked.tensors = *std::move(tensors);
  return checked;
}

PushAssembly::PushAssembly(const IngestServices& services, std::string key, v1::PushHeader header,
                           std::shared_ptr<const ShardView> view, CheckedPushHeader checked)
    : services_(services),
      key_(std::move(key)),
      header_(std::move(header)),
      view_(std::move(view)),
      checked_(std::move(checked)),
      parts_(checked_.part_count, nullptr),
      expected_(ExpectedOf(*view_, checked_.tensors)) {
  if (!checked_.tables.empty()) {
    MutexLock lock(&mu_);
    table_rows_.emplace(*view_, checked_.tables, checked_.dtype, services_.staging->capacity());
  }
}

// Whether a part's header equals the push's first (but for part_index). A push in one call has
// one header, which made the assembly: nothing to compare.
bool PushAssembly::SameHeader(const v1::PushHeader& header) const {
  if (checked_.part_count == 1) return true;
  v1::PushHeader mine = header, first = header_;
  mine.clear_part_index();
  first.clear_part_index();
  return google::protobuf::util::MessageDifferencer::Equals(mine, first);
}

absl::Status PushAssembly::Join(PushPart* part, uint32_t index, const v1::PushHeader& header) {
  if (!SameHeader(header)) {
    const absl::Status s =
        absl::InvalidArgumentError(absl::StrCat("header of part ", index,
                                                " differs from the header of the push's first "
                                                "part (only part_index may differ)"));
    Fail(nullptr, s);  // The parts that joined get ABORTED; this one answers for itself.
    return s;
  }
  bool ready;
  {
    MutexLock lock(&mu_);
    if (over_) return absl::AbortedError("the push this part belongs to has failed or ended");
    if (parts_[index] != nullptr) {
      return absl::AbortedError(absl::StrCat("header.part_index = ", index,
                                             " of this push is being received on another call"));
    }
    parts_[index] = part;
    ++joined_;
    ready = ready_;
    if (ready) part->BeginMessage();
  }
  if (ready) part->OnStagingReady();
  return absl::OkStatus();
}

void PushAssembly::Reserve() {
  uint64_t bytes;
  {
    // OnReserved moves expected_ under the lock; this read comes before ReserveAsync below.
    MutexLock lock(&mu_);
    bytes = ChunkAssembler::StagingBytes(expected_, DTypeSize(checked_.dtype));
  }
  const uint64_t ticket = services_.staging->ReserveAsync(
      bytes, [self = shared_from_this()](absl::StatusOr<StagingPool::Reservation> r) {
        self->OnReserved(std::move(r));
      });
  MutexLock lock(&mu_);
  if (!ready_ && !over_) ticket_ = ticket;
}

void PushAssembly::OnReserved(absl::StatusOr<StagingPool::Reservation> reservation) {
  if (!reservation.ok()) return FailAll(reservation.status());
  std::vector<PushPart*> joined;
  absl::Status failed;
  {
    MutexLock lock(&mu_);
    if (over_) return;  // Failed meanwhile; the reservation goes back now.
    ticket_ = 0;
    reservation_ = *std::move(reservation);
    absl::StatusOr<ChunkAssembler> assembler = ChunkAssembler::Create(
        std::move(expected_), DTypeSize(checked_.dtype), reservation_.data());
    if (assembler.ok()) {
      assembler_.emplace(*std::move(assembler));
      ready_ = true;
      for (PushPart* p : parts_) {
        if (p == nullptr) continue;
        p->BeginMessage();  // Under mu_: no Fail can end the part before it adds it.
        joined.push_back(p);
      }
    } else {
      failed = assembler.status();
    }
  }
  if (!failed.ok()) return FailAll(failed);
  for (PushPart* p : joined) p->OnStagingReady();
}

absl::Status PushAssembly::AddMessage(MessageSlices message, bool first, uint32_t part_index,
                                      uint64_t* bytes_added) {
  // With commit_at_end the scale is not known yet: the gradients are checked as they are, and
  // again at the end if the commit's scale could make a finite gradient overflow (PartEnded).
  const float grad_scale = header_.has_grad_scale() ? header_.grad_scale() : 0.0f;
  {
    MutexLock lock(&mu_);
    if (commit_part_ == static_cast<int64_t>(part_index)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "part ", part_index, " sent a message after its commit (the commit comes last)"));
    }
  }
  char* staging = nullptr;  // reservation_'s memory, fixed once ready_.
  uint64_t staging_offset = 0;
  const auto claim = [&](absl::string_view tensor, uint64_t offset,
                         uint64_t bytes) -> absl::StatusOr<char*> {
    MutexLock lock(&mu_);
    if (over_) return absl::AbortedError("the push this part belongs to has failed");
    absl::StatusOr<std::optional<uint64_t>> at =
        ClaimChunk(*assembler_, *view_, tensor, offset, bytes);
    if (!at.ok()) return at.status();
    staging = reservation_.data();
    staging_offset = reservation_.offset();
    return at->has_value() ? staging + **at : nullptr;
  };
  // Outside mu_: this part's copy into staging (in ReadPushChunks), its check, and the device
  // copy of what the message staged. The staging stays reserved while any part is in here (the
  // parts hold the assembly), and a push is submitted only when every part has ended, after its
  // last AddMessage.
  uint64_t lowest = UINT64_MAX, highest = 0;  // The arena bytes this message staged.
  // Through a device workspace: its chunks' device copies, the host-staged ranges one by one
  // (a span could cover bytes the device copies wrote), and what both saw of the gradients,
  // for the verdict at any scale (PartEnded).
  const bool device = ThroughDeviceWorkspace();
  std::vector<DeviceStagingCopy> device_copies;
  std::vector<std::pair<uint64_t, uint64_t>> host_ranges;  // (offset, bytes) in the arena
  GradCheck seen;
  const auto staged = [&](char* data, uint64_t bytes) -> absl::Status {
    *bytes_added += bytes;
    const uint64_t at = staging_offset + (data - staging);
    if (device) {
      MergeGradChecks(&seen, SeeGrads(data, checked_.dtype, bytes / DTypeSize(checked_.dtype)));
      host_ranges.emplace_back(at, bytes);
      return absl::OkStatus();
    }
    if (!GradsAllFinite(data, checked_.dtype, bytes / DTypeSize(checked_.dtype), grad_scale,
                        /*parallel=*/false)) {
      MutexLock lock(&mu_);
      grads_finite_ = false;
    }
    lowest = std::min(lowest, at);
    highest = std::max(highest, at + bytes);
    return absl::OkStatus();
  };
  const auto copy_on_device = [&](char* destination, uint64_t workspace_offset,
                                  uint64_t bytes) -> absl::Status {
    // The device reads whole elements: a misaligned one would be a device fault, not an error.
    if (const uint64_t size = DTypeSize(checked_.dtype); workspace_offset % size != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunks.workspace_offset_bytes = ", workspace_offset,
                       " must be a multiple of the gradient dtype's size, ", size,
                       ", in a push through a device workspace"));
    }
    *bytes_added += bytes;
    device_copies.push_back({checked_.workspace->memory().data() + workspace_offset,
                             staging_offset + (destination - staging), bytes});
    return absl::OkStatus();
  };
  const DeviceChunkFn on_device = copy_on_device;  // A reference: the lambda outlives it.
  const absl::Time start = absl::Now();
  std::optional<v1::PushCommit> commit;
  ChunkWorkspace workspace;
  if (checked_.workspace != nullptr) {
    const absl::Span<const char> memory = checked_.workspace->memory();
    workspace = device ? ChunkWorkspace(memory, &on_device) : ChunkWorkspace(memory);
  }
  std::vector<v1::TableRows> table_rows;
  absl::Status read =
      ReadPushChunks(message, first, claim, staged, &commit, workspace, &table_rows);
  if (read.ok() && !table_rows.empty()) {
    read = TakeTableRows(table_rows);
    for (const v1::TableRows& rows : table_rows) {
      *bytes_added += rows.keys().size() + rows.grads().size();
    }
  }
  if (read.ok() && commit.has_value()) read = TakeCommit(*std::move(commit), part_index);
  // One device copy per message, not per chunk (a message of many small tensors has hundreds).
  // It may span bytes of this push that other messages or parts write meanwhile: each of those
  // issues its own copy after writing, later on the same copy stream, so the last copy of every
  // byte reads its final value.
  if (read.ok() && highest > lowest) {
    read = services_.engine->CopyStagingToDevice(lowest, highest - lowest);
  }
  for (const auto& [offset, bytes] : host_ranges) {
    if (!read.ok()) break;
    read = services_.engine->CopyStagingToDevice(offset, bytes);
  }
  if (read.ok() && !device_copies.empty()) {
    absl::StatusOr<GradCheck> copied =
        services_.engine->CopyDeviceToStaging(device_copies, checked_.dtype);
    if (copied.ok()) {
      MergeGradChecks(&seen, *copied);
    } else {
      read = copied.status();
    }
  }
  if (read.ok() && device) {
    MutexLock lock(&mu_);
    MergeGradChecks(&device_seen_, seen);
    if (!GradCheckFinite(seen, grad_scale)) grads_finite_ = false;
  }
  ingest_nanos_.fetch_add(absl::ToInt64Nanoseconds(absl::Now() - start), std::memory_order_relaxed);
  return read;
}

absl::Status PushAssembly::TakeTableRows(const std::vector<v1::TableRows>& rows) {
  MutexLock lock(&mu_);
  if (over_) return absl::AbortedError("the push this part belongs to has failed");
  if (!table_rows_.has_value()) {
    return absl::InvalidArgumentError(
        "table_rows in a push whose header names no tables (header.tables)");
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    if (absl::Status s = table_rows_->Add(rows[i], absl::StrCat("table_rows[", i, "]")); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status PushAssembly::TakeCommit(v1::PushCommit commit, uint32_t part_index) {
  if (!header_.commit_at_end()) {
    return absl::InvalidArgumentError(
        "a commit in a push whose header.commit_at_end is false (its scale is in the header)");
  }
  if (commit.has_grad_scale() && !(std::isfinite(commit.grad_scale()) && commit.grad_scale() > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("commit.grad_scale = ", commit.grad_scale(), " must be finite and > 0"));
  }
  std::optional<PullPlan> pull;
  if (commit.has_pull()) {
    absl::StatusOr<PullPlan> planned = PlanCommitPull(commit.pull(), header_, services_.model,
                                                      *services_.engine, checked_.workspace);
    if (!planned.ok()) return planned.status();
    pull = *std::move(planned);
    commit.clear_pull();
  }
  MutexLock lock(&mu_);
  if (commit_.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "part ", part_index, " sent a second commit (part ", commit_part_, " sent the first)"));
  }
  commit_ = std::move(commit);
  commit_part_ = part_index;
  commit_pull_ = std::move(pull);
  return absl::OkStatus();
}

void PushAssembly::PartEnded() {
  absl::Status complete;
  {
    MutexLock lock(&mu_);
    if (over_ || ++ended_ < checked_.part_count) return;
    complete = assembler_->Finish();
    if (complete.ok() && header_.commit_at_end() && !commit_.has_value()) {
      complete = absl::InvalidArgumentError(
          "every part of the push ended without its commit (header.commit_at_end)");
    }
    if (complete.ok()) {
      over_ = true;  // Submitted: no part can fail it any more.
      received_ = absl::Now();
      push_.client_id = header_.client_id();
      push_.sequence_number = header_.sequence_number();
      push_.tensors = checked_.tensors;
      if (table_rows_.has_value()) push_.tables = table_rows_->Take();
      push_.grad_offsets = assembler_->staging_offsets();
      push_.grads = assembler_->staging();
      push_.grad_dtype = checked_.dtype;
      push_.grad_scale = header_.has_grad_scale() ? header_.grad_scale() : 0.0f;
      if (commit_.has_value() && commit_->has_grad_scale()) {
        push_.grad_scale = commit_->grad_scale();
      }
      push_.grads_finite = grads_finite_;
      push_.grad_bytes = assembler_->bytes_received();
      if (table_rows_.has_value()) push_.grad_bytes += table_rows_->wire_bytes();
      push_.base_version = header_.base_version();
      push_.arrived = arrived_;
      push_.received = received_;
    }
  }
  if (!complete.ok()) return FailAll(complete);
  // The messages were checked without the commit's scale. Dividing a finite gradient by a
  // scale >= 1 keeps it finite; by a smaller one it may overflow, so those are read again.
  // Through a device workspace the host holds no copy to read: what the messages saw decides.
  if (ThroughDeviceWorkspace()) {
    MutexLock lock(&mu_);
    push_.grads_finite = push_.grads_finite && GradCheckFinite(device_seen_, push_.grad_scale);
  } else if (push_.grads_finite && push_.grad_scale > 0.0f && push_.grad_scale < 1.0f) {
    StepRequest check = GradsOf(push_);
    check.grads_checked = false;  // What this is for.
    push_.grads_finite =
        PushGradsAllFinite(check, [this](uint32_t t) { return view_->tensor(t).numel; });
  }
  // The staging goes back once the engine no longer reads the grads: in sync mode when they
  // are summed into the round, long before the round's step.
  services_.engine->Step(
      &push_,
      [self = shared_from_this()](absl::StatusOr<StepResult> result) { self->OnApplied(result); },
      [self = shared_from_this()] {
        StagingPool::Reservation released;
        MutexLock lock(&self->mu_);
        released = std::move(self->reservation_);
      });
}

void PushAssembly::OnApplied(const absl::StatusOr<StepResult>& result) {
  const absl::Time stepped = absl::Now();
  std::optional<PullPlan> pull;
  {
    MutexLock lock(&mu_);
    pull.swap(commit_pull_);
  }
  if (!pull.has_value() || !result.ok()) return Answer(result, stepped);
  // The commit's pull, in stream order after the step (skipped or not): the reply goes once the
  // values are in the workspace. A failed read (a device fault) fails the push's reply, though
  // the step was applied: the shard is unusable then (UpdateEngine::Step).
  const ReadJob job = pull->WorkspaceJob();
  services_.engine->Read(job, [self = shared_from_this(), step = *result, stepped,
                               plan = std::move(*pull)](absl::StatusOr<ReadResult> read) mutable {
    if (!read.ok()) return self->Answer(read.status(), stepped);
    step.reply.pulled_version = read->version;
    self->services_.metrics->RecordCommitPull(plan.WorkspaceBytes());
    self->Answer(step, stepped);
  });
}

void PushAssembly::Answer(const absl::StatusOr<StepResult>& result, absl::Time stepped) {
  std::vector<PushPart*> parts;
  {
    MutexLock lock(&mu_);
    parts = TakePartsLocked();
  }
  if (!key_.empty()) services_.assemblies->Remove(key_, this, /*failed=*/!result.ok());
  PushReply reply;
  PushStageSeconds stages;
  if (result.ok()) {
    reply = result->reply;
    if (!reply.duplicate) {
      if (result->counts_step) {
        services_.metrics->RecordStep(services_.model, reply.skipped, kSkipNonFiniteGrad);
      }
      // Every pusher's rows, also in a sync round (whose evictions its first pusher of each
      // table reports).
      if (!reply.skipped) {
        for (size_t i = 0; i < push_.tables.size(); ++i) {  // The engine is done with it.
          const ReadyTableRows& rows = push_.tables[i];
          services_.metrics->RecordTablePush(
              services_.model, view_->tensor(rows.tensor).name, rows.keys.size(),
              i < result->table_evictions.size() ? result->table_evictions[i] : 0);
        }
      }
      // h2d is how long the device waited for the gradients' copies once it reached the step;
      // apply is the rest until the step was back: the engine's queue and the kernels; ack
      // from then on (with the commit's pull, if any).
      stages.receive = absl::ToDoubleSeconds(received_ - arrived_);
      stages.h2d = result->copy_wait_seconds;
      stages.apply = std::max(0.0, absl::ToDoubleSeconds(stepped - received_) - stages.h2d);
      stages.ack = absl::ToDoubleSeconds(absl::Now() - stepped);
      stages.ingest = 1e-9 * static_cast<double>(ingest_nanos_.load(std::memory_order_relaxed));
    }
  }
  for (PushPart* p : parts) p->Finish(result.status(), reply, stages);
}

void PushAssembly::Fail(const PushPart* part, const absl::Status& status, bool whole_push) {
  std::vector<PushPart*> parts;
  uint64_t ticket;
  {
    MutexLock lock(&mu_);
    if (over_) return;
    over_ = true;
    ticket = std::exchange(ticket_, 0);
    parts = TakePartsLocked();
  }
  if (ticket != 0) services_.staging->Cancel(ticket);  // Its callback finds over_ set.
  if (!key_.empty()) services_.assemblies->Remove(key_, this, /*failed=*/true);
  const absl::Status aborted =
      absl::AbortedError(absl::StrCat("another part of this push failed: ", status.message()));
  // A single call gets the error itself; in a push of parts, the part that failed gets it (or
  // every part, when the push failed as a whole).
  for (PushPart* p : parts) {
    p->Finish(whole_push || p == part || checked_.part_count == 1 ? status : aborted, {}, {});
  }
}

uint32_t PushAssembly::parts_joined() const {
  MutexLock lock(&mu_);
  return joined_;
}

std::vector<PushPart*> PushAssembly::TakePartsLocked() {
  std::vector<PushPart*> taken;
  for (PushPart*& p : parts_) {
    if (p != nullptr) taken.push_back(std::exchange(p, nullptr));
  }
  return taken;
}

PushAssemblies::PushAssemblies(absl::Duration part_wait)
    : part_wait_(part_wait), checker_([this] { FailLatePushes(); }) {}

PushAssemblies::~PushAssemblies() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  stop_cv_.SignalAll();
  checker_.join();
}

std::string PushAssemblies::Key(const v1::PushHeader& header) {
  return absl::StrCat(header.client_id(), "\n", header.sequence_number());
}

void PushAssemblies::FailLatePushes() {
  const absl::Duration period = std::min(absl::Seconds(1), part_wait_ / 4);
  mu_.Lock();
  while (true) {
    const auto due = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(period);
    while (!stop_ && !stop_cv_.WaitWithDeadline(&mu_, due)) {
    }
    if (stop_) break;
    const absl::Time now = absl::Now();
    std::vector<std::shared_ptr<PushAssembly>> late;
    for (const auto& [key, assembly] : assemblies_) {
      if (now - assembly->arrived() > part_wait_ &&
          assembly->parts_joined() < assembly->part_count()) {
        late.push_back(assembly);
      }
    }
    if (late.empty()) continue;
    mu_.Unlock();  // FailAll calls Remove.
    for (const std::shared_ptr<PushAssembly>& assembly : late) {
      assembly->FailAll(absl::DeadlineExceededError(
          absl::StrCat("only ", assembly->parts_joined(), " of the push's ", assembly->part_count(),
                       " parts arrived within ", absl::FormatDuration(part_wait_),
                       " of its first (--push-part-wait-seconds)")));
    }
    late.clear();
    mu_.Lock();
  }
  mu_.Unlock();
}

std::shared_ptr<PushAssembly> PushAssemblies::FindOrCreate(
    const std::string& key, const std::function<std::shared_ptr<PushAssembly>()>& make,
    bool* created) {
  MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  absl::erase_if(failed_, [now](const auto& entry) { return now - entry.second > kFailedMemory; });
  *created = false;
  if (failed_.contains(key)) return nullptr;
  auto [it, inserted] = assemblies_.try_emplace(key, nullptr);
  if (inserted) it->second = make();
  *created = inserted;
  return it->second;
}

void PushAssemblies::Remove(const std::string& key, const PushAssembly* assembly, bool failed) {
  MutexLock lock(&mu_);
  auto it = assemblies_.find(key);
  if (it != assemblies_.end() && it->second.get() == assembly) assemblies_.erase(it);
  if (failed) failed_[key] = absl::Now();
}

}  // namespace fusedps
