// tensor_chunk_reader.h: reads one TensorChunk {string tensor = 1; uint64 offset = 2; bytes data
// = 3} of a serialized message (proto/fusedps/v1/parameter_service.proto) and copies its payload
// once, from the input (gRPC's slices, common/slice_input_stream.h) straight to where it
// belongs. The server reads pushes with it (server/ingest/push_message.cc), the client pulls
// (client/pull_into.cc).
//
// Field numbers are the generated code's (v1::TensorChunk::k*FieldNumber), not copies.
//
// Every protobuf serializer writes a chunk's fields in that order, so `data` is last and its
// destination is known when it starts. A chunk whose `data` is followed by other fields (legal
// protobuf, from an unusual writer) is still read correctly, through a temporary copy. Unknown
// fields are skipped, as protobuf does.
#ifndef FUSEDPS_COMMON_TENSOR_CHUNK_READER_H_
#define FUSEDPS_COMMON_TENSOR_CHUNK_READER_H_

#include <climits>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/workspace_range.h"
#include "fusedps/v1/parameter_service.pb.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace fusedps {

// Whether a wire tag is field `number` of wire type `type`: for readers that walk a message's
// fields by hand, with the generated k*FieldNumber constants.
inline bool IsWireField(uint32_t tag, int number,
                        google::protobuf::internal::WireFormatLite::WireType type) {
  using google::protobuf::internal::WireFormatLite;
  return WireFormatLite::GetTagFieldNumber(tag) == number &&
         WireFormatLite::GetTagWireType(tag) == type;
}

// Where a chunk's `bytes` of payload go: claim(tensor, offset, bytes) checks the chunk and
// returns a destination of `bytes` bytes, or nullptr to drop the payload.
using ClaimChunkFn = absl::FunctionRef<absl::StatusOr<char*>(absl::string_view tensor,
                                                             uint64_t offset, uint64_t bytes)>;
// Called once a claimed destination holds its payload.
using ChunkStagedFn = absl::FunctionRef<absl::Status(char* data, uint64_t bytes)>;
// The caller's error for bytes that are not a TensorChunk; `what` names the part.
using MalformedFn = absl::FunctionRef<absl::Status(absl::string_view what)>;

// A chunk whose bytes lie in a device workspace: claimed as any other, then handed over with
// where its bytes are (workspace_offset, bytes) instead of being copied on the host.
using DeviceChunkFn =
    absl::FunctionRef<absl::Status(char* destination, uint64_t workspace_offset, uint64_t bytes)>;

// The workspace a call's chunks may name (proto OpenWorkspace): its memory (empty: the call
// names none) and, for a device workspace (whose memory the host must not touch), on_device.
struct ChunkWorkspace {
  ChunkWorkspace() = default;
  ChunkWorkspace(absl::Span<const char> host_memory)  // NOLINT(runtime/explicit): a host one.
      : memory(host_memory) {}
  ChunkWorkspace(absl::Span<const char> device_memory, const DeviceChunkFn* on_device_chunk)
      : memory(device_memory), on_device(on_device_chunk) {}

  absl::Span<const char> memory;
  const DeviceChunkFn* on_device = nullptr;
};

