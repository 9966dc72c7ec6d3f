// Client (fusedps/client.h): creating one, and its calls that move tensor data:
// RegisterParamGroup, RegisterTensors, PushGradients and PullParameters. BeginPush is in
// push_transaction.cc, PullInto in pull_into.cc, and the calls about the server and its models
// in server_calls.cc.
#include "fusedps/client.h"

#include <algorithm>
#include <functional>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/memory/memory.h"
#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/channel.h"
#include "client/connection.h"
#include "client/wire.h"
#include "common/mutex.h"
#include "fusedps/v1/parameter_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace fusedps::client {

using internal::ChunkSpan;
using internal::ConfigureContext;
using internal::MessagePlan;
using internal::TensorExtent;
using internal::ToAbslStatus;

namespace {

// A target is HOST:PORT (a name, an IPv4 address or a bracketed IPv6 one; PORT 1..65535) or a
// gRPC target with a scheme, which gRPC parses. gRPC itself takes "127.0.0.1:50051x" as port
// 50051: a typo must not reach another port silently.
absl::Status ValidateTarget(const std::string& target) {
  for (absl::string_view scheme :
       {"dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:", "xds:"}) {
    if (absl::StartsWith(target, scheme)) return absl::OkStatus();
  }
  if (absl::StrContains(target, "://")) return absl::OkStatus();
  const size_t colon = target.rfind(':');
  const absl::string_view host =
      colon == std::string::npos ? "" : absl::string_view(target).substr(0, colon);
  const absl::string_view port =
      colon == std::string::npos ? "" : absl::string_view(target).substr(colon + 1);
  bool ok = !host.empty() && !port.empty() && port.size() <= 5 &&
            std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; });
  if (ok && host.front() == '[') {
    ok = host.back() == ']' && host.size() > 2;
  } else if (ok) {
    ok = std::all_of(host.begin(), host.end(), [](char c) {
      return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_';
    });
  }
  int number = 0;
  if (!ok || !absl::SimpleAtoi(port, &number) || number < 1 || number > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "target '", target,
        "' is not HOST:PORT with a port in 1..65535 (or a gRPC target with a scheme, such as "
        "dns:///HOST:PORT or unix:PATH)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateOptions(const ClientOptions& options) {
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout must be > 0, not ", absl::FormatDuration(options.timeout)));
  }
  if (options.keepalive_time <= absl::ZeroDuration() ||
      options.keepalive_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("keepalive_time and keepalive_timeout must be > 0, not ",
                     absl::FormatDuration(options.keepalive_time), " and ",
                     absl::FormatDuration(options.keepalive_timeout)));
  }
  if (options.max_chunk_bytes < 4 || options.max_chunk_bytes > internal::kMaxChunkBytesLimit) {
    return absl::InvalidArgumentError(absl::StrCat("max_chunk_bytes must be in [4, ",
                                                   internal::kMaxChunkBytesLimit, "], not ",
                                                   options.max_chunk_bytes));
  }
  if (options.streams < 1 || options.streams > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("streams must be in [1, 64], not ", options.streams));
  }
  return absl::OkStatus();
}

