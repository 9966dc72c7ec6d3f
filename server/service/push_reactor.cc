#include "server/service/push_reactor.h"

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/byte_buffer_view.h"
#include "common/logging.h"
#include "common/mutex.h"
#include "common/tsan.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/support/proto_buffer_writer.h"
#include "server/ingest/push_admission.h"
#include "server/ingest/push_message.h"
#include "server/service/convert.h"

namespace fusedps {
namespace {

class PushReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer>, public PushPart {
 public:
  PushReactor(grpc::CallbackServerContext* context, grpc::ByteBuffer* response,
              const ServiceContext& services)
      : context_(context),
        response_(response),
        services_(services),
        watch_(services.watchdog->Watch([this] { OnIdle(); })) {
    FUSEDPS_HAPPENS_BEFORE(this);
    if (absl::Status s = services_.Admit(*context_, Rpc::kPushGradients, &caller_); !s.ok()) {
      FinishCall(s, {}, {});
      return;
    }
    StartNextRead();
  }

  void OnReadDone(bool ok) override {
    FUSEDPS_HAPPENS_AFTER(this);
    watch_->Disarm();
    std::shared_ptr<PushAssembly> assembly = Assembly();
    if (!ok) {
      if (assembly == nullptr) {
        return FinishCall(
            context_->IsCancelled()
                ? absl::CancelledError("cancelled")
                : absl::InvalidArgumentError("the first PushGradientsRequest must carry header"),
            {}, {});
      }
      // A part that is cancelled mid-push, or after its last chunk, fails the push.
      if (context_->IsCancelled()) return assembly->Fail(this, absl::CancelledError("cancelled"));
      bool ended;
      {
        MutexLock lock(&mu_);
        stream_ended_ = true;
        ended = messages_in_flight_ == 0;  // Else the last message to be added ends it.
      }
      if (ended) assembly->PartEnded();
      return;
    }
    if (assembly == nullptr) return OnHeader();
    BeginMessage();  // Any message: counted until it is added.
    AddMessage(*assembly, request_, /*first=*/false);
  }

  void OnCancel() override {
    FUSEDPS_HAPPENS_AFTER(this);
    FailPart(absl::CancelledError("cancelled"));
  }

  void OnDone() override {
    FUSEDPS_HAPPENS_AFTER(this);
    watch_->Stop();
    {
      MutexLock lock(&mu_);
      done_ = true;
      if (holds_ > 0) return;  // The last holder deletes this.
    }
    delete this;
  }

  // PushPart.
  void BeginMessage() override {
    MutexLock lock(&mu_);
    ++messages_in_flight_;
    ++holds_;
  }
  void OnStagingReady() override { AddMessage(*Assembly(), first_, /*first=*/true); }
  void Finish(const absl::Status& status, const PushReply& reply,
              const PushStageSeconds& stages) override {
    FinishCall(status, reply, stages);
  }

 private:
  std::shared_ptr<PushAssembly> Assembly() ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    return assembly_;
  }

  // Fails this part from outside its reads (OnCancel, OnIdle, which may run while OnHeader
  // does): through its push once it has joined one, else by itself, and then it never joins
  // one (a push would finish it a second time, after gRPC has freed the call).
  void FailPart(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_) {
    std::shared_ptr<PushAssembly> assembly;
    {
      MutexLock lock(&mu_);
      assembly = assembly_;
      if (assembly == nullptr && failed_alone_.ok()) failed_alone_ = status;
    }
    if (assembly != nullptr) return assembly->Fail(this, status);
    FinishCall(status, {}, {});
  }

  // The one place a call ends: metrics, then the status and reply to the client. Once.
  void FinishCall(const absl::Status& status, const PushReply& reply,
                  const PushStageSeconds& stages) ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    if (finished_) return;
    finished_ = true;
    if (status.ok()) {
      v1::PushGradientsResponse response;
      ToProto(reply, &response);
      bool own_buffer = false;
      // The response is small; serializing it cannot fail short of running out of memory.
      grpc::GenericSerialize<grpc::ProtoBufferWriter, v1::PushGradientsResponse>(
          response, response_, &own_buffer)
          .IgnoreError();
    }
    services_.metrics->RecordPush(static_cast<grpc::StatusCode>(status.code()),
                                  bytes_.load(std::memory_order_relaxed), stages,
                                  status.ok() && reply.duplicate);
    if (!status.ok() && !absl::IsCancelled(status)) {
      FUSEDPS_LOG_EVERY_SECONDS(WARNING, 1) << "push from " << context_->peer() << " (client_id "
                                            << QuoteName(client_id_) << ") failed: " << status;
    }
    FUSEDPS_HAPPENS_BEFORE(this);
    grpc::ServerReadReactor<grpc::ByteBuffer>::Finish(ToGrpc(status));
  }

