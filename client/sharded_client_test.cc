// Tests of the ShardedClient over real gRPC against three fake ParameterServices in this process
// (client/fake_parameter_service.h), each serving one shard of a plan: each fake must hold
// exactly its plan's slices, registered and pushed under the plan's hash, and pulls must gather
// whole tensors again.
#include "fusedps/sharded_client.h"

#include <chrono>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/client_test_util.h"
#include "client/fake_parameter_service.h"
#include "client/wire.h"
#include "fusedps/client.h"
#include "fusedps/plan.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace fusedps::client {
namespace {

using testing::FakeParameterService;
using testing::Normal;

constexpr int kShards = 3;
constexpr uint64_t kSliceElements = 16;

class ShardedClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < kShards; ++i) {
      int port = 0;
      grpc::ServerBuilder builder;
      builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
      builder.RegisterService(&services_[i]);
      builder.SetMaxReceiveMessageSize(static_cast<int>(internal::kMaxMessageBytes));
      servers_.push_back(builder.BuildAndStart());
      ASSERT_NE(servers_.back(), nullptr);
      ASSERT_NE(port, 0);
      targets_.push_back(absl::StrCat("127.0.0.1:", port));
    }
    // wte is cut into 5 slices (16, 16, 16, 16, 6); the others stay whole.
    values_ = {Normal(70, 1), Normal(15, 2), Normal(4, 3), Normal(1, 4)};
    model_ = {{"wte", {10, 7}, "", values_[0]},
              {"wpe", {5, 3}, "default", values_[1]},
              {"ln.b", {4}, "", values_[2]},
              {"scale", {}, "", values_[3]}};
  }
  void TearDown() override {
    for (auto& server : servers_) {
      server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    }
  }

  std::unique_ptr<ShardedClient> Connect() {
    ClientOptions options;
    options.max_chunk_bytes = 32;  // Several messages per shard.
    return ShardedClient::Create(targets_, options).value();
  }

  FakeParameterService services_[kShards];
  std::vector<std::unique_ptr<grpc::Server>> servers_;
  std::vector<std::string> targets_;
  std::vector<std::vector<float>> values_;
  std::vector<TensorInit> model_;
};

// values[begin, end) of the model tensor named `tensor`.
std::vector<float> SliceOf(const std::vector<TensorInit>& model, const PlanSlice& slice) {
  for (const TensorInit& tensor : model) {
    if (tensor.name == slice.tensor) {
      return std::vector<float>(tensor.values.begin() + static_cast<ptrdiff_t>(slice.begin),
                                tensor.values.begin() + static_cast<ptrdiff_t>(slice.end));
    }
  }
  ADD_FAILURE() << "no tensor " << slice.tensor;
  return {};
}

