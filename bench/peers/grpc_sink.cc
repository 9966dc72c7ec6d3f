// fusedps-grpc-sink: the raw gRPC ceiling for the push benchmark.
//
//   fusedps-grpc-sink --listen=0.0.0.0:50051 --port-file=/tmp/sink.port
//
// It serves fusedps.v1.ParameterService with the same generated stubs and the same message-size
// limits as fusedps-server, so that a load generator drives both unchanged. PushGradients is,
// as in fusedps-server, a raw method on gRPC's callback API; the sink scans each message's
// framing with fusedps's own reader (server/ingest/push_message.h), counts the chunks' payload
// bytes and skips them: no protobuf message, no copy, no staging, no optimizer. Its push rate is
// what the network and gRPC allow, the ceiling fusedps is measured against. (The other RPCs
// are synchronous, as in fusedps-server; they are not what is measured.)
//
// Behaviour per RPC:
//   RegisterParamGroup  remembers the group with torch.optim.AdamW's defaults filled in;
//                       identical again: created = false; different: ALREADY_EXISTS.
//   RegisterTensors     needs the header; remembers names, shapes, groups and numel (unknown
//                       group: NOT_FOUND; same name, other spec: ALREADY_EXISTS); reads the
//                       value chunks and discards them.
//   PushGradients       needs the header in the first message (a header elsewhere or bytes that
//                       are not a PushGradientsRequest: INVALID_ARGUMENT), nothing else is
//                       checked; counts the chunk payload bytes, skips them, and replies
//                       with the version incremented, grad_bytes and tensors_updated (the
//                       header's count, or every registered tensor when it names none). Steps
//                       are not tracked.
//   PullParameters      streams zeros of the right sizes in the asked dtype, packed like
//                       fusedps-server packs them (max_chunk_bytes, default 1 MiB); the header
//                       reports step 0 for every tensor. Unknown tensor: NOT_FOUND.
//   GetInfo             backend "sink", the counts, groups and --max-message-bytes.
//   ListTensors         the registered tensors (step 0).
//   SetHyperparameters  updates the stored group (amsgrad cannot change).
//
// SIGTERM or SIGINT: stop accepting calls, let the calls in flight finish (at most
// --shutdown-grace-seconds), exit 0.
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "common/byte_buffer_view.h"
#include "common/flag_usage.h"
#include "common/port_file.h"
#include "fusedps/v1/parameter_service.grpc.pb.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/support/proto_buffer_writer.h"
#include "server/ingest/push_message.h"
#include "server/schema/hyperparameters.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:50051", "gRPC address, HOST:PORT; port 0 picks one");
ABSL_FLAG(std::string, port_file, "",
          "once serving, write the bound gRPC port to this file (atomically)");
ABSL_FLAG(uint64_t, max_message_bytes, 8 << 20, "gRPC max receive and send message size");
ABSL_FLAG(int, shutdown_grace_seconds, 30,
          "on SIGTERM/SIGINT, how long calls in flight may take to finish");

