// service_harness.h: what the integration tests share. A fixture starts a real fusedps server
// in-process on 127.0.0.1:0 (CPU backend) and talks to it over real gRPC through the generated
// raw stub; helpers build chunked streams, encode gradients as fp32/bf16/fp16, snapshot the
// shard's whole state as bytes, and keep a host-side AdamW model (kernels/adamw_math.h) that the
// server's results must equal bit for bit.
//
// Usage:
//   TEST_F(ServiceTest, Something) {
//     RegisterGroup("custom", CustomHyperparameters());
//     RegisterTensors({{"w", {4, 8}, "custom"}});
//     auto [status, ack] = Push(Messages<v1::PushGradientsRequest>(header, chunks));
//     host_.Step("w", grads, /*grad_scale=*/0);
//     ExpectMatchesHost(/*version=*/1);
//   }
#ifndef FUSEDPS_TESTS_INTEGRATION_SERVICE_HARNESS_H_
#define FUSEDPS_TESTS_INTEGRATION_SERVICE_HARNESS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "fusedps/v1/parameter_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/adamw_math.h"
#include "server/schema/hyperparameters.h"
#include "server/server.h"

namespace fusedps::integration {

inline constexpr size_t kMiB = size_t{1} << 20;

// Deterministic values in [-scale, scale).
std::vector<float> RandomValues(size_t n, uint32_t seed, float scale = 1.0f);

int ElementSize(GradDType dtype);
// Little-endian wire bytes of values in dtype (bf16/fp16 rounded to nearest even).
std::string Encode(GradDType dtype, const std::vector<float>& values);
// The fp32 values the server works with after values travel as dtype.
std::vector<float> RoundTrip(GradDType dtype, const std::vector<float>& values);

v1::TensorChunk Chunk(const std::string& tensor, uint64_t offset, std::string data);
// Splits a tensor's wire bytes into chunks of at most chunk_bytes (rounded down to elements).
std::vector<v1::TensorChunk> SplitIntoChunks(const std::string& tensor, const std::string& bytes,
                                             int element_size, size_t chunk_bytes);
// Reorders chunks deterministically (so that they arrive out of order).
void Shuffle(std::vector<v1::TensorChunk>& chunks, uint32_t seed);
// Splits chunks round-robin into `count` shares: one per part of a push sent in parts.
std::vector<std::vector<v1::TensorChunk>> ShareChunks(const std::vector<v1::TensorChunk>& chunks,
                                                      uint32_t count);

// A client stream: the first message carries header and the first chunks_in_first chunks, each
// later message one chunk.
template <typename Request, typename Header>
std::vector<Request> Messages(const Header& header, const std::vector<v1::TensorChunk>& chunks,
                              size_t chunks_in_first = 0) {
  std::vector<Request> messages(1);
  *messages[0].mutable_header() = header;
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (i < chunks_in_first) {
      *messages[0].add_chunks() = chunks[i];
    } else {
      *messages.emplace_back().add_chunks() = chunks[i];
    }
  }
  return messages;
}

v1::PushHeader MakePushHeader(v1::DType dtype, const std::string& client_id = "",
                              uint64_t sequence_number = 0,
                              const std::vector<std::string>& tensors = {});
v1::DType ToProto(GradDType dtype);

// A param group with every hyperparameter away from torch's defaults.
AdamWHyperparameters CustomHyperparameters();
// Every field set, as the server returns a group (the storage fields too).
v1::Hyperparameters ToProto(const AdamWHyperparameters& h);

struct TensorDef {
  std::string name;
  std::vector<int64_t> shape;
  std::string param_group;  // As sent; empty means "default".
};

// The reference: the same update, on the host, one tensor at a time.
class HostModel {
 public:
  struct Tensor {
    TensorDef def;
    uint64_t numel = 0;
    int64_t step = 0;
    std::vector<float> param, exp_avg, exp_avg_sq, max_exp_avg_sq;
  };

  HostModel();
  void SetGroup(const std::string& name, const AdamWHyperparameters& h) { groups_[name] = h; }
  const AdamWHyperparameters& group(const std::string& name) const { return groups_.at(name); }
  void AddTensor(const TensorDef& def, std::vector<float> values);
  // One AdamW step of one tensor with the fp32 grads the server decoded.
  void Step(const std::string& name, const std::vector<float>& grads, float grad_scale);

  Tensor& tensor(const std::string& name) { return tensors_.at(index_.at(name)); }
  const std::vector<Tensor>& tensors() const { return tensors_; }

