#include "server/service/push_reactor.h"

#include <algorithm>
#include <atomic>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "google/protobuf/util/message_differencer.h"
#include "kernels/grad_check.h"
#include "grpcpp/support/proto_buffer_writer.h"
#include "server/ingest/chunk_assembler.h"
#include "server/ingest/push_message.h"
#include "server/service/wire_checks.h"

namespace fusedps {
namespace {

constexpr uint32_t kMaxParts = 64;
constexpr absl::Duration kFailedMemory = absl::Minutes(1);

class PushReactor;

}  // namespace

// The state of one push, shared by its parts. Parts call in from gRPC's threads; the staging
// pool and the update engine call back from theirs. Calls into parts (OnReady, Reply) are made
// without mu_ held, and Reply at most once per part.
class PushAssembly : public std::enable_shared_from_this<PushAssembly> {
 public:
  PushAssembly(const PushServices& services, std::string key, v1::PushHeader header,
               std::vector<TensorInfo> tensors, GradDType dtype, uint32_t part_count)
      : services_(services),
        key_(std::move(key)),
        header_(std::move(header)),
        tensors_(std::move(tensors)),
        dtype_(dtype),
        expected_(Expected(tensors_)),
        part_count_(part_count),
        parts_(part_count, nullptr) {}

  // Adds a part. Errors: INVALID_ARGUMENT for a header unlike the first part's or a part index
  // seen before; ABORTED once the push failed or was applied. Calls part->OnReady() at once
  // when the staging is ready.
  absl::Status Join(PushReactor* part, uint32_t index, const v1::PushHeader& header);

  // Reserves the staging; the first part calls it once, after joining.
  void Reserve();

  // Checks one message's chunks of a part and copies them once, from gRPC's buffer into
  // staging, checking their gradients for non-finite values and starting each one's copy to
  // the device. Only the checks hold mu_: parts copy their chunks concurrently.
  absl::Status AddMessage(grpc::ByteBuffer& message, bool first, uint64_t* bytes_added)
      ABSL_LOCKS_EXCLUDED(mu_);

  // A part's stream ended well. The last one submits the push.
  void PartEnded() ABSL_LOCKS_EXCLUDED(mu_);

  // The push fails: `part` (if any) gets `status`, the other parts ABORTED.
  void Fail(const PushReactor* part, const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);
  // The push fails as a whole (not because of one part): every part gets `status`.
  void FailAll(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_) { Fail(nullptr, status, true); }

  // When the push began (its first part's header arrived).
  absl::Time arrived() const { return arrived_; }
  // How many of its parts have joined; the rest are still awaited.
  uint32_t parts_joined() const ABSL_LOCKS_EXCLUDED(mu_);
  uint32_t part_count() const { return part_count_; }

 private:
  static std::vector<ChunkAssembler::Expected> Expected(const std::vector<TensorInfo>& tensors) {
    std::vector<ChunkAssembler::Expected> expected;
    for (const TensorInfo& t : tensors) expected.push_back({t.spec.name, t.numel});
    return expected;
  }
  void OnReserved(absl::StatusOr<StagingPool::Reservation> reservation) ABSL_LOCKS_EXCLUDED(mu_);
  void OnApplied(const absl::StatusOr<PushOutcome>& outcome) ABSL_LOCKS_EXCLUDED(mu_);
  void Fail(const PushReactor* part, const absl::Status& status, bool whole_push)
      ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<PushReactor*> TakePartsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const PushServices services_;
  const std::string key_;  // Empty for a single call (not in PushAssemblies).
  const v1::PushHeader header_;
  const std::vector<TensorInfo> tensors_;
  const GradDType dtype_;
  const std::vector<ChunkAssembler::Expected> expected_;  // tensors_, as staging sees them.
  const uint32_t part_count_;
  const absl::Time arrived_ = absl::Now();
  mutable absl::Mutex mu_;
  std::vector<PushReactor*> parts_ ABSL_GUARDED_BY(mu_);  // By part index; null: not joined.
  uint32_t joined_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t ended_ ABSL_GUARDED_BY(mu_) = 0;
  bool ready_ ABSL_GUARDED_BY(mu_) = false;
  bool over_ ABSL_GUARDED_BY(mu_) = false;  // Failed, or submitted.
  uint64_t ticket_ ABSL_GUARDED_BY(mu_) = 0;
  StagingPool::Reservation reservation_ ABSL_GUARDED_BY(mu_);  // Set once, before ready_.
  std::optional<ChunkAssembler> assembler_ ABSL_GUARDED_BY(mu_);
  bool grads_finite_ ABSL_GUARDED_BY(mu_) = true;
  std::atomic<int64_t> ingest_nanos_{0};  // PushStageSeconds::ingest, summed over messages.
  absl::Time received_;
  ReadyPush push_;
};

namespace {

class PushReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  PushReactor(grpc::CallbackServerContext* context, grpc::ByteBuffer* response,
              const PushServices& services)
      : context_(context), response_(response), services_(services) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    std::shared_ptr<PushAssembly> assembly = Assembly();
    if (!ok) {
      if (assembly == nullptr) {
        return Reply(context_->IsCancelled()
                         ? absl::CancelledError("cancelled")
                         : absl::InvalidArgumentError(
                               "the first PushGradientsRequest must carry header"),
                     {});
      }
      // A part that is cancelled mid-push, or after its last chunk, fails the push.
      if (context_->IsCancelled()) return assembly->Fail(this, absl::CancelledError("cancelled"));
      bool ended;
      {
        absl::MutexLock lock(&mu_);
        stream_ended_ = true;
        ended = messages_in_flight_ == 0;  // Else the last message to be added ends it.
      }
      if (ended) assembly->PartEnded();
      return;
    }
    if (assembly == nullptr) return OnHeader();
    BeginMessage();
    AddMessage(*assembly, request_, /*first=*/false);
  }

