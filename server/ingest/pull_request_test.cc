// Tests of a pull request's checks and plan against a real engine, view and workspaces: the
// plan's layout and read, and each refusal with its status and message.
#include "server/ingest/pull_request.h"

#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/temp_dir.h"
#include "gtest/gtest.h"
#include "server/engine/engine_test_util.h"

namespace fusedps {
namespace {

class PullRequestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    workspaces_ = std::make_unique<WorkspaceTable>(WorkspaceOptions{dir_.path(), 1 << 20}, nullptr);
    // The server keeps a bf16 copy of fp32 params. Tensors: "a" (10 elements) and "b" (3) in
    // the default group, "m" (5) in the amsgrad group "ams".
    engine_ = std::make_unique<UpdateEngine>(
        MakeCpuBackend({.param_copy_dtype = ParamCopyDType::kBFloat16, .threads = 1}), &fault_,
        &retries_);
    AdamWHyperparameters amsgrad;
    amsgrad.amsgrad = true;
    ASSERT_TRUE(Sync<bool>([&](UpdateEngine::Done<bool> d) {
                  engine_->RegisterParamGroup({"ams", amsgrad}, d);
                }).ok());
    const std::vector<TensorMeta> metas = {{"a", {10}, 0, 10}, {"b", {3}, 0, 3}, {"m", {5}, 1, 5}};
    ASSERT_TRUE(Sync<uint32_t>([&](UpdateEngine::Done<uint32_t> d) {
                  engine_->BeginRegistration(metas, d);
                }).ok());
    ASSERT_TRUE(Sync<uint64_t>([&](UpdateEngine::Done<uint64_t> d) {
                  engine_->CommitRegistration("", d);
                }).ok());
  }
  void TearDown() override {
    engine_.reset();
    workspaces_.reset();
  }

  absl::StatusOr<PullPlan> Plan(const v1::PullParametersRequest& request,
                                absl::string_view owner = "alice") const {
    return PlanPull(request, *engine_, *workspaces_, owner);
  }

  static v1::PullParametersRequest Request(std::vector<std::string> tensors) {
    v1::PullParametersRequest request;
    for (const std::string& t : tensors) request.add_tensors(t);
    return request;
  }

  TempDir dir_{"fusedps-pull-request-test"};
  ShardFault fault_;
  RetryTable retries_{100};
  std::unique_ptr<WorkspaceTable> workspaces_;
  std::unique_ptr<UpdateEngine> engine_;
};

TEST_F(PullRequestTest, AnEmptyRequestPlansEveryTensorAsFloat32Params) {
  absl::StatusOr<PullPlan> plan = Plan(v1::PullParametersRequest());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->view, engine_->view());
  EXPECT_EQ(plan->tensors, (std::vector<uint32_t>{0, 1, 2}));  // Registration order.
  EXPECT_EQ(plan->wire_dtype, v1::DTYPE_FLOAT32);
  EXPECT_EQ(plan->dtype, GradDType::kFloat32);
  EXPECT_EQ(plan->chunk_bytes, kDefaultPullChunkBytes);
  EXPECT_EQ(plan->field, TensorField::kParam);
  EXPECT_FALSE(plan->param_copy);
  EXPECT_EQ(plan->stored_size, 4u);
  // Each tensor at a multiple of 8 elements (16-byte aligned): 16, 8 and 8 elements.
  EXPECT_EQ(plan->offsets, (std::vector<uint64_t>{0, 64, 96}));
  EXPECT_EQ(plan->total_bytes, 128u);
  EXPECT_EQ(plan->workspace, nullptr);
  EXPECT_TRUE(plan->workspace_offsets.empty());
  const ReadJob job = plan->Job();
  EXPECT_EQ(job.field, TensorField::kParam);
  EXPECT_FALSE(job.param_copy);
  EXPECT_EQ(job.tensors, plan->tensors);
}