namespace fusedps {
namespace {

using google::protobuf::util::MessageDifferencer;

constexpr char kDefaultParamGroup[] = "default";
constexpr uint32_t kDefaultPullChunkBytes = 1 << 20;
constexpr uint32_t kMinPullChunkBytes = 16;
constexpr uint32_t kMaxPullChunkBytes = 4 << 20;

// The group's hyperparameters with the server's defaults (torch.optim.AdamW's) for every field
// the caller left unset, as fusedps-server converts them (server/schema/hyperparameters.h).
absl::StatusOr<v1::Hyperparameters> WithDefaults(const v1::Hyperparameters& h) {
  absl::StatusOr<fusedps::AdamWHyperparameters> full = fusedps::HyperparametersFromProto(h);
  if (!full.ok()) return full.status();
  return fusedps::HyperparametersToProto(*full);
}

// Bytes per element of a wire dtype; 0 for anything else.
uint32_t ElementSize(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32:
      return 4;
    case v1::DTYPE_BFLOAT16:
    case v1::DTYPE_FLOAT16:
      return 2;
    default:
      return 0;
  }
}

class SinkService final : public v1::ParameterService::WithRawCallbackMethod_PushGradients<
                              v1::ParameterService::Service> {
 public:
  explicit SinkService(uint64_t max_message_bytes) : max_message_bytes_(max_message_bytes) {
    v1::ParamGroup group;
    group.set_name(kDefaultParamGroup);
    *group.mutable_hyperparameters() = *WithDefaults({});
    groups_.push_back(group);
  }

  grpc::Status RegisterParamGroup(grpc::ServerContext*,
                                  const v1::RegisterParamGroupRequest* request,
                                  v1::RegisterParamGroupResponse* response) override {
    v1::ParamGroup group = request->param_group();
    if (group.name().empty()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "param_group.name is empty");
    }
    absl::StatusOr<v1::Hyperparameters> hyperparameters = WithDefaults(group.hyperparameters());
    if (!hyperparameters.ok()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          std::string(hyperparameters.status().message()));
    }
    *group.mutable_hyperparameters() = *hyperparameters;
    std::lock_guard<std::mutex> lock(mu_);
    *response->mutable_param_group() = group;
    if (const v1::ParamGroup* existing = FindGroup(group.name())) {
      if (!MessageDifferencer::Equals(*existing, group)) {
        return grpc::Status(
            grpc::StatusCode::ALREADY_EXISTS,
            absl::StrCat("param group '", group.name(), "' exists with other hyperparameters"));
      }
      response->set_created(false);
      return grpc::Status::OK;
    }
    groups_.push_back(group);
    response->set_created(true);
    return grpc::Status::OK;
  }

  grpc::Status RegisterTensors(grpc::ServerContext*,
                               grpc::ServerReader<v1::RegisterTensorsRequest>* reader,
                               v1::RegisterTensorsResponse* response) override {
    v1::RegisterTensorsRequest request;
    if (!reader->Read(&request) || !request.has_header()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "the first RegisterTensorsRequest must carry header (the tensor specs)");
    }
    std::vector<v1::TensorInfo> specs;
    for (const v1::TensorSpec& spec : request.header().tensors()) {
      v1::TensorInfo info;
      info.set_name(spec.name());
      info.mutable_shape()->CopyFrom(spec.shape());
      info.set_param_group(spec.param_group().empty() ? kDefaultParamGroup : spec.param_group());
      uint64_t numel = 1;
      for (int64_t dim : spec.shape()) {
        if (dim < 0) {
          return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                              absl::StrCat("tensor '", spec.name(), "' has a negative dim"));
        }
        numel *= static_cast<uint64_t>(dim);
      }
      info.set_numel(numel);
      specs.push_back(std::move(info));
    }
    // The initial values: read and dropped.
    while (reader->Read(&request)) {
    }
    std::lock_guard<std::mutex> lock(mu_);
    uint32_t created = 0;
    uint32_t existing = 0;
    for (const v1::TensorInfo& info : specs) {
      if (FindGroup(info.param_group()) == nullptr) {
        return grpc::Status(
            grpc::StatusCode::NOT_FOUND,
            absl::StrCat("param group '", info.param_group(), "' is not registered"));
      }
      auto it = tensor_index_.find(info.name());
      if (it == tensor_index_.end()) continue;
      if (!MessageDifferencer::Equals(tensors_[it->second], info)) {
        return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                            absl::StrCat("tensor '", info.name(), "' exists with another spec"));
      }
    }
    for (v1::TensorInfo& info : specs) {
      if (tensor_index_.count(info.name()) > 0) {
        ++existing;
        continue;
      }
      tensor_index_.emplace(info.name(), tensors_.size());
      parameter_count_ += info.numel();
      tensors_.push_back(std::move(info));
      ++created;
    }
    tensor_count_.store(tensors_.size(), std::memory_order_relaxed);
    response->set_tensors_created(created);
    response->set_tensors_existing(existing);
    response->set_version(version_.load());
    return grpc::Status::OK;
  }

  // The measured path (see PushReactor below).
  grpc::ServerReadReactor<grpc::ByteBuffer>* PushGradients(grpc::CallbackServerContext*,
                                                           grpc::ByteBuffer* response) override;

  // A push was received whole: the reply's version and tensors_updated.
  uint64_t NextVersion() { return version_.fetch_add(1) + 1; }
  uint32_t TensorCount() const {
    return static_cast<uint32_t>(tensor_count_.load(std::memory_order_relaxed));
  }

  grpc::Status PullParameters(grpc::ServerContext* context,
                              const v1::PullParametersRequest* request,
                              grpc::ServerWriter<v1::PullParametersResponse>* writer) override {
    const v1::DType dtype =
        request->dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_FLOAT32 : request->dtype();
    const uint32_t element_size = ElementSize(dtype);
    if (element_size == 0) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "dtype must be FLOAT32, BFLOAT16 or FLOAT16");
    }
    const uint32_t chunk_bytes =
        request->max_chunk_bytes() == 0 ? kDefaultPullChunkBytes : request->max_chunk_bytes();
    if (chunk_bytes < kMinPullChunkBytes || chunk_bytes > kMaxPullChunkBytes) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("max_chunk_bytes = ", chunk_bytes, " must be 0 or in [",
                                       kMinPullChunkBytes, ", ", kMaxPullChunkBytes, "]"));
    }
    v1::PullParametersResponse message;
    v1::PullHeader* header = message.mutable_header();
    header->set_dtype(dtype);
    {
      std::lock_guard<std::mutex> lock(mu_);
      header->set_version(version_.load());
      if (request->tensors().empty()) {
        for (const v1::TensorInfo& t : tensors_) *header->add_tensors() = t;
      }
      for (const std::string& name : request->tensors()) {
        auto it = tensor_index_.find(name);
        if (it == tensor_index_.end()) {
          return grpc::Status(grpc::StatusCode::NOT_FOUND,
                              absl::StrCat("tensor '", name, "' is not registered"));
        }
        *header->add_tensors() = tensors_[it->second];
      }
    }
    const std::vector<v1::TensorInfo> tensors(header->tensors().begin(), header->tensors().end());
    if (!writer->Write(message)) return grpc::Status(grpc::StatusCode::CANCELLED, "client left");
    message.Clear();
    const std::string zeros(chunk_bytes, '\0');
    const uint64_t elements_per_message = chunk_bytes / element_size;
    uint64_t room = elements_per_message;
    for (const v1::TensorInfo& t : tensors) {
      for (uint64_t offset = 0; offset < t.numel();) {
        const uint64_t count = std::min(room, t.numel() - offset);
        v1::TensorChunk* chunk = message.add_chunks();
        chunk->set_tensor(t.name());
        chunk->set_offset(offset);
        chunk->set_data(zeros.data(), count * element_size);
        offset += count;
        room -= count;
        if (room == 0) {
          if (context->IsCancelled() || !writer->Write(message)) {
            return grpc::Status(grpc::StatusCode::CANCELLED, "client left");
          }
          message.Clear();
          room = elements_per_message;
        }
      }
    }
    if (message.chunks_size() > 0 && !writer->Write(message)) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "client left");
    }
    return grpc::Status::OK;
  }

  grpc::Status GetInfo(grpc::ServerContext*, const v1::GetInfoRequest*,
                       v1::GetInfoResponse* response) override {
    std::lock_guard<std::mutex> lock(mu_);
    response->set_version(version_.load());
    response->set_backend("sink");
    response->set_device("none (gradients are discarded)");
    response->set_tensor_count(static_cast<uint32_t>(tensors_.size()));
    response->set_parameter_count(parameter_count_);
    for (const v1::ParamGroup& g : groups_) *response->add_param_groups() = g;
    response->set_server_version("fusedps-grpc-sink");
    response->set_max_message_bytes(max_message_bytes_);
    return grpc::Status::OK;
  }

  grpc::Status ListTensors(grpc::ServerContext*, const v1::ListTensorsRequest*,
                           v1::ListTensorsResponse* response) override {
    std::lock_guard<std::mutex> lock(mu_);
    response->set_version(version_.load());
    for (const v1::TensorInfo& t : tensors_) *response->add_tensors() = t;
    return grpc::Status::OK;
  }

  grpc::Status SetHyperparameters(grpc::ServerContext*,
                                  const v1::SetHyperparametersRequest* request,
                                  v1::SetHyperparametersResponse* response) override {
    const std::string name =
        request->param_group().empty() ? kDefaultParamGroup : request->param_group();
    std::lock_guard<std::mutex> lock(mu_);
    v1::ParamGroup* group = FindGroup(name);
    if (group == nullptr) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          absl::StrCat("param group '", name, "' is not registered"));
    }
    const v1::Hyperparameters& update = request->hyperparameters();
    if (update.has_amsgrad() && update.amsgrad() != group->hyperparameters().amsgrad()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "amsgrad cannot change");
    }
    group->mutable_hyperparameters()->MergeFrom(update);  // Only the fields that are set.
    *response->mutable_param_group() = *group;
    return grpc::Status::OK;
  }

 private:
  // REQUIRES: mu_ is held.
  v1::ParamGroup* FindGroup(const std::string& name) {
    for (v1::ParamGroup& g : groups_) {
      if (g.name() == name) return &g;
    }
    return nullptr;
  }

  const uint64_t max_message_bytes_;
  std::atomic<uint64_t> version_{0};
  std::atomic<size_t> tensor_count_{0};  // tensors_.size(), read by pushes without mu_.
  std::mutex mu_;                        // Guards the registry below.
  std::vector<v1::ParamGroup> groups_;
  std::vector<v1::TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
  uint64_t parameter_count_ = 0;
};

