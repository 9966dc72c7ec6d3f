#include "server/checkpoint/checkpointer.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/notification.h"
#include "server/checkpoint/shard_files.h"

namespace fusedps::checkpoint {
namespace {

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

double UnixNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// How often the thread looks at the version, for --checkpoint-every-versions.
constexpr absl::Duration kVersionPoll = absl::Milliseconds(50);
// A fenced snapshot's buffer when --checkpoint-host-buffer-bytes does not say (the full buffer
// could not be allocated): large enough for fast writes, small enough to be had.
constexpr uint64_t kFallbackFenceBytes = uint64_t{256} << 20;

}  // namespace

struct Checkpointer::Request {
  Notification done;
  absl::StatusOr<CheckpointResult> result = absl::UnknownError("not run");
};

Checkpointer::Checkpointer(UpdateEngine* engine, Metrics* metrics, CheckpointerOptions options)
    : engine_(engine), metrics_(metrics), options_(std::move(options)) {}

void Checkpointer::Start() {
  metrics_->SetCheckpointInterval(absl::ToDoubleSeconds(options_.interval));
  metrics_->AddCheckpointedModel(options_.model);
  thread_ = std::thread([this] { Run(); });
}

Checkpointer::~Checkpointer() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.SignalAll();
  if (thread_.joinable()) thread_.join();
  // Requests that came before Start, if it never came.
  for (const std::shared_ptr<Request>& request : requests_) {
    request->result = absl::UnavailableError("the checkpointer is stopping");
    request->done.Notify();
  }
  if (buffer_ != nullptr) engine_->FreeHostBuffer(buffer_);
}

absl::StatusOr<CheckpointResult> Checkpointer::CheckpointNow() {
  auto request = std::make_shared<Request>();
  {
    MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("the checkpointer is stopping");
    requests_.push_back(request);
  }
  cv_.SignalAll();
  request->done.WaitForNotification();
  return request->result;
}

void Checkpointer::Restored(const CheckpointResult& result) {
  MutexLock lock(&mu_);  // Orders it before the thread's next checkpoint.
  last_ = result;
  last_generation_ = engine_->generation();
  metrics_->RecordCheckpointSuccess(options_.model, 0, UnixNow());
}

void Checkpointer::Run() {
  using Clock = std::chrono::steady_clock;
  const bool timed = options_.interval > absl::ZeroDuration();
  const auto interval = absl::ToChronoNanoseconds(options_.interval);
  Clock::time_point due = Clock::now() + interval;
  uint64_t last_version = engine_->version();
  for (;;) {
    std::vector<std::shared_ptr<Request>> batch;
    {
      MutexLock lock(&mu_);
      for (;;) {
        if (!requests_.empty()) {
          batch.swap(requests_);
          break;
        }
        if (stopping_) return;
        if (timed && Clock::now() >= due) break;
        if (options_.every_versions > 0 &&
            engine_->version() >= last_version + options_.every_versions) {
          break;
        }
        if (options_.every_versions > 0) {
          cv_.WaitWithTimeout(&mu_, kVersionPoll);
        } else if (timed) {
          cv_.WaitWithDeadline(&mu_, due);
        } else {
          cv_.Wait(&mu_);
        }
      }
    }
    const uint64_t attempted = engine_->version();
    absl::StatusOr<CheckpointResult> result = TakeOne();
    // After a failure too: the next try waits for the next trigger (a full disk is not retried
    // in a loop, each try taking its snapshot on the step path).
    last_version = result.ok() ? result->version : attempted;
    due = Clock::now() + interval;
    for (const std::shared_ptr<Request>& request : batch) {
      request->result = result;
      request->done.Notify();
    }
  }
}

