#include "tests/integration/service_harness.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <random>

#include "grpc/grpc.h"

namespace fusedps::integration {

std::vector<float> RandomValues(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> values(n);
  for (float& v : values) v = dist(rng);
  return values;
}

int ElementSize(GradDType dtype) { return DTypeSize(dtype); }

std::string Encode(GradDType dtype, const std::vector<float>& values) {
  std::string bytes(values.size() * ElementSize(dtype), '\0');
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == GradDType::kFloat32) {
      std::memcpy(&bytes[i * 4], &values[i], 4);
    } else {
      const uint16_t half =
          dtype == GradDType::kBFloat16 ? FloatToBFloat16(values[i]) : FloatToFloat16(values[i]);
      std::memcpy(&bytes[i * 2], &half, 2);
    }
  }
  return bytes;
}

std::vector<float> RoundTrip(GradDType dtype, const std::vector<float>& values) {
  const std::string bytes = Encode(dtype, values);
  std::vector<float> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = LoadGrad(bytes.data(), dtype, i);
  return out;
}

v1::TensorChunk Chunk(const std::string& tensor, uint64_t offset, std::string data) {
  v1::TensorChunk chunk;
  chunk.set_tensor(tensor);
  chunk.set_offset(offset);
  chunk.set_data(std::move(data));
  return chunk;
}

std::vector<v1::TensorChunk> SplitIntoChunks(const std::string& tensor, const std::string& bytes,
                                             int element_size, size_t chunk_bytes) {
  const size_t step = chunk_bytes / element_size * element_size;
  std::vector<v1::TensorChunk> chunks;
  for (size_t begin = 0; begin < bytes.size(); begin += step) {
    chunks.push_back(Chunk(tensor, begin / element_size,
                           bytes.substr(begin, std::min(step, bytes.size() - begin))));
  }
  return chunks;
}

void Shuffle(std::vector<v1::TensorChunk>& chunks, uint32_t seed) {
  std::mt19937 rng(seed);
  std::shuffle(chunks.begin(), chunks.end(), rng);
}

std::vector<std::vector<v1::TensorChunk>> ShareChunks(const std::vector<v1::TensorChunk>& chunks,
                                                      uint32_t count) {
  std::vector<std::vector<v1::TensorChunk>> shares(count);
  for (size_t i = 0; i < chunks.size(); ++i) shares[i % count].push_back(chunks[i]);
  return shares;
}

v1::PushHeader MakePushHeader(v1::DType dtype, const std::string& client_id,
                              uint64_t sequence_number, const std::vector<std::string>& tensors) {
  v1::PushHeader header;
  header.set_grad_dtype(dtype);
  header.set_client_id(client_id);
  header.set_sequence_number(sequence_number);
  for (const std::string& t : tensors) header.add_tensors(t);
  return header;
}

v1::DType ToProto(GradDType dtype) { return static_cast<v1::DType>(dtype); }

AdamWHyperparameters CustomHyperparameters() {
  AdamWHyperparameters h;
  h.lr = 0.01;
  h.beta1 = 0.8;
  h.beta2 = 0.99;
  h.eps = 1e-6;
  h.weight_decay = 0.1;
  return h;
}

v1::Hyperparameters ToProto(const AdamWHyperparameters& h) { return HyperparametersToProto(h); }

// --- HostModel ---

HostModel::HostModel() { groups_["default"] = AdamWHyperparameters{}; }

void HostModel::AddTensor(const TensorDef& def, std::vector<float> values) {
  Tensor t;
  t.def = def;
  if (t.def.param_group.empty()) t.def.param_group = "default";
  t.numel = values.size();
  t.param = std::move(values);
  t.exp_avg.assign(t.numel, 0.0f);
  t.exp_avg_sq.assign(t.numel, 0.0f);
  t.max_exp_avg_sq.assign(t.numel, 0.0f);
  index_[def.name] = tensors_.size();
  tensors_.push_back(std::move(t));
}

void HostModel::Step(const std::string& name, const std::vector<float>& grads, float grad_scale) {
  Tensor& t = tensor(name);
  const AdamWHyperparameters& h = group(t.def.param_group);
  ASSERT_EQ(grads.size(), t.numel) << name;
  ++t.step;
  const AdamWStepScalars s = MakeStepScalars(h, t.step, grad_scale);
  for (uint64_t i = 0; i < t.numel; ++i) {
    AdamWUpdate(s, grads[i], t.param[i], t.exp_avg[i], t.exp_avg_sq[i],
                h.amsgrad ? &t.max_exp_avg_sq[i] : nullptr);
  }
}