 private:
  std::map<std::string, AdamWHyperparameters> groups_;
  std::vector<Tensor> tensors_;  // In registration order.
  std::map<std::string, size_t> index_;
};

// One PullParameters call, reassembled.
struct Pulled {
  grpc::Status status;
  v1::PullHeader header;
  std::map<std::string, std::string> data;  // Per tensor, numel elements as wire bytes.
  size_t messages = 0;
  size_t max_message_payload = 0;  // Largest sum of chunk bytes in one message.
  std::string malformed;           // Why the stream broke the contract; empty when it did not.
};

// Everything a failed call must leave unchanged, as bytes.
struct ShardState {
  uint64_t version = 0;
  std::map<std::string, int64_t> steps;
  // Per field (PARAM, EXP_AVG, EXP_AVG_SQ), per tensor: fp32 bytes.
  std::map<int, std::map<std::string, std::string>> fields;
};

// Compares wire bytes element by element; on a mismatch reports the count and the first one.
void ExpectSameBytes(const std::string& got, const std::string& want, int element_size,
                     const std::string& what);
void ExpectSameState(const ShardState& before, const ShardState& after);

// Gives a call a deadline, so that a hung server fails the test instead of hanging it.
void SetDeadline(grpc::ClientContext& context);
// Polls `condition` every few milliseconds until it holds or `timeout` has passed; returns its
// last value (for server state that settles after a call returns, e.g. staging given back).
bool WaitUntil(const std::function<bool()>& condition, absl::Duration timeout = absl::Seconds(10));

// A same-host workspace (OpenWorkspace) opened through `stub` and mapped here, as a trainer
// does. Open() fails only when the call did (status then says why, memory is null). The
// destructor ends the lease (the server then closes the workspace) and unmaps it; lease may
// also be cancelled from another thread meanwhile.
struct MappedWorkspace {
  static std::unique_ptr<MappedWorkspace> Open(v1::ParameterService::Stub& stub, uint64_t bytes);
  ~MappedWorkspace();

  grpc::ClientContext lease;
  std::unique_ptr<grpc::ClientReader<v1::OpenWorkspaceResponse>> reader;
  v1::OpenWorkspaceResponse opened;
  grpc::Status status;     // Of a call that failed before its response.
  char* memory = nullptr;  // opened.bytes() bytes, shared with the server.
};

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;
  virtual ServerOptions Options() const;

  grpc::Status RegisterTensors(const std::vector<v1::RegisterTensorsRequest>& messages,
                               v1::RegisterTensorsResponse* response);
  std::pair<grpc::Status, v1::PushGradientsResponse> Push(
      const std::vector<v1::PushGradientsRequest>& messages);
  Pulled Pull(const v1::PullParametersRequest& request);
  Pulled Pull(const std::vector<std::string>& tensors, v1::DType dtype,
              v1::TensorField field = v1::TENSOR_FIELD_PARAM, uint32_t max_chunk_bytes = 0);
  v1::ListTensorsResponse ListTensors();
  v1::GetInfoResponse GetInfo();
  ShardState Snapshot();

  // Registers a group and mirrors it in host_. Fails the test on an error.
  void RegisterGroup(const std::string& name, const AdamWHyperparameters& h);
  // Registers tensors with random initial values in shuffled chunks of chunk_bytes, and mirrors
  // them in host_. Fails the test on an error.
  void RegisterTensors(const std::vector<TensorDef>& defs, size_t chunk_bytes = kMiB,
                       uint32_t seed = 1);
  // Random gradients for the named tensors.
  std::map<std::string, std::vector<float>> RandomGrads(const std::vector<std::string>& names,
                                                        uint32_t seed, float scale = 1.0f);
  // The shuffled chunks of grads in dtype.
  static std::vector<v1::TensorChunk> GradChunks(
      GradDType dtype, const std::map<std::string, std::vector<float>>& grads,
      size_t chunk_bytes = kMiB, uint32_t seed = 3);
  // Pushes grads in dtype and, when the server applied them, steps host_ the same way.
  v1::PushGradientsResponse PushAndStep(v1::PushHeader header, GradDType dtype,
                                        const std::map<std::string, std::vector<float>>& grads,
                                        float grad_scale = 0.0f);
  // Pulls every field of every tensor (fp32, and bf16 params) and compares it with host_,
  // bit for bit, along with steps and the version.
  void ExpectMatchesHost(uint64_t version);

  std::unique_ptr<Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::ParameterService::Stub> stub_;
  HostModel host_;
};

}  // namespace fusedps::integration

#endif  // FUSEDPS_TESTS_INTEGRATION_SERVICE_HARNESS_H_
