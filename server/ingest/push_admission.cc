#include "server/ingest/push_admission.h"

#include <utility>

namespace fusedps {
namespace {

PushVerdict Refused(absl::Status status) {
  PushVerdict verdict;
  verdict.kind = PushVerdict::Kind::kRefused;
  verdict.status = std::move(status);
  return verdict;
}

}  // namespace

PushVerdict AdmitPushHeader(const v1::PushHeader& header, const PushShard& shard,
                            RetryTable::Waiter waiter) {
  std::shared_ptr<const ShardView> view = shard.engine->view();
  absl::StatusOr<CheckedPushHeader> checked = CheckPushHeader(header, *view);
  if (!checked.ok()) return Refused(checked.status());
  if (!header.workspace().empty()) {
    absl::StatusOr<std::shared_ptr<const Workspace>> workspace =
        shard.workspaces->Find(header.workspace(), shard.workspace_owner);
    if (!workspace.ok()) return Refused(workspace.status());
    checked->workspace = *std::move(workspace);
  }

  // A retry is answered from its header: its chunks are never read. Await drops the waiter
  // (unrun) for every kind but kInFlight.
  const RetryTable::Verdict retry =
      shard.retries->Await(header.client_id(), header.sequence_number(), std::move(waiter));
  switch (retry.kind) {
    case RetryTable::Kind::kInFlight: {
      PushVerdict verdict;
      verdict.kind = PushVerdict::Kind::kWaiting;
      return verdict;
    }
    case RetryTable::Kind::kDone: {
      PushVerdict verdict;
      verdict.kind = PushVerdict::Kind::kAnswered;
      verdict.reply = retry.reply;
      return verdict;
    }
    case RetryTable::Kind::kStale:
      return Refused(StalePushError(header.sequence_number(), retry.highest));
    case RetryTable::Kind::kNew:
    case RetryTable::Kind::kUntracked:
      break;
  }

  // What the shard's consistency mode refuses from the header alone (after the retries, which
  // are answered whatever their version).
  if (absl::Status s = shard.engine->AdmitPush(header.client_id(), header.base_version());
      !s.ok()) {
    return Refused(std::move(s));
  }
  PushVerdict verdict;
  verdict.kind = PushVerdict::Kind::kAdmitted;
  verdict.view = std::move(view);
  verdict.checked = *std::move(checked);
  return verdict;
}

}  // namespace fusedps