// One push: each serialized message is scanned for its chunks' framing
// (server/ingest/push_message.h) and their payload bytes are counted and skipped: no protobuf
// message, no copy of the data. On gRPC's callback API, as fusedps-server's pushes, so no thread is
// held per call.
class PushReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  PushReactor(grpc::ByteBuffer* response, SinkService* service)
      : response_(response), service_(service) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      if (!has_header_) return Fail("the first PushGradientsRequest must carry header");
      v1::PushGradientsResponse reply;
      reply.set_version(service_->NextVersion());
      reply.set_tensors_updated(tensors_named_ > 0 ? tensors_named_ : service_->TensorCount());
      reply.set_grad_bytes(grad_bytes_);
      bool own_buffer = false;
      grpc::GenericSerialize<grpc::ProtoBufferWriter, v1::PushGradientsResponse>(reply, response_,
                                                                                 &own_buffer)
          .IgnoreError();
      return Finish(grpc::Status::OK);
    }
    const bool first = !has_header_;
    const ByteBufferView message(request_);
    if (!message.ok()) return Fail("cannot read the message's slices");
    if (first) {
      absl::StatusOr<std::optional<v1::PushHeader>> header = ReadPushHeader(message.views());
      if (!header.ok()) return Fail(std::string(header.status().message()));
      if (!header->has_value()) return Fail("the first PushGradientsRequest must carry header");
      has_header_ = true;
      tensors_named_ = static_cast<uint32_t>((*header)->tensors_size());
    }
    const absl::Status scanned = ReadPushChunks(
        message.views(), first,
        [this](absl::string_view, uint64_t, uint64_t bytes) -> absl::StatusOr<char*> {
          grad_bytes_ += bytes;
          return nullptr;  // Skip the payload.
        },
        [](char*, uint64_t) { return absl::OkStatus(); });
    if (!scanned.ok()) return Fail(std::string(scanned.message()));
    request_.Clear();
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  void Fail(const std::string& message) {
    Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, message));
  }

  grpc::ByteBuffer* const response_;
  SinkService* const service_;
  grpc::ByteBuffer request_;
  bool has_header_ = false;
  uint32_t tensors_named_ = 0;
  uint64_t grad_bytes_ = 0;
};

