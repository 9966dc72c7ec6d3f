#include "server/service/pull_reactor.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/byte_buffer_view.h"
#include "common/chunk_framing.h"
#include "common/logging.h"
#include "common/mutex.h"
#include "common/tsan.h"
#include "server/ingest/pull_request.h"
#include "server/service/convert.h"
#include "server/workspace/workspace.h"

namespace fusedps {
namespace {

// Room left in a message for its framing, beside the payload or the TensorInfo it carries.
constexpr uint64_t kMessageMarginBytes = 64 << 10;

// Keeps a pull's staging window while gRPC holds slices of it (the user data of each slice).
void ReleaseWindow(void* user_data) {
  FUSEDPS_HAPPENS_AFTER(user_data);  // Made on the reactor's thread (WriteNext).
  delete static_cast<std::shared_ptr<StagingPool::Reservation>*>(user_data);
}

absl::StatusOr<v1::PullParametersRequest> ParseRequest(const grpc::ByteBuffer& bytes) {
  const ByteBufferView view(bytes);
  std::string whole;
  for (absl::string_view piece : view.views()) whole.append(piece.data(), piece.size());
  v1::PullParametersRequest request;
  if (!view.ok() || !request.ParseFromString(whole)) {
    return absl::InvalidArgumentError("malformed PullParametersRequest");
  }
  return request;
}

class PullReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  PullReactor(grpc::CallbackServerContext* context, const grpc::ByteBuffer& request_bytes,
              const ServiceContext& services)
      : context_(context), services_(services), watch_(services.watchdog->Watch([this] {
          idle_ = true;
          context_->TryCancel();  // The pending write ends with !ok; OnWriteDone finishes.
        })) {
    FUSEDPS_HAPPENS_BEFORE(this);
    Caller caller;
    absl::Status ready = services_.Admit(*context_, Rpc::kPullParameters, &caller);
    absl::StatusOr<v1::PullParametersRequest> request = ParseRequest(request_bytes);
    if (ready.ok()) ready = request.status();
    if (ready.ok()) {
      absl::StatusOr<std::shared_ptr<Model>> model =
          services_.FindModel(caller, request->model(), *context_);
      ready = model.status();
      if (ready.ok()) {
        model_ = *std::move(model);
        engine_ = &model_->engine();
        if (model_->deleted()) ready = model_->DeletedError();
      }
    }
    if (ready.ok()) {
      // The request is checked and planned in ingest (server/ingest/pull_request.h); this
      // executes the plan.
      absl::StatusOr<PullPlan> plan =
          PlanPull(*request, *engine_, *services_.workspaces, WorkspaceOwner(caller));
      ready = plan.status();
      if (ready.ok()) plan_ = *std::move(plan);
    }
    if (!ready.ok()) {
      FinishCall(ready);
      return;
    }
    if (plan_.workspace != nullptr) {
      ReadIntoWorkspace();
      return;
    }
    Hold();
    window_limit_ = services_.window_bytes();
    if (plan_.total_bytes <= window_limit_) {
      Reserve(services_.staging, plan_.total_bytes, [this](StagingPool::Reservation r) {
        window_ = std::make_shared<StagingPool::Reservation>(std::move(r));
        window_end_ = plan_.total_bytes;
        Read(/*snapshot_bytes=*/0);
      });
    } else {
      Reserve(services_.snapshot_budget, plan_.total_bytes,
              [this](StagingPool::Reservation budget) {
                budget_ = std::move(budget);
                Hold();
                Reserve(services_.staging, window_limit_, [this](StagingPool::Reservation r) {
                  window_ = std::make_shared<StagingPool::Reservation>(std::move(r));
                  Read(plan_.total_bytes);
                });
              });
    }
  }

  void OnWriteDone(bool ok) override {
    FUSEDPS_HAPPENS_AFTER(this);
    watch_->Disarm();
    if (!ok) {
      return FinishCall(idle_ ? IdleError() : absl::CancelledError("the client left"));
    }
    bytes_sent_ += message_payload_;
    WriteNext();
  }

  void OnCancel() override {
    FUSEDPS_HAPPENS_AFTER(this);
    uint64_t ticket;
    StagingPool* pool;
    {
      MutexLock lock(&mu_);
      ticket = std::exchange(ticket_, 0);
      pool = ticket_pool_;
    }
    if (ticket != 0) pool->Cancel(ticket);  // Its callback finishes the call.
  }

  void OnDone() override {
    FUSEDPS_HAPPENS_AFTER(this);
    watch_->Stop();
    {
      MutexLock lock(&mu_);
      done_ = true;
      if (holds_ > 0) return;
    }
    delete this;
  }

  ~PullReactor() override {
    if (snapshot_ != nullptr) engine_->FreeSnapshot(snapshot_);
  }