  // Reads the next message, unless the call is finished. The watch is armed first, so that the
  // read's OnReadDone (which disarms it) cannot come before.
  void StartNextRead() ABSL_LOCKS_EXCLUDED(mu_) {
    watch_->Arm();
    MutexLock lock(&mu_);
    if (finished_) return;
    FUSEDPS_HAPPENS_BEFORE(this);
    StartRead(&request_);
  }

  void ReleaseHold() ABSL_LOCKS_EXCLUDED(mu_) {
    {
      MutexLock lock(&mu_);
      if (--holds_ > 0 || !done_) return;
    }
    delete this;
  }

  void OnIdle() {
    const absl::Status idle = absl::DeadlineExceededError(
        absl::StrCat("no message for ", absl::FormatDuration(services_.watchdog->idle_limit()),
                     " (--call-idle-seconds)"));
    FailPart(idle);
  }

  // Adds a message after BeginMessage and reads the next. The stream's end waits for it,
  // and so does the reactor's deletion (OnStagingReady runs on the staging pool's thread, so a
  // Fail from another part could otherwise end the call under it).
  void AddMessage(PushAssembly& assembly, grpc::ByteBuffer& message, bool first) {
    uint64_t bytes = 0;
    absl::Status added;
    {
      const ByteBufferView view(message);
      added = view.ok() ? assembly.AddMessage(view.views(), first, part_index_, &bytes)
                        : absl::InternalError("cannot read the message's slices");
    }
    message.Clear();  // gRPC's buffer goes back now.
    bytes_.fetch_add(bytes, std::memory_order_relaxed);
    if (added.ok()) {
      StartNextRead();
    } else {
      assembly.Fail(this, added);
    }
    bool ended;
    {
      MutexLock lock(&mu_);
      ended = --messages_in_flight_ == 0 && stream_ended_;
    }
    if (ended) assembly.PartEnded();
    ReleaseHold();
  }

  void OnHeader() {
    absl::StatusOr<std::optional<v1::PushHeader>> read;
    {
      const ByteBufferView view(request_);
      read = view.ok() ? ReadPushHeader(view.views())
                       : absl::InternalError("cannot read the message's slices");
    }
    if (!read.ok()) return FinishCall(read.status(), {}, {});
    if (!read->has_value()) {
      return FinishCall(
          absl::InvalidArgumentError("the first PushGradientsRequest must carry header"), {}, {});
    }
    const v1::PushHeader header = **std::move(read);
    {
      MutexLock lock(&mu_);
      client_id_ = header.client_id();
    }
    part_index_ = header.part_index();
    // With authentication on, the retry table's key is the caller's own identity.
    if (absl::Status s =
            services_.authorizer->CheckClientId(caller_, header.client_id(), *context_);
        !s.ok()) {
      return FinishCall(s, {}, {});
    }
    absl::StatusOr<std::shared_ptr<Model>> found =
        services_.FindModel(caller_, header.model(), *context_);
    if (!found.ok()) return FinishCall(found.status(), {}, {});
    const std::shared_ptr<Model> model = *std::move(found);
    if (model->deleted()) return FinishCall(model->DeletedError(), {}, {});

    // The shard decides (server/ingest/push_admission.h); this only translates its verdict.
    {
      MutexLock lock(&mu_);
      ++holds_;  // For the waiter, which may run on another thread before the verdict is back.
    }
    const std::string owner = WorkspaceOwner(caller_);
    PushVerdict verdict =
        AdmitPushHeader(header, {&model->engine(), &model->retries(), services_.workspaces, owner},
                        [this](absl::StatusOr<PushReply> reply) {
                          FinishCall(reply.status(), reply.ok() ? *reply : PushReply{}, {});
                          ReleaseHold();
                        });
    if (verdict.kind == PushVerdict::Kind::kWaiting) return;  // The waiter finishes the call.
    ReleaseHold();  // The waiter was dropped; this call still holds the reactor (not done).
    switch (verdict.kind) {
      case PushVerdict::Kind::kRefused:
        return FinishCall(verdict.status, {}, {});
      case PushVerdict::Kind::kAnswered:
        return FinishCall(absl::OkStatus(), verdict.reply, {});
      case PushVerdict::Kind::kWaiting:
      case PushVerdict::Kind::kAdmitted:
        break;
    }
    JoinAssembly(model, header, std::move(verdict));
  }