// --- Comparisons ---

void ExpectSameBytes(const std::string& got, const std::string& want, int element_size,
                     const std::string& what) {
  if (got.size() != want.size()) {
    ADD_FAILURE() << what << ": got " << got.size() << " bytes, want " << want.size();
    return;
  }
  if (std::memcmp(got.data(), want.data(), got.size()) == 0) return;
  size_t mismatches = 0, first = 0;
  for (size_t i = 0; i < got.size() / element_size; ++i) {
    if (std::memcmp(&got[i * element_size], &want[i * element_size], element_size) != 0) {
      if (mismatches++ == 0) first = i;
    }
  }
  uint32_t got_bits = 0, want_bits = 0;
  std::memcpy(&got_bits, &got[first * element_size], element_size);
  std::memcpy(&want_bits, &want[first * element_size], element_size);
  const float got_value = element_size == 4 ? BitsToFloat(got_bits) : BitsToFloat(got_bits << 16);
  const float want_value =
      element_size == 4 ? BitsToFloat(want_bits) : BitsToFloat(want_bits << 16);
  char detail[160];
  std::snprintf(detail, sizeof(detail),
                "element %zu: got 0x%08" PRIx32 " (%.9g), want 0x%08" PRIx32 " (%.9g)", first,
                got_bits, got_value, want_bits, want_value);
  ADD_FAILURE() << what << ": " << mismatches << " of " << got.size() / element_size
                << " elements differ; first " << detail;
}

void ExpectSameState(const ShardState& before, const ShardState& after) {
  EXPECT_EQ(after.version, before.version) << "version changed";
  EXPECT_EQ(after.steps, before.steps) << "steps changed";
  EXPECT_EQ(after.fields.size(), before.fields.size());
  for (const auto& [field, tensors] : before.fields) {
    auto it = after.fields.find(field);
    if (it == after.fields.end()) continue;
    for (const auto& [name, bytes] : tensors) {
      auto found = it->second.find(name);
      if (found == it->second.end()) {
        ADD_FAILURE() << "tensor '" << name << "' is gone";
        continue;
      }
      ExpectSameBytes(found->second, bytes, 4,
                      "field " + v1::TensorField_Name(static_cast<v1::TensorField>(field)) +
                          " of '" + name + "'");
    }
    EXPECT_EQ(it->second.size(), tensors.size()) << "tensor count changed";
  }
}

// --- ServiceTest ---

ServerOptions ServiceTest::Options() const {
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.device = "cpu";
  options.backend.threads = 2;
  // The tests' pushes are a few KiB; the 2 GiB default costs nothing in a plain build (untouched
  // pages), but ASan poisons the whole arena's shadow when it is allocated and again when it is
  // freed: 2 x 256 MiB of memset per test, about 2 s of each test under ASan (238 s of the 250 s
  // that service_integration_test took). security_test's servers use 64 MiB too.
  options.staging_pool_bytes = 64 << 20;
  return options;
}

void ServiceTest::SetUp() {
  // gRPC 1.51 shuts its library down whenever the process's last gRPC object goes away (here, the
  // server at the end of each test), and that shutdown can wait up to 10 s for an executor thread
  // sitting in epoll_wait. One reference held for the whole program keeps every test fast.
  static const bool grpc_initialized = (grpc_init(), true);
  (void)grpc_initialized;
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(Options());
  ASSERT_TRUE(server.ok()) << server.status();
  server_ = *std::move(server);
  ASSERT_GT(server_->port(), 0);
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(16 << 20);
  args.SetMaxReceiveMessageSize(16 << 20);
  channel_ = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(server_->port()),
                                       grpc::InsecureChannelCredentials(), args);
  stub_ = v1::ParameterService::NewStub(channel_);
}

void ServiceTest::TearDown() {
  stub_.reset();
  channel_.reset();
  if (server_ != nullptr) server_->Shutdown(absl::Seconds(5));
  server_.reset();
}

void SetDeadline(grpc::ClientContext& context) {
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
}

