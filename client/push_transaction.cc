// PushTransaction (fusedps/client.h) and Client::BeginPush: a push sent a piece at a time, its
// chunks' payloads slices of the caller's memory, committed with its grad_scale at the end.
#include <algorithm>
#include <atomic>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/connection.h"
#include "client/raw_call.h"
#include "client/wire.h"
#include "common/byte_buffer_view.h"
#include "common/chunk_framing.h"
#include "common/mutex.h"
#include "common/tsan.h"
#include "fusedps/client.h"
#include "fusedps/v1/parameter_service.pb.h"

namespace fusedps::client {
namespace {

constexpr char kPushMethod[] = "/fusedps.v1.ParameterService/PushGradients";

}  // namespace

// gRPC holds a reference to each slice of the caller's memory until it has sent it; each
// slice's user data is a reference to this tracker, dropped by its destroy callback.
struct PushTransaction::SliceTracker {
  Mutex mu;
  CondVar released;
  uint64_t held ABSL_GUARDED_BY(mu) = 0;

  // A slice of the caller's memory whose release this counts.
  static grpc::Slice Borrow(const std::shared_ptr<SliceTracker>& tracker, const void* data,
                            size_t bytes) {
    {
      MutexLock lock(&tracker->mu);
      ++tracker->held;
    }
    auto* reference = new std::shared_ptr<SliceTracker>(tracker);
    // libgrpc hands the slice to the thread that frees it: common/tsan.h says why the edge.
    FUSEDPS_HAPPENS_BEFORE(reference);
    return grpc::Slice(const_cast<void*>(data), bytes, &Release, reference);
  }
  static void Release(void* user_data) {
    FUSEDPS_HAPPENS_AFTER(user_data);
    auto* reference = static_cast<std::shared_ptr<SliceTracker>*>(user_data);
    SliceTracker& tracker = **reference;
    {
      MutexLock lock(&tracker.mu);
      if (--tracker.held == 0) tracker.released.SignalAll();
    }
    delete reference;
  }
};

PushTransaction::PushTransaction(const ClientOptions& options, std::vector<TensorSize> tensors,
                                 DType dtype, Workspace workspace)
    : options_(options),
      tensors_(std::move(tensors)),
      dtype_(dtype),
      workspace_(std::move(workspace)),
      tracker_(std::make_shared<SliceTracker>()) {
  for (const TensorSize& t : tensors_) total_bytes_ += t.numel * ElementBytes(dtype_);
}

PushTransaction::~PushTransaction() { Cancel(); }

void PushTransaction::OpenPart(const std::shared_ptr<grpc::Channel>& channel,
                               std::string header_message) {
  const size_t index = parts_.size();
  // Replies are parsed after Await; each part's reply lands in its own string (replies_ is
  // sized before the first part opens, so it never moves under a callback).
  parts_.push_back(std::make_unique<internal::RawCall>(
      channel, kPushMethod, options_, absl::InfiniteFuture(),
      [this, index](const grpc::ByteBuffer& message) {
        const ByteBufferView view(message);
        if (!view.ok()) return absl::InternalError("cannot read the push reply's slices");
        std::string& reply = replies_[index];
        for (absl::string_view piece : view.views()) reply.append(piece.data(), piece.size());
        return absl::OkStatus();
      }));
  grpc::Slice slice(header_message);
  parts_.back()->Write(grpc::ByteBuffer(&slice, 1), header_message.size());
}

internal::RawCall& PushTransaction::LightestPart() {
  internal::RawCall* lightest = parts_.front().get();
  uint64_t least = lightest->queued_bytes();
  for (size_t i = 1; i < parts_.size() && least > 0; ++i) {
    const uint64_t queued = parts_[i]->queued_bytes();
    if (queued < least) {
      least = queued;
      lightest = parts_[i].get();
    }
  }
  return *lightest;
}

absl::Status PushTransaction::Write(absl::Span<const Piece> pieces) {
  if (ended_) return absl::FailedPreconditionError("the push was committed or cancelled");
  const size_t element_bytes = ElementBytes(dtype_);
  for (const Piece& piece : pieces) {
    if (piece.tensor >= tensors_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("piece of tensor number ", piece.tensor,
                                                     "; the push has ", tensors_.size()));
    }
    const TensorSize& tensor = tensors_[piece.tensor];
    if (piece.offset > tensor.numel || piece.numel > tensor.numel - piece.offset ||
        (piece.numel > 0 && piece.data == nullptr)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "piece [", piece.offset, ", ", piece.offset + piece.numel, ") of tensor ", tensor.name,
          " (", tensor.numel, " elements)", piece.data == nullptr ? ", no data" : ""));
    }
  }
  for (const std::unique_ptr<internal::RawCall>& part : parts_) {
    if (part->done()) {
      absl::Status status = part->Await();
      return status.ok() ? absl::AbortedError("a part of the push ended before its commit")
                         : status;
    }
  }
  std::vector<Piece> inline_pieces;  // The rest travel as their places in the workspace.
  if (!workspace_.id.empty()) {
    std::vector<Piece> references;
    for (const Piece& piece : pieces) {
      const bool inside =
          piece.numel > 0 && workspace_.OffsetOf(piece.data, piece.numel * element_bytes) >= 0;
      (inside ? references : inline_pieces).push_back(piece);
    }
    WriteReferences(references);
    pieces = inline_pieces;
  }
  // Messages of up to max_chunk_bytes of payload, each to the part with the least queued.
  const uint64_t elements_per_message =
      std::max<uint64_t>(1, options_.max_chunk_bytes / element_bytes);
  std::vector<grpc::Slice> slices;
  uint64_t message_elements = 0;
  const auto flush = [&] {
    if (slices.empty()) return;
    const uint64_t bytes = message_elements * element_bytes;
    LightestPart().Write(grpc::ByteBuffer(slices.data(), slices.size()), bytes);
    bytes_written_ += bytes;
    slices.clear();
    message_elements = 0;
  };
  for (const Piece& piece : pieces) {
    const std::string& name = tensors_[piece.tensor].name;
    for (uint64_t done = 0; done < piece.numel;) {
      const uint64_t count = std::min(piece.numel - done, elements_per_message - message_elements);
      const uint64_t bytes = count * element_bytes;
      slices.emplace_back(ChunkFraming(name, piece.offset + done, bytes));
      slices.push_back(SliceTracker::Borrow(
          tracker_, static_cast<const char*>(piece.data) + done * element_bytes, bytes));
      message_elements += count;
      done += count;
      if (message_elements == elements_per_message ||
          slices.size() * internal::kChunkFramingBytes >= internal::kMaxChunkMetadataBytes) {
        flush();
      }
    }
  }
  flush();
  return absl::OkStatus();
}

