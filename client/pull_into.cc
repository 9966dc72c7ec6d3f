// Client::PullInto (fusedps/client.h): a pull whose chunks are copied once, from gRPC's
// receive slices straight into the caller's memory, as raw elements of the wire dtype.
#include <cstring>
#include <optional>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/connection.h"
#include "client/raw_call.h"
#include "client/wire.h"
#include "common/byte_buffer_view.h"
#include "common/slice_input_stream.h"
#include "common/tensor_chunk_reader.h"
#include "fusedps/client.h"
#include "fusedps/v1/parameter_service.pb.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace fusedps::client {
namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;

constexpr char kPullMethod[] = "/fusedps.v1.ParameterService/PullParameters";

constexpr int kResponseHeader = v1::PullParametersResponse::kHeaderFieldNumber;
constexpr int kResponseChunks = v1::PullParametersResponse::kChunksFieldNumber;
constexpr int kResponseTensors = v1::PullParametersResponse::kTensorsFieldNumber;

absl::Status Malformed(absl::string_view what) {
  return absl::InternalError(absl::StrCat("malformed pull reply: ", what));
}

// Reads a pull's reply messages into the targets, checking what PullAssembler checks (wire.h):
// one header first, each tensor's TensorInfo before its chunks and once, the reply's tensor
// count, and chunks that cover each tensor exactly (here: in order, as the server sends them).
class PullReader {
 public:
  // `workspace`: the memory of the pull's workspace, when it names one.
  PullReader(absl::Span<const PullTarget> targets, size_t element_bytes,
             absl::Span<const char> workspace)
      : targets_(targets),
        element_bytes_(element_bytes),
        workspace_(workspace),
        tensors_(targets.size()) {
    for (size_t i = 0; i < targets.size(); ++i) index_.emplace(targets[i].name, i);
  }

  absl::Status Add(const grpc::ByteBuffer& message) {
    const ByteBufferView view(message);
    if (!view.ok()) return absl::InternalError("cannot read the pull reply's slices");
    SliceInputStream stream(view.views());
    CodedInputStream in(&stream);
    for (uint32_t tag = in.ReadTag(); tag != 0; tag = in.ReadTag()) {
      if (IsWireField(tag, kResponseHeader, WireFormatLite::WIRETYPE_LENGTH_DELIMITED)) {
        v1::PullHeader header;
        std::string bytes;
        if (!WireFormatLite::ReadString(&in, &bytes) || !header.ParseFromString(bytes)) {
          return Malformed("header");
        }
        if (has_header_) return Malformed("a second header");
        has_header_ = true;
        version_ = header.version();
        tensor_count_ = header.tensor_count();
        for (const v1::TensorInfo& info : header.tensors()) {
          if (absl::Status s = AddInfo(info); !s.ok()) return s;
        }
      } else if (IsWireField(tag, kResponseTensors, WireFormatLite::WIRETYPE_LENGTH_DELIMITED)) {
        v1::TensorInfo info;
        std::string bytes;
        if (!WireFormatLite::ReadString(&in, &bytes) || !info.ParseFromString(bytes)) {
          return Malformed("tensors");
        }
        if (absl::Status s = AddInfo(info); !s.ok()) return s;
      } else if (IsWireField(tag, kResponseChunks, WireFormatLite::WIRETYPE_LENGTH_DELIMITED)) {
        uint32_t length = 0;
        if (!in.ReadVarint32(&length) || length > INT_MAX) return Malformed("chunks");
        const CodedInputStream::Limit limit = in.PushLimit(static_cast<int>(length));
        if (absl::Status s = ReadChunk(in); !s.ok()) return s;
        in.PopLimit(limit);
      } else if (!WireFormatLite::SkipField(&in, tag)) {
        return Malformed("an unknown field");
      }
    }
    if (!in.ConsumedEntireMessage()) return Malformed("truncated");
    return absl::OkStatus();
  }

  // The reply is complete: every target's TensorInfo and every element came.
  absl::StatusOr<PullIntoResult> Finish() const {
    if (!has_header_) return Malformed("no header");
    if (tensor_count_ != 0 && infos_ != tensor_count_) {
      return Malformed(absl::StrCat(infos_, " TensorInfo for a tensor_count of ", tensor_count_));
    }
    PullIntoResult result;
    result.version = version_;
    for (size_t i = 0; i < targets_.size(); ++i) {
      if (!tensors_[i].info) return Malformed(absl::StrCat("no TensorInfo for ", targets_[i].name));
      if (tensors_[i].received != targets_[i].numel) {
        return Malformed(absl::StrCat("chunks of ", targets_[i].name, " cover ",
                                      tensors_[i].received, " of ", targets_[i].numel,
                                      " elements"));
      }
      result.steps.push_back(tensors_[i].step);
    }
    return result;
  }

 private:
  struct Tensor {
    bool info = false;
    int64_t step = 0;
    uint64_t received = 0;  // Elements, in order.
  };

