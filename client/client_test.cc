// Tests of the Client over real gRPC, against a small fake ParameterService in this process that
// checks every chunk (client/fake_parameter_service.h). Deadlines and keepalive are tested in
// client_deadline_test.cc; the real server's integration tests live in tests/.
#include "fusedps/client.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client_test_util.h"
#include "client/fake_parameter_service.h"
#include "client/wire.h"
#include "common/half_float.h"
#include "fusedps/v1/parameter_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace fusedps::client {
namespace {

using testing::FakeParameterService;
using testing::Normal;

class ClientTest : public testing::FakeServerTest {};

float RoundTrip(float value, DType dtype) {
  if (dtype == DType::kBFloat16) return BFloat16ToFloat(FloatToBFloat16(value));
  if (dtype == DType::kFloat16) return Float16ToFloat(FloatToFloat16(value));
  return value;
}

class ClientRoundTripTest : public ClientTest, public ::testing::WithParamInterface<DType> {};

TEST_P(ClientRoundTripTest, RegisterPushPull) {
  const DType dtype = GetParam();
  ClientOptions options;
  options.max_chunk_bytes = 4096;
  std::unique_ptr<Client> client = Connect(options);
  const std::vector<float> w = Normal(300 * 1001, 1), b = Normal(7, 2), scalar = {0.5f};
  ASSERT_TRUE(client
                  ->RegisterTensors({{"w", {300, 1001}, "", w},
                                     {"b", {7}, "", b},
                                     {"scalar", {}, "", scalar},
                                     {"empty", {0, 3}, "", {}}})
                  .ok());
  EXPECT_LE(service_.max_request_bytes(), 4096 + internal::kMaxChunkMetadataBytes + 1024);

  const std::vector<float> grad_w = Normal(w.size(), 3), grad_b = Normal(b.size(), 4);
  PushOptions push;
  push.grad_dtype = dtype;
  push.grad_scale = 2.0f;
  push.base_version = 0;
  absl::StatusOr<PushResult> ack = client->PushGradients(
      push, {{"w", grad_w}, {"b", grad_b}, {"scalar", scalar}, {"empty", {}}});
  ASSERT_TRUE(ack.ok()) << ack.status();
  EXPECT_EQ(ack->version, 1u);
  EXPECT_EQ(ack->tensors_updated, 4u);
  EXPECT_EQ(ack->grad_bytes, (w.size() + b.size() + 1) * ElementBytes(dtype));
  EXPECT_TRUE(service_.last_push_header().has_grad_scale());
  EXPECT_EQ(service_.last_push_header().grad_dtype(), internal::ToProtoDType(dtype));

  absl::StatusOr<PullResult> pulled = client->PullParameters({});
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(pulled->version, 1u);
  ASSERT_EQ(pulled->tensors.size(), 4u);
  const PulledTensor& pulled_w = pulled->tensors.at("w");
  EXPECT_EQ(pulled_w.shape, (std::vector<int64_t>{300, 1001}));
  EXPECT_EQ(pulled_w.step, 1);
  ASSERT_EQ(pulled_w.values.size(), w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    ASSERT_EQ(pulled_w.values[i], w[i] - RoundTrip(grad_w[i], dtype)) << "element " << i;
  }
  EXPECT_EQ(pulled->tensors.at("b").values[6], b[6] - RoundTrip(grad_b[6], dtype));
  EXPECT_EQ(pulled->tensors.at("scalar").values, std::vector<float>{0.0f});
  EXPECT_TRUE(pulled->tensors.at("empty").values.empty());
  EXPECT_EQ(pulled->tensors.at("empty").shape, (std::vector<int64_t>{0, 3}));
}

INSTANTIATE_TEST_SUITE_P(GradDTypes, ClientRoundTripTest,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return info.param == DType::kFloat32    ? "Float32"
                                  : info.param == DType::kBFloat16 ? "BFloat16"
                                                                   : "Float16";
                         });

