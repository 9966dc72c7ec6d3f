#include "server/ingest/pull_request.h"

#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/workspace_range.h"
#include "server/ingest/push_assembly.h"
#include "server/ingest/state_loader.h"

namespace fusedps {
namespace {

// The request's dtype, chunk size, field and tensors, checked against `engine`'s view, and the
// read's layout: every tensor AlignedNumel elements of stored_size, one after the other.
absl::Status CheckTensors(const v1::PullParametersRequest& request, const UpdateEngine& engine,
                          PullPlan* plan) {
  plan->wire_dtype = request.dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_FLOAT32 : request.dtype();
  absl::StatusOr<GradDType> dtype = GradDTypeFromProto(plan->wire_dtype, "dtype");
  if (!dtype.ok()) return dtype.status();
  plan->dtype = *dtype;
  absl::StatusOr<uint32_t> chunk_bytes = PullChunkBytes(request.max_chunk_bytes());
  if (!chunk_bytes.ok()) return chunk_bytes.status();
  plan->chunk_bytes = *chunk_bytes;
  const std::optional<TensorField> field = TensorFieldFromProto(request.field());
  if (!field) {
    return absl::InvalidArgumentError(
        absl::StrCat("field = ", static_cast<int>(request.field()), " is not a TensorField"));
  }
  plan->field = *field;
  absl::flat_hash_set<absl::string_view> seen;
  for (int i = 0; i < request.tensors_size(); ++i) {
    if (!seen.insert(request.tensors(i)).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensors[", i, "] names tensor ", QuoteName(request.tensors(i)), " a second time"));
    }
  }
  plan->view = engine.view();
  const ShardView& view = *plan->view;
  const std::vector<std::string> names(request.tensors().begin(), request.tensors().end());
  absl::StatusOr<std::vector<uint32_t>> tensors = view.Resolve(names);
  if (!tensors.ok()) return tensors.status();
  plan->tensors = *std::move(tensors);
  for (uint32_t t : plan->tensors) {
    if (plan->field == TensorField::kMaxExpAvgSq &&
        !view.groups()[view.tensor(t).group].hyperparameters.amsgrad) {
      return absl::FailedPreconditionError(
          absl::StrCat("tensor ", QuoteName(view.tensor(t).name),
                       ": max_exp_avg_sq exists only in param groups with amsgrad"));
    }
  }
  // A 16-bit pull of params is served from the server's copy when it keeps one in that dtype
  // and every tensor pulled has one (fp32 params: bf16 params have no copy). Otherwise the
  // values are read as fp32 (bf16 params and state widened, int8 state dequantized) and
  // rounded by the transport.
  plan->param_copy = plan->field == TensorField::kParam && plan->dtype != GradDType::kFloat32 &&
                     static_cast<int>(plan->dtype) == static_cast<int>(engine.param_copy_dtype());
  for (size_t i = 0; plan->param_copy && i < plan->tensors.size(); ++i) {
    plan->param_copy = view.layout(plan->tensors[i]).params == ParamsDType::kFloat32;
  }
  plan->stored_size = plan->param_copy ? 2 : 4;
  for (uint32_t t : plan->tensors) {
    plan->offsets.push_back(plan->total_bytes);
    plan->total_bytes += AlignedNumel(view.tensor(t).numel) * plan->stored_size;
  }
  return absl::OkStatus();
}

// A pull into the caller's workspace: finds it and checks the offsets (one per tensor, aligned,
// inside, disjoint).
absl::Status CheckWorkspace(const v1::PullParametersRequest& request,
                            std::shared_ptr<const Workspace> found, PullPlan* plan) {
  if (request.tensors_size() == 0) {
    return absl::InvalidArgumentError(
        "a pull into a workspace must name its tensors (one workspace_offsets_bytes each)");
  }
  if (request.workspace_offsets_bytes_size() != request.tensors_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("workspace_offsets_bytes has ", request.workspace_offsets_bytes_size(),
                     " entries; tensors has ", request.tensors_size(), " (one offset per tensor)"));
  }
  const ShardView& view = *plan->view;
  const uint64_t size = found->memory().size();
  const uint64_t wire_size = DTypeSize(plan->dtype);
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // (begin, end), to check overlaps.
  for (size_t i = 0; i < plan->tensors.size(); ++i) {
    const uint64_t at = request.workspace_offsets_bytes(static_cast<int>(i));
    const uint64_t bytes = view.tensor(plan->tensors[i]).numel * wire_size;
    const std::string field = absl::StrCat("workspace_offsets_bytes[", i, "]");
    if (at % wire_size != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " = ", at, " must be a multiple of the dtype's size, ", wire_size));
    }
    if (absl::Status s = CheckWorkspaceRange(at, bytes, size, field); !s.ok()) return s;
    plan->workspace_offsets.push_back(at);
    ranges.emplace_back(at, at + bytes);
  }
  std::vector<size_t> order(ranges.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return ranges[a].first < ranges[b].first; });
  for (size_t k = 1; k < order.size(); ++k) {
    if (ranges[order[k]].first < ranges[order[k - 1]].second) {
      return absl::InvalidArgumentError(
          absl::StrCat("workspace_offsets_bytes[", order[k], "] overlaps the region of tensor ",
                       QuoteName(view.tensor(plan->tensors[order[k - 1]]).name),
                       " (workspace_offsets_bytes[", order[k - 1], "])"));
    }
  }
  plan->workspace = std::move(found);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<uint32_t> PullChunkBytes(uint32_t max_chunk_bytes) {
  const uint32_t bytes = max_chunk_bytes == 0 ? kDefaultPullChunkBytes : max_chunk_bytes;
  if (bytes < kMinPullChunkBytes || bytes > kMaxPullChunkBytes) {
    return absl::InvalidArgumentError(absl::StrCat("max_chunk_bytes = ", bytes,
                                                   " must be 0 or in [", kMinPullChunkBytes, ", ",
                                                   kMaxPullChunkBytes, "]"));
  }
  return bytes;
}