 private:
  absl::Status IdleError() const {
    return absl::DeadlineExceededError(absl::StrCat(
        "the client read nothing for ", absl::FormatDuration(services_.watchdog->idle_limit()),
        " (--call-idle-seconds)"));
  }

  void Hold() ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    ++holds_;
  }
  void ReleaseHold() ABSL_LOCKS_EXCLUDED(mu_) {
    {
      MutexLock lock(&mu_);
      if (--holds_ > 0 || !done_) return;
    }
    delete this;
  }

  // The engine reads straight into the workspace when the wire has the stored dtype (on a GPU,
  // device-to-host copies into the page-locked mapping); else into host memory of its own, and
  // the values are rounded to 16 bits into the workspace here.
  // A device workspace takes what the read gives as it is (device to device; nothing rounded).
  void ReadIntoWorkspace() {
    if (plan_.stored_size == static_cast<uint32_t>(DTypeSize(plan_.dtype))) {
      return StartRead(plan_.WorkspaceJob(), [] {});
    }
    ReadJob job = plan_.Job();
    if (plan_.workspace->on_device()) {
      return FinishCall(absl::FailedPreconditionError(absl::StrCat(
          "a pull into a device workspace is in fp32, or in the dtype of the server's param "
          "copy (--param-copy-dtype); this one asks for ",
          DTypeSize(plan_.dtype) * 8, "-bit values of ", plan_.stored_size * 8,
          "-bit ones (nothing is rounded on the way)")));
    }
    scratch_.reset(new (std::nothrow) char[plan_.total_bytes]);
    if (scratch_ == nullptr) {
      return FinishCall(absl::ResourceExhaustedError(absl::StrCat(
          "no host memory for a pull of ", plan_.total_bytes, " bytes to round to 16 bits")));
    }
    job.dst = scratch_.get();
    job.dst_offsets = plan_.offsets;
    StartRead(std::move(job), [this] {
      for (size_t i = 0; i < plan_.tensors.size(); ++i) {
        StoreFloats(reinterpret_cast<const float*>(scratch_.get() + plan_.offsets[i]),
                    plan_.view->tensor(plan_.tensors[i]).numel, plan_.dtype,
                    plan_.workspace->memory().data() + plan_.workspace_offsets[i]);
      }
      scratch_.reset();
    });
  }

  // After the header and TensorInfo: the chunks of a workspace pull, one per tensor, naming
  // where its bytes are (already written), as many per message as fit.
  void WriteWorkspaceChunks() {
    const uint64_t budget = services_.limits.max_message_bytes - kMessageMarginBytes;
    const uint64_t wire_size = DTypeSize(plan_.dtype);
    uint64_t bytes = 0;
    while (cursor_tensor_ < plan_.tensors.size()) {
      const TensorMeta& meta = plan_.view->tensor(plan_.tensors[cursor_tensor_]);
      const uint64_t size = meta.name.size() + 40;
      if (bytes + size > budget && message_.chunks_size() > 0) break;
      v1::TensorChunk* chunk = message_.add_chunks();
      chunk->set_tensor(meta.name);
      chunk->set_workspace_offset_bytes(plan_.workspace_offsets[cursor_tensor_]);
      chunk->set_workspace_bytes(meta.numel * wire_size);
      message_payload_ += meta.numel * wire_size;
      bytes += size;
      ++cursor_tensor_;
    }
    if (message_.chunks_size() == 0) return FinishCall(absl::OkStatus());
    StartWritingMessage();
  }

  // Reserves `bytes` of `pool` asynchronously; `then` runs with the reservation (under a hold,
  // released after it), or the call finishes with the error.
  void Reserve(StagingPool* pool, uint64_t bytes,
               std::function<void(StagingPool::Reservation)> then) ABSL_LOCKS_EXCLUDED(mu_) {
    uint64_t reserve;
    {
      MutexLock lock(&mu_);
      ticket_pool_ = pool;
      reserve = ++reserves_;
    }
    const uint64_t ticket = pool->ReserveAsync(
        bytes, [this, then = std::move(then)](absl::StatusOr<StagingPool::Reservation> r) {
          {
            MutexLock lock(&mu_);
            ticket_ = 0;
            ++reserves_;  // This wait is over: its ticket must not be stored below.
          }
          if (!r.ok()) {
            FinishCall(r.status());
          } else if (context_->IsCancelled()) {
            FinishCall(absl::CancelledError("cancelled"));
          } else {
            then(*std::move(r));
          }
          ReleaseHold();
        });
    // Unless the grant ran meanwhile (and maybe began the next wait, on this pool or another).
    MutexLock lock(&mu_);
    if (ticket != 0 && !finished_ && reserves_ == reserve) ticket_ = ticket;
  }

