// Integration tests of the ParameterService over real gRPC on loopback: registration, pushes in
// every gradient dtype checked bit for bit against the host AdamW, pulls, hyperparameter changes,
// retries, health, and concurrent pushes. Bad input is in service_bad_input_test.cc.
#include <algorithm>
#include <atomic>
#include <future>
#include <iostream>
#include <set>
#include <thread>

#include "fusedps/client.h"
#include "tests/integration/service_harness.h"

namespace fusedps::integration {
namespace {

constexpr int64_t kBigRows = 1100, kBigCols = 1000;  // 1,100,000 floats: 4.4 MB.

AdamWHyperparameters AmsgradHyperparameters() {
  AdamWHyperparameters h;
  h.lr = 0.02;
  h.weight_decay = 0.05;
  h.amsgrad = true;
  h.maximize = true;
  h.decoupled_weight_decay = false;
  return h;
}

class ServiceIntegrationTest : public ServiceTest {
 protected:
  // Groups "custom" and "ams"; "default" comes into being with the tensors that name it (or
  // name no group). With big, a tensor over 4 MB that needs several chunks.
  void RegisterModel(bool big) {
    RegisterGroup("custom", CustomHyperparameters());
    RegisterGroup("ams", AmsgradHyperparameters());
    std::vector<TensorDef> defs;
    if (big) defs.push_back({"big", {kBigRows, kBigCols}, "custom"});
    defs.push_back({"scalar", {}, "custom"});
    defs.push_back({"w", {3, 5}, ""});
    defs.push_back({"b", {7}, "default"});
    defs.push_back({"m", {40}, "ams"});
    RegisterTensors(defs);
  }

  std::vector<std::string> Names() const {
    std::vector<std::string> names;
    for (const HostModel::Tensor& t : host_.tensors()) names.push_back(t.def.name);
    return names;
  }