ReadJob PullPlan::Job() const {
  ReadJob job;
  job.field = field;
  job.param_copy = param_copy;
  job.tensors = tensors;
  return job;
}

ReadJob PullPlan::WorkspaceJob() const {
  ReadJob job = Job();
  job.dst = workspace->memory().data();
  job.dst_offsets = workspace_offsets;
  job.dst_on_device = workspace->on_device();
  return job;
}

uint64_t PullPlan::WorkspaceBytes() const {
  uint64_t bytes = 0;
  for (const uint32_t t : tensors) bytes += view->tensor(t).numel * DTypeSize(dtype);
  return bytes;
}

absl::StatusOr<PullPlan> PlanPull(const v1::PullParametersRequest& request,
                                  const UpdateEngine& engine, const WorkspaceTable& workspaces,
                                  absl::string_view workspace_owner) {
  PullPlan plan;
  if (absl::Status s = CheckTensors(request, engine, &plan); !s.ok()) return s;
  if (!request.workspace().empty()) {
    absl::StatusOr<std::shared_ptr<const Workspace>> found =
        workspaces.Find(request.workspace(), workspace_owner);
    if (!found.ok()) return found.status();
    if (absl::Status s = CheckWorkspace(request, *std::move(found), &plan); !s.ok()) return s;
  }
  return plan;
}

absl::StatusOr<PullPlan> PlanPullInto(const v1::PullParametersRequest& request,
                                      const UpdateEngine& engine,
                                      std::shared_ptr<const Workspace> workspace) {
  PullPlan plan;
  if (absl::Status s = CheckTensors(request, engine, &plan); !s.ok()) return s;
  if (absl::Status s = CheckWorkspace(request, std::move(workspace), &plan); !s.ok()) return s;
  return plan;
}

absl::StatusOr<PullPlan> PlanCommitPull(const v1::PullParametersRequest& pull,
                                        const v1::PushHeader& header, absl::string_view model,
                                        const UpdateEngine& engine,
                                        std::shared_ptr<const Workspace> workspace) {
  if (workspace == nullptr) {
    return absl::InvalidArgumentError(
        "commit.pull in a push without a workspace (header.workspace): a commit's pull writes "
        "into its push's workspace");
  }
  if (!pull.workspace().empty() && pull.workspace() != header.workspace()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "commit.pull.workspace = ", QuoteName(pull.workspace()),
        " must be empty or the push's header.workspace, ", QuoteName(header.workspace())));
  }
  if (!pull.model().empty() && pull.model() != model) {
    return absl::InvalidArgumentError(absl::StrCat("commit.pull.model = ", QuoteName(pull.model()),
                                                   " must be empty or the push's model, ",
                                                   QuoteName(model)));
  }
  absl::StatusOr<PullPlan> plan = PlanPullInto(pull, engine, std::move(workspace));
  if (!plan.ok()) {
    return absl::Status(plan.status().code(),
                        absl::StrCat("commit.pull: ", plan.status().message()));
  }
  if (plan->stored_size != static_cast<uint32_t>(DTypeSize(plan->dtype))) {
    return absl::FailedPreconditionError(absl::StrCat(
        "commit.pull.dtype asks for ", DTypeSize(plan->dtype) * 8, "-bit values of ",
        plan->stored_size * 8,
        "-bit ones: a commit's pull is in fp32, or in the dtype of the server's param copy "
        "(--param-copy-dtype); nothing is rounded on the way"));
  }
  return plan;
}

}  // namespace fusedps