  void OnCancel() override {
    if (std::shared_ptr<PushAssembly> assembly = Assembly()) {
      assembly->Fail(this, absl::CancelledError("cancelled"));
    }
  }

  void OnDone() override {
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
      if (messages_in_flight_ > 0) return;  // The last message to be added deletes this.
    }
    delete this;
  }

  // A message is about to be added (a count OnDone waits for). The assembly calls it for the
  // first message, under its lock, before OnReady.
  void BeginMessage() {
    absl::MutexLock lock(&mu_);
    ++messages_in_flight_;
  }

  // The staging is ready (BeginMessage was called): add the first message.
  void OnReady() { AddMessage(*Assembly(), first_, /*first=*/true); }

  // The one place a call ends: metrics, then the status and reply to the client.
  void Reply(const absl::Status& status, const v1::PushGradientsResponse& response,
             const PushStageSeconds& stages = {}) {
    bool own_buffer = false;
    if (status.ok()) {
      // The response message is small; a failure to serialize it cannot happen short of OOM.
      grpc::GenericSerialize<grpc::ProtoBufferWriter, v1::PushGradientsResponse>(
          response, response_, &own_buffer)
          .IgnoreError();
    }
    services_.metrics->RecordPush(static_cast<grpc::StatusCode>(status.code()), bytes_, stages);
    Finish(ToGrpc(status));
  }

 private:
  std::shared_ptr<PushAssembly> Assembly() {
    absl::MutexLock lock(&mu_);
    return assembly_;
  }

  // Adds a message after BeginMessage and reads the next. The stream's end waits for it, and
  // so does the reactor's deletion (OnReady runs outside gRPC's reactions, so a Fail from
  // another part could otherwise end the call under it). (Reading the next message before
  // adding this one was measured too: no faster on the H200 host, docs/benchmarks.md.)
  void AddMessage(PushAssembly& assembly, grpc::ByteBuffer& message, bool first) {
    uint64_t bytes = 0;
    const absl::Status added = assembly.AddMessage(message, first, &bytes);
    message.Clear();  // gRPC's buffer goes back now.
    bytes_.fetch_add(bytes, std::memory_order_relaxed);
    if (added.ok()) {
      StartRead(&request_);
    } else {
      assembly.Fail(this, added);
    }
    bool ended, done;
    {
      absl::MutexLock lock(&mu_);
      ended = --messages_in_flight_ == 0 && stream_ended_;
      done = messages_in_flight_ == 0 && done_;
    }
    if (done) {
      delete this;
    } else if (ended) {
      assembly.PartEnded();
    }
  }

  void OnHeader() {
    absl::StatusOr<std::optional<v1::PushHeader>> read = ReadPushHeader(request_);
    if (!read.ok()) return Reply(read.status(), {});
    if (!read->has_value()) {
      return Reply(absl::InvalidArgumentError("the first PushGradientsRequest must carry header"),
                   {});
    }
    header_ = **std::move(read);
    const v1::PushHeader& header = header_;
    const uint32_t parts = std::max<uint32_t>(1, header.part_count());
    if (parts > kMaxParts || header.part_index() >= parts) {
      return Reply(absl::InvalidArgumentError(absl::StrCat(
                       "header.part_index = ", header.part_index(), " and header.part_count = ",
                       header.part_count(), " must satisfy part_index < part_count <= ",
                       kMaxParts)),
                   {});
    }
    if (parts > 1 && (header.client_id().empty() || header.sequence_number() == 0)) {
      return Reply(absl::InvalidArgumentError(
                       "a push in parts needs header.client_id and header.sequence_number"),
                   {});
    }
    absl::StatusOr<std::vector<TensorInfo>> tensors =
        CheckPushHeader(header, *services_.store);
    if (!tensors.ok()) return Reply(tensors.status(), {});
    const GradDType dtype = *GradDTypeFromProto(header.grad_dtype(), "header.grad_dtype");
    first_.Swap(&request_);
    const auto make = [&] {
      return std::make_shared<PushAssembly>(services_, parts > 1 ? Key(header) : "", header,
                                            *std::move(tensors), dtype, parts);
    };
    bool created = true;
    std::shared_ptr<PushAssembly> assembly =
        parts > 1 ? services_.assemblies->FindOrCreate(Key(header), make, &created) : make();
    if (assembly == nullptr) {
      return Reply(absl::AbortedError("another part of this push failed already"), {});
    }
    {
      absl::MutexLock lock(&mu_);
      assembly_ = assembly;
    }
    if (absl::Status s = assembly->Join(this, header.part_index(), header); !s.ok()) {
      // Joined nothing: this part answers for itself (and a bad header fails the push).
      {
        absl::MutexLock lock(&mu_);
        assembly_ = nullptr;
      }
      if (absl::IsInvalidArgument(s)) assembly->Fail(nullptr, s);
      return Reply(s, {});
    }
    if (created) assembly->Reserve();
  }

  static std::string Key(const v1::PushHeader& header) {
    return absl::StrCat(header.client_id(), "\n", header.sequence_number());
  }

  grpc::CallbackServerContext* const context_;
  grpc::ByteBuffer* const response_;  // A serialized PushGradientsResponse.
  const PushServices services_;
  grpc::ByteBuffer request_;  // The message being read: a serialized PushGradientsRequest.
  grpc::ByteBuffer first_;    // The header's message, kept for its chunks until staging is ready.
  v1::PushHeader header_;     // first_'s header.
  std::atomic<uint64_t> bytes_{0};  // Gradient payload this part received.
  absl::Mutex mu_;
  std::shared_ptr<PushAssembly> assembly_ ABSL_GUARDED_BY(mu_);
  int messages_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool stream_ended_ ABSL_GUARDED_BY(mu_) = false;  // The client's writes are done.
  bool done_ ABSL_GUARDED_BY(mu_) = false;          // gRPC called OnDone.
};

}  // namespace