// Runs fn(0), ..., fn(n - 1) on n threads (fn(0) on this one) and returns the first error by
// index, or OK.
absl::Status RunConcurrently(size_t n, const std::function<absl::Status(size_t)>& fn) {
  std::vector<absl::Status> statuses(n);
  std::vector<std::thread> threads;
  threads.reserve(n > 0 ? n - 1 : 0);
  for (size_t i = 1; i < n; ++i) {
    threads.emplace_back([&statuses, &fn, i] { statuses[i] = fn(i); });
  }
  if (n > 0) statuses[0] = fn(0);
  for (std::thread& thread : threads) thread.join();
  for (absl::Status& status : statuses) {
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

// Writes a client stream: `message` holds the header; then the chunks of `plan`, which name
// tensors by index into `names`, with payloads from encode(span, &data). The header shares the
// first message with chunks unless it is large. Returns false when the stream broke (the call's
// Finish then says why).
template <typename Request, typename Encode>
bool WriteChunked(grpc::ClientWriter<Request>& writer, Request message,
                  const std::vector<MessagePlan>& plan,
                  const std::vector<const std::string*>& names, const Encode& encode) {
  if (plan.empty() || message.ByteSizeLong() > internal::kMaxChunkMetadataBytes) {
    if (!writer.Write(message)) return false;
    message.Clear();
  }
  for (const MessagePlan& chunks : plan) {
    for (const ChunkSpan& span : chunks) {
      v1::TensorChunk* chunk = message.add_chunks();
      chunk->set_tensor(*names[span.tensor]);
      chunk->set_offset(span.offset);
      encode(span, chunk->mutable_data());
    }
    if (!writer.Write(message)) return false;
    message.Clear();  // Keeps the chunks' buffers for the next message.
  }
  return true;
}

// Finishes a client stream whose writes are done or broke.
template <typename Request>
absl::Status FinishWrites(grpc::ClientWriter<Request>& writer, bool writes_ok) {
  if (writes_ok) writer.WritesDone();
  return ToAbslStatus(writer.Finish());
}

// Cancels a call once CallTimeout(options, payload) has passed since the call began, where the
// payload may grow while the call runs: a pull learns its size from the reply, and gRPC's own
// deadline is fixed when a call starts. Does nothing when options.timeout is infinite.
// REQUIRES: the context outlives this object.
class GrowingDeadline {
 public:
  GrowingDeadline(const ClientOptions& options, grpc::ClientContext* context)
      : options_(options), context_(context), start_(absl::Now()) {
    if (options_.timeout == absl::InfiniteDuration()) return;
    deadline_ = start_ + internal::CallTimeout(options_, 0);
    thread_ = std::thread([this] { Watch(); });
  }
  GrowingDeadline(const GrowingDeadline&) = delete;
  GrowingDeadline& operator=(const GrowingDeadline&) = delete;
  ~GrowingDeadline() {
    {
      MutexLock lock(&mu_);
      done_ = true;
    }
    changed_.Signal();
    if (thread_.joinable()) thread_.join();
  }

  // The call's payload so far, in bytes.
  void SetPayload(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    if (bytes == payload_bytes_) return;
    payload_bytes_ = bytes;
    deadline_ = start_ + internal::CallTimeout(options_, bytes);
  }

  // DEADLINE_EXCEEDED when this cancelled the call, else OK.
  absl::Status status() ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    if (!expired_) return absl::OkStatus();
    return absl::DeadlineExceededError(
        absl::StrCat("call exceeded its deadline of ", absl::FormatDuration(deadline_ - start_),
                     " (", absl::FormatDuration(options_.timeout), " plus ", payload_bytes_,
                     " bytes at ", options_.min_bytes_per_second, " bytes/s)"));
  }

 private:
  void Watch() ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    while (!done_) {
      if (absl::Now() >= deadline_) {
        expired_ = true;
        context_->TryCancel();
        return;
      }
      // A deadline far off (or infinite) is looked at again hourly.
      changed_.WaitWithDeadline(&mu_, std::min(deadline_, absl::Now() + absl::Hours(1)));
    }
  }

  const ClientOptions& options_;
  grpc::ClientContext* const context_;
  const absl::Time start_;
  Mutex mu_;
  CondVar changed_;
  absl::Time deadline_ ABSL_GUARDED_BY(mu_);
  uint64_t payload_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool expired_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Create(const std::string& target,
                                                       ClientOptions options) {
  if (target.empty()) return absl::InvalidArgumentError("empty target");
  if (absl::Status status = ValidateTarget(target); !status.ok()) return status;
  if (absl::Status status = ValidateOptions(options); !status.ok()) return status;
  if (absl::Status status = internal::LoadToken(&options); !status.ok()) return status;
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      internal::ChannelCredentials(options);
  if (!credentials.ok()) return credentials.status();
  std::vector<std::unique_ptr<Connection>> connections;
  for (int i = 0; i < options.streams; ++i) {
    auto connection = std::make_unique<Connection>();
    connection->channel = internal::NewChannel(target, *credentials, options);
    connection->stub = v1::ParameterService::NewStub(connection->channel);
    connections.push_back(std::move(connection));
  }
  return absl::WrapUnique(new Client(options, std::move(connections)));
}

absl::StatusOr<std::unique_ptr<Client>> Client::CreateWithChannel(
    std::shared_ptr<grpc::Channel> channel, ClientOptions options) {
  if (channel == nullptr) return absl::InvalidArgumentError("null channel");
  if (absl::Status status = ValidateOptions(options); !status.ok()) return status;
  if (absl::Status status = internal::LoadToken(&options); !status.ok()) return status;
  std::vector<std::unique_ptr<Connection>> connections;
  auto connection = std::make_unique<Connection>();
  connection->channel = std::move(channel);
  connection->stub = v1::ParameterService::NewStub(connection->channel);
  connections.push_back(std::move(connection));
  return absl::WrapUnique(new Client(options, std::move(connections)));
}

Client::Client(ClientOptions options, std::vector<std::unique_ptr<Connection>> connections)
    : options_(options),
      connections_(std::move(connections)),
      default_client_id_(absl::StrCat(
          "fusedps-client-", absl::Hex(absl::Uniform<uint64_t>(absl::BitGen()), absl::kZeroPad16))),
      last_sequence_number_(static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()))) {}

