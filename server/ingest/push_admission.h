// push_admission.h: what happens to a push's header at its shard, decided before any of its
// payload is read. Free of gRPC.
//
// The transport (server/service/push_reactor.cc) reads the header, checks who pushes (with
// authentication on, the client_id must be one of the caller's principals: server/auth) and
// finds the model the header names (server/models); then it asks AdmitPushHeader about the
// model's shard, and only translates the verdict. The checks, in this order (the first that
// fails decides):
//   1. the header against the shard's current view (CheckPushHeader: dtype, grad_scale,
//      worker_count, client_id's length, the parts fields, each tensor named once and
//      registered);
//   2. its workspace (PushHeader.workspace), when it names one: one of the caller's open ones;
//   3. the retry table (RetryTable::Await): a push it remembers is answered with that push's
//      reply (duplicate = true); a retry of a push still being applied waits for it; a sequence
//      number below the client's highest that it no longer remembers is ABORTED;
//   4. the shard's consistency mode (UpdateEngine::AdmitPush), after the retries, which are
//      answered whatever their base_version.
// Nothing here changes the shard: the retry table gains at most the waiter of step 3 (and the
// client's recency), and step 4 counts its refusals in the consistency metrics. The engine
// checks the retry table again when it queues the step (the authoritative check).
//
// Usage (the reactor; `Hold` and `Release` keep the reactor alive for the waiter):
//   Hold();
//   PushVerdict v = AdmitPushHeader(header, {&engine, &retries, &workspaces, owner},
//                                   [this](absl::StatusOr<PushReply> r) { End(r); Release(); });
//   if (v.kind != PushVerdict::Kind::kWaiting) Release();  // The waiter was dropped.
//   switch (v.kind) { ... }
//
// Thread safety: AdmitPushHeader may be called from any thread, for any number of pushes at once.
#ifndef FUSEDPS_SERVER_INGEST_PUSH_ADMISSION_H_
#define FUSEDPS_SERVER_INGEST_PUSH_ADMISSION_H_

#include <memory>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "fusedps/v1/parameter_service.pb.h"
#include "server/engine/update_engine.h"
#include "server/ingest/push_assembly.h"
#include "server/store/retry_table.h"
#include "server/store/shard_view.h"
#include "server/workspace/workspace.h"

namespace fusedps {

// The shard a push header is admitted to (a model's: server/models/model.h), and where its
// workspace is found. Everything is borrowed, for the AdmitPushHeader call only: the verdict
// holds what outlives it (the view, the workspace) by shared_ptr.
struct PushShard {
  const UpdateEngine* engine = nullptr;  // Its view and its consistency mode.
  RetryTable* retries = nullptr;         // Its retry table (the one its engine writes).
  const WorkspaceTable* workspaces = nullptr;
  // Who owns the caller's workspaces (WorkspaceTable's owner: its principals, empty without
  // authentication).
  absl::string_view workspace_owner;
};

// The decision about one push header.
struct PushVerdict {
  enum class Kind {
    // End the call with `status` (never OK): a bad header (INVALID_ARGUMENT, NOT_FOUND,
    // UNIMPLEMENTED, as CheckPushHeader), a workspace that is not the caller's (NOT_FOUND), a
    // stale retry (ABORTED, StalePushError), or the consistency mode's refusal (ABORTED,
    // INVALID_ARGUMENT: UpdateEngine::AdmitPush).
    kRefused,
    // A retry of a push already applied (or skipped): end the call with OK and `reply`
    // (duplicate = true). Its payload is never read.
    kAnswered,
    // A retry of a push still being applied: the waiter ends the call, once, with that push's
    // reply (duplicate = true) or its error. Its payload is never read.
    kWaiting,
    // A new (or untracked) push: read its payload into a PushAssembly made of `view` and
    // `checked`.
    kAdmitted,
  };
  Kind kind = Kind::kRefused;
  absl::Status status;  // kRefused.
  PushReply reply;      // kAnswered.
  // kAdmitted: the view the header was checked against (its tensor indices are this view's),
  // and the checked header, with its workspace (null for none).
  std::shared_ptr<const ShardView> view;
  CheckedPushHeader checked;
};

// Decides what happens to a push with `header` at `shard` (the checks of the file comment).
//
// `waiter` runs exactly once when the verdict is kWaiting: on the thread that finishes or
// abandons the original push (RetryTable::Finish, Abandon), possibly before AdmitPushHeader
// returns, so whatever it touches must stay alive until it has run. With any other verdict it
// never runs (it is dropped).
//
// REQUIRES: shard's pointers are not null.
PushVerdict AdmitPushHeader(const v1::PushHeader& header, const PushShard& shard,
                            RetryTable::Waiter waiter);

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_INGEST_PUSH_ADMISSION_H_
