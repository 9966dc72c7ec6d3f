// wire.h: how the client lays tensors out on the wire. Internal to client/; not installed.
//
// These are the pure pieces of the client, kept apart from gRPC calls so that they can be tested
// without a server: planning which element ranges of which tensors go in which request message,
// splitting tensors across concurrent calls, converting elements to and from wire dtypes,
// reassembling a pull's reply, a call's deadline, and translating between the public structs and
// the proto messages.
//
// Usage:
//   std::vector<TensorExtent> extents = {{1 << 22, 5}, {10, 3}};
//   std::vector<MessagePlan> plan = PlanChunks(extents, 4, 1 << 20).value();
//   for (const MessagePlan& message : plan)
//     for (const ChunkSpan& span : message) ... elements [span.offset, span.offset + span.numel)
#ifndef FUSEDPS_CLIENT_WIRE_H_
#define FUSEDPS_CLIENT_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "fusedps/client.h"
#include "fusedps/v1/parameter_service.pb.h"

namespace grpc {
class Status;
}  // namespace grpc

namespace fusedps::client::internal {

// Max send and receive message size of the client's channels.
inline constexpr size_t kMaxMessageBytes = 16 << 20;
// Upper bound of ClientOptions::max_chunk_bytes: leaves room for names, framing and a header.
inline constexpr size_t kMaxChunkBytesLimit = 15 << 20;
// The wire API's bounds on a pull's chunk size (PullParametersRequest.max_chunk_bytes).
inline constexpr size_t kMinPullChunkBytes = 16;
inline constexpr size_t kMaxPullChunkBytes = 4 << 20;
// Bytes a TensorChunk spends beside its name and payload, at most: field tags, the length
// prefixes of the submessage, name and data, and the offset varint.
inline constexpr size_t kChunkFramingBytes = 32;
// A message takes no further chunk once names and framing would pass this many bytes, which
// bounds a message's size by max_chunk_bytes + kMaxChunkMetadataBytes (+ one chunk's metadata).
inline constexpr size_t kMaxChunkMetadataBytes = 64 << 10;

// One tensor as the chunk planner sees it.
struct TensorExtent {
  uint64_t numel = 0;
  size_t name_bytes = 0;
};

// Elements [offset, offset + numel) of tensor number `tensor` (an index into the planned list).
struct ChunkSpan {
  size_t tensor = 0;
  uint64_t offset = 0;
  uint64_t numel = 0;

  bool operator==(const ChunkSpan& other) const {
    return tensor == other.tensor && offset == other.offset && numel == other.numel;
  }
};

// The chunks of one request message.
using MessagePlan = std::vector<ChunkSpan>;

// Splits tensors into chunks and packs the chunks into messages, in tensor order, each tensor's
// chunks in offset order. Every element of every tensor lies in exactly one chunk; tensors of
// 0 elements get no chunk. A message carries at most max_chunk_bytes of payload
// (numel * element_bytes summed over its chunks), always at least one element, and takes no
// further chunk once its metadata (name_bytes + kChunkFramingBytes per chunk) would pass
// kMaxChunkMetadataBytes. Every message but the last is full of payload or of metadata.
// Errors: INVALID_ARGUMENT when element_bytes is 0 or max_chunk_bytes < element_bytes.
absl::StatusOr<std::vector<MessagePlan>> PlanChunks(absl::Span<const TensorExtent> tensors,
                                                    size_t element_bytes, size_t max_chunk_bytes);

// Splits tensor indices 0..numels.size()-1 into at most `parts` non-empty groups of about equal
// total numel (largest tensors first, each to the lightest group; an empty tensor counts as
// one element). Each group lists its indices in increasing order; groups are ordered by their
// first index. REQUIRES: parts >= 1.
std::vector<std::vector<size_t>> PartitionTensors(absl::Span<const uint64_t> numels, int parts);

// The number of elements of a tensor of this shape (1 for shape {}).
// Errors: INVALID_ARGUMENT for a negative dim or a count that overflows int64.
absl::StatusOr<uint64_t> NumElements(absl::Span<const int64_t> shape);

// Replaces *out with values in dtype, little-endian, rounded to nearest even.
void EncodeElements(absl::Span<const float> values, DType dtype, std::string* out);

// Widens little-endian elements of dtype into out.
// REQUIRES: data.size() == out.size() * ElementBytes(dtype).
void DecodeElements(absl::string_view data, DType dtype, absl::Span<float> out);

// The chunk size a pull asks for: max_chunk_bytes brought into the wire API's bounds,
// [kMinPullChunkBytes, kMaxPullChunkBytes].
uint32_t PullChunkBytes(size_t max_chunk_bytes);

// How long a call moving payload_bytes of tensor data may take: options.timeout plus
// payload_bytes at options.min_bytes_per_second (nothing more when that is 0), saturating at
// absl::InfiniteDuration(); infinite when options.timeout is.
absl::Duration CallTimeout(const ClientOptions& options, uint64_t payload_bytes);

// Collects a pull's reply (PullParametersResponse messages, in order) into a PullResult, and
// checks it: one header, first; each tensor's TensorInfo (from the header, then from later
// messages' `tensors`) before its first chunk, tensors named once; header.tensor_count of them
// in all when it is set (0, from servers that predate it, means the header holds them all);
// chunks inside their tensor, covering each exactly. Every failed check is INTERNAL with a
// message that starts "malformed pull reply: ".
//
// Usage:
//   PullAssembler assembler(DType::kFloat32);
//   while (reader->Read(&response)) RETURN_IF_ERROR(assembler.Add(response));
//   RETURN_IF_ERROR(assembler.Finish(requested_names));
//   PullResult result = std::move(assembler).result();
class PullAssembler {
 public:
  explicit PullAssembler(DType requested_dtype) : dtype_(requested_dtype) {}

