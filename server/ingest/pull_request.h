// pull_request.h: a pull's request checked against its shard, and the plan of its read. Free
// of gRPC.
//
// The transport (server/service/pull_reactor.cc) parses the PullParametersRequest, checks who
// calls and finds the model it names; PlanPull then checks the request against the model's
// engine (its current view) and lays the read out; the reactor executes the plan (staging or a
// snapshot, the engine's read, the messages) and never checks the request itself.
//
// Usage:
//   absl::StatusOr<PullPlan> plan = PlanPull(request, engine, workspaces, owner);
//   if (!plan.ok()) return Finish(plan.status());
//   ReadJob job = plan->Job();  // dst, dst_offsets: plan->offsets into a buffer of
//                               // plan->total_bytes, or plan->workspace_offsets.
//
// Thread safety: PlanPull may be called from any thread; a PullPlan is a value.
#ifndef FUSEDPS_SERVER_INGEST_PULL_REQUEST_H_
#define FUSEDPS_SERVER_INGEST_PULL_REQUEST_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "fusedps/v1/parameter_service.pb.h"
#include "kernels/backend.h"
#include "server/engine/update_engine.h"
#include "server/store/shard_view.h"
#include "server/workspace/workspace.h"

namespace fusedps {

// PullParametersRequest.max_chunk_bytes: 0 means the default; else in [min, max]. Bytes.
inline constexpr uint32_t kDefaultPullChunkBytes = 1 << 20;
inline constexpr uint32_t kMaxPullChunkBytes = 4 << 20;
inline constexpr uint32_t kMinPullChunkBytes = 16;

// A request's max_chunk_bytes (PullParametersRequest's, LookupRowsRequest's) as the bytes per
// chunk: the default for 0. INVALID_ARGUMENT naming max_chunk_bytes outside [min, max].
absl::StatusOr<uint32_t> PullChunkBytes(uint32_t max_chunk_bytes);

// A checked pull: what to read, and where each tensor's values go.
struct PullPlan {
  v1::DType wire_dtype = v1::DTYPE_FLOAT32;       // The header's (DTYPE_UNSPECIFIED: FLOAT32).
  GradDType dtype = GradDType::kFloat32;          // The same, as the kernels name it.
  uint32_t chunk_bytes = kDefaultPullChunkBytes;  // The most payload per chunk.
  TensorField field = TensorField::kParam;
  // Read from the server's 16-bit copy of the params (ReadJob::param_copy): a 16-bit pull of
  // params whose dtype is the copy's, of tensors that all have one (fp32 params).
  bool param_copy = false;
  // Bytes per element the engine reads: 2 from the copy, else 4 (fp32, rounded to a 16-bit
  // wire dtype by the transport).
  uint32_t stored_size = 4;
  // The view the request was checked against; `tensors` are its indices, in request order
  // (every tensor, in registration order, when the request names none).
  std::shared_ptr<const ShardView> view;
  std::vector<uint32_t> tensors;
  // Per tensor, bytes into the read's buffer (each AlignedNumel elements of stored_size, so
  // 16-byte aligned), and the buffer's size.
  std::vector<uint64_t> offsets;
  uint64_t total_bytes = 0;
  // A pull into the caller's workspace (PullParametersRequest.workspace), held until the plan
  // is gone, and per tensor its offset there in bytes (numel * DTypeSize(dtype) bytes each,
  // aligned to the dtype, inside, disjoint). Null and empty for a pull over gRPC.
  std::shared_ptr<const Workspace> workspace;
  std::vector<uint64_t> workspace_offsets;

  // The engine's read of the plan's tensors and field; dst and dst_offsets are the caller's to
  // set.
  ReadJob Job() const;
  // Job() into the workspace, at workspace_offsets: the stored bytes as they are (the caller
  // has checked that stored_size is the dtype's). REQUIRES: workspace is set.
  ReadJob WorkspaceJob() const;
  // The bytes a pull into the workspace writes there: numel * DTypeSize(dtype) per tensor.
  uint64_t WorkspaceBytes() const;
};

// Checks `request` against `engine`'s current view and plans its read. The checks, in order
// (the first that fails decides):
//   INVALID_ARGUMENT: a dtype that is not FLOAT32, BFLOAT16 or FLOAT16 (naming "dtype");
//     max_chunk_bytes not 0 and outside [kMinPullChunkBytes, kMaxPullChunkBytes]; a field that
//     is not a TensorField; a tensor named twice (naming its index);
//   NOT_FOUND: a tensor that is not registered (ShardView::Resolve);
//   FAILED_PRECONDITION: max_exp_avg_sq of a tensor whose param group has no amsgrad;
// and for a pull into a workspace (request.workspace not empty):
//   NOT_FOUND: a workspace that is not open, or not `workspace_owner`'s (WorkspaceTable::Find);
//   INVALID_ARGUMENT: no tensors named; not one workspace_offsets_bytes per tensor; an offset
//     that is not a multiple of the dtype's size, or whose bytes pass the workspace's end
//     (naming workspace_offsets_bytes[i]), or that overlaps another tensor's bytes.
// `workspace_owner`: the caller's (WorkspaceOwner: its principals, empty without
// authentication). Borrowed for the call only.
absl::StatusOr<PullPlan> PlanPull(const v1::PullParametersRequest& request,
                                  const UpdateEngine& engine, const WorkspaceTable& workspaces,
                                  absl::string_view workspace_owner);

// PlanPull of a pull into `workspace` (found by the caller; request.workspace is not read):
// PlanPull's checks but the workspace's NOT_FOUND. A commit's pull (PushCommit.pull) is planned
// so, into its push's workspace. REQUIRES: workspace is not null.
absl::StatusOr<PullPlan> PlanPullInto(const v1::PullParametersRequest& request,
                                      const UpdateEngine& engine,
                                      std::shared_ptr<const Workspace> workspace);

// The pull a push's commit carries (PushCommit.pull), into the push's `workspace` (the
// header's, found when the push began; null without one), checked as the commit arrives.
// `model`: the push's model as the registry names it (IngestServices::model).
// Errors, each naming commit.pull's field: INVALID_ARGUMENT for no workspace, a pull.workspace
// other than empty or header.workspace, a pull.model other than empty or the push's;
// PlanPullInto's; FAILED_PRECONDITION for a dtype the engine cannot read straight into the
// workspace (16 bits of fp32 values: nothing is rounded on the way).
absl::StatusOr<PullPlan> PlanCommitPull(const v1::PullParametersRequest& pull,
                                        const v1::PushHeader& header, absl::string_view model,
                                        const UpdateEngine& engine,
                                        std::shared_ptr<const Workspace> workspace);

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_INGEST_PULL_REQUEST_H_