TEST_F(ShardedClientTest, RegisterPushPullRoundTrip) {
  std::unique_ptr<ShardedClient> client = Connect();
  absl::StatusOr<std::vector<RegisterTensorsResult>> registered =
      client->Register(model_, kSliceElements);
  ASSERT_TRUE(registered.ok()) << registered.status();
  const std::shared_ptr<const ShardPlan> plan = client->plan();
  ASSERT_NE(plan, nullptr);
  ASSERT_EQ(plan->slices().size(), 8u);

  // Each fake holds exactly its slices, as registered under the plan's hash.
  uint32_t created = 0;
  for (uint32_t i = 0; i < kShards; ++i) {
    SCOPED_TRACE(absl::StrCat("shard ", i));
    const std::vector<PlanSlice> slices = plan->ShardSlices(i);
    ASSERT_FALSE(slices.empty());
    const std::map<std::string, FakeParameterService::Tensor> held = services_[i].tensors();
    ASSERT_EQ(held.size(), slices.size());
    for (const PlanSlice& slice : slices) {
      auto it = held.find(slice.server_tensor);
      ASSERT_NE(it, held.end()) << slice.server_tensor;
      EXPECT_EQ(it->second.shape, slice.server_shape);
      EXPECT_EQ(it->second.param_group, "default");
      EXPECT_EQ(it->second.values, SliceOf(model_, slice));
    }
    EXPECT_EQ(services_[i].register_plan_hashes(), std::vector<std::string>{plan->hash()});
    created += (*registered)[i].tensors_created;
  }
  EXPECT_EQ(created, 8u);
  EXPECT_EQ(client->versions(), (std::vector<uint64_t>(kShards, 0)));

  const std::vector<float> grad_wte = Normal(70, 5), grad_wpe = Normal(15, 6),
                           grad_ln = Normal(4, 7), grad_scale = {0.25f};
  const std::vector<TensorGrad> grads = {
      {"wte", grad_wte}, {"wpe", grad_wpe}, {"ln.b", grad_ln}, {"scale", grad_scale}};
  PushOptions push;
  push.grad_dtype = DType::kFloat32;
  push.base_version = 99;    // Not used: each shard gets the version the client saw.
  push.plan_hash = "other";  // Not used either.
  for (int step = 1; step <= 2; ++step) {
    absl::StatusOr<std::vector<PushResult>> pushed = client->PushGradients(push, grads);
    ASSERT_TRUE(pushed.ok()) << pushed.status();
    ASSERT_EQ(pushed->size(), static_cast<size_t>(kShards));
    uint64_t bytes = 0;
    for (uint32_t i = 0; i < kShards; ++i) {
      EXPECT_EQ((*pushed)[i].version, static_cast<uint64_t>(step));
      EXPECT_EQ((*pushed)[i].tensors_updated, plan->ShardSlices(i).size());
      bytes += (*pushed)[i].grad_bytes;
      const v1::PushHeader header = services_[i].last_push_header();
      EXPECT_EQ(header.plan_hash(), plan->hash());
      EXPECT_EQ(header.base_version(), static_cast<uint64_t>(step - 1));
      std::set<std::string> names(header.tensors().begin(), header.tensors().end());
      std::set<std::string> expected;
      for (const PlanSlice& slice : plan->ShardSlices(i)) expected.insert(slice.server_tensor);
      EXPECT_EQ(names, expected);
    }
    EXPECT_EQ(bytes, (70 + 15 + 4 + 1) * sizeof(float));
  }

  absl::StatusOr<ShardedPullResult> pulled = client->PullParameters({});
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(pulled->versions, (std::vector<uint64_t>(kShards, 2)));
  ASSERT_EQ(pulled->tensors.size(), model_.size());
  for (size_t t = 0; t < model_.size(); ++t) {
    SCOPED_TRACE(model_[t].name);
    const PulledTensor& tensor = pulled->tensors.at(model_[t].name);
    EXPECT_EQ(tensor.shape, model_[t].shape);
    EXPECT_EQ(tensor.param_group, "default");
    EXPECT_EQ(tensor.step, 2);
    const absl::Span<const float> grad = grads[t].grads;
    ASSERT_EQ(tensor.values.size(), values_[t].size());
    for (size_t e = 0; e < tensor.values.size(); ++e) {
      ASSERT_EQ(tensor.values[e], values_[t][e] - grad[e] - grad[e]) << "element " << e;
    }
  }

  // A pull of some tensors calls only the shards that hold them.
  PullOptions some;
  some.tensors = {"ln.b"};
  pulled = client->PullParameters(some);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(pulled->tensors.size(), 1u);
  EXPECT_EQ(pulled->tensors.at("ln.b").values.size(), 4u);
}

TEST_F(ShardedClientTest, TrainerWithTheSamePlanPushesASubset) {
  std::unique_ptr<ShardedClient> first = Connect();
  ASSERT_TRUE(first->Register(model_, kSliceElements).ok());
  std::vector<PlanTensor> tensors;
  for (const TensorInit& t : model_) tensors.push_back({t.name, t.shape, t.param_group});
  std::unique_ptr<ShardedClient> second = Connect();
  ASSERT_TRUE(second->SetPlan(ShardPlan::Make(tensors, kShards, kSliceElements).value()).ok());
  EXPECT_EQ(second->plan()->hash(), first->plan()->hash());

  const std::vector<float> grad = Normal(4, 8);
  absl::StatusOr<std::vector<PushResult>> pushed = second->PushGradients({}, {{"ln.b", grad}});
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  const uint32_t holder = [&] {
    for (const PlanSlice& s : second->plan()->slices()) {
      if (s.tensor == "ln.b") return s.shard;
    }
    return 0u;
  }();
  for (uint32_t i = 0; i < kShards; ++i) {
    EXPECT_EQ((*pushed)[i].version, i == holder ? 1u : 0u) << "shard " << i;
    EXPECT_EQ((*pushed)[i].tensors_updated, i == holder ? 1u : 0u) << "shard " << i;
  }
  EXPECT_EQ(second->versions()[holder], 1u);

  // Base versions given explicitly, one per shard.
  const std::vector<uint64_t> bases = {7, 8, 9};
  ASSERT_TRUE(second->PushGradients({}, {{"ln.b", grad}}, bases).ok());
  EXPECT_EQ(services_[holder].last_push_header().base_version(), bases[holder]);
  EXPECT_EQ(
      second->PushGradients({}, {{"ln.b", grad}}, absl::MakeSpan(bases).subspan(1)).status().code(),
      absl::StatusCode::kInvalidArgument);
}