// Reads one TensorChunk, whose length limit `in` has pushed: claim, copy, staged. A claim's or
// staged's error is returned as it is. A chunk whose bytes lie in a workspace
// (workspace_offset_bytes, workspace_bytes > 0; proto OpenWorkspace) is copied from
// `workspace`, the call's workspace, or for a device workspace handed to its on_device (and
// not to staged). Errors: INVALID_ARGUMENT for such a chunk when the call names no workspace,
// when it also carries data, or when its range passes the workspace's end.
inline absl::Status ReadTensorChunk(google::protobuf::io::CodedInputStream& in, ClaimChunkFn claim,
                                    ChunkStagedFn staged, MalformedFn malformed,
                                    ChunkWorkspace chunk_workspace = {}) {
  const absl::Span<const char> workspace = chunk_workspace.memory;
  using google::protobuf::internal::WireFormatLite;
  constexpr int kTensor = v1::TensorChunk::kTensorFieldNumber;
  constexpr int kOffset = v1::TensorChunk::kOffsetFieldNumber;
  constexpr int kData = v1::TensorChunk::kDataFieldNumber;
  constexpr int kWorkspaceOffset = v1::TensorChunk::kWorkspaceOffsetBytesFieldNumber;
  constexpr int kWorkspaceBytes = v1::TensorChunk::kWorkspaceBytesFieldNumber;
  uint64_t workspace_offset = 0, workspace_bytes = 0;
  bool has_data = false;
  const auto is = IsWireField;
  std::string tensor;
  uint64_t offset = 0;
  std::optional<std::string> held;  // data that other fields follow (an unusual order)
  bool done = false;                // data went straight to its destination; nothing can follow it
  for (uint32_t tag = in.ReadTag(); tag != 0; tag = in.ReadTag()) {
    if (is(tag, kTensor, WireFormatLite::WIRETYPE_LENGTH_DELIMITED)) {
      if (!WireFormatLite::ReadString(&in, &tensor)) return malformed("chunks.tensor");
    } else if (is(tag, kOffset, WireFormatLite::WIRETYPE_VARINT)) {
      if (!in.ReadVarint64(&offset)) return malformed("chunks.offset");
    } else if (is(tag, kWorkspaceOffset, WireFormatLite::WIRETYPE_VARINT)) {
      if (!in.ReadVarint64(&workspace_offset)) return malformed("chunks.workspace_offset_bytes");
    } else if (is(tag, kWorkspaceBytes, WireFormatLite::WIRETYPE_VARINT)) {
      if (!in.ReadVarint64(&workspace_bytes)) return malformed("chunks.workspace_bytes");
    } else if (is(tag, kData, WireFormatLite::WIRETYPE_LENGTH_DELIMITED)) {
      has_data = true;
      uint32_t bytes = 0;
      if (!in.ReadVarint32(&bytes) || bytes > INT_MAX ||
          static_cast<int>(bytes) > in.BytesUntilLimit()) {
        return malformed("chunks.data");
      }
      if (static_cast<int>(bytes) != in.BytesUntilLimit()) {
        held.emplace();
        if (!in.ReadString(&*held, static_cast<int>(bytes))) return malformed("chunks.data");
        continue;
      }
      // The last field of the chunk: tensor and offset are final, so is the destination.
      held.reset();
      absl::StatusOr<char*> destination = claim(tensor, offset, bytes);
      if (!destination.ok()) return destination.status();
      if (*destination == nullptr) {
        if (!in.Skip(static_cast<int>(bytes))) return malformed("chunks.data");
      } else {
        if (!in.ReadRaw(*destination, static_cast<int>(bytes))) return malformed("chunks.data");
        if (absl::Status s = staged(*destination, bytes); !s.ok()) return s;
      }
      done = true;
    } else if (!WireFormatLite::SkipField(&in, tag)) {
      return malformed("chunks: an unknown field");
    }
  }
  if (!in.ConsumedEntireMessage() || in.BytesUntilLimit() != 0) {
    return malformed("chunks: truncated");
  }
  if (workspace_bytes > 0) {
    if (has_data) {
      return absl::InvalidArgumentError(
          "a chunk carries both data and workspace_bytes (its bytes are in one or the other)");
    }
    if (workspace.data() == nullptr) {
      return absl::InvalidArgumentError(
          "chunks.workspace_bytes > 0 in a call that names no workspace");
    }
    if (absl::Status s = CheckWorkspaceRange(workspace_offset, workspace_bytes, workspace.size(),
                                             "chunks.workspace_offset_bytes and workspace_bytes");
        !s.ok()) {
      return s;
    }
    absl::StatusOr<char*> destination = claim(tensor, offset, workspace_bytes);
    if (!destination.ok()) return destination.status();
    if (*destination == nullptr) return absl::OkStatus();
    if (chunk_workspace.on_device != nullptr) {
      return (*chunk_workspace.on_device)(*destination, workspace_offset, workspace_bytes);
    }
    // A pull's reader claims the very bytes the server wrote: nothing to move then.
    const char* source = workspace.data() + workspace_offset;
    if (*destination != source) std::memmove(*destination, source, workspace_bytes);
    return staged(*destination, workspace_bytes);
  }
  if (done) return absl::OkStatus();
  const std::string data = held.has_value() ? *std::move(held) : std::string();
  absl::StatusOr<char*> destination = claim(tensor, offset, data.size());
  if (!destination.ok()) return destination.status();
  if (*destination == nullptr) return absl::OkStatus();
  if (!data.empty()) std::memcpy(*destination, data.data(), data.size());
  return staged(*destination, data.size());
}

}  // namespace fusedps

#endif  // FUSEDPS_COMMON_TENSOR_CHUNK_READER_H_
