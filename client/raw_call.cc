#include "client/raw_call.h"

#include <utility>

#include "client/channel.h"
#include "client/wire.h"
#include "common/tsan.h"
#include "grpcpp/generic/generic_stub.h"

namespace fusedps::client::internal {

RawCall::RawCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                 const ClientOptions& options, absl::Time deadline, OnMessage on_message)
    : on_message_(std::move(on_message)) {
  ConfigureCall(options, &context_);
  if (deadline != absl::InfiniteFuture()) context_.set_deadline(absl::ToChronoTime(deadline));
  grpc::GenericStub stub(channel);
  stub.PrepareBidiStreamingCall(&context_, method, grpc::StubOptions(), this);
  // Holds OnDone back until the writes are done or the call is cancelled: writes are started
  // from outside the reactions, which must not happen after OnDone.
  AddHold();
  FUSEDPS_HAPPENS_BEFORE(this);
  StartRead(&reply_);
  StartCall();
}

RawCall::~RawCall() {
  if (!done()) Cancel();
  MutexLock lock(&mu_);
  while (!done_) done_cv_.Wait(&mu_);
}

void RawCall::Write(grpc::ByteBuffer message, uint64_t bytes) {
  Next next;
  {
    MutexLock lock(&mu_);
    if (broken_ || hold_removed_) return;
    queue_.emplace_back(std::move(message), bytes);
    queued_bytes_ += bytes;
    if (write_in_flight_) return;
    next = NextWriteLocked();
  }
  Start(next);
}

void RawCall::WritesDone() {
  Next next = Next::kNothing;
  {
    MutexLock lock(&mu_);
    if (writes_done_asked_) return;
    writes_done_asked_ = true;
    if (!write_in_flight_) next = NextWriteLocked();
  }
  Start(next);
}

uint64_t RawCall::queued_bytes() const {
  MutexLock lock(&mu_);
  return queued_bytes_;
}

void RawCall::Cancel() {
  context_.TryCancel();
  bool remove;
  {
    MutexLock lock(&mu_);
    remove = !hold_removed_ && !write_in_flight_;
    if (remove) hold_removed_ = true;
    broken_ = true;
    queue_.clear();
    queued_bytes_ = 0;
  }
  // A write in flight fails now and its OnWriteDone removes the hold.
  if (remove) RemoveHold();
}

bool RawCall::done() const {
  MutexLock lock(&mu_);
  return done_;
}

bool RawCall::WaitDone(absl::Time deadline) const {
  MutexLock lock(&mu_);
  while (!done_) {
    if (done_cv_.WaitWithDeadline(&mu_, deadline)) return done_;
  }
  return true;
}

absl::Status RawCall::Await() {
  MutexLock lock(&mu_);
  while (!done_) done_cv_.Wait(&mu_);
  if (!message_error_.ok()) return message_error_;
  return ToAbslStatus(status_);
}

RawCall::Next RawCall::NextWriteLocked() {
  if (!broken_ && !queue_.empty()) {
    writing_ = std::move(queue_.front().first);
    queued_bytes_ -= queue_.front().second;
    queue_.pop_front();
    write_in_flight_ = true;
    return Next::kWrite;
  }
  if ((writes_done_asked_ || broken_) && !hold_removed_) {
    hold_removed_ = true;
    // A broken call sends nothing more; its hold goes, so that OnDone can come.
    return broken_ ? Next::kRemoveHold : Next::kWritesDone;
  }
  return Next::kNothing;
}

void RawCall::Start(Next next) {
  FUSEDPS_HAPPENS_BEFORE(this);
  switch (next) {
    case Next::kWrite:
      // writing_ stays put until OnWriteDone: only that reaction moves the next one in.
      StartWrite(&writing_);
      return;
    case Next::kWritesDone:
      StartWritesDone();
      RemoveHold();
      return;
    case Next::kRemoveHold:
      RemoveHold();
      return;
    case Next::kNothing:
      return;
  }
}

void RawCall::OnWriteDone(bool ok) {
  FUSEDPS_HAPPENS_AFTER(this);
  Next next;
  {
    MutexLock lock(&mu_);
    write_in_flight_ = false;
    writing_.Clear();
    if (!ok) {
      // The stream broke: OnDone will say why. Nothing more is sent.
      broken_ = true;
      queue_.clear();
      queued_bytes_ = 0;
    }
    next = NextWriteLocked();
  }
  Start(next);
}

void RawCall::OnReadInitialMetadataDone(bool /*ok*/) {
  // Nothing to do but order gRPC's bookkeeping after this reaction with our construction.
  FUSEDPS_HAPPENS_AFTER(this);
}

void RawCall::OnReadDone(bool ok) {
  FUSEDPS_HAPPENS_AFTER(this);
  if (!ok) {
    // The replies have ended. When that happens before the writes are done, the server ended
    // the call: nothing more is sent, and the hold goes so that OnDone can come.
    bool remove;
    {
      MutexLock lock(&mu_);
      broken_ = true;
      queue_.clear();
      queued_bytes_ = 0;
      remove = !hold_removed_ && !write_in_flight_;
      if (remove) hold_removed_ = true;
    }
    if (remove) RemoveHold();
    return;
  }
  absl::Status handled = on_message_(reply_);
  reply_.Clear();
  if (!handled.ok()) {
    {
      MutexLock lock(&mu_);
      if (message_error_.ok()) message_error_ = handled;
    }
    context_.TryCancel();
    return;
  }
  FUSEDPS_HAPPENS_BEFORE(this);
  StartRead(&reply_);
}

void RawCall::OnDone(const grpc::Status& status) {
  FUSEDPS_HAPPENS_AFTER(this);
  MutexLock lock(&mu_);
  status_ = status;
  done_ = true;
  // Under mu_: a waiter that sees done_ may destroy this right after it takes mu_.
  done_cv_.SignalAll();
}

}  // namespace fusedps::client::internal
