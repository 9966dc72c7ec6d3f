// Tests of the Client over real gRPC, against a small fake ParameterService in this process that
// checks every chunk. The real server's integration tests live in tests/.
#include "fusedps/client.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/wire.h"
#include "fusedps/v1/parameter_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/adamw_math.h"

namespace fusedps::client {
namespace {

// A minimal in-memory ParameterService: fp32 tensors, "SGD with lr 1" pushes (param -= grad),
// strict chunk checks, and knobs to misbehave. Element conversions use kernels/adamw_math.h,
// as the real server does, not the client's code.
class FakeParameterService final : public v1::ParameterService::Service {
 public:
  struct Tensor {
    std::vector<int64_t> shape;
    std::string param_group;
    std::vector<float> values;
    int64_t step = 0;
  };

  grpc::Status RegisterParamGroup(grpc::ServerContext*,
                                  const v1::RegisterParamGroupRequest* request,
                                  v1::RegisterParamGroupResponse* response) override {
    response->set_created(true);
    *response->mutable_param_group() = request->param_group();
    response->mutable_param_group()->mutable_hyperparameters()->set_lr(
        request->param_group().hyperparameters().has_lr()
            ? request->param_group().hyperparameters().lr()
            : 1e-3);
    return grpc::Status::OK;
  }

  grpc::Status RegisterTensors(grpc::ServerContext* context,
                               grpc::ServerReader<v1::RegisterTensorsRequest>* reader,
                               v1::RegisterTensorsResponse* response) override {
    NotePeer(context);
    std::map<std::string, Tensor> incoming;
    Received received;
    v1::RegisterTensorsRequest request;
    for (bool first = true; reader->Read(&request); first = false) {
      NoteRequest(request.ByteSizeLong());
      if (first != request.has_header()) return Invalid("header must come first, once");
      for (const v1::TensorSpec& spec : request.header().tensors()) {
        Tensor& tensor = incoming[spec.name()];
        tensor.shape.assign(spec.shape().begin(), spec.shape().end());
        tensor.param_group = spec.param_group().empty() ? "default" : spec.param_group();
        tensor.values.resize(internal::NumElements(tensor.shape).value());
        received.targets[spec.name()] = &tensor.values;
      }
      for (const v1::TensorChunk& chunk : request.chunks()) {
        if (grpc::Status s = received.Add(chunk, GradDType::kFloat32); !s.ok()) return s;
      }
    }
    if (grpc::Status s = received.Finish(); !s.ok()) return s;
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [name, tensor] : incoming) tensors_[name] = std::move(tensor);
    response->set_tensors_created(static_cast<uint32_t>(incoming.size()));
    response->set_version(version_);
    return grpc::Status::OK;
  }

  grpc::Status PushGradients(grpc::ServerContext* context,
                             grpc::ServerReader<v1::PushGradientsRequest>* reader,
                             v1::PushGradientsResponse* response) override {
    NotePeer(context);
    std::lock_guard<std::mutex> lock(mu_);
    push_messages_ = 0;
    std::map<std::string, std::vector<float>> grads;
    Received received;
    GradDType dtype = GradDType::kFloat32;
    v1::PushGradientsRequest request;
    for (bool first = true; reader->Read(&request); first = false) {
      NoteRequest(request.ByteSizeLong());
      ++push_messages_;
      if (first != request.has_header()) return Invalid("header must come first, once");
      if (first) {
        dtype = static_cast<GradDType>(request.header().grad_dtype());
        last_push_header_ = request.header();
      }
      for (const std::string& name : request.header().tensors()) {
        auto it = tensors_.find(name);
        if (it == tensors_.end()) {
          return grpc::Status(grpc::StatusCode::NOT_FOUND, "no tensor named " + name);
        }
        grads[name].resize(it->second.values.size());
        received.targets[name] = &grads[name];
      }
      for (const v1::TensorChunk& chunk : request.chunks()) {
        if (grpc::Status s = received.Add(chunk, dtype); !s.ok()) return s;
      }
    }
    if (grpc::Status s = received.Finish(); !s.ok()) return s;
    for (const auto& [name, grad] : grads) {
      Tensor& tensor = tensors_[name];
      for (size_t i = 0; i < grad.size(); ++i) tensor.values[i] -= grad[i];
      ++tensor.step;
    }
    response->set_version(++version_);
    response->set_tensors_updated(static_cast<uint32_t>(grads.size()));
    response->set_grad_bytes(received.bytes);
    return grpc::Status::OK;
  }