TEST_F(ClientTest, PushOfThreeMillionFloatsUsesMebibyteMessages) {
  std::unique_ptr<Client> client = Connect();
  const std::vector<float> values = Normal(3'000'000, 5);
  ASSERT_TRUE(client->RegisterTensors({{"big", {3'000'000}, "", values}}).ok());
  PushOptions push;  // bf16 on the wire by default.
  ASSERT_TRUE(client->PushGradients(push, {{"big", values}}).ok());
  EXPECT_EQ(service_.last_push_header().grad_dtype(), v1::DTYPE_BFLOAT16);
  EXPECT_EQ(service_.push_messages(), 6);  // ceil(6e6 bytes / 1 MiB), header in the first.
  EXPECT_LE(service_.max_request_bytes(), (1u << 20) + 1024);
  const std::vector<float> stored = service_.tensors().at("big").values;
  EXPECT_EQ(stored[2'999'999], values[2'999'999] - RoundTrip(values[2'999'999], DType::kBFloat16));
}

TEST_F(ClientTest, ManyTensorsWithLongNamesSendALargeHeaderAlone) {
  std::unique_ptr<Client> client = Connect();
  const std::vector<float> one = {1.0f};
  std::vector<std::string> names;
  for (int i = 0; i < 3000; ++i) names.push_back(absl::StrCat(std::string(200, 'x'), i));
  std::vector<TensorInit> inits;
  std::vector<TensorGrad> grads;
  for (const std::string& name : names) {
    inits.push_back({name, {}, "", one});
    grads.push_back({name, one});
  }
  ASSERT_TRUE(client->RegisterTensors(inits).ok());
  absl::StatusOr<PushResult> ack = client->PushGradients({}, grads);
  ASSERT_TRUE(ack.ok()) << ack.status();
  EXPECT_EQ(ack->tensors_updated, 3000u);
  // The header alone, then chunks bounded by their names: 282 per message.
  EXPECT_EQ(service_.push_messages(), 1 + (3000 + 281) / 282);
  EXPECT_EQ(service_.tensors().at(names[2999]).values, std::vector<float>{0.0f});
}

TEST_F(ClientTest, PullsBFloat16AndSelectedTensors) {
  std::unique_ptr<Client> client = Connect();
  const std::vector<float> a = Normal(1000, 6), b = Normal(10, 7);
  ASSERT_TRUE(client->RegisterTensors({{"a", {1000}, "", a}, {"b", {10}, "", b}}).ok());
  PullOptions options;
  options.tensors = {"a"};
  options.dtype = DType::kBFloat16;
  absl::StatusOr<PullResult> pulled = client->PullParameters(options);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  ASSERT_EQ(pulled->tensors.size(), 1u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(pulled->tensors.at("a").values[i], RoundTrip(a[i], DType::kBFloat16));
  }
}

TEST_F(ClientTest, StreamsSplitRegistrationAndPullsOverConnections) {
  ClientOptions options;
  options.streams = 3;
  options.max_chunk_bytes = 1000;
  std::unique_ptr<Client> client = Connect(options);
  std::vector<std::vector<float>> values;
  std::vector<TensorInit> inits;
  for (int i = 0; i < 9; ++i) values.push_back(Normal(100 * (i + 1), 10 + i));
  for (int i = 0; i < 9; ++i) {
    inits.push_back(
        {absl::StrCat("t", i), {static_cast<int64_t>(values[i].size())}, "", values[i]});
  }
  absl::StatusOr<RegisterTensorsResult> registered = client->RegisterTensors(inits);
  ASSERT_TRUE(registered.ok()) << registered.status();
  EXPECT_EQ(registered->tensors_created, 9u);
  EXPECT_EQ(service_.peer_count(), 3u);
  absl::StatusOr<PullResult> pulled = client->PullParameters({});
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  ASSERT_EQ(pulled->tensors.size(), 9u);
  for (int i = 0; i < 9; ++i) EXPECT_EQ(pulled->tensors.at(absl::StrCat("t", i)).values, values[i]);
}