  // Joins the admitted push's assembly, or makes it and reserves its staging; the assembly then
  // has this part add the header's message and read on (OnStagingReady).
  void JoinAssembly(const std::shared_ptr<Model>& model, const v1::PushHeader& header,
                    PushVerdict admitted) {
    first_.Swap(&request_);
    if (services_.testing_before_push_join != nullptr) (*services_.testing_before_push_join)();
    const bool parts = admitted.checked.part_count > 1;
    const std::string key = parts ? PushAssemblies::Key(header) : std::string();
    const auto make = [&] {
      return std::make_shared<PushAssembly>(services_.ingest(model), key, header,
                                            std::move(admitted.view), std::move(admitted.checked));
    };
    bool created = true;
    std::shared_ptr<PushAssembly> assembly =
        parts ? model->assemblies().FindOrCreate(key, make, &created) : make();
    if (assembly == nullptr) {
      return FinishCall(absl::AbortedError("another part of this push failed already"), {}, {});
    }
    absl::Status failed_alone;
    {
      MutexLock lock(&mu_);
      failed_alone = failed_alone_;
      if (failed_alone.ok()) assembly_ = assembly;
    }
    if (!failed_alone.ok()) {
      // Cancelled (or idle) meanwhile, and answered already: the push fails without this part,
      // as when a part is cancelled mid-push (the others get ABORTED).
      return assembly->Fail(this, failed_alone);
    }
    if (absl::Status s = assembly->Join(this, header.part_index(), header); !s.ok()) {
      // Joined nothing: this part answers for itself.
      {
        MutexLock lock(&mu_);
        assembly_ = nullptr;
      }
      return FinishCall(s, {}, {});
    }
    if (created) assembly->Reserve();
  }

  grpc::CallbackServerContext* const context_;
  grpc::ByteBuffer* const response_;  // A serialized PushGradientsResponse.
  const ServiceContext services_;
  const std::shared_ptr<CallWatchdog::Handle> watch_;
  Caller caller_;             // Who calls (set by the constructor, before the first read).
  grpc::ByteBuffer request_;  // The message being read: a serialized PushGradientsRequest.
  grpc::ByteBuffer first_;    // The header's message, kept for its chunks until staging is ready.
  std::atomic<uint64_t> bytes_{0};  // Gradient payload this part received.
  // The header's part_index: set before the part joins its push, read by the message adds.
  uint32_t part_index_ = 0;
  Mutex mu_;
  std::string client_id_ ABSL_GUARDED_BY(mu_);  // The header's, for the log.
  std::shared_ptr<PushAssembly> assembly_ ABSL_GUARDED_BY(mu_);
  // FailPart's error before a join; then no join.
  absl::Status failed_alone_ ABSL_GUARDED_BY(mu_);
  int messages_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  int holds_ ABSL_GUARDED_BY(mu_) = 0;              // Messages in flight and a retry's waiter.
  bool stream_ended_ ABSL_GUARDED_BY(mu_) = false;  // The client's writes are done.
  bool finished_ ABSL_GUARDED_BY(mu_) = false;      // Finish was called.
  bool done_ ABSL_GUARDED_BY(mu_) = false;          // gRPC called OnDone.
};

}  // namespace

grpc::ServerReadReactor<grpc::ByteBuffer>* NewPushReactor(grpc::CallbackServerContext* context,
                                                          grpc::ByteBuffer* response,
                                                          const ServiceContext& services) {
  return new PushReactor(context, response, services);
}

}  // namespace fusedps