absl::StatusOr<CheckpointSnapshot> Checkpointer::Snapshot(
    bool* fenced, std::chrono::steady_clock::time_point* started) {
  for (int attempt = 0;; ++attempt) {
    uint64_t needed = 0;
    const std::shared_ptr<const ShardView> view = engine_->view();
    SnapshotLayout(*view, engine_->param_copy_dtype(), &needed);
    *fenced =
        full_failed_ || (options_.host_buffer_bytes > 0 && needed > options_.host_buffer_bytes);
    uint64_t want = needed;
    if (*fenced) {
      // At least the largest tensor of any field (a fenced read takes whole tensors).
      want = options_.host_buffer_bytes > 0 ? options_.host_buffer_bytes : kFallbackFenceBytes;
      for (uint32_t t = 0; t < view->tensor_count(); ++t) {
        want = std::max(want, AlignedNumel(view->tensor(t).numel) * sizeof(float));
      }
    }
    if (buffer_bytes_ < want) {
      if (buffer_ != nullptr) engine_->FreeHostBuffer(std::exchange(buffer_, nullptr));
      buffer_bytes_ = 0;
      // Some room for tensors registered later, so that a growing shard reallocates rarely.
      const uint64_t bytes = *fenced ? want : want + want / 8;
      absl::StatusOr<void*> buffer = engine_->AllocateHostBuffer(bytes);
      if (!buffer.ok()) {
        if (*fenced || !absl::IsResourceExhausted(buffer.status())) return buffer.status();
        LOG(WARNING) << "checkpoint: cannot have " << bytes << " bytes of page-locked host "
                     << "memory for a full snapshot (" << buffer.status()
                     << "); checkpoints are fenced from now on: steps wait while one is written";
        full_failed_ = true;
        continue;
      }
      buffer_ = *buffer;
      buffer_bytes_ = bytes;
    }
    *started = std::chrono::steady_clock::now();  // The cut's time, not the allocation's.
    absl::StatusOr<CheckpointSnapshot> snapshot =
        UpdateEngine::Wait<CheckpointSnapshot>([&](UpdateEngine::Done<CheckpointSnapshot> done) {
          engine_->Snapshot(buffer_, buffer_bytes_, *fenced, done);
        });
    // OUT_OF_RANGE: a registration grew the shard between the layout and the job.
    if (absl::IsOutOfRange(snapshot.status()) && attempt < 3) continue;
    return snapshot;
  }
}

absl::StatusOr<CheckpointResult> Checkpointer::TakeOne() {
  {
    MutexLock lock(&mu_);
    // Nothing changed since the last checkpoint: it holds it all.
    if (last_.has_value() && engine_->generation() == last_generation_) {
      metrics_->RecordCheckpointSuccess(options_.model, 0, UnixNow());
      return *last_;
    }
  }
  auto start = std::chrono::steady_clock::now();
  bool fenced = false;
  absl::StatusOr<CheckpointSnapshot> snapshot = Snapshot(&fenced, &start);
  if (!snapshot.ok()) {
    RecordFailure(snapshot.status(), /*snapshot=*/true);
    return snapshot.status();
  }
  const double snapshot_seconds = Seconds(start);
  WriteSettings settings;
  settings.root = options_.root;
  settings.keep = options_.keep;
  settings.server_version = options_.server_version;
  settings.param_copy_dtype = engine_->param_copy_dtype();
  settings.fence_buffer = static_cast<char*>(buffer_);
  settings.fence_buffer_bytes = buffer_bytes_;
  const auto write_start = std::chrono::steady_clock::now();
  absl::StatusOr<Written> written = WriteCheckpoint(*snapshot, settings);
  const uint64_t generation = snapshot->cut.generation;
  snapshot->fence.reset();  // Fenced: steps go on from here.
  const double write_seconds = Seconds(write_start);
  // For a fenced snapshot the steps waited for the whole of it.
  metrics_->RecordCheckpointPhase("snapshot", fenced ? Seconds(start) : snapshot_seconds);
  if (!written.ok()) {
    RecordFailure(written.status(), /*snapshot=*/false);
    return written.status();
  }
  metrics_->RecordCheckpointPhase("write", write_seconds);
  metrics_->RecordCheckpointSuccess(options_.model, written->bytes, UnixNow());
  LOG(INFO) << "checkpoint: version " << written->version << " in " << written->directory << ", "
            << written->bytes << " bytes; snapshot " << snapshot_seconds * 1e3 << " ms"
            << (fenced ? " (fenced)" : "") << ", write " << write_seconds << " s ("
            << written->bytes / std::max(write_seconds, 1e-9) / 1e9 << " GB/s)";
  CheckpointResult result{written->version, written->directory};
  MutexLock lock(&mu_);
  last_ = result;
  last_generation_ = generation;
  return result;
}

void Checkpointer::RecordFailure(const absl::Status& status, bool snapshot) {
  std::string reason = "io";
  if (absl::IsUnavailable(status)) {
    reason = "stopping";
  } else if (snapshot) {
    reason = "snapshot";
  } else if (absl::IsResourceExhausted(status) || absl::IsOutOfRange(status)) {
    reason = "disk_full";  // ENOSPC, EDQUOT; EFBIG (a file size limit) is OUT_OF_RANGE.
  }
  metrics_->RecordCheckpointFailure(options_.model, reason);
  LOG(ERROR) << "checkpoint failed (" << reason << "): " << status;
}

}  // namespace fusedps::checkpoint