TEST_F(ClientTest, ServerErrorsKeepCodeAndMessage) {
  std::unique_ptr<Client> client = Connect();
  ParamGroupOptions changes;
  changes.lr = 0.1;
  absl::StatusOr<ParamGroup> group = client->SetHyperparameters("nope", changes);
  EXPECT_EQ(group.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(group.status().message(), "no param group named nope");
  const std::vector<float> grads = {1.0f};
  EXPECT_EQ(client->PushGradients({}, {{"missing", grads}}).status().code(),
            absl::StatusCode::kNotFound);
  absl::StatusOr<ParamGroup> changed = client->SetHyperparameters("default", changes);
  ASSERT_TRUE(changed.ok());
  EXPECT_EQ(changed->hyperparameters.lr, 0.1);
  EXPECT_FALSE(changed->hyperparameters.beta1.has_value());
}

TEST_F(ClientTest, BadArgumentsFailBeforeAnyCall) {
  std::unique_ptr<Client> client = Connect();
  const std::vector<float> three = {1, 2, 3};
  EXPECT_EQ(client->RegisterTensors({{"w", {2, 2}, "", three}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->RegisterTensors({{"w", {-3}, "", three}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->RegisterTensors({}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->RegisterTensors({{"w", {3}, "", three}, {"w", {3}, "", three}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->PushGradients({}, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(service_.max_request_bytes(), 0u);

  ClientOptions options;
  options.max_chunk_bytes = 2;
  EXPECT_EQ(Client::Create("127.0.0.1:1", options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = {};
  options.streams = 0;
  EXPECT_EQ(Client::Create("127.0.0.1:1", options).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Client::Create("").status().code(), absl::StatusCode::kInvalidArgument);
  // gRPC would take "50051x" as port 50051: a typo must not reach another port.
  for (const char* bad : {"127.0.0.1:50051x", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:70000",
                          ":50051", "host:port", "[::1:50051"}) {
    const absl::Status status = Client::Create(bad).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(status.message().find(bad), std::string::npos) << status;
  }
  for (const char* good : {"localhost:50051", "[::1]:50051", "dns:///ps-0:50051",
                           "unix:/tmp/fusedps.sock", "ipv4:127.0.0.1:50051", "ps-0.ns.svc:1"}) {
    EXPECT_TRUE(Client::Create(good).ok()) << good;
  }
  EXPECT_EQ(Client::CreateWithChannel(nullptr).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ClientTest, MalformedPullIsInternal) {
  std::unique_ptr<Client> client = Connect();
  const std::vector<float> values = Normal(1 << 20, 8);
  ASSERT_TRUE(client->RegisterTensors({{"w", {1 << 20}, "", values}}).ok());
  service_.drop_first_pull_chunk();
  EXPECT_EQ(client->PullParameters({}).status().code(), absl::StatusCode::kInternal);
}

TEST_F(ClientTest, NoTensorCountMeansTheHeaderHoldsThemAll) {
  service_.legacy_pull();
  std::unique_ptr<Client> client = Connect();
  const std::vector<float> a = Normal(100, 11), b = Normal(3, 12), c = Normal(5, 13);
  ASSERT_TRUE(
      client->RegisterTensors({{"a", {100}, "", a}, {"b", {3}, "", b}, {"c", {5}, "", c}}).ok());
  absl::StatusOr<PullResult> pulled = client->PullParameters({});
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(service_.max_pull_infos_per_message(), 3);
  EXPECT_EQ(pulled->tensors.at("a").values, a);
  EXPECT_EQ(pulled->tensors.at("c").values, c);
}

TEST_F(ClientTest, PullTakesTensorInfoContinuedPastTheHeader) {
  std::unique_ptr<Client> client = Connect();
  std::vector<std::vector<float>> values;
  std::vector<TensorInit> inits;
  for (int i = 0; i < 7; ++i) values.push_back(Normal(10 + i, 20 + i));
  for (int i = 0; i < 7; ++i) {
    inits.push_back(
        {absl::StrCat("t", i), {static_cast<int64_t>(values[i].size())}, "", values[i]});
  }
  ASSERT_TRUE(client->RegisterTensors(inits).ok());
  absl::StatusOr<PullResult> pulled = client->PullParameters({});
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  // The header held 2 of the 7; 3 more messages held the rest.
  EXPECT_EQ(service_.max_pull_infos_per_message(), FakeParameterService::kPullInfosPerMessage);
  ASSERT_EQ(pulled->tensors.size(), 7u);
  for (int i = 0; i < 7; ++i) {
    EXPECT_EQ(pulled->tensors.at(absl::StrCat("t", i)).values, values[i]) << i;
    EXPECT_EQ(pulled->tensors.at(absl::StrCat("t", i)).shape,
              std::vector<int64_t>{static_cast<int64_t>(values[i].size())});
  }
}

TEST_F(ClientTest, ChunkBeforeItsTensorInfoIsMalformed) {
  service_.pull_chunk_before_info();
  std::unique_ptr<Client> client = Connect();
  const std::vector<float> one = {1.0f};
  ASSERT_TRUE(
      client->RegisterTensors({{"a", {}, "", one}, {"b", {}, "", one}, {"c", {}, "", one}}).ok());
  absl::StatusOr<PullResult> pulled = client->PullParameters({});
  EXPECT_EQ(pulled.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(pulled.status().message(), "malformed pull reply: a chunk of c before its TensorInfo");
}

TEST_F(ClientTest, TensorInfoShortOfTensorCountIsMalformed) {
  service_.pull_tensor_count_surplus(1);
  std::unique_ptr<Client> client = Connect();
  const std::vector<float> one = {1.0f};
  ASSERT_TRUE(client->RegisterTensors({{"a", {}, "", one}, {"b", {}, "", one}}).ok());
  absl::StatusOr<PullResult> pulled = client->PullParameters({});
  EXPECT_EQ(pulled.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(pulled.status().message(),
            "malformed pull reply: 2 TensorInfo, not its tensor_count of 3");
}

TEST_F(ClientTest, PullAsksForAChunkSizeInTheWireBounds) {
  ClientOptions options;
  options.max_chunk_bytes = 4;  // Below a pull's 16-byte minimum.
  std::unique_ptr<Client> client = Connect(options);
  const std::vector<float> values = Normal(50, 14);
  ASSERT_TRUE(client->RegisterTensors({{"w", {50}, "", values}}).ok());
  absl::StatusOr<PullResult> pulled = client->PullParameters({});
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(pulled->tensors.at("w").values, values);
}

TEST_F(ClientTest, ListTensorsFollowsPagesToTheEnd) {
  std::unique_ptr<Client> client = Connect();
  const std::vector<float> one = {1.0f};
  std::vector<std::string> names;
  std::vector<TensorInit> inits;
  for (int i = 0; i < 10; ++i) names.push_back(absl::StrCat("layer", 9 - i, ".weight"));
  for (const std::string& name : names) inits.push_back({name, {}, "", one});
  ASSERT_TRUE(client->RegisterTensors(inits).ok());
  absl::StatusOr<TensorList> list = client->ListTensors();
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(service_.list_calls(), 4);  // Pages of 3, 3, 3 and 1.
  ASSERT_EQ(list->tensors.size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) EXPECT_EQ(list->tensors[i].name, names[i]);

  // A pull over several streams lists first: it needs every page too.
  ClientOptions options;
  options.streams = 2;
  absl::StatusOr<PullResult> pulled = Connect(options)->PullParameters({});
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(pulled->tensors.size(), names.size());
}

TEST_F(ClientTest, ListTensorsOfAnEmptyServerIsOnePage) {
  absl::StatusOr<TensorList> list = Connect()->ListTensors();
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_TRUE(list->tensors.empty());
  EXPECT_EQ(service_.list_calls(), 1);
}

TEST_F(ClientTest, WorksOverAGivenChannel) {
  grpc::ChannelArguments args;
  std::unique_ptr<Client> client =
      Client::CreateWithChannel(server_->InProcessChannel(args)).value();
  absl::StatusOr<ServerInfo> info = client->GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->backend, "fake");
  EXPECT_FALSE(info->param_copy_dtype.has_value());
}

TEST(ClientUnreachableTest, CallsFailWithUnavailable) {
  ClientOptions options;
  options.timeout = absl::Seconds(20);
  std::unique_ptr<Client> client = Client::Create("127.0.0.1:1", options).value();
  EXPECT_EQ(client->GetInfo().status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace fusedps::client