  absl::Status AddInfo(const v1::TensorInfo& info) {
    if (!has_header_) return Malformed("TensorInfo before the header");
    auto it = index_.find(info.name());
    if (it == index_.end()) return Malformed(absl::StrCat("unrequested tensor ", info.name()));
    Tensor& tensor = tensors_[it->second];
    if (tensor.info) return Malformed(absl::StrCat("a second TensorInfo for ", info.name()));
    const PullTarget& target = targets_[it->second];
    if (info.numel() != target.numel) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", info.name(), " has ", info.numel(),
                                                     " elements on the server; its target ",
                                                     target.numel));
    }
    tensor.info = true;
    tensor.step = info.step();
    ++infos_;
    return absl::OkStatus();
  }

  // One TensorChunk, whose length limit `in` has pushed: its payload straight into the target.
  // A chunk of a pull into the workspace names where the server wrote its bytes, which must be
  // its target's own place there: nothing is copied on the host (the workspace may be device
  // memory), and another place is DATA_LOSS.
  absl::Status ReadChunk(CodedInputStream& in) {
    const auto in_place = [this](char* destination, uint64_t workspace_offset, uint64_t bytes) {
      if (destination != workspace_.data() + workspace_offset) {
        return absl::DataLossError(absl::StrCat("the pull into the workspace answered with ", bytes,
                                                " bytes at workspace byte ", workspace_offset,
                                                ", not where the chunk's target lies"));
      }
      return absl::OkStatus();
    };
    const DeviceChunkFn check_place = in_place;  // A reference: in_place outlives it.
    return ReadTensorChunk(
        in,
        [this](absl::string_view tensor, uint64_t offset, uint64_t bytes) {
          return Claim(std::string(tensor), offset, bytes);
        },
        [](char*, uint64_t) { return absl::OkStatus(); }, Malformed,
        ChunkWorkspace(workspace_, &check_place));
  }

  // Where a chunk's `bytes` of payload go: it must continue its tensor where the last ended.
  absl::StatusOr<char*> Claim(const std::string& name, uint64_t offset, uint64_t bytes) {
    auto it = index_.find(name);
    if (it == index_.end()) return Malformed(absl::StrCat("a chunk of unrequested tensor ", name));
    Tensor& tensor = tensors_[it->second];
    const PullTarget& target = targets_[it->second];
    if (!tensor.info) return Malformed(absl::StrCat("a chunk of ", name, " before its TensorInfo"));
    if (bytes % element_bytes_ != 0 || offset != tensor.received ||
        bytes / element_bytes_ > target.numel - tensor.received) {
      return Malformed(absl::StrCat("chunk of ", name, " at element ", offset, " with ", bytes,
                                    " bytes, after ", tensor.received, " of ", target.numel,
                                    " elements"));
    }
    tensor.received += bytes / element_bytes_;
    return static_cast<char*>(target.data) + offset * element_bytes_;
  }

  const absl::Span<const PullTarget> targets_;
  const size_t element_bytes_;
  const absl::Span<const char> workspace_;
  absl::flat_hash_map<std::string, size_t> index_;
  std::vector<Tensor> tensors_;
  bool has_header_ = false;
  uint64_t version_ = 0;
  uint32_t tensor_count_ = 0;
  uint32_t infos_ = 0;
};

}  // namespace

absl::StatusOr<PullIntoResult> Client::PullInto(const PullOptions& options,
                                                absl::Span<const PullTarget> targets, int stream) {
  if (targets.empty()) return absl::InvalidArgumentError("PullInto needs a target");
  if (options.dtype != DType::kFloat32 && options.dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError("PullInto pulls fp32 or bf16");
  }
  v1::PullParametersRequest request;
  request.set_model(options_.model);
  uint64_t payload = 0;
  for (const PullTarget& target : targets) {
    if (target.data == nullptr && target.numel > 0) {
      return absl::InvalidArgumentError(absl::StrCat("target ", target.name, " has no memory"));
    }
    request.add_tensors(target.name);
    payload += target.numel * ElementBytes(options.dtype);
  }
  request.set_dtype(internal::ToProtoDType(options.dtype));
  request.set_field(internal::ToProtoField(options.field));
  request.set_max_chunk_bytes(internal::PullChunkBytes(options_.max_chunk_bytes));
  // Through the workspace when every target lies in it (the server writes them there).
  const Workspace workspace = this->workspace();
  absl::Span<const char> workspace_memory;
  if (!workspace.id.empty()) {
    std::vector<uint64_t> offsets;
    for (const PullTarget& target : targets) {
      const int64_t at =
          workspace.OffsetOf(target.data, target.numel * ElementBytes(options.dtype));
      if (at < 0) break;
      offsets.push_back(static_cast<uint64_t>(at));
    }
    if (offsets.size() == targets.size()) {
      request.set_workspace(workspace.id);
      for (uint64_t at : offsets) request.add_workspace_offsets_bytes(at);
      workspace_memory = absl::Span<const char>(workspace.data, workspace.bytes);
    }
  }

  PullReader reader(targets, ElementBytes(options.dtype), workspace_memory);
  internal::RawCall call(
      connection(static_cast<size_t>(stream)).channel, kPullMethod, options_,
      absl::Now() + internal::CallTimeout(options_, payload),
      [&reader](const grpc::ByteBuffer& message) { return reader.Add(message); });
  const std::string bytes = request.SerializeAsString();
  grpc::Slice slice(bytes);
  call.Write(grpc::ByteBuffer(&slice, 1), bytes.size());
  call.WritesDone();
  if (absl::Status status = call.Await(); !status.ok()) return status;
  return reader.Finish();
}

}  // namespace fusedps::client