absl::Status PushAssembly::Join(PushReactor* part, uint32_t index, const v1::PushHeader& header) {
  v1::PushHeader mine = header, first = header_;
  mine.clear_part_index();
  first.clear_part_index();
  if (!google::protobuf::util::MessageDifferencer::Equals(mine, first)) {
    return absl::InvalidArgumentError(
        absl::StrCat("header of part ", index, " differs from the header of the push's first "
                     "part (only part_index may differ)"));
  }
  bool ready;
  {
    absl::MutexLock lock(&mu_);
    if (over_) return absl::AbortedError("the push this part belongs to has failed or ended");
    if (parts_[index] != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("header.part_index = ", index, " arrived twice for this push"));
    }
    parts_[index] = part;
    ++joined_;
    ready = ready_;
    if (ready) part->BeginMessage();
  }
  if (ready) part->OnReady();
  return absl::OkStatus();
}

void PushAssembly::Reserve() {
  const uint64_t bytes = ChunkAssembler::StagingBytes(expected_, DTypeSize(dtype_));
  const uint64_t ticket = services_.staging->ReserveAsync(
      bytes, [self = shared_from_this()](absl::StatusOr<StagingPool::Reservation> r) {
        self->OnReserved(std::move(r));
      });
  absl::MutexLock lock(&mu_);
  if (!ready_ && !over_) ticket_ = ticket;
}