  grpc::Status PullParameters(grpc::ServerContext* context,
                              const v1::PullParametersRequest* request,
                              grpc::ServerWriter<v1::PullParametersResponse>* writer) override {
    NotePeer(context);
    std::lock_guard<std::mutex> lock(mu_);
    const bool bf16 = request->dtype() == v1::DTYPE_BFLOAT16;
    std::vector<std::string> names(request->tensors().begin(), request->tensors().end());
    if (names.empty()) {
      for (const auto& [name, tensor] : tensors_) names.push_back(name);
    }
    v1::PullParametersResponse response;
    response.mutable_header()->set_version(version_);
    response.mutable_header()->set_dtype(bf16 ? v1::DTYPE_BFLOAT16 : v1::DTYPE_FLOAT32);
    for (const std::string& name : names) {
      auto it = tensors_.find(name);
      if (it == tensors_.end()) {
        return grpc::Status(grpc::StatusCode::NOT_FOUND, "no tensor named " + name);
      }
      v1::TensorInfo* info = response.mutable_header()->add_tensors();
      info->set_name(name);
      info->mutable_shape()->Add(it->second.shape.begin(), it->second.shape.end());
      info->set_param_group(it->second.param_group);
      info->set_step(it->second.step);
      info->set_numel(it->second.values.size());
    }
    writer->Write(response);
    const uint64_t per_chunk = request->max_chunk_bytes() / (bf16 ? 2 : 4);
    for (const std::string& name : names) {
      const std::vector<float>& values = tensors_[name].values;
      // Last chunk first: the client must not depend on order.
      const uint64_t chunks = (values.size() + per_chunk - 1) / per_chunk;
      for (uint64_t c = chunks; c-- > (drop_first_pull_chunk_ ? 1 : 0);) {
        response.Clear();
        v1::TensorChunk* chunk = response.add_chunks();
        chunk->set_tensor(name);
        chunk->set_offset(c * per_chunk);
        const uint64_t n = std::min<uint64_t>(per_chunk, values.size() - c * per_chunk);
        for (uint64_t i = c * per_chunk; i < c * per_chunk + n; ++i) {
          if (bf16) {
            const uint16_t element = FloatToBFloat16(values[i]);
            chunk->mutable_data()->append(reinterpret_cast<const char*>(&element), 2);
          } else {
            chunk->mutable_data()->append(reinterpret_cast<const char*>(&values[i]), 4);
          }
        }
        writer->Write(response);
      }
    }
    return grpc::Status::OK;
  }

  grpc::Status GetInfo(grpc::ServerContext*, const v1::GetInfoRequest*,
                       v1::GetInfoResponse* response) override {
    std::lock_guard<std::mutex> lock(mu_);
    response->set_version(version_);
    response->set_backend("fake");
    response->set_tensor_count(static_cast<uint32_t>(tensors_.size()));
    return grpc::Status::OK;
  }

  grpc::Status ListTensors(grpc::ServerContext*, const v1::ListTensorsRequest*,
                           v1::ListTensorsResponse* response) override {
    std::lock_guard<std::mutex> lock(mu_);
    response->set_version(version_);
    for (const auto& [name, tensor] : tensors_) {
      v1::TensorInfo* info = response->add_tensors();
      info->set_name(name);
      info->mutable_shape()->Add(tensor.shape.begin(), tensor.shape.end());
      info->set_numel(tensor.values.size());
      info->set_step(tensor.step);
    }
    return grpc::Status::OK;
  }

  grpc::Status SetHyperparameters(grpc::ServerContext*,
                                  const v1::SetHyperparametersRequest* request,
                                  v1::SetHyperparametersResponse* response) override {
    if (request->param_group() != "default") {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          "no param group named " + request->param_group());
    }
    response->mutable_param_group()->set_name("default");
    *response->mutable_param_group()->mutable_hyperparameters() = request->hyperparameters();
    return grpc::Status::OK;
  }