  // Takes one message: its header, then its tensors, then its chunks.
  absl::Status Add(const v1::PullParametersResponse& response);

  // Checks that the reply is complete and holds every tensor of `requested` (empty: no check).
  absl::Status Finish(absl::Span<const std::string> requested) const;

  // Bytes of tensor data the reply has announced so far (numel times the wire dtype's size over
  // the TensorInfo received): the payload a pull's deadline grows with.
  uint64_t announced_bytes() const { return announced_bytes_; }

  PullResult result() && { return std::move(result_); }

 private:
  struct Pending {
    std::vector<float>* values;
    uint64_t received;
  };

  absl::Status AddHeader(const v1::PullHeader& header);
  absl::Status AddInfo(const v1::TensorInfo& info);
  absl::Status AddChunk(const v1::TensorChunk& chunk);

  DType dtype_;
  bool has_header_ = false;
  uint32_t tensor_count_ = 0;  // From the header; 0: the header holds them all.
  uint64_t infos_received_ = 0;
  uint64_t announced_bytes_ = 0;
  PullResult result_;
  absl::flat_hash_map<std::string, Pending> pending_;
};

// Same code and message.
absl::Status ToAbslStatus(const grpc::Status& status);

// The outcome of a push sent as parts: the root cause when any part failed (the first status
// that is not ABORTED: the parts that did not fail themselves get ABORTED), else the first
// error; OK when every part succeeded.
absl::Status PushPartsStatus(absl::Span<const absl::Status> statuses);

// A push's reply as the public struct.
PushResult FromProtoPushResult(const v1::PushGradientsResponse& response);

// Public structs <-> proto messages.
v1::DType ToProtoDType(DType dtype);
absl::StatusOr<DType> FromProtoDType(v1::DType dtype);  // INVALID_ARGUMENT for UNSPECIFIED.
v1::TensorField ToProtoField(TensorField field);
v1::Hyperparameters ToProtoHyperparameters(const ParamGroupOptions& options);
ParamGroupOptions FromProtoHyperparameters(const v1::Hyperparameters& hyper);
ParamGroup FromProtoParamGroup(const v1::ParamGroup& group);
TensorInfo FromProtoTensorInfo(const v1::TensorInfo& info);
// Consistency::mode from the proto's enum: "" for UNSPECIFIED, "mode N" for one unknown here.
Consistency FromProtoConsistency(const v1::Consistency& consistency);
// INVALID_ARGUMENT for a mode other than "async", "sync" and "bounded".
absl::StatusOr<v1::Consistency> ToProtoConsistency(const Consistency& consistency);
ModelInfo FromProtoModel(const v1::ModelInfo& model);

}  // namespace fusedps::client::internal

#endif  // FUSEDPS_CLIENT_WIRE_H_