void PushAssembly::OnReserved(absl::StatusOr<StagingPool::Reservation> reservation) {
  if (!reservation.ok()) return FailAll(reservation.status());
  std::vector<PushReactor*> joined;
  {
    absl::MutexLock lock(&mu_);
    if (over_) return;  // Failed meanwhile; the reservation goes back now.
    ticket_ = 0;
    reservation_ = *std::move(reservation);
    absl::StatusOr<ChunkAssembler> assembler =
        ChunkAssembler::Create(expected_, DTypeSize(dtype_), reservation_.data());
    if (assembler.ok()) {
      assembler_.emplace(*std::move(assembler));
      ready_ = true;
      for (PushReactor* p : parts_) {
        if (p == nullptr) continue;
        p->BeginMessage();  // Under mu_: no Fail can end the part's call before OnReady.
        joined.push_back(p);
      }
    } else {
      reservation = assembler.status();
    }
  }
  if (!reservation.ok()) return FailAll(reservation.status());
  for (PushReactor* p : joined) p->OnReady();
}

absl::Status PushAssembly::AddMessage(grpc::ByteBuffer& message, bool first,
                                      uint64_t* bytes_added) {
  const float grad_scale = header_.has_grad_scale() ? header_.grad_scale() : 0.0f;
  char* staging = nullptr;  // reservation_'s memory, fixed once ready_.
  uint64_t staging_offset = 0;
  const auto claim = [&](absl::string_view tensor, uint64_t offset,
                         uint64_t bytes) -> absl::StatusOr<char*> {
    absl::MutexLock lock(&mu_);
    if (over_) return absl::AbortedError("the push this part belongs to has failed");
    absl::StatusOr<std::optional<uint64_t>> at =
        ClaimChunk(*assembler_, *services_.store, tensor, offset, bytes);
    if (!at.ok()) return at.status();
    staging = reservation_.data();
    staging_offset = reservation_.offset();
    return at->has_value() ? staging + **at : nullptr;
  };
  // Outside mu_: this part's copy into staging (in ReadPushChunks), its check and the start of
  // its device copy. The staging stays reserved while any part is in here (the parts hold
  // the assembly), and a push is submitted only when every part has ended, after its last
  // AddMessage.
  const auto staged = [&](char* data, uint64_t bytes) -> absl::Status {
    *bytes_added += bytes;
    if (!GradsAllFinite(data, dtype_, bytes / DTypeSize(dtype_), grad_scale,
                        /*parallel=*/false)) {
      absl::MutexLock lock(&mu_);
      grads_finite_ = false;
    }
    return services_.store->CopyStagingToDevice(staging_offset + (data - staging), bytes);
  };
  const absl::Time start = absl::Now();
  absl::Status read = ReadPushChunks(message, first, claim, staged);
  ingest_nanos_.fetch_add(absl::ToInt64Nanoseconds(absl::Now() - start),
                          std::memory_order_relaxed);
  return read;
}

void PushAssembly::PartEnded() {
  absl::Status complete;
  {
    absl::MutexLock lock(&mu_);
    if (over_ || ++ended_ < part_count_) return;
    complete = assembler_->Finish();
    if (complete.ok()) {
      over_ = true;  // Submitted: no part can fail it any more.
      received_ = absl::Now();
      push_.client_id = header_.client_id();
      push_.sequence_number = header_.sequence_number();
      for (const TensorInfo& t : tensors_) push_.tensors.push_back(t.index);
      push_.grad_offsets = assembler_->staging_offsets();
      push_.grads = assembler_->staging();
      push_.grad_dtype = dtype_;
      push_.grad_scale = header_.has_grad_scale() ? header_.grad_scale() : 0.0f;
      push_.grads_checked = true;
      push_.grads_finite = grads_finite_;
    }
  }
  if (!complete.ok()) return FailAll(complete);
  services_.engine->Submit(&push_, [self = shared_from_this()](
                                       absl::StatusOr<PushOutcome> outcome) {
    self->OnApplied(outcome);
  });
}