void PushTransaction::WriteReferences(absl::Span<const Piece> pieces) {
  if (pieces.empty()) return;
  const uint64_t element_bytes = ElementBytes(dtype_);
  uint64_t total = 0;
  for (const Piece& piece : pieces) total += piece.numel * element_bytes;
  const uint64_t share =
      std::max<uint64_t>(element_bytes, (total + parts_.size() - 1) / parts_.size());
  v1::PushGradientsRequest message;
  uint64_t room = share, message_bytes = 0;
  const auto flush = [&] {
    if (message.chunks_size() == 0) return;
    const std::string bytes = message.SerializeAsString();
    grpc::Slice slice(bytes);
    parts_[next_reference_part_++ % parts_.size()]->Write(grpc::ByteBuffer(&slice, 1),
                                                          bytes.size());
    bytes_written_ += message_bytes;
    message.Clear();
    room = share;
    message_bytes = 0;
  };
  for (const Piece& piece : pieces) {
    const uint64_t at =
        static_cast<uint64_t>(workspace_.OffsetOf(piece.data, piece.numel * element_bytes));
    for (uint64_t done = 0; done < piece.numel;) {
      const uint64_t count =
          std::min(piece.numel - done, std::max<uint64_t>(1, room / element_bytes));
      v1::TensorChunk* chunk = message.add_chunks();
      chunk->set_tensor(tensors_[piece.tensor].name);
      chunk->set_offset(piece.offset + done);
      chunk->set_workspace_offset_bytes(at + done * element_bytes);
      chunk->set_workspace_bytes(count * element_bytes);
      done += count;
      message_bytes += count * element_bytes;
      room -= std::min(room, count * element_bytes);
      // A message of places stays small: a few hundred bytes per chunk.
      if (room == 0 ||
          static_cast<uint64_t>(message.chunks_size()) * 320 >= options_.max_chunk_bytes) {
        flush();
      }
    }
  }
  flush();
}

absl::StatusOr<PushResult> PushTransaction::Commit(std::optional<float> grad_scale) {
  if (ended_) return absl::FailedPreconditionError("the push was committed or cancelled");
  v1::PushGradientsRequest commit;
  commit.mutable_commit();
  if (grad_scale.has_value()) commit.mutable_commit()->set_grad_scale(*grad_scale);
  return SendCommit(commit.SerializeAsString());
}

absl::StatusOr<PushResult> PushTransaction::Commit(std::optional<float> grad_scale, DType dtype,
                                                   absl::Span<const PullTarget> then_pull) {
  if (ended_) return absl::FailedPreconditionError("the push was committed or cancelled");
  if (workspace_.id.empty()) {
    return absl::InvalidArgumentError(
        "a commit's pull writes into the push's workspace; this push was begun without one");
  }
  if (then_pull.empty()) return absl::InvalidArgumentError("a commit's pull needs a target");
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError("a commit's pull is fp32 or bf16");
  }
  v1::PushGradientsRequest commit;
  v1::PullParametersRequest* pull = commit.mutable_commit()->mutable_pull();
  pull->set_dtype(internal::ToProtoDType(dtype));
  pull->set_field(internal::ToProtoField(TensorField::kParam));
  for (const PullTarget& target : then_pull) {
    const int64_t at = workspace_.OffsetOf(target.data, target.numel * ElementBytes(dtype));
    if (at < 0 || target.numel == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("the commit's pull target ", target.name, " (", target.numel,
                       " elements) does not lie in the push's workspace"));
    }
    pull->add_tensors(target.name);
    pull->add_workspace_offsets_bytes(static_cast<uint64_t>(at));
  }
  if (grad_scale.has_value()) commit.mutable_commit()->set_grad_scale(*grad_scale);
  return SendCommit(commit.SerializeAsString());
}