  uint64_t TotalNumel() const {
    uint64_t total = 0;
    for (const HostModel::Tensor& t : host_.tensors()) total += t.numel;
    return total;
  }
};

TEST_F(ServiceIntegrationTest, RegistersTensorsFromOutOfOrderChunks) {
  ASSERT_NO_FATAL_FAILURE(RegisterModel(/*big=*/true));
  ExpectMatchesHost(/*version=*/0);

  Pulled pulled = Pull({}, v1::DTYPE_UNSPECIFIED, v1::TENSOR_FIELD_UNSPECIFIED);
  ASSERT_TRUE(pulled.status.ok()) << pulled.status.error_message();
  EXPECT_EQ(pulled.malformed, "");
  EXPECT_EQ(pulled.header.dtype(), v1::DTYPE_FLOAT32);
  EXPECT_LE(pulled.max_message_payload, kMiB) << "default max_chunk_bytes is 1 MiB";
  EXPECT_GE(pulled.messages, 1 + (kBigRows * kBigCols * 4 + kMiB - 1) / kMiB);
  const struct {
    const char* name;
    std::vector<int64_t> shape;
    const char* group;
    uint64_t numel;
  } want[] = {{"big", {kBigRows, kBigCols}, "custom", kBigRows * kBigCols},
              {"scalar", {}, "custom", 1},
              {"w", {3, 5}, "default", 15},
              {"b", {7}, "default", 7},
              {"m", {40}, "ams", 40}};
  const v1::ListTensorsResponse list = ListTensors();
  EXPECT_EQ(list.version(), 0u);
  ASSERT_EQ(pulled.header.tensors_size(), 5);
  ASSERT_EQ(list.tensors_size(), 5);
  for (int i = 0; i < 5; ++i) {
    for (const v1::TensorInfo& info : {pulled.header.tensors(i), list.tensors(i)}) {
      EXPECT_EQ(info.name(), want[i].name);
      EXPECT_EQ(std::vector<int64_t>(info.shape().begin(), info.shape().end()), want[i].shape)
          << want[i].name;
      EXPECT_EQ(info.param_group(), want[i].group) << want[i].name;
      EXPECT_EQ(info.numel(), want[i].numel) << want[i].name;
      EXPECT_EQ(info.step(), 0) << want[i].name;
    }
  }

  const v1::GetInfoResponse info = GetInfo();
  EXPECT_EQ(info.version(), 0u);
  EXPECT_EQ(info.backend(), "cpu");
  EXPECT_NE(info.device(), "");
  EXPECT_NE(info.server_version(), "");
  EXPECT_EQ(info.tensor_count(), 5u);
  EXPECT_EQ(info.parameter_count(), TotalNumel());
  EXPECT_EQ(info.max_message_bytes(), uint64_t{8} << 20);
  EXPECT_EQ(info.param_copy_dtype(), v1::DTYPE_UNSPECIFIED);
  std::map<std::string, v1::Hyperparameters> groups;
  for (const v1::ParamGroup& g : info.param_groups()) groups[g.name()] = g.hyperparameters();
  ASSERT_EQ(groups.size(), 3u);
  for (const char* name : {"custom", "ams", "default"}) {
    ASSERT_TRUE(groups.count(name)) << name;
    EXPECT_EQ(groups[name].SerializeAsString(), ToProto(host_.group(name)).SerializeAsString())
        << name << ": " << groups[name].ShortDebugString();
  }

  // A subset, in the order asked for, in small chunks.
  Pulled subset = Pull({"m", "scalar", "w"}, v1::DTYPE_FLOAT32, v1::TENSOR_FIELD_PARAM, 64);
  ASSERT_TRUE(subset.status.ok()) << subset.status.error_message();
  EXPECT_EQ(subset.malformed, "");
  EXPECT_LE(subset.max_message_payload, 64u);
  ASSERT_EQ(subset.header.tensors_size(), 3);
  EXPECT_EQ(subset.header.tensors(0).name(), "m");
  EXPECT_EQ(subset.header.tensors(1).name(), "scalar");
  EXPECT_EQ(subset.header.tensors(2).name(), "w");
  for (const char* name : {"m", "scalar", "w"}) {
    ExpectSameBytes(subset.data[name], Encode(GradDType::kFloat32, host_.tensor(name).param), 4,
                    name);
  }
}

TEST_F(ServiceIntegrationTest, RegisterParamGroupIsIdempotentAndConflictsAreAlreadyExists) {
  ASSERT_NO_FATAL_FAILURE(RegisterGroup("custom", CustomHyperparameters()));
  v1::RegisterParamGroupRequest request;
  request.mutable_param_group()->set_name("custom");
  *request.mutable_param_group()->mutable_hyperparameters() = ToProto(CustomHyperparameters());
  v1::RegisterParamGroupResponse response;
  {
    grpc::ClientContext context;
    SetDeadline(context);
    ASSERT_TRUE(stub_->RegisterParamGroup(&context, request, &response).ok());
    EXPECT_FALSE(response.created());
  }
  // Unset fields take torch's defaults, and the response shows them filled in.
  v1::RegisterParamGroupRequest defaults;
  defaults.mutable_param_group()->set_name("plain");
  {
    grpc::ClientContext context;
    SetDeadline(context);
    ASSERT_TRUE(stub_->RegisterParamGroup(&context, defaults, &response).ok());
    EXPECT_TRUE(response.created());
    EXPECT_EQ(response.param_group().hyperparameters().SerializeAsString(),
              ToProto(AdamWHyperparameters{}).SerializeAsString())
        << response.param_group().ShortDebugString();
  }
  request.mutable_param_group()->mutable_hyperparameters()->set_lr(0.5);
  grpc::ClientContext context;
  SetDeadline(context);
  grpc::Status status = stub_->RegisterParamGroup(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_NE(status.error_message().find("'custom'"), std::string::npos) << status.error_message();
}

TEST_F(ServiceIntegrationTest, PushesInEveryDTypeMatchHostAdamW) {
  ASSERT_NO_FATAL_FAILURE(RegisterModel(/*big=*/true));
  const uint64_t numel = TotalNumel();

  v1::PushGradientsResponse ack = PushAndStep(MakePushHeader(v1::DTYPE_UNSPECIFIED, "t", 1),
                                              GradDType::kFloat32, RandomGrads(Names(), 100));
  EXPECT_EQ(ack.version(), 1u);
  EXPECT_EQ(ack.tensors_updated(), 5u);
  EXPECT_EQ(ack.grad_bytes(), numel * 4);
  EXPECT_FALSE(ack.step_skipped());
  EXPECT_EQ(ack.skip_reason(), "");
  EXPECT_FALSE(ack.duplicate());
  ASSERT_NO_FATAL_FAILURE(ExpectMatchesHost(1));

  // bf16 with loss scaling: the grads are 8x larger and divided by grad_scale on the server.
  ack = PushAndStep(MakePushHeader(v1::DTYPE_UNSPECIFIED, "t", 2), GradDType::kBFloat16,
                    RandomGrads(Names(), 200, 8.0f), /*grad_scale=*/8.0f);
  EXPECT_EQ(ack.version(), 2u);
  EXPECT_EQ(ack.tensors_updated(), 5u);
  EXPECT_EQ(ack.grad_bytes(), numel * 2);
  EXPECT_FALSE(ack.step_skipped());
  ASSERT_NO_FATAL_FAILURE(ExpectMatchesHost(2));

  ack = PushAndStep(MakePushHeader(v1::DTYPE_UNSPECIFIED, "t", 3), GradDType::kFloat16,
                    RandomGrads(Names(), 300));
  EXPECT_EQ(ack.version(), 3u);
  EXPECT_EQ(ack.grad_bytes(), numel * 2);
  ASSERT_NO_FATAL_FAILURE(ExpectMatchesHost(3));

  const v1::ListTensorsResponse list = ListTensors();
  EXPECT_EQ(list.version(), 3u);
  for (const v1::TensorInfo& t : list.tensors()) EXPECT_EQ(t.step(), 3) << t.name();
  EXPECT_EQ(GetInfo().version(), 3u);
}

TEST_F(ServiceIntegrationTest, SetHyperparametersChangesLrForTheNextPush) {
  ASSERT_NO_FATAL_FAILURE(RegisterModel(/*big=*/false));
  PushAndStep(MakePushHeader(v1::DTYPE_FLOAT32), GradDType::kFloat32, RandomGrads(Names(), 10));

  v1::SetHyperparametersRequest request;
  request.set_param_group("custom");
  request.mutable_hyperparameters()->set_lr(0.05);
  v1::SetHyperparametersResponse response;
  grpc::ClientContext context;
  SetDeadline(context);
  grpc::Status status = stub_->SetHyperparameters(&context, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  AdamWHyperparameters changed = CustomHyperparameters();
  changed.lr = 0.05;  // Only lr changes; the rest keeps its value.
  EXPECT_EQ(response.param_group().name(), "custom");
  EXPECT_EQ(response.param_group().hyperparameters().SerializeAsString(),
            ToProto(changed).SerializeAsString())
      << response.param_group().ShortDebugString();
  host_.SetGroup("custom", changed);

  v1::PushGradientsResponse ack =
      PushAndStep(MakePushHeader(v1::DTYPE_FLOAT32), GradDType::kFloat32, RandomGrads(Names(), 20));
  EXPECT_EQ(ack.version(), 2u);
  ExpectMatchesHost(2);
  const v1::GetInfoResponse info = GetInfo();
  for (const v1::ParamGroup& g : info.param_groups()) {
    if (g.name() == "custom") {
      EXPECT_EQ(g.hyperparameters().lr(), 0.05);
    } else if (g.name() == "default") {
      EXPECT_EQ(g.hyperparameters().lr(), 1e-3);
    }
  }
}

TEST_F(ServiceIntegrationTest, RetriedPushIsAppliedOnce) {
  ASSERT_NO_FATAL_FAILURE(RegisterModel(/*big=*/false));
  const std::map<std::string, std::vector<float>> grads = RandomGrads(Names(), 30);
  const std::vector<v1::PushGradientsRequest> push = Messages<v1::PushGradientsRequest>(
      MakePushHeader(v1::DTYPE_FLOAT32, "trainer-0", 1), GradChunks(GradDType::kFloat32, grads));
  auto [status, first] = Push(push);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_FALSE(first.duplicate());
  EXPECT_EQ(first.version(), 1u);
  for (const auto& [name, values] : grads) host_.Step(name, values, 0.0f);
  const ShardState applied = Snapshot();

  auto [retry_status, retry] = Push(push);  // The same client_id and sequence_number.
  ASSERT_TRUE(retry_status.ok()) << retry_status.error_message();
  EXPECT_TRUE(retry.duplicate());
  EXPECT_EQ(retry.version(), 1u);
  ExpectSameState(applied, Snapshot());

  // A lower sequence number is a retry too; other clients and untracked pushes are not.
  PushAndStep(MakePushHeader(v1::DTYPE_FLOAT32, "trainer-0", 2), GradDType::kFloat32, grads);
  const ShardState second = Snapshot();
  auto [old_status, old] = Push(push);
  ASSERT_TRUE(old_status.ok()) << old_status.error_message();
  EXPECT_TRUE(old.duplicate());
  ExpectSameState(second, Snapshot());
  EXPECT_FALSE(
      PushAndStep(MakePushHeader(v1::DTYPE_FLOAT32, "trainer-1", 1), GradDType::kFloat32, grads)
          .duplicate());
  for (int i = 0; i < 2; ++i) {
    EXPECT_FALSE(PushAndStep(MakePushHeader(v1::DTYPE_FLOAT32, "", 7), GradDType::kFloat32, grads)
                     .duplicate());
    EXPECT_FALSE(
        PushAndStep(MakePushHeader(v1::DTYPE_FLOAT32, "trainer-0", 0), GradDType::kFloat32, grads)
            .duplicate());
  }
  ExpectMatchesHost(7);
}

// The header of RegisterModel(false)'s tensors, as registered.
v1::RegisterTensorsHeader SameSpecs() {
  v1::RegisterTensorsHeader header;
  for (const TensorDef& def : std::vector<TensorDef>{// "" and "default" name the same group.
                                                     {"scalar", {}, "custom"},
                                                     {"w", {3, 5}, "default"},
                                                     {"b", {7}, ""},
                                                     {"m", {40}, "ams"}}) {
    v1::TensorSpec* spec = header.add_tensors();
    spec->set_name(def.name);
    for (int64_t d : def.shape) spec->add_shape(d);
    spec->set_param_group(def.param_group);
  }
  return header;
}

TEST_F(ServiceIntegrationTest, ReRegisteringTheSameSpecWithChunksIsANoOp) {
  ASSERT_NO_FATAL_FAILURE(RegisterModel(/*big=*/false));
  PushAndStep(MakePushHeader(v1::DTYPE_FLOAT32), GradDType::kFloat32, RandomGrads(Names(), 40));
  const ShardState before = Snapshot();

  // Other values for the same specs: checked, then ignored.
  std::vector<v1::TensorChunk> chunks;
  for (const HostModel::Tensor& t : host_.tensors()) {
    chunks.push_back(Chunk(t.def.name, 0, Encode(GradDType::kFloat32, RandomValues(t.numel, 9))));
  }
  v1::RegisterTensorsResponse response;
  grpc::Status status =
      RegisterTensors(Messages<v1::RegisterTensorsRequest>(SameSpecs(), chunks), &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.tensors_created(), 0u);
  EXPECT_EQ(response.tensors_existing(), 4u);
  EXPECT_EQ(response.version(), 1u);
  ExpectSameState(before, Snapshot());

  // One existing and one new tensor: only the new one is created.
  v1::RegisterTensorsHeader header;
  *header.add_tensors() = SameSpecs().tensors(1);
  v1::TensorSpec* fresh = header.add_tensors();
  fresh->set_name("c");
  fresh->add_shape(5);
  const std::vector<float> values = RandomValues(5, 11);
  status = RegisterTensors(
      Messages<v1::RegisterTensorsRequest>(
          header, {Chunk("c", 0, Encode(GradDType::kFloat32, values)),
                   Chunk("w", 0, Encode(GradDType::kFloat32, RandomValues(15, 12)))}),
      &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.tensors_created(), 1u);
  EXPECT_EQ(response.tensors_existing(), 1u);
  host_.AddTensor({"c", {5}, ""}, values);
  ExpectMatchesHost(1);
}

// The contract (proto/fusedps/v1): chunks cover every element of every NEW tensor.
TEST_F(ServiceIntegrationTest, ReRegisteringTheSameSpecWithoutChunksIsANoOp) {
  ASSERT_NO_FATAL_FAILURE(RegisterModel(/*big=*/false));
  PushAndStep(MakePushHeader(v1::DTYPE_FLOAT32), GradDType::kFloat32, RandomGrads(Names(), 40));
  const ShardState before = Snapshot();
  v1::RegisterTensorsResponse response;
  grpc::Status status =
      RegisterTensors(Messages<v1::RegisterTensorsRequest>(SameSpecs(), {}), &response);
  EXPECT_TRUE(status.ok()) << grpc::StatusCode(status.error_code()) << ": "
                           << status.error_message();
  EXPECT_EQ(response.tensors_created(), 0u);
  EXPECT_EQ(response.tensors_existing(), 4u);
  ExpectSameState(before, Snapshot());
}

TEST_F(ServiceIntegrationTest, ConflictingSpecIsAlreadyExistsAndChangesNothing) {
  ASSERT_NO_FATAL_FAILURE(RegisterModel(/*big=*/false));
  PushAndStep(MakePushHeader(v1::DTYPE_FLOAT32), GradDType::kFloat32, RandomGrads(Names(), 50));
  const ShardState before = Snapshot();
  struct Case {
    const char* what;
    TensorDef def;
  };
  for (const Case& c :
       {Case{"other shape", {"w", {5, 3}, ""}}, Case{"other group", {"b", {7}, "custom"}},
        Case{"0-dim becomes 1-dim", {"scalar", {1}, "custom"}}}) {
    SCOPED_TRACE(c.what);
    v1::RegisterTensorsHeader header;
    v1::TensorSpec* fresh = header.add_tensors();  // A new tensor before the conflict.
    fresh->set_name("fresh");
    fresh->add_shape(2);
    v1::TensorSpec* spec = header.add_tensors();
    spec->set_name(c.def.name);
    uint64_t numel = 1;
    for (int64_t d : c.def.shape) {
      spec->add_shape(d);
      numel *= d;
    }
    spec->set_param_group(c.def.param_group);
    v1::RegisterTensorsResponse response;
    grpc::Status status = RegisterTensors(
        Messages<v1::RegisterTensorsRequest>(
            header, {Chunk("fresh", 0, Encode(GradDType::kFloat32, {1, 2})),
                     Chunk(c.def.name, 0, Encode(GradDType::kFloat32, RandomValues(numel, 5)))}),
        &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::ALREADY_EXISTS) << status.error_message();
    EXPECT_NE(status.error_message().find("'" + c.def.name + "'"), std::string::npos)
        << status.error_message();
    ExpectSameState(before, Snapshot());
    EXPECT_EQ(GetInfo().tensor_count(), 4u);
  }
}

TEST_F(ServiceIntegrationTest, PushOfSomeTensorsAdvancesOnlyTheirSteps) {
  ASSERT_NO_FATAL_FAILURE(RegisterModel(/*big=*/true));
  PushAndStep(MakePushHeader(v1::DTYPE_FLOAT32), GradDType::kFloat32, RandomGrads(Names(), 60));
  const v1::PushGradientsResponse ack =
      PushAndStep(MakePushHeader(v1::DTYPE_FLOAT32, "", 0, {"w", "scalar"}), GradDType::kBFloat16,
                  RandomGrads({"w", "scalar"}, 70));
  EXPECT_EQ(ack.version(), 2u);
  EXPECT_EQ(ack.tensors_updated(), 2u);
  EXPECT_EQ(ack.grad_bytes(), (15u + 1u) * 2);
  const std::map<std::string, int64_t> want_steps = {
      {"big", 1}, {"scalar", 2}, {"w", 2}, {"b", 1}, {"m", 1}};
  std::map<std::string, int64_t> steps;
  const v1::ListTensorsResponse list = ListTensors();
  for (const v1::TensorInfo& t : list.tensors()) steps[t.name()] = t.step();
  EXPECT_EQ(steps, want_steps);
  ExpectMatchesHost(2);  // The other tensors' params and state are untouched.
}

// grpc.health.v1 through the C++ client library's health check.
TEST_F(ServiceIntegrationTest, HealthServiceAnswersServing) {
  absl::StatusOr<std::unique_ptr<client::Client>> client =
      client::Client::CreateWithChannel(channel_);
  ASSERT_TRUE(client.ok()) << client.status();
  for (const std::string service : {"", "fusedps.v1.ParameterService"}) {
    absl::StatusOr<bool> serving = (*client)->CheckHealth(service);
    ASSERT_TRUE(serving.ok()) << "'" << service << "': " << serving.status();
    EXPECT_TRUE(*serving) << "'" << service << "' is not SERVING";
  }
  EXPECT_EQ((*client)->CheckHealth("no.such.Service").status().code(), absl::StatusCode::kNotFound);
}

// 8 trainers push at once while a reader pulls: no push is lost or applied twice, and every
// pull is a consistent read of one version.
TEST_F(ServiceIntegrationTest, ConcurrentPushesAreEachAppliedOnce) {
  ASSERT_NO_FATAL_FAILURE(RegisterModel(/*big=*/false));
  constexpr int kThreads = 8, kPushesPerThread = 20, kPushes = kThreads * kPushesPerThread;
  // Every push carries the same grads, so the state at version v does not depend on the order
  // of arrival: it is v steps with these grads.
  const std::map<std::string, std::vector<float>> grads = RandomGrads(Names(), 80);
  const std::vector<v1::TensorChunk> chunks = GradChunks(GradDType::kFloat32, grads, 16);
  std::vector<std::vector<uint64_t>> versions(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      for (int n = 1; n <= kPushesPerThread; ++n) {
        auto [status, ack] = Push(Messages<v1::PushGradientsRequest>(
            MakePushHeader(v1::DTYPE_FLOAT32, "worker-" + std::to_string(i), n), chunks));
        EXPECT_TRUE(status.ok()) << status.error_message();
        EXPECT_FALSE(ack.duplicate());
        EXPECT_FALSE(ack.step_skipped());
        versions[i].push_back(ack.version());
      }
    });
  }
  std::atomic<bool> pushing{true};
  std::vector<Pulled> pulls;
  std::thread reader([&] {
    while (pushing.load() && pulls.size() < 1000) {
      pulls.push_back(Pull({}, v1::DTYPE_FLOAT32));
      EXPECT_TRUE(pulls.back().status.ok()) << pulls.back().status.error_message();
    }
  });
  for (std::thread& t : threads) t.join();
  pushing = false;
  reader.join();

  std::set<uint64_t> all;
  for (const std::vector<uint64_t>& v : versions) {
    EXPECT_TRUE(std::is_sorted(v.begin(), v.end()));
    all.insert(v.begin(), v.end());
  }
  EXPECT_EQ(all.size(), size_t{kPushes}) << "two pushes were acknowledged with the same version";
  EXPECT_EQ(*all.begin(), 1u);
  EXPECT_EQ(*all.rbegin(), uint64_t{kPushes});

  std::multimap<uint64_t, const Pulled*> pulls_by_version;
  for (const Pulled& p : pulls) pulls_by_version.emplace(p.header.version(), &p);
  for (int version = 0; version <= kPushes; ++version) {
    auto [begin, end] = pulls_by_version.equal_range(version);
    for (auto it = begin; it != end; ++it) {
      const Pulled& p = *it->second;
      EXPECT_EQ(p.malformed, "");
      for (const v1::TensorInfo& info : p.header.tensors()) {
        EXPECT_EQ(info.step(), version) << info.name() << " in a pull of version " << version;
        ExpectSameBytes(p.data.at(info.name()),
                        Encode(GradDType::kFloat32, host_.tensor(info.name()).param), 4,
                        "'" + info.name() + "' pulled at version " + std::to_string(version));
      }
    }
    if (version == kPushes) break;
    for (const auto& [name, values] : grads) host_.Step(name, values, 0.0f);
  }
  std::cout << "[ INFO     ] " << pulls.size() << " pulls during the pushes\n";

  const v1::ListTensorsResponse list = ListTensors();
  EXPECT_EQ(list.version(), uint64_t{kPushes});
  for (const v1::TensorInfo& t : list.tensors()) EXPECT_EQ(t.step(), kPushes) << t.name();
  ExpectMatchesHost(kPushes);
}

TEST_F(ServiceIntegrationTest, EmptyTensorIsRegisteredAndStepped) {
  ASSERT_NO_FATAL_FAILURE(RegisterTensors({{"x", {3}, ""}, {"empty", {2, 0}, ""}}));
  Pulled pulled = Pull({"empty"}, v1::DTYPE_FLOAT32);
  ASSERT_TRUE(pulled.status.ok()) << pulled.status.error_message();
  ASSERT_EQ(pulled.header.tensors_size(), 1);
  EXPECT_EQ(pulled.header.tensors(0).numel(), 0u);
  EXPECT_EQ(pulled.malformed, "");
  const v1::PushGradientsResponse ack =
      PushAndStep(MakePushHeader(v1::DTYPE_FLOAT32), GradDType::kFloat32,
                  {{"x", RandomValues(3, 1)}, {"empty", {}}});
  EXPECT_EQ(ack.version(), 1u);
  EXPECT_EQ(ack.tensors_updated(), 2u);
  ExpectMatchesHost(1);
}

// With --param-copy-dtype=bf16 the bf16 pull reads the copy that the update writes.
class BFloat16CopyTest : public ServiceIntegrationTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = ServiceTest::Options();
    options.backend.param_copy_dtype = ParamCopyDType::kBFloat16;
    return options;
  }
};

TEST_F(BFloat16CopyTest, BFloat16PullsReadTheCopy) {
  EXPECT_EQ(GetInfo().param_copy_dtype(), v1::DTYPE_BFLOAT16);
  ASSERT_NO_FATAL_FAILURE(RegisterModel(/*big=*/false));
  ExpectMatchesHost(0);
  PushAndStep(MakePushHeader(v1::DTYPE_FLOAT32), GradDType::kFloat16, RandomGrads(Names(), 90));
  ExpectMatchesHost(1);
}

}  // namespace
}  // namespace fusedps::integration