  // The engine's read, in stream order: into the window, or into a snapshot.
  void Read(uint64_t snapshot_bytes) {
    ReadJob job = plan_.Job();
    job.dst_offsets = plan_.offsets;
    job.dst = window_->data();
    job.snapshot_bytes = snapshot_bytes;
    StartRead(std::move(job), [] {});
  }

  // Has the engine run `job`; once it has read, `after_read` (on the thread that acknowledges
  // it), then the header goes out.
  void StartRead(ReadJob job, std::function<void()> after_read) {
    Hold();
    engine_->Read(std::move(job),
                  [this, after_read = std::move(after_read)](absl::StatusOr<ReadResult> result) {
                    if (!result.ok()) {
                      FinishCall(result.status());
                    } else {
                      snapshot_ = result->snapshot;
                      version_ = result->version;
                      steps_ = std::move(result->steps);
                      after_read();
                      if (context_->IsCancelled()) {
                        FinishCall(absl::CancelledError("cancelled"));
                      } else {
                        WriteHeader();
                      }
                    }
                    ReleaseHold();
                  });
  }

  void WriteHeader() {
    message_.Clear();
    v1::PullHeader* header = message_.mutable_header();
    header->set_version(version_);
    header->set_dtype(plan_.wire_dtype);
    header->set_tensor_count(static_cast<uint32_t>(plan_.tensors.size()));
    AddInfos(header->mutable_tensors());
    message_payload_ = 0;
    StartWritingMessage();
  }

  // Adds TensorInfo from the next one on, as many as fit in a message.
  void AddInfos(google::protobuf::RepeatedPtrField<v1::TensorInfo>* infos) {
    const uint64_t budget = services_.limits.max_message_bytes - kMessageMarginBytes;
    uint64_t bytes = 0;
    while (next_info_ < plan_.tensors.size()) {
      v1::TensorInfo info;
      ToProto(*plan_.view, plan_.tensors[next_info_], steps_[next_info_], &info);
      const uint64_t size = info.ByteSizeLong() + 8;
      if (bytes + size > budget && !infos->empty()) break;
      bytes += size;
      *infos->Add() = std::move(info);
      ++next_info_;
    }
  }

  // Writes message_ (the header, or TensorInfo), serialized.
  void StartWritingMessage() {
    const std::string bytes = message_.SerializeAsString();
    grpc::Slice slice(bytes);
    buffer_ = grpc::ByteBuffer(&slice, 1);
    StartWriting();
  }

  void StartWriting() ABSL_LOCKS_EXCLUDED(mu_) {
    watch_->Arm();
    MutexLock lock(&mu_);
    if (finished_) return;
    FUSEDPS_HAPPENS_BEFORE(this);
    StartWrite(&buffer_);
  }

  // The next message: TensorInfo that did not fit, then chunks, then the end. A chunk is its
  // framing and its payload: a slice of the window itself when the whole pull is in it and the
  // wire has the stored dtype (the slice holds the window until gRPC is done with it), else a
  // copy (the window is reloaded from a snapshot, or the values are rounded to 16 bits here).
  void WriteNext() {
    message_.Clear();
    message_payload_ = 0;
    if (next_info_ < plan_.tensors.size()) {
      AddInfos(message_.mutable_tensors());
      return StartWritingMessage();
    }
    if (plan_.workspace != nullptr) return WriteWorkspaceChunks();
    const uint32_t wire_size = DTypeSize(plan_.dtype);
    uint64_t room = plan_.chunk_bytes / wire_size;  // Elements left in this message.
    // Names count too: many small tensors with long names must not outgrow a message.
    const uint64_t budget = services_.limits.max_message_bytes - kMessageMarginBytes;
    uint64_t message_bytes = 0;
    std::vector<grpc::Slice> slices;
    while (room > 0 && cursor_tensor_ < plan_.tensors.size()) {
      const TensorMeta& meta = plan_.view->tensor(plan_.tensors[cursor_tensor_]);
      if (cursor_element_ == meta.numel) {
        ++cursor_tensor_;
        cursor_element_ = 0;
        continue;
      }
      const uint64_t overhead = meta.name.size() + 32;  // Name, offset and framing.
      if (!slices.empty() && message_bytes + overhead + wire_size > budget) break;
      const uint64_t position = plan_.offsets[cursor_tensor_] + cursor_element_ * plan_.stored_size;
      if (position + plan_.stored_size > window_end_) {
        if (absl::Status s = LoadWindow(position); !s.ok()) return FinishCall(s);
      }
      const uint64_t count = std::min(
          {room, meta.numel - cursor_element_, (window_end_ - position) / plan_.stored_size});
      char* data = window_->data() + (position - window_begin_);
      const uint64_t bytes = count * wire_size;
      slices.emplace_back(ChunkFraming(meta.name, cursor_element_, bytes));
      if (plan_.stored_size == wire_size && snapshot_ == nullptr) {
        auto* hold = new std::shared_ptr<StagingPool::Reservation>(window_);
        FUSEDPS_HAPPENS_BEFORE(hold);
        slices.emplace_back(data, bytes, &ReleaseWindow, hold);
      } else if (plan_.stored_size == wire_size) {
        slices.emplace_back(data, bytes);  // A copy: the window is reloaded later.
      } else {  // fp32 stored, 16-bit on the wire: rounded here, into aligned memory (a
                // small grpc::Slice keeps its bytes inline, at any alignment).
        std::string rounded(bytes, '\0');
        StoreFloats(reinterpret_cast<const float*>(data), count, plan_.dtype, rounded.data());
        slices.emplace_back(rounded);
      }
      cursor_element_ += count;
      room -= count;
      message_payload_ += bytes;
      message_bytes += overhead + bytes;
    }
    if (slices.empty()) return FinishCall(absl::OkStatus());
    buffer_ = grpc::ByteBuffer(slices.data(), slices.size());
    StartWriting();
  }