Client::~Client() = default;

absl::Status Client::WaitForReady(absl::Duration timeout) {
  const auto deadline = absl::ToChronoTime(absl::Now() + timeout);
  size_t connected = 0;
  for (const std::unique_ptr<Connection>& connection : connections_) {
    if (connection->channel->WaitForConnected(deadline)) ++connected;
  }
  if (connected == connections_.size()) return absl::OkStatus();
  return absl::DeadlineExceededError(absl::StrCat(connected, " of ", connections_.size(),
                                                  " channels connected within ",
                                                  absl::FormatDuration(timeout)));
}

absl::StatusOr<RegisterParamGroupResult> Client::RegisterParamGroup(
    const std::string& name, const ParamGroupOptions& options) {
  v1::RegisterParamGroupRequest request;
  request.set_model(options_.model);
  request.mutable_param_group()->set_name(name);
  *request.mutable_param_group()->mutable_hyperparameters() =
      internal::ToProtoHyperparameters(options);
  v1::RegisterParamGroupResponse response;
  grpc::ClientContext context;
  ConfigureContext(options_, &context);
  absl::Status status =
      ToAbslStatus(connection(0).stub->RegisterParamGroup(&context, request, &response));
  if (!status.ok()) return status;
  return RegisterParamGroupResult{response.created(),
                                  internal::FromProtoParamGroup(response.param_group())};
}

absl::StatusOr<RegisterTensorsResult> Client::RegisterTensors(
    absl::Span<const TensorInit> tensors) {
  return RegisterTensors(tensors, std::string());
}