bool WaitUntil(const std::function<bool()>& condition, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!condition() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(2));
  return condition();
}

namespace {

// Writes a client stream; stops early when the server has already answered.
template <typename Request, typename Writer>
grpc::Status WriteAll(Writer& writer, const std::vector<Request>& messages) {
  for (const Request& message : messages) {
    if (!writer->Write(message)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

}  // namespace

grpc::Status ServiceTest::RegisterTensors(const std::vector<v1::RegisterTensorsRequest>& messages,
                                          v1::RegisterTensorsResponse* response) {
  grpc::ClientContext context;
  SetDeadline(context);
  auto writer = stub_->RegisterTensors(&context, response);
  return WriteAll(writer, messages);
}

std::pair<grpc::Status, v1::PushGradientsResponse> ServiceTest::Push(
    const std::vector<v1::PushGradientsRequest>& messages) {
  grpc::ClientContext context;
  SetDeadline(context);
  v1::PushGradientsResponse response;
  auto writer = stub_->PushGradients(&context, &response);
  grpc::Status status = WriteAll(writer, messages);
  return {status, response};
}

Pulled ServiceTest::Pull(const v1::PullParametersRequest& request) {
  Pulled out;
  grpc::ClientContext context;
  SetDeadline(context);
  auto reader = stub_->PullParameters(&context, request);
  std::map<std::string, std::vector<std::pair<uint64_t, uint64_t>>> ranges;
  int element_size = 4;
  v1::PullParametersResponse message;
  while (reader->Read(&message)) {
    if (out.messages++ == 0) {
      if (!message.has_header()) out.malformed = "the first message has no header";
      out.header = message.header();
      element_size = out.header.dtype() == v1::DTYPE_FLOAT32 ? 4 : 2;
      for (const v1::TensorInfo& t : out.header.tensors()) {
        out.data[t.name()].assign(t.numel() * element_size, '\0');
      }
    } else if (message.has_header()) {
      out.malformed = "a later message has a header";
    }
    for (const v1::TensorInfo& t : message.tensors()) {  // Infos that did not fit the header.
      *out.header.add_tensors() = t;
      out.data[t.name()].assign(t.numel() * element_size, '\0');
    }
    size_t payload = 0;
    for (const v1::TensorChunk& chunk : message.chunks()) {
      payload += chunk.data().size();
      auto it = out.data.find(chunk.tensor());
      const uint64_t begin = chunk.offset() * element_size;
      if (it == out.data.end() || chunk.data().size() % element_size != 0 ||
          begin > it->second.size() || chunk.data().size() > it->second.size() - begin) {
        out.malformed = "a chunk of '" + chunk.tensor() + "' is out of bounds";
        continue;
      }
      std::memcpy(&it->second[begin], chunk.data().data(), chunk.data().size());
      ranges[chunk.tensor()].push_back(
          {chunk.offset(), chunk.offset() + chunk.data().size() / element_size});
    }
    out.max_message_payload = std::max(out.max_message_payload, payload);
  }
  out.status = reader->Finish();
  if (!out.status.ok()) return out;
  for (const v1::TensorInfo& t : out.header.tensors()) {
    std::vector<std::pair<uint64_t, uint64_t>>& r = ranges[t.name()];
    std::sort(r.begin(), r.end());
    uint64_t covered = 0;
    for (const auto& [begin, end] : r) {
      if (begin != covered) out.malformed = "chunks of '" + t.name() + "' leave a gap or overlap";
      covered = end;
    }
    if (covered != t.numel()) out.malformed = "chunks of '" + t.name() + "' do not cover it";
  }
  return out;
}

Pulled ServiceTest::Pull(const std::vector<std::string>& tensors, v1::DType dtype,
                         v1::TensorField field, uint32_t max_chunk_bytes) {
  v1::PullParametersRequest request;
  for (const std::string& t : tensors) request.add_tensors(t);
  request.set_dtype(dtype);
  request.set_field(field);
  request.set_max_chunk_bytes(max_chunk_bytes);
  return Pull(request);
}

v1::ListTensorsResponse ServiceTest::ListTensors() {
  grpc::ClientContext context;
  SetDeadline(context);
  v1::ListTensorsResponse response;
  grpc::Status status = stub_->ListTensors(&context, {}, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return response;
}

v1::GetInfoResponse ServiceTest::GetInfo() {
  grpc::ClientContext context;
  SetDeadline(context);
  v1::GetInfoResponse response;
  grpc::Status status = stub_->GetInfo(&context, {}, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return response;
}

ShardState ServiceTest::Snapshot() {
  ShardState state;
  const v1::ListTensorsResponse list = ListTensors();
  state.version = list.version();
  for (const v1::TensorInfo& t : list.tensors()) state.steps[t.name()] = t.step();
  for (v1::TensorField field :
       {v1::TENSOR_FIELD_PARAM, v1::TENSOR_FIELD_EXP_AVG, v1::TENSOR_FIELD_EXP_AVG_SQ}) {
    Pulled pulled = Pull({}, v1::DTYPE_FLOAT32, field);
    EXPECT_TRUE(pulled.status.ok()) << pulled.status.error_message();
    EXPECT_EQ(pulled.malformed, "");
    EXPECT_EQ(pulled.header.version(), state.version);
    state.fields[field] = std::move(pulled.data);
  }
  return state;
}

void ServiceTest::RegisterGroup(const std::string& name, const AdamWHyperparameters& h) {
  grpc::ClientContext context;
  SetDeadline(context);
  v1::RegisterParamGroupRequest request;
  request.mutable_param_group()->set_name(name);
  *request.mutable_param_group()->mutable_hyperparameters() = ToProto(h);
  v1::RegisterParamGroupResponse response;
  grpc::Status status = stub_->RegisterParamGroup(&context, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(response.created());
  host_.SetGroup(name, h);
}

void ServiceTest::RegisterTensors(const std::vector<TensorDef>& defs, size_t chunk_bytes,
                                  uint32_t seed) {
  v1::RegisterTensorsHeader header;
  std::vector<v1::TensorChunk> chunks;
  std::vector<std::vector<float>> values;
  for (size_t i = 0; i < defs.size(); ++i) {
    v1::TensorSpec* spec = header.add_tensors();
    spec->set_name(defs[i].name);
    uint64_t numel = 1;
    for (int64_t d : defs[i].shape) {
      spec->add_shape(d);
      numel *= d;
    }
    spec->set_param_group(defs[i].param_group);
    values.push_back(RandomValues(numel, seed + static_cast<uint32_t>(i)));
    for (v1::TensorChunk& c : SplitIntoChunks(
             defs[i].name, Encode(GradDType::kFloat32, values.back()), 4, chunk_bytes)) {
      chunks.push_back(std::move(c));
    }
  }
  Shuffle(chunks, seed);
  v1::RegisterTensorsResponse response;
  grpc::Status status =
      RegisterTensors(Messages<v1::RegisterTensorsRequest>(header, chunks, 1), &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.tensors_created(), defs.size());
  EXPECT_EQ(response.tensors_existing(), 0u);
  for (size_t i = 0; i < defs.size(); ++i) host_.AddTensor(defs[i], std::move(values[i]));
}

std::map<std::string, std::vector<float>> ServiceTest::RandomGrads(
    const std::vector<std::string>& names, uint32_t seed, float scale) {
  std::map<std::string, std::vector<float>> grads;
  for (const std::string& name : names) {
    grads[name] = RandomValues(host_.tensor(name).numel, seed++, scale);
  }
  return grads;
}

std::vector<v1::TensorChunk> ServiceTest::GradChunks(
    GradDType dtype, const std::map<std::string, std::vector<float>>& grads, size_t chunk_bytes,
    uint32_t seed) {
  std::vector<v1::TensorChunk> chunks;
  for (const auto& [name, values] : grads) {
    for (v1::TensorChunk& c :
         SplitIntoChunks(name, Encode(dtype, values), ElementSize(dtype), chunk_bytes)) {
      chunks.push_back(std::move(c));
    }
  }
  Shuffle(chunks, seed);
  return chunks;
}

v1::PushGradientsResponse ServiceTest::PushAndStep(
    v1::PushHeader header, GradDType dtype, const std::map<std::string, std::vector<float>>& grads,
    float grad_scale) {
  header.set_grad_dtype(ToProto(dtype));
  if (grad_scale > 0) header.set_grad_scale(grad_scale);
  auto [status, response] =
      Push(Messages<v1::PushGradientsRequest>(header, GradChunks(dtype, grads)));
  EXPECT_TRUE(status.ok()) << status.error_message();
  if (status.ok() && !response.step_skipped() && !response.duplicate()) {
    for (const auto& [name, values] : grads) host_.Step(name, RoundTrip(dtype, values), grad_scale);
  }
  return response;
}

void ServiceTest::ExpectMatchesHost(uint64_t version) {
  struct FieldCase {
    v1::TensorField field;
    v1::DType dtype;
    std::vector<float> HostModel::Tensor::*values;
  };
  const FieldCase cases[] = {
      {v1::TENSOR_FIELD_PARAM, v1::DTYPE_FLOAT32, &HostModel::Tensor::param},
      {v1::TENSOR_FIELD_PARAM, v1::DTYPE_BFLOAT16, &HostModel::Tensor::param},
      {v1::TENSOR_FIELD_EXP_AVG, v1::DTYPE_FLOAT32, &HostModel::Tensor::exp_avg},
      {v1::TENSOR_FIELD_EXP_AVG_SQ, v1::DTYPE_FLOAT32, &HostModel::Tensor::exp_avg_sq},
  };
  for (const FieldCase& c : cases) {
    const std::string what =
        v1::TensorField_Name(c.field) + " as " + v1::DType_Name(c.dtype) + " of '";
    Pulled pulled = Pull({}, c.dtype, c.field);
    ASSERT_TRUE(pulled.status.ok()) << what << "': " << pulled.status.error_message();
    EXPECT_EQ(pulled.malformed, "") << what;
    EXPECT_EQ(pulled.header.version(), version) << what;
    EXPECT_EQ(pulled.header.dtype(), c.dtype) << what;
    ASSERT_EQ(static_cast<size_t>(pulled.header.tensors_size()), host_.tensors().size());
    for (const HostModel::Tensor& t : host_.tensors()) {
      const GradDType dtype = static_cast<GradDType>(c.dtype);
      ExpectSameBytes(pulled.data[t.def.name], Encode(dtype, t.*c.values), ElementSize(dtype),
                      what + t.def.name + "'");
    }
    for (int i = 0; i < pulled.header.tensors_size(); ++i) {
      const v1::TensorInfo& info = pulled.header.tensors(i);
      EXPECT_EQ(info.name(), host_.tensors()[i].def.name);
      EXPECT_EQ(info.step(), host_.tensors()[i].step) << info.name();
    }
  }
  for (const HostModel::Tensor& t : host_.tensors()) {
    if (!host_.group(t.def.param_group).amsgrad) continue;
    Pulled pulled = Pull({t.def.name}, v1::DTYPE_FLOAT32, v1::TENSOR_FIELD_MAX_EXP_AVG_SQ);
    ASSERT_TRUE(pulled.status.ok()) << pulled.status.error_message();
    ExpectSameBytes(pulled.data[t.def.name], Encode(GradDType::kFloat32, t.max_exp_avg_sq), 4,
                    "MAX_EXP_AVG_SQ of '" + t.def.name + "'");
  }
}

std::unique_ptr<MappedWorkspace> MappedWorkspace::Open(v1::ParameterService::Stub& stub,
                                                       uint64_t bytes) {
  auto w = std::make_unique<MappedWorkspace>();
  SetDeadline(w->lease);
  v1::OpenWorkspaceRequest request;
  request.set_bytes(bytes);
  w->reader = stub.OpenWorkspace(&w->lease, request);
  if (!w->reader->Read(&w->opened)) {
    w->status = w->reader->Finish();
    w->reader.reset();
    return w;
  }
  const int fd = ::open(w->opened.path().c_str(), O_RDWR);
  EXPECT_GE(fd, 0) << w->opened.path();
  if (fd < 0) return w;
  void* mapped = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  EXPECT_NE(mapped, MAP_FAILED);
  if (mapped != MAP_FAILED) w->memory = static_cast<char*>(mapped);
  return w;
}

MappedWorkspace::~MappedWorkspace() {
  if (reader != nullptr) {
    lease.TryCancel();
    v1::OpenWorkspaceResponse none;
    while (reader->Read(&none)) {
    }
    reader->Finish().IgnoreError();
  }
  if (memory != nullptr) munmap(memory, opened.bytes());
}

}  // namespace fusedps::integration