TEST_F(ShardedClientTest, Errors) {
  std::unique_ptr<ShardedClient> client = Connect();
  const std::vector<float> grad(70, 0.0f);
  EXPECT_EQ(client->PushGradients({}, {{"wte", grad}}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(client->PullParameters({}).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(client->SetPlan(ShardPlan::Make({{"w", {4}}}, 2).value()).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<TensorInit> short_values = model_;
  short_values[0].values = short_values[0].values.subspan(1);
  EXPECT_EQ(client->Register(short_values, kSliceElements).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->plan(), nullptr);  // A failed Register leaves no plan.

  ASSERT_TRUE(client->Register(model_, kSliceElements).ok());
  EXPECT_EQ(client->PushGradients({}, {{"nope", grad}}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(client->PushGradients({}, {{"wte", absl::MakeSpan(grad).subspan(1)}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->PushGradients({}, {{"wte", grad}, {"wte", grad}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->PushGradients({}, {}).status().code(), absl::StatusCode::kInvalidArgument);
  PullOptions unknown;
  unknown.tensors = {"nope"};
  EXPECT_EQ(client->PullParameters(unknown).status().code(), absl::StatusCode::kNotFound);
  std::vector<TensorInit> regrouped = {model_[2]};
  regrouped[0].param_group = "other";
  EXPECT_EQ(client->RegisterTensors(regrouped).status().code(), absl::StatusCode::kInvalidArgument);

  // A plan the servers do not hold: a shard's own error, naming the shard.
  std::unique_ptr<ShardedClient> stranger = Connect();
  ASSERT_TRUE(stranger->SetPlan(ShardPlan::Make({{"unknown", {4}}}, kShards).value()).ok());
  const std::vector<float> four(4, 0.0f);
  absl::Status status = stranger->PushGradients({}, {{"unknown", four}}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(status.message().find("shard 0 (127.0.0.1:"), absl::string_view::npos) << status;
}

TEST_F(ShardedClientTest, GetInfoReportsConsistencyAndPlanHash) {
  std::unique_ptr<ShardedClient> client = Connect();
  ASSERT_TRUE(client->Register(model_, kSliceElements).ok());
  v1::Consistency consistency;
  consistency.set_mode(v1::CONSISTENCY_MODE_SYNC);
  consistency.set_replicas_to_aggregate(3);
  consistency.set_total_replicas(4);
  consistency.set_round_timeout_seconds(2.5);
  services_[1].set_consistency(consistency);
  services_[1].set_round_workers(3);
  absl::StatusOr<ServerInfo> info = client->shard(1).GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->consistency.mode, "sync");
  EXPECT_EQ(info->consistency.replicas_to_aggregate, 3u);
  EXPECT_EQ(info->consistency.total_replicas, 4u);
  EXPECT_EQ(info->consistency.round_timeout, absl::Milliseconds(2500));
  EXPECT_EQ(info->plan_hash, client->plan()->hash());
  info = client->shard(0).GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->consistency.mode, "");  // A server that does not say.

  const std::vector<float> grad(70, 0.0f), grad15(15, 0.0f), grad4(4, 0.0f), grad1(1, 0.0f);
  absl::StatusOr<std::vector<PushResult>> pushed = client->PushGradients(
      {}, {{"wte", grad}, {"wpe", grad15}, {"ln.b", grad4}, {"scale", grad1}});
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ((*pushed)[1].round_workers, 3u);
  EXPECT_EQ((*pushed)[0].round_workers, 0u);
}

}  // namespace
}  // namespace fusedps::client