TEST_F(PullRequestTest, ABFloat16PullOfParamsIsReadFromTheCopy) {
  v1::PullParametersRequest request = Request({"b", "a"});
  request.set_dtype(v1::DTYPE_BFLOAT16);
  request.set_max_chunk_bytes(kMinPullChunkBytes);
  absl::StatusOr<PullPlan> plan = Plan(request);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->tensors, (std::vector<uint32_t>{1, 0}));  // Request order.
  EXPECT_EQ(plan->dtype, GradDType::kBFloat16);
  EXPECT_EQ(plan->chunk_bytes, kMinPullChunkBytes);
  EXPECT_TRUE(plan->param_copy);
  EXPECT_TRUE(plan->Job().param_copy);
  EXPECT_EQ(plan->stored_size, 2u);
  EXPECT_EQ(plan->offsets, (std::vector<uint64_t>{0, 16}));
  EXPECT_EQ(plan->total_bytes, 48u);

  // Not the copy's dtype, or not params: read as fp32 and rounded by the transport.
  request.set_dtype(v1::DTYPE_FLOAT16);
  plan = Plan(request);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_FALSE(plan->param_copy);
  EXPECT_EQ(plan->stored_size, 4u);
  request.set_dtype(v1::DTYPE_BFLOAT16);
  request.set_field(v1::TENSOR_FIELD_EXP_AVG);
  plan = Plan(request);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->field, TensorField::kExpAvg);
  EXPECT_FALSE(plan->param_copy);
  EXPECT_EQ(plan->total_bytes, 96u);
}

TEST_F(PullRequestTest, EachBadRequestIsRefusedNamingItsFieldAndLimit) {
  struct Case {
    const char* what;
    v1::PullParametersRequest request;
    absl::StatusCode code;
    std::string message;
  };
  std::vector<Case> cases;
  const auto add = [&](const char* what, absl::StatusCode code, std::string message,
                       const std::function<void(v1::PullParametersRequest*)>& edit) {
    v1::PullParametersRequest request = Request({"a"});
    edit(&request);
    cases.push_back({what, std::move(request), code, std::move(message)});
  };
  using C = absl::StatusCode;
  add("dtype", C::kInvalidArgument, "dtype = 9 must be FLOAT32, BFLOAT16 or FLOAT16",
      [](auto* r) { r->set_dtype(static_cast<v1::DType>(9)); });
  add("small chunks", C::kInvalidArgument, "max_chunk_bytes = 8 must be 0 or in [16, 4194304]",
      [](auto* r) { r->set_max_chunk_bytes(8); });
  add("large chunks", C::kInvalidArgument,
      "max_chunk_bytes = 4194305 must be 0 or in [16, 4194304]",
      [](auto* r) { r->set_max_chunk_bytes((4 << 20) + 1); });
  add("field", C::kInvalidArgument, "field = 99 is not a TensorField",
      [](auto* r) { r->set_field(static_cast<v1::TensorField>(99)); });
  add("tensor twice", C::kInvalidArgument, "tensors[2] names tensor 'a' a second time",
      [](auto* r) {
        r->add_tensors("b");
        r->add_tensors("a");
      });
  add("unknown tensor", C::kNotFound, "tensor 'nope' is not registered",
      [](auto* r) { r->add_tensors("nope"); });
  add("no amsgrad", C::kFailedPrecondition,
      "tensor 'a': max_exp_avg_sq exists only in param groups with amsgrad",
      [](auto* r) { r->set_field(v1::TENSOR_FIELD_MAX_EXP_AVG_SQ); });
  // The first check that fails decides: the dtype before the duplicate, the tensors before the
  // workspace.
  add("dtype first", C::kInvalidArgument, "dtype = 9 must be FLOAT32, BFLOAT16 or FLOAT16",
      [](auto* r) {
        r->set_dtype(static_cast<v1::DType>(9));
        r->add_tensors("a");
      });
  add("tensors before workspace", C::kNotFound, "tensor 'nope' is not registered", [](auto* r) {
    r->add_tensors("nope");
    r->set_workspace("0123456789abcdef0123456789abcdef");
  });
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const absl::StatusOr<PullPlan> plan = Plan(c.request);
    ASSERT_FALSE(plan.ok());
    EXPECT_EQ(plan.status(), absl::Status(c.code, c.message));
  }

  // max_exp_avg_sq of a tensor with amsgrad is fine.
  v1::PullParametersRequest request = Request({"m"});
  request.set_field(v1::TENSOR_FIELD_MAX_EXP_AVG_SQ);
  absl::StatusOr<PullPlan> plan = Plan(request);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->field, TensorField::kMaxExpAvgSq);
}