  std::map<std::string, Tensor> tensors() {
    std::lock_guard<std::mutex> lock(mu_);
    return tensors_;
  }
  size_t max_request_bytes() {
    std::lock_guard<std::mutex> lock(request_mu_);
    return max_request_bytes_;
  }
  size_t peer_count() {
    std::lock_guard<std::mutex> lock(request_mu_);
    return peers_.size();
  }
  int push_messages() { return push_messages_; }
  const v1::PushHeader& last_push_header() { return last_push_header_; }
  void drop_first_pull_chunk() { drop_first_pull_chunk_ = true; }

 private:
  // The chunks of one call, scattered into fp32 arrays; every element exactly once.
  struct Received {
    std::map<std::string, std::vector<float>*> targets;
    std::map<std::string, std::vector<bool>> seen;
    uint64_t bytes = 0;

    grpc::Status Add(const v1::TensorChunk& chunk, GradDType dtype) {
      auto it = targets.find(chunk.tensor());
      if (it == targets.end()) return Invalid("chunk of an unnamed tensor " + chunk.tensor());
      std::vector<float>& values = *it->second;
      std::vector<bool>& seen_elements = seen[chunk.tensor()];
      seen_elements.resize(values.size());
      const size_t size = DTypeSize(dtype);
      const uint64_t n = chunk.data().size() / size;
      if (n == 0 || chunk.data().size() % size != 0 || chunk.offset() + n > values.size()) {
        return Invalid("bad chunk of " + chunk.tensor());
      }
      for (uint64_t i = 0; i < n; ++i) {
        if (seen_elements[chunk.offset() + i]) return Invalid("overlap in " + chunk.tensor());
        seen_elements[chunk.offset() + i] = true;
        values[chunk.offset() + i] = LoadGrad(chunk.data().data(), dtype, i);
      }
      bytes += chunk.data().size();
      return grpc::Status::OK;
    }
    grpc::Status Finish() {
      for (const auto& [name, values] : targets) {
        const std::vector<bool>& seen_elements = seen[name];
        if (std::count(seen_elements.begin(), seen_elements.end(), true) !=
            static_cast<int64_t>(values->size())) {
          return Invalid("missing elements of " + name);
        }
      }
      return grpc::Status::OK;
    }
  };

  static grpc::Status Invalid(const std::string& message) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, message);
  }
  void NoteRequest(size_t bytes) {
    std::lock_guard<std::mutex> lock(request_mu_);
    max_request_bytes_ = std::max(max_request_bytes_, bytes);
  }
  void NotePeer(grpc::ServerContext* context) {
    std::lock_guard<std::mutex> lock(request_mu_);
    peers_.insert(context->peer());
  }

  std::mutex mu_;
  std::mutex request_mu_;
  std::map<std::string, Tensor> tensors_;
  uint64_t version_ = 0;
  size_t max_request_bytes_ = 0;
  std::set<std::string> peers_;
  int push_messages_ = 0;
  v1::PushHeader last_push_header_;
  bool drop_first_pull_chunk_ = false;
};

class ClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    builder.SetMaxReceiveMessageSize(static_cast<int>(internal::kMaxMessageBytes));
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_NE(port_, 0);
  }
  void TearDown() override { server_->Shutdown(); }

  std::unique_ptr<Client> Connect(ClientOptions options = {}) {
    options.timeout = absl::Seconds(30);
    return Client::Create(absl::StrCat("127.0.0.1:", port_), options).value();
  }

  FakeParameterService service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

std::vector<float> Normal(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(n);
  for (float& v : values) v = normal(rng);
  return values;
}

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
  const std::vector<float>& stored = service_.tensors().at("big").values;
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
  EXPECT_EQ(Client::CreateWithChannel(nullptr).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ClientTest, MalformedPullIsInternal) {
  std::unique_ptr<Client> client = Connect();
  const std::vector<float> values = Normal(1 << 20, 8);
  ASSERT_TRUE(client->RegisterTensors({{"w", {1 << 20}, "", values}}).ok());
  service_.drop_first_pull_chunk();
  EXPECT_EQ(client->PullParameters({}).status().code(), absl::StatusCode::kInternal);
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