grpc::ServerReadReactor<grpc::ByteBuffer>* SinkService::PushGradients(grpc::CallbackServerContext*,
                                                                      grpc::ByteBuffer* response) {
  return new PushReactor(response, this);
}

}  // namespace
}  // namespace fusedps

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "fusedps-grpc-sink: fusedps.v1.ParameterService that discards every gradient byte.\n"
      "  fusedps-grpc-sink --listen=0.0.0.0:50051 --port-file=/tmp/sink.port");
  if (std::optional<int> exit_code = fusedps::ParseProgramFlags(argc, argv, {__FILE__})) {
    return *exit_code;
  }

  const uint64_t max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (max_message_bytes == 0 ||
      max_message_bytes > static_cast<uint64_t>(std::numeric_limits<int>::max())) {
    std::fprintf(stderr, "fusedps-grpc-sink: --max-message-bytes must be in [1, 2^31)\n");
    return 2;
  }

  // Block the stop signals in every thread; main waits for them below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  if (pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr) != 0) {
    std::perror("fusedps-grpc-sink: pthread_sigmask");
    return 1;
  }

  const std::string listen = absl::GetFlag(FLAGS_listen);
  fusedps::SinkService service(max_message_bytes);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(max_message_bytes));
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::fprintf(stderr, "fusedps-grpc-sink: cannot listen on '%s'\n", listen.c_str());
    return 1;
  }
  server->GetHealthCheckService()->SetServingStatus(true);
  const std::string host = listen.substr(0, listen.rfind(':'));
  std::fprintf(stderr, "fusedps-grpc-sink listening on %s:%d\n", host.c_str(), port);
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty() && !fusedps::WritePortFile(port_file, port)) {
    std::fprintf(stderr, "fusedps-grpc-sink: cannot write --port-file %s\n", port_file.c_str());
    return 1;
  }

  int signal = 0;
  sigwait(&stop_signals, &signal);
  const int grace = absl::GetFlag(FLAGS_shutdown_grace_seconds);
  std::fprintf(stderr, "fusedps-grpc-sink: %s, draining for up to %ds\n", strsignal(signal), grace);
  server->GetHealthCheckService()->SetServingStatus(false);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(grace));
  server->Wait();
  std::fprintf(stderr, "fusedps-grpc-sink: stopped\n");
  return 0;
}
