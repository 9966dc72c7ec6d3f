#include "client/fake_parameter_service.h"

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/wire.h"
#include "common/half_float.h"

namespace fusedps::client::testing {
namespace {

grpc::Status Invalid(const std::string& message) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, message);
}

// Blocks until the call is cancelled (by its client, its deadline or the server's shutdown).
void WaitForCancellation(grpc::ServerContext* context) {
  while (!context->IsCancelled()) absl::SleepFor(absl::Milliseconds(5));
}

// Element i of wire data in `dtype`, as fp32.
float Element(const void* data, DType dtype, uint64_t i) {
  switch (dtype) {
    case DType::kBFloat16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kFloat16:
      return Float16ToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kFloat32:
    default:
      return static_cast<const float*>(data)[i];
  }
}

// The chunks of one call, scattered into fp32 arrays; every element exactly once.
struct Received {
  std::map<std::string, std::vector<float>*> targets;
  std::map<std::string, std::vector<bool>> seen;
  uint64_t bytes = 0;

  grpc::Status Add(const v1::TensorChunk& chunk, DType dtype) {
    auto it = targets.find(chunk.tensor());
    if (it == targets.end()) return Invalid("chunk of an unnamed tensor " + chunk.tensor());
    std::vector<float>& values = *it->second;
    std::vector<bool>& seen_elements = seen[chunk.tensor()];
    seen_elements.resize(values.size());
    const size_t size = ElementBytes(dtype);
    const uint64_t n = chunk.data().size() / size;
    if (n == 0 || chunk.data().size() % size != 0 || chunk.offset() + n > values.size()) {
      return Invalid("bad chunk of " + chunk.tensor());
    }
    for (uint64_t i = 0; i < n; ++i) {
      if (seen_elements[chunk.offset() + i]) return Invalid("overlap in " + chunk.tensor());
      seen_elements[chunk.offset() + i] = true;
      values[chunk.offset() + i] = Element(chunk.data().data(), dtype, i);
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

void FillInfo(const std::string& name, const FakeParameterService::Tensor& tensor,
              v1::TensorInfo* info) {
  info->set_name(name);
  info->mutable_shape()->Add(tensor.shape.begin(), tensor.shape.end());
  info->set_param_group(tensor.param_group);
  info->set_step(tensor.step);
  info->set_numel(tensor.values.size());
}

// The chunks of one tensor, last first, one per message.
std::vector<v1::PullParametersResponse> ChunkMessages(const std::string& name,
                                                      const std::vector<float>& values, bool bf16,
                                                      uint64_t per_chunk, bool drop_first) {
  std::vector<v1::PullParametersResponse> messages;
  const uint64_t chunks = (values.size() + per_chunk - 1) / per_chunk;
  for (uint64_t c = chunks; c-- > (drop_first ? 1 : 0);) {
    v1::TensorChunk* chunk = messages.emplace_back().add_chunks();
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
  }
  return messages;
}

}  // namespace

grpc::Status FakeParameterService::RegisterParamGroup(grpc::ServerContext*,
                                                      const v1::RegisterParamGroupRequest* request,
                                                      v1::RegisterParamGroupResponse* response) {
  response->set_created(true);
  *response->mutable_param_group() = request->param_group();
  response->mutable_param_group()->mutable_hyperparameters()->set_lr(
      request->param_group().hyperparameters().has_lr()
          ? request->param_group().hyperparameters().lr()
          : 1e-3);
  return grpc::Status::OK;
}

grpc::Status FakeParameterService::RegisterTensors(
    grpc::ServerContext* context, grpc::ServerReader<v1::RegisterTensorsRequest>* reader,
    v1::RegisterTensorsResponse* response) {
  NotePeer(context);
  std::map<std::string, Tensor> incoming;
  std::vector<std::string> order;
  std::string plan_hash;
  Received received;
  v1::RegisterTensorsRequest request;
  for (bool first = true; reader->Read(&request); first = false) {
    NoteRequest(request.ByteSizeLong());
    if (first != request.has_header()) return Invalid("header must come first, once");
    if (first) plan_hash = request.header().plan_hash();
    for (const v1::TensorSpec& spec : request.header().tensors()) {
      Tensor& tensor = incoming[spec.name()];
      order.push_back(spec.name());
      tensor.shape.assign(spec.shape().begin(), spec.shape().end());
      tensor.param_group = spec.param_group().empty() ? "default" : spec.param_group();
      tensor.values.resize(internal::NumElements(tensor.shape).value());
      received.targets[spec.name()] = &tensor.values;
    }
    for (const v1::TensorChunk& chunk : request.chunks()) {
      if (grpc::Status s = received.Add(chunk, DType::kFloat32); !s.ok()) return s;
    }
  }
  if (grpc::Status s = received.Finish(); !s.ok()) return s;
  MutexLock lock(&mu_);
  register_plan_hashes_.push_back(plan_hash);
  for (const std::string& name : order) {
    if (tensors_.count(name) == 0) registration_order_.push_back(name);
    tensors_[name] = std::move(incoming[name]);
  }
  response->set_tensors_created(static_cast<uint32_t>(incoming.size()));
  response->set_version(version_);
  return grpc::Status::OK;
}

grpc::Status FakeParameterService::PushGradients(
    grpc::ServerContext* context, grpc::ServerReader<v1::PushGradientsRequest>* reader,
    v1::PushGradientsResponse* response) {
  NotePeer(context);
  MutexLock lock(&mu_);
  push_messages_ = 0;
  std::map<std::string, std::vector<float>> grads;
  Received received;
  DType dtype = DType::kFloat32;
  v1::PushGradientsRequest request;
  for (bool first = true; reader->Read(&request); first = false) {
    NoteRequest(request.ByteSizeLong());
    ++push_messages_;
    if (first != request.has_header()) return Invalid("header must come first, once");
    if (first) {
      dtype = static_cast<DType>(request.header().grad_dtype());
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
  response->set_round_workers(round_workers_);
  return grpc::Status::OK;
}

grpc::Status FakeParameterService::PullParameters(
    grpc::ServerContext* context, const v1::PullParametersRequest* request,
    grpc::ServerWriter<v1::PullParametersResponse>* writer) {
  NotePeer(context);
  const uint32_t max_chunk_bytes = request->max_chunk_bytes();
  if (max_chunk_bytes != 0 && (max_chunk_bytes < internal::kMinPullChunkBytes ||
                               max_chunk_bytes > internal::kMaxPullChunkBytes)) {
    return Invalid(absl::StrCat("max_chunk_bytes must be 0 or 16 B..4 MiB, not ", max_chunk_bytes));
  }
  const bool bf16 = request->dtype() == v1::DTYPE_BFLOAT16;
  const uint64_t per_chunk = (max_chunk_bytes == 0 ? 1 << 20 : max_chunk_bytes) / (bf16 ? 2 : 4);
  const bool legacy = legacy_pull_;

  // The whole reply, built under the lock and sent without it.
  std::vector<v1::PullParametersResponse> messages(1);
  {
    MutexLock lock(&mu_);
    std::vector<std::string> names(request->tensors().begin(), request->tensors().end());
    if (names.empty()) names = registration_order_;
    v1::PullHeader* header = messages[0].mutable_header();
    header->set_version(version_);
    header->set_dtype(bf16 ? v1::DTYPE_BFLOAT16 : v1::DTYPE_FLOAT32);
    if (!legacy) {
      header->set_tensor_count(static_cast<uint32_t>(names.size()) + pull_tensor_count_surplus_);
    }
    std::vector<v1::PullParametersResponse> chunk_messages;
    for (size_t i = 0; i < names.size(); ++i) {
      auto it = tensors_.find(names[i]);
      if (it == tensors_.end()) {
        return grpc::Status(grpc::StatusCode::NOT_FOUND, "no tensor named " + names[i]);
      }
      std::vector<v1::PullParametersResponse> chunks =
          ChunkMessages(names[i], it->second.values, bf16, per_chunk, drop_first_pull_chunk_);
      const bool early_chunk = i + 1 == names.size() && pull_chunk_before_info_ && !chunks.empty();
      if (early_chunk) {
        messages.push_back(std::move(chunks.back()));  // The tensor's first chunk, too soon.
        chunks.pop_back();
      }
      if (legacy || static_cast<int>(i) < kPullInfosPerMessage) {
        FillInfo(names[i], it->second, messages[0].mutable_header()->add_tensors());
      } else {
        if (i % kPullInfosPerMessage == 0 || early_chunk) messages.emplace_back();
        FillInfo(names[i], it->second, messages.back().add_tensors());
      }
      for (v1::PullParametersResponse& chunk : chunks) chunk_messages.push_back(std::move(chunk));
    }
    for (v1::PullParametersResponse& chunk : chunk_messages) messages.push_back(std::move(chunk));
  }
  for (size_t m = 0; m < messages.size(); ++m) {
    const int infos = messages[m].header().tensors_size() + messages[m].tensors_size();
    max_pull_infos_per_message_ = std::max<int>(max_pull_infos_per_message_, infos);
    if (m > 0) {
      if (hang_pull_after_header_) {
        WaitForCancellation(context);
        return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
      }
      absl::SleepFor(absl::Nanoseconds(pull_message_delay_nanos_.load()));
    }
    if (!writer->Write(messages[m])) break;
  }
  return grpc::Status::OK;
}

grpc::Status FakeParameterService::GetInfo(grpc::ServerContext* context, const v1::GetInfoRequest*,
                                           v1::GetInfoResponse* response) {
  if (hang_get_info_) {
    WaitForCancellation(context);
    return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
  }
  MutexLock lock(&mu_);
  response->set_version(version_);
  response->set_backend("fake");
  response->set_tensor_count(static_cast<uint32_t>(tensors_.size()));
  *response->mutable_consistency() = consistency_;
  if (!register_plan_hashes_.empty()) response->set_plan_hash(register_plan_hashes_.front());
  return grpc::Status::OK;
}

grpc::Status FakeParameterService::ListTensors(grpc::ServerContext*,
                                               const v1::ListTensorsRequest* request,
                                               v1::ListTensorsResponse* response) {
  ++list_calls_;
  MutexLock lock(&mu_);
  size_t begin = 0;
  if (!request->page_token().empty() && !absl::SimpleAtoi(request->page_token(), &begin)) {
    return Invalid("bad page_token " + request->page_token());
  }
  if (begin > registration_order_.size()) return Invalid("page_token past the end");
  const size_t page_size = request->page_size() == 0
                               ? kListPageSize
                               : std::min<size_t>(request->page_size(), kListPageSize);
  const size_t end = std::min(begin + page_size, registration_order_.size());
  response->set_version(version_);
  for (size_t i = begin; i < end; ++i) {
    FillInfo(registration_order_[i], tensors_.at(registration_order_[i]), response->add_tensors());
  }
  if (end < registration_order_.size()) response->set_next_page_token(absl::StrCat(end));
  return grpc::Status::OK;
}

grpc::Status FakeParameterService::SetHyperparameters(grpc::ServerContext*,
                                                      const v1::SetHyperparametersRequest* request,
                                                      v1::SetHyperparametersResponse* response) {
  if (request->param_group() != "default") {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        "no param group named " + request->param_group());
  }
  response->mutable_param_group()->set_name("default");
  *response->mutable_param_group()->mutable_hyperparameters() = request->hyperparameters();
  return grpc::Status::OK;
}

std::map<std::string, FakeParameterService::Tensor> FakeParameterService::tensors() {
  MutexLock lock(&mu_);
  return tensors_;
}

size_t FakeParameterService::max_request_bytes() {
  MutexLock lock(&request_mu_);
  return max_request_bytes_;
}

size_t FakeParameterService::peer_count() {
  MutexLock lock(&request_mu_);
  return peers_.size();
}

v1::PushHeader FakeParameterService::last_push_header() {
  MutexLock lock(&mu_);
  return last_push_header_;
}

std::vector<std::string> FakeParameterService::register_plan_hashes() {
  MutexLock lock(&mu_);
  return register_plan_hashes_;
}

void FakeParameterService::set_consistency(const v1::Consistency& consistency) {
  MutexLock lock(&mu_);
  consistency_ = consistency;
}

void FakeParameterService::NoteRequest(size_t bytes) {
  MutexLock lock(&request_mu_);
  max_request_bytes_ = std::max(max_request_bytes_, bytes);
}

void FakeParameterService::NotePeer(grpc::ServerContext* context) {
  MutexLock lock(&request_mu_);
  peers_.insert(context->peer());
}

}  // namespace fusedps::client::testing