absl::StatusOr<PushResult> PushTransaction::SendCommit(const std::string& commit) {
  ended_ = true;
  grpc::Slice slice(commit);
  LightestPart().Write(grpc::ByteBuffer(&slice, 1), commit.size());
  for (const std::unique_ptr<internal::RawCall>& part : parts_) part->WritesDone();

  const absl::Time deadline = absl::Now() + internal::CallTimeout(options_, total_bytes_);
  std::vector<absl::Status> statuses;
  for (const std::unique_ptr<internal::RawCall>& part : parts_) {
    if (!part->WaitDone(deadline)) {
      for (const std::unique_ptr<internal::RawCall>& p : parts_) p->Cancel();
      parts_.clear();  // Each waits for its call's end.
      AwaitSlicesReleased();
      return absl::DeadlineExceededError(
          absl::StrCat("push commit exceeded its deadline of ",
                       absl::FormatDuration(internal::CallTimeout(options_, total_bytes_)), " (",
                       absl::FormatDuration(options_.timeout), " plus ", total_bytes_, " bytes at ",
                       options_.min_bytes_per_second, " bytes/s)"));
    }
    statuses.push_back(part->Await());
  }
  parts_.clear();
  AwaitSlicesReleased();
  if (absl::Status status = internal::PushPartsStatus(statuses); !status.ok()) return status;
  v1::PushGradientsResponse response;
  if (!response.ParseFromString(replies_[0])) {
    return absl::InternalError("malformed PushGradientsResponse");
  }
  return internal::FromProtoPushResult(response);
}

void PushTransaction::Cancel() {
  if (ended_ && parts_.empty()) return;
  ended_ = true;
  bool any = false;
  for (const std::unique_ptr<internal::RawCall>& part : parts_) {
    if (!part->done()) {
      part->Cancel();
      any = true;
    }
  }
  if (any) {
    for (const std::unique_ptr<internal::RawCall>& part : parts_) part->Await().IgnoreError();
  }
  parts_.clear();
  AwaitSlicesReleased();
}

void PushTransaction::AwaitSlicesReleased() {
  // gRPC drops its references to a call's slices when the call is freed, with its context
  // (the parts are destroyed before this).
  MutexLock lock(&tracker_->mu);
  while (tracker_->held != 0) tracker_->released.Wait(&tracker_->mu);
}

absl::StatusOr<std::unique_ptr<PushTransaction>> Client::BeginPush(
    const PushOptions& options, absl::Span<const TensorSize> tensors) {
  if (tensors.empty()) return absl::InvalidArgumentError("BeginPush needs a tensor");
  if (options.grad_scale.has_value()) {
    return absl::InvalidArgumentError(
        "BeginPush: options.grad_scale must be unset (Commit carries the step's grad_scale)");
  }
  v1::PushGradientsRequest message;
  v1::PushHeader* header = message.mutable_header();
  header->set_client_id(options.client_id.empty() ? default_client_id_ : options.client_id);
  header->set_sequence_number(options.sequence_number != 0 ? options.sequence_number
                                                           : ++last_sequence_number_);
  header->set_grad_dtype(internal::ToProtoDType(options.grad_dtype));
  header->set_base_version(options.base_version);
  header->set_plan_hash(options.plan_hash);
  header->set_model(options_.model);
  header->set_commit_at_end(true);
  Workspace workspace = this->workspace();
  header->set_workspace(workspace.id);
  for (const TensorSize& t : tensors) header->add_tensors(t.name);
  const uint32_t parts = static_cast<uint32_t>(PartsOf(options));
  if (parts > 1) header->set_part_count(parts);
  auto push = absl::WrapUnique(
      new PushTransaction(options_, std::vector<TensorSize>(tensors.begin(), tensors.end()),
                          options.grad_dtype, std::move(workspace)));
  push->replies_.resize(parts);
  for (uint32_t p = 0; p < parts; ++p) {
    if (parts > 1) header->set_part_index(p);
    push->OpenPart(connection(p).channel, message.SerializeAsString());
  }
  return push;
}

void Client::SetWorkspace(Workspace workspace) {
  MutexLock lock(&workspace_mu_);
  workspace_ = std::move(workspace);
}

Workspace Client::workspace() const {
  MutexLock lock(&workspace_mu_);
  return workspace_;
}

}  // namespace fusedps::client
