// raw_call.h (client internal): one ParameterService call whose messages are raw
// grpc::ByteBuffers, over gRPC's callback API and generic stub. A message's payload can then be
// a slice of the caller's own memory (no copy into a protobuf string, none by gRPC's
// serializer), and a reply can be parsed straight from gRPC's slices. PushTransaction
// (push_transaction.cc) sends a push's parts this way, Client::PullInto (pull_into.cc) reads
// pulls.
//
// Writes are queued and sent one after another (the callback API takes one at a time): Write
// never blocks. Each reply message is handed to a callback on gRPC's thread.
//
// Usage:
//   RawCall call(channel, "/fusedps.v1.ParameterService/PushGradients", options,
//                absl::InfiniteFuture(), [&](const grpc::ByteBuffer& reply) { ...; return OK; });
//   call.Write(message); ...; call.WritesDone();
//   absl::Status status = call.Await();
//
// Lifetimes: a RawCall must outlive its call: the destructor cancels a call that is not done
// and waits for gRPC's OnDone. The callback runs only before Await returns.
// Thread safety: every method may be called from any thread.
#ifndef FUSEDPS_CLIENT_RAW_CALL_H_
#define FUSEDPS_CLIENT_RAW_CALL_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "fusedps/client.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/client_callback.h"

namespace fusedps::client::internal {

class RawCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // Called with each reply message; an error cancels the call and becomes Await's status.
  using OnMessage = std::function<absl::Status(const grpc::ByteBuffer& message)>;

  // Starts `method` on `channel` with the call options of `options` (the token's metadata,
  // wait_for_ready) and `deadline` (absl::InfiniteFuture(): none).
  RawCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
          const ClientOptions& options, absl::Time deadline, OnMessage on_message);
  RawCall(const RawCall&) = delete;
  RawCall& operator=(const RawCall&) = delete;
  ~RawCall() override;

  // Queues a message; `bytes` is its size, for queued_bytes(). Dropped once the call has
  // broken (Await then says why). REQUIRES: WritesDone not called yet.
  void Write(grpc::ByteBuffer message, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the writes once the queued messages are sent.
  void WritesDone() ABSL_LOCKS_EXCLUDED(mu_);
  // Bytes queued by Write and not yet handed to gRPC.
  uint64_t queued_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  // Cancels the call (TryCancel); Await still waits for its end.
  void Cancel() ABSL_LOCKS_EXCLUDED(mu_);
  // Whether the call has ended (OnDone ran).
  bool done() const ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until the call has ended, at most until `deadline`: false when it has not by then.
  bool WaitDone(absl::Time deadline) const ABSL_LOCKS_EXCLUDED(mu_);
  // Waits for the end: the callback's error if it returned one, else the call's status.
  absl::Status Await() ABSL_LOCKS_EXCLUDED(mu_);

  // grpc::ClientBidiReactor.
  void OnReadInitialMetadataDone(bool ok) override;
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

 private:
  // Takes the next queued message and starts its write, or ends the writes; returns what to
  // start outside mu_. REQUIRES: mu_ held, no write in flight.
  enum class Next { kNothing, kWrite, kWritesDone, kRemoveHold };
  Next NextWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Start(Next next) ABSL_LOCKS_EXCLUDED(mu_);

  grpc::ClientContext context_;
  const OnMessage on_message_;
  grpc::ByteBuffer reply_;  // The read in flight; only gRPC's reactions touch it.

  mutable Mutex mu_;
  mutable CondVar done_cv_;
  std::deque<std::pair<grpc::ByteBuffer, uint64_t>> queue_ ABSL_GUARDED_BY(mu_);
  grpc::ByteBuffer writing_ ABSL_GUARDED_BY(mu_);  // The write in flight.
  bool write_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool writes_done_asked_ ABSL_GUARDED_BY(mu_) = false;
  bool hold_removed_ ABSL_GUARDED_BY(mu_) = false;
  // A write failed; later writes are dropped.
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status message_error_ ABSL_GUARDED_BY(mu_);  // The callback's first error.
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);  // OnDone's.
};

}  // namespace fusedps::client::internal

#endif  // FUSEDPS_CLIENT_RAW_CALL_H_