void PushAssembly::OnApplied(const absl::StatusOr<PushOutcome>& outcome) {
  const absl::Time stepped = absl::Now();
  std::vector<PushReactor*> parts;
  v1::PushGradientsResponse response;
  {
    absl::MutexLock lock(&mu_);
    parts = TakePartsLocked();
    if (outcome.ok()) {
      response.set_version(outcome->version);
      response.set_step_skipped(outcome->skipped);
      if (outcome->skipped) response.set_skip_reason(kSkipNonFiniteGrad);
      response.set_tensors_updated(outcome->tensors_updated);
      response.set_grad_bytes(assembler_->bytes_received());
      response.set_duplicate(outcome->duplicate);
    }
  }
  if (!key_.empty()) services_.assemblies->Remove(key_, this, /*failed=*/false);
  PushStageSeconds stages;
  if (outcome.ok()) {
    if (!outcome->duplicate) services_.metrics->RecordStep(outcome->skipped, kSkipNonFiniteGrad);
    // h2d is what the backend step spent outside its kernels (what was left of the copies);
    // apply is the rest until the outcome was back: the engine's queue and the kernels.
    stages.receive = absl::ToDoubleSeconds(received_ - arrived_);
    stages.h2d = std::max(0.0, outcome->step_seconds - outcome->device_seconds);
    stages.apply = std::max(0.0, absl::ToDoubleSeconds(stepped - received_) - stages.h2d);
    stages.ack = absl::ToDoubleSeconds(absl::Now() - stepped);
    stages.ingest = 1e-9 * static_cast<double>(ingest_nanos_.load(std::memory_order_relaxed));
  }
  for (PushReactor* p : parts) p->Reply(outcome.status(), response, stages);
}

void PushAssembly::Fail(const PushReactor* part, const absl::Status& status) {
  Fail(part, status, /*whole_push=*/false);
}

void PushAssembly::Fail(const PushReactor* part, const absl::Status& status, bool whole_push) {
  std::vector<PushReactor*> parts;
  uint64_t ticket;
  {
    absl::MutexLock lock(&mu_);
    if (over_) return;
    over_ = true;
    ticket = std::exchange(ticket_, 0);
    parts = TakePartsLocked();
  }
  if (ticket != 0) services_.staging->Cancel(ticket);  // Its callback finds over_ set.
  if (!key_.empty()) services_.assemblies->Remove(key_, this, /*failed=*/true);
  const absl::Status aborted = absl::AbortedError(
      absl::StrCat("another part of this push failed: ", status.message()));
  // A single call gets the error itself; in a push of parts, the part that failed gets it (or
  // every part, when the push failed as a whole).
  for (PushReactor* p : parts) {
    p->Reply(whole_push || p == part || part_count_ == 1 ? status : aborted, {});
  }
}

uint32_t PushAssembly::parts_joined() const {
  absl::MutexLock lock(&mu_);
  return joined_;
}

std::vector<PushReactor*> PushAssembly::TakePartsLocked() {
  std::vector<PushReactor*> taken;
  for (PushReactor*& p : parts_) {
    if (p != nullptr) taken.push_back(std::exchange(p, nullptr));
  }
  return taken;
}

PushAssemblies::PushAssemblies(absl::Duration part_wait)
    : part_wait_(part_wait), checker_([this] { FailLatePushes(); }) {}

PushAssemblies::~PushAssemblies() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  checker_.join();
}

void PushAssemblies::FailLatePushes() {
  const absl::Duration period = std::min(absl::Seconds(1), part_wait_ / 4);
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stop_), period)) {
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
      assembly->FailAll(absl::DeadlineExceededError(absl::StrCat(
          "only ", assembly->parts_joined(), " of the push's ", assembly->part_count(),
          " parts arrived within ", absl::FormatDuration(part_wait_),
          " of its first (--push-part-wait-seconds)")));
    }
    late.clear();
    mu_.Lock();
  }
}

std::shared_ptr<PushAssembly> PushAssemblies::FindOrCreate(
    const std::string& key, const std::function<std::shared_ptr<PushAssembly>()>& make,
    bool* created) {
  absl::MutexLock lock(&mu_);
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
  absl::MutexLock lock(&mu_);
  auto it = assemblies_.find(key);
  if (it != assemblies_.end() && it->second.get() == assembly) assemblies_.erase(it);
  if (failed) failed_[key] = absl::Now();
}

grpc::ServerReadReactor<grpc::ByteBuffer>* NewPushReactor(
    grpc::CallbackServerContext* context, grpc::ByteBuffer* response,
    const PushServices& services) {
  return new PushReactor(context, response, services);
}

}  // namespace fusedps
