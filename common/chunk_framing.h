// chunk_framing.h: the bytes of one TensorChunk entry of a message up to its payload, so that
// the payload itself can travel as a separate gRPC slice (the caller's memory, or staging)
// instead of being copied into a protobuf string. Both PushGradientsRequest and
// PullParametersResponse keep their chunks in field 2 (proto/fusedps/v1/parameter_service.proto).
//
// Usage:
//   slices.emplace_back(ChunkFraming(name, offset, bytes));   // tag, lengths, name, offset
//   slices.push_back(<a slice of the `bytes` payload bytes>);
#ifndef FUSEDPS_COMMON_CHUNK_FRAMING_H_
#define FUSEDPS_COMMON_CHUNK_FRAMING_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"

namespace fusedps {

// The repeated TensorChunk field of PushGradientsRequest and PullParametersResponse.
inline constexpr int kChunksField = 2;

// What protobuf writes for `repeated TensorChunk chunks = 2` holding one TensorChunk {tensor,
// offset (left out when 0), data}, up to data's first byte: the chunk's tag and length, its
// tensor field, offset field, and data's tag and length (payload_bytes). REQUIRES:
// payload_bytes < 4 GiB.
inline std::string ChunkFraming(absl::string_view tensor, uint64_t offset, uint64_t payload_bytes) {
  using google::protobuf::internal::WireFormatLite;
  constexpr int kTensor = 1, kOffset = 2, kData = 3;  // TensorChunk's fields.
  std::string fields;
  {
    google::protobuf::io::StringOutputStream stream(&fields);
    google::protobuf::io::CodedOutputStream out(&stream);
    WireFormatLite::WriteTag(kTensor, WireFormatLite::WIRETYPE_LENGTH_DELIMITED, &out);
    out.WriteVarint32(static_cast<uint32_t>(tensor.size()));
    out.WriteRaw(tensor.data(), static_cast<int>(tensor.size()));
    if (offset != 0) WireFormatLite::WriteUInt64(kOffset, offset, &out);
    WireFormatLite::WriteTag(kData, WireFormatLite::WIRETYPE_LENGTH_DELIMITED, &out);
    out.WriteVarint32(static_cast<uint32_t>(payload_bytes));
  }
  std::string framing;
  {
    google::protobuf::io::StringOutputStream stream(&framing);
    google::protobuf::io::CodedOutputStream out(&stream);
    WireFormatLite::WriteTag(kChunksField, WireFormatLite::WIRETYPE_LENGTH_DELIMITED, &out);
    out.WriteVarint32(static_cast<uint32_t>(fields.size() + payload_bytes));
    out.WriteRaw(fields.data(), static_cast<int>(fields.size()));
  }
  return framing;
}

}  // namespace fusedps

#endif  // FUSEDPS_COMMON_CHUNK_FRAMING_H_