  // Copies the snapshot's bytes from `position` on into the window.
  absl::Status LoadWindow(uint64_t position) {
    if (snapshot_ == nullptr) {
      return absl::InternalError(absl::StrCat("a pull read past its window at byte ", position));
    }
    const uint64_t bytes = std::min(window_->bytes(), plan_.total_bytes - position);
    if (absl::Status s = engine_->CopyFromSnapshot(snapshot_, position, bytes, window_->data());
        !s.ok()) {
      return s;
    }
    window_begin_ = position;
    window_end_ = position + bytes;
    return absl::OkStatus();
  }

  // The one place a call ends: metrics, then the status. Once.
  void FinishCall(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    if (finished_) return;
    finished_ = true;
    services_.metrics->RecordPull(static_cast<grpc::StatusCode>(status.code()), bytes_sent_);
    if (!status.ok() && !absl::IsCancelled(status)) {
      FUSEDPS_LOG_EVERY_SECONDS(WARNING, 1)
          << "pull from " << context_->peer() << " failed: " << status;
    }
    FUSEDPS_HAPPENS_BEFORE(this);
    Finish(ToGrpc(status));
  }

  grpc::CallbackServerContext* const context_;
  const ServiceContext services_;
  const std::shared_ptr<CallWatchdog::Handle> watch_;
  // The pull's model, held until the reactor is gone (set by the constructor, before anything
  // else reads it), and its engine.
  std::shared_ptr<Model> model_;
  UpdateEngine* engine_ = nullptr;

  // The request, checked and laid out (PlanPull): set by the constructor before anything else
  // reads it, then only read. It holds its view and its workspace until the reactor is gone.
  PullPlan plan_;
  uint64_t window_limit_ = 0;  // The most staging this pull holds.
  // The fp32 values of a workspace pull that are rounded to 16 bits here.
  std::unique_ptr<char[]> scratch_;

  // What the read saw, and where its bytes are. Written before the first write, by the thread
  // that starts it; read by the writes that follow (each after the one before, as gRPC orders
  // them).
  uint64_t version_ = 0;
  std::vector<int64_t> steps_;
  void* snapshot_ = nullptr;
  StagingPool::Reservation budget_;  // Of the snapshot budget.
  // Of staging; shared with the slices of it that gRPC holds (WriteNext).
  std::shared_ptr<StagingPool::Reservation> window_;
  uint64_t window_begin_ = 0, window_end_ = 0;  // The layout's bytes the window holds.
  size_t next_info_ = 0;                        // The next TensorInfo to send.
  size_t cursor_tensor_ = 0;                    // The next chunk's tensor and first element.
  uint64_t cursor_element_ = 0;
  v1::PullParametersResponse message_;  // The header or TensorInfo message being built.
  grpc::ByteBuffer buffer_;             // The message being written.
  uint64_t message_payload_ = 0;        // Tensor bytes in buffer_.
  uint64_t bytes_sent_ = 0;
  std::atomic<bool> idle_{false};

  Mutex mu_;
  uint64_t ticket_ ABSL_GUARDED_BY(mu_) = 0;  // A staging wait to cancel.
  StagingPool* ticket_pool_ ABSL_GUARDED_BY(mu_) = nullptr;
  // Counts Reserve calls and grants (a stale ticket).
  uint64_t reserves_ ABSL_GUARDED_BY(mu_) = 0;
  int holds_ ABSL_GUARDED_BY(mu_) = 0;  // Callbacks still to come.
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

grpc::ServerWriteReactor<grpc::ByteBuffer>* NewPullReactor(grpc::CallbackServerContext* context,
                                                           const grpc::ByteBuffer* request,
                                                           const ServiceContext& services) {
  return new PullReactor(context, *request, services);
}

}  // namespace fusedps