absl::StatusOr<RegisterTensorsResult> Client::RegisterTensors(absl::Span<const TensorInit> tensors,
                                                              const std::string& plan_hash) {
  if (tensors.empty()) return absl::InvalidArgumentError("RegisterTensors needs a tensor");
  std::vector<uint64_t> numels;
  numels.reserve(tensors.size());
  absl::flat_hash_set<absl::string_view> names;
  for (const TensorInit& tensor : tensors) {
    // Checked here too, since with streams > 1 two calls could not see each other's names.
    if (!names.insert(tensor.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", tensor.name, " is listed twice"));
    }
    absl::StatusOr<uint64_t> numel = internal::NumElements(tensor.shape);
    if (!numel.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", tensor.name, ": ", numel.status().message()));
    }
    if (tensor.values.size() != *numel) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", tensor.name, " has ",
                                                     tensor.values.size(), " values for ", *numel,
                                                     " elements"));
    }
    numels.push_back(*numel);
  }
  const std::vector<std::vector<size_t>> groups =
      internal::PartitionTensors(numels, options_.streams);
  std::vector<RegisterTensorsResult> results(groups.size());
  absl::Status status = RunConcurrently(groups.size(), [&](size_t i) {
    absl::StatusOr<RegisterTensorsResult> result =
        RegisterTensorsOnce(connection(i), tensors, groups[i], plan_hash);
    if (!result.ok()) return result.status();
    results[i] = *result;
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  RegisterTensorsResult total;
  for (const RegisterTensorsResult& result : results) {
    total.tensors_created += result.tensors_created;
    total.tensors_existing += result.tensors_existing;
    total.version = std::max(total.version, result.version);
  }
  return total;
}

absl::StatusOr<RegisterTensorsResult> Client::RegisterTensorsOnce(
    Connection& connection, absl::Span<const TensorInit> tensors, absl::Span<const size_t> indices,
    const std::string& plan_hash) {
  v1::RegisterTensorsRequest message;
  message.mutable_header()->set_plan_hash(plan_hash);
  message.mutable_header()->set_model(options_.model);
  std::vector<TensorExtent> extents;
  std::vector<const std::string*> names;
  for (size_t index : indices) {
    const TensorInit& tensor = tensors[index];
    v1::TensorSpec* spec = message.mutable_header()->add_tensors();
    spec->set_name(tensor.name);
    spec->mutable_shape()->Add(tensor.shape.begin(), tensor.shape.end());
    spec->set_param_group(tensor.param_group);
    extents.push_back({tensor.values.size(), tensor.name.size()});
    names.push_back(&tensor.name);
  }
  absl::StatusOr<std::vector<MessagePlan>> plan =
      internal::PlanChunks(extents, sizeof(float), options_.max_chunk_bytes);
  if (!plan.ok()) return plan.status();

  uint64_t payload_bytes = 0;
  for (const TensorExtent& extent : extents) payload_bytes += extent.numel * sizeof(float);
  v1::RegisterTensorsResponse response;
  grpc::ClientContext context;
  ConfigureContext(options_, &context, payload_bytes);
  std::unique_ptr<grpc::ClientWriter<v1::RegisterTensorsRequest>> writer =
      connection.stub->RegisterTensors(&context, &response);
  const bool writes_ok = WriteChunked(
      *writer, std::move(message), *plan, names, [&](const ChunkSpan& span, std::string* data) {
        const absl::Span<const float> values = tensors[indices[span.tensor]].values;
        internal::EncodeElements(values.subspan(span.offset, span.numel), DType::kFloat32, data);
      });
  absl::Status status = FinishWrites(*writer, writes_ok);
  if (!status.ok()) return status;
  return RegisterTensorsResult{response.tensors_created(), response.tensors_existing(),
                               response.version()};
}

absl::StatusOr<PushResult> Client::PushGradients(const PushOptions& options,
                                                 absl::Span<const TensorGrad> grads) {
  // An empty tensor list would mean "every tensor" on the wire.
  if (grads.empty()) return absl::InvalidArgumentError("PushGradients needs a tensor");
  v1::PushGradientsRequest message;
  v1::PushHeader* header = message.mutable_header();
  header->set_client_id(options.client_id);
  header->set_sequence_number(options.sequence_number);
  header->set_grad_dtype(internal::ToProtoDType(options.grad_dtype));
  if (options.grad_scale) header->set_grad_scale(*options.grad_scale);
  header->set_base_version(options.base_version);
  header->set_plan_hash(options.plan_hash);
  header->set_model(options_.model);
  std::vector<TensorExtent> extents;
  std::vector<const std::string*> names;
  extents.reserve(grads.size());
  names.reserve(grads.size());
  for (const TensorGrad& grad : grads) {
    header->add_tensors(grad.name);
    extents.push_back({grad.grads.size(), grad.name.size()});
    names.push_back(&grad.name);
  }
  absl::StatusOr<std::vector<MessagePlan>> plan =
      internal::PlanChunks(extents, ElementBytes(options.grad_dtype), options_.max_chunk_bytes);
  if (!plan.ok()) return plan.status();

  // With several streams the push travels as that many parts, one per connection, at once;
  // the server applies it once. Parts need the push named: a client id and a sequence number.
  const size_t parts = std::min<size_t>(PartsOf(options), std::max<size_t>(plan->size(), 1));
  if (parts > 1) {
    if (options.client_id.empty()) header->set_client_id(default_client_id_);
    if (options.sequence_number == 0) header->set_sequence_number(++last_sequence_number_);
    header->set_part_count(static_cast<uint32_t>(parts));
  }
  std::vector<v1::PushGradientsResponse> responses(parts);
  std::vector<absl::Status> statuses(parts);
  // Each part's own status is kept below; RunConcurrently's first error is not the one wanted.
  (void)RunConcurrently(parts, [&](size_t p) {
    std::vector<MessagePlan> share;  // Messages p, p + parts, ...
    uint64_t share_elements = 0;
    for (size_t m = p; m < plan->size(); m += parts) {
      share.push_back((*plan)[m]);
      for (const ChunkSpan& span : (*plan)[m]) share_elements += span.numel;
    }
    v1::PushGradientsRequest first = message;
    if (parts > 1) first.mutable_header()->set_part_index(static_cast<uint32_t>(p));
    grpc::ClientContext context;
    ConfigureContext(options_, &context, share_elements * ElementBytes(options.grad_dtype));
    std::unique_ptr<grpc::ClientWriter<v1::PushGradientsRequest>> writer =
        connection(p).stub->PushGradients(&context, &responses[p]);
    const bool writes_ok = WriteChunked(
        *writer, std::move(first), share, names, [&](const ChunkSpan& span, std::string* data) {
          internal::EncodeElements(grads[span.tensor].grads.subspan(span.offset, span.numel),
                                   options.grad_dtype, data);
        });
    statuses[p] = FinishWrites(*writer, writes_ok);
    return statuses[p];
  });
  if (absl::Status status = internal::PushPartsStatus(statuses); !status.ok()) return status;
  return internal::FromProtoPushResult(responses[0]);
}

absl::StatusOr<PullResult> Client::PullParameters(const PullOptions& options) {
  if (options_.streams > 1 && options.tensors.size() != 1) {
    absl::StatusOr<TensorList> listing = ListTensors();
    if (!listing.ok()) return listing.status();
    absl::flat_hash_map<std::string, uint64_t> numel_of;
    for (const TensorInfo& info : listing->tensors) numel_of[info.name] = info.numel;
    std::vector<std::string> names = options.tensors;
    if (names.empty()) {
      for (const TensorInfo& info : listing->tensors) names.push_back(info.name);
    }
    std::vector<uint64_t> numels;
    for (const std::string& name : names) {
      auto it = numel_of.find(name);
      numels.push_back(it == numel_of.end() ? 0 : it->second);  // The server says NOT_FOUND.
    }
    const std::vector<std::vector<size_t>> groups =
        internal::PartitionTensors(numels, options_.streams);
    if (groups.size() > 1) {
      std::vector<PullResult> parts(groups.size());
      absl::Status status = RunConcurrently(groups.size(), [&](size_t i) {
        PullOptions part = options;
        part.tensors.clear();
        for (size_t index : groups[i]) part.tensors.push_back(names[index]);
        absl::StatusOr<PullResult> result = PullOnce(connection(i), part);
        if (!result.ok()) return result.status();
        parts[i] = *std::move(result);
        return absl::OkStatus();
      });
      if (!status.ok()) return status;
      const bool one_version = std::all_of(parts.begin(), parts.end(), [&](const PullResult& p) {
        return p.version == parts[0].version;
      });
      if (one_version) {
        PullResult merged = std::move(parts[0]);
        for (size_t i = 1; i < parts.size(); ++i) merged.tensors.merge(parts[i].tensors);
        return merged;
      }
      // A push landed between the calls: read everything at once instead.
    }
  }
  return PullOnce(connection(0), options);
}

absl::StatusOr<PullResult> Client::PullOnce(Connection& connection, const PullOptions& options) {
  v1::PullParametersRequest request;
  request.set_model(options_.model);
  for (const std::string& name : options.tensors) request.add_tensors(name);
  request.set_dtype(internal::ToProtoDType(options.dtype));
  request.set_field(internal::ToProtoField(options.field));
  request.set_max_chunk_bytes(internal::PullChunkBytes(options_.max_chunk_bytes));
  grpc::ClientContext context;
  internal::ConfigureCall(options_, &context);
  // The size is known from the reply only, so the deadline grows as the reply announces it.
  GrowingDeadline deadline(options_, &context);
  std::unique_ptr<grpc::ClientReader<v1::PullParametersResponse>> reader =
      connection.stub->PullParameters(&context, request);

  internal::PullAssembler assembler(options.dtype);
  absl::Status malformed;
  v1::PullParametersResponse response;
  while (malformed.ok() && reader->Read(&response)) {
    malformed = assembler.Add(response);
    deadline.SetPayload(assembler.announced_bytes());
  }
  if (!malformed.ok()) {
    context.TryCancel();
    while (reader->Read(&response)) {
    }
    reader->Finish().IgnoreError();
    return malformed;
  }
  absl::Status status = ToAbslStatus(reader->Finish());
  if (!status.ok()) {
    absl::Status expired = deadline.status();
    return expired.ok() ? status : expired;
  }
  if (absl::Status finished = assembler.Finish(options.tensors); !finished.ok()) return finished;
  return std::move(assembler).result();
}

}  // namespace fusedps::client