TEST_F(PullRequestTest, AWorkspacePullIsCheckedAndPlanned) {
  absl::StatusOr<std::shared_ptr<const Workspace>> mine = workspaces_->Open("alice", 4096);
  ASSERT_TRUE(mine.ok()) << mine.status();
  const std::string id = (*mine)->id();
  // a: 10 fp32 elements (40 bytes), b: 3 (12 bytes).
  const auto request = [&](std::vector<std::string> tensors, std::vector<uint64_t> offsets) {
    v1::PullParametersRequest r = Request(std::move(tensors));
    r.set_workspace(id);
    for (uint64_t at : offsets) r.add_workspace_offsets_bytes(at);
    return r;
  };

  absl::StatusOr<PullPlan> plan = Plan(request({"a", "b"}, {100, 40}));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->workspace, *mine);  // Held by the plan, then by the reactor.
  EXPECT_EQ(plan->workspace_offsets, (std::vector<uint64_t>{100, 40}));
  EXPECT_EQ(plan->total_bytes, 96u);  // The layout of a read that rounds to 16 bits here.

  using C = absl::StatusCode;
  struct Case {
    const char* what;
    v1::PullParametersRequest request;
    absl::string_view owner;
    absl::Status status;
  };
  const std::string not_open =
      "\" is not open (its OpenWorkspace call has ended, or it was never yours)";
  v1::PullParametersRequest unknown = request({"a"}, {0});
  unknown.set_workspace("0123456789abcdef0123456789abcdef");
  v1::PullParametersRequest half = request({"a"}, {2});
  half.set_dtype(v1::DTYPE_BFLOAT16);
  const std::vector<Case> cases = {
      {"not open", unknown, "alice",
       absl::Status(C::kNotFound, "workspace \"0123456789abcdef0123456789abcdef" + not_open)},
      {"another's", request({"a"}, {0}), "bob",
       absl::Status(C::kNotFound, "workspace \"" + id + not_open)},
      {"no tensors", request({}, {}), "alice",
       absl::Status(C::kInvalidArgument,
                    "a pull into a workspace must name its tensors (one "
                    "workspace_offsets_bytes each)")},
      {"offsets", request({"a", "b"}, {0}), "alice",
       absl::Status(C::kInvalidArgument,
                    "workspace_offsets_bytes has 1 entries; tensors has 2 (one offset per "
                    "tensor)")},
      {"unaligned", request({"a"}, {2}), "alice",
       absl::Status(C::kInvalidArgument,
                    "workspace_offsets_bytes[0] = 2 must be a multiple of the dtype's size, 4")},
      {"past the end", request({"b", "a"}, {0, 4060}), "alice",
       absl::Status(C::kInvalidArgument,
                    "workspace_offsets_bytes[1]: bytes [4060, 4060 + 40) pass the end of the "
                    "workspace (4096 bytes)")},
      {"overlap", request({"a", "b"}, {100, 136}), "alice",
       absl::Status(C::kInvalidArgument,
                    "workspace_offsets_bytes[1] overlaps the region of tensor 'a' "
                    "(workspace_offsets_bytes[0])")},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    plan = Plan(c.request, c.owner);
    ASSERT_FALSE(plan.ok());
    EXPECT_EQ(plan.status(), c.status);
  }
  // 16-bit values need 2-byte alignment only.
  plan = Plan(half);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->workspace_offsets, (std::vector<uint64_t>{2}));
}

}  // namespace
}  // namespace fusedps
