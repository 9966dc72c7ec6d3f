#include "server/ingest/push_message.h"

#include <climits>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace fusedps {
namespace {

using google::protobuf::io::CodedInputStream;
using google::protobuf::internal::WireFormatLite;

// Field numbers of proto/fusedps/v1/parameter_service.proto.
constexpr int kRequestHeader = 1;  // PushGradientsRequest.header
constexpr int kRequestChunks = 2;  // PushGradientsRequest.chunks
constexpr int kChunkTensor = 1;    // TensorChunk.tensor
constexpr int kChunkOffset = 2;    // TensorChunk.offset
constexpr int kChunkData = 3;      // TensorChunk.data

// The slices of a message as protobuf's input stream, without copying them.
class SliceInputStream final : public google::protobuf::io::ZeroCopyInputStream {
 public:
  explicit SliceInputStream(MessageSlices slices) : slices_(slices) {}

  bool Next(const void** data, int* size) override {
    while (index_ < slices_.size()) {
      const absl::string_view slice = slices_[index_];
      if (position_ < slice.size()) {
        *data = slice.data() + position_;
        *size = static_cast<int>(slice.size() - position_);
        byte_count_ += *size;
        position_ = slice.size();
        return true;
      }
      ++index_;
      position_ = 0;
    }
    return false;
  }
  void BackUp(int count) override {
    position_ -= count;
    byte_count_ -= count;
  }
  bool Skip(int count) override {
    const void* data;
    int size;
    while (count > 0) {
      if (!Next(&data, &size)) return false;
      if (size > count) {
        BackUp(size - count);
        return true;
      }
      count -= size;
    }
    return true;
  }
  int64_t ByteCount() const override { return byte_count_; }

 private:
  const MessageSlices slices_;
  size_t index_ = 0;
  size_t position_ = 0;  // In slices_[index_].
  int64_t byte_count_ = 0;
};

absl::Status Malformed(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("malformed PushGradientsRequest: ", what));
}

bool IsField(uint32_t tag, int number, WireFormatLite::WireType type) {
  return WireFormatLite::GetTagFieldNumber(tag) == number &&
         WireFormatLite::GetTagWireType(tag) == type;
}

// Reads one TensorChunk, whose length limit `in` has pushed.
absl::Status ReadChunk(CodedInputStream& in, ClaimChunkFn claim, ChunkStagedFn staged) {
  std::string tensor;
  uint64_t offset = 0;
  std::optional<std::string> held;  // data that other fields follow (an unusual order)
  bool done = false;  // data went straight to its destination; nothing can follow it
  for (uint32_t tag = in.ReadTag(); tag != 0; tag = in.ReadTag()) {
    if (IsField(tag, kChunkTensor, WireFormatLite::WIRETYPE_LENGTH_DELIMITED)) {
      if (!WireFormatLite::ReadString(&in, &tensor)) return Malformed("chunks.tensor");
    } else if (IsField(tag, kChunkOffset, WireFormatLite::WIRETYPE_VARINT)) {
      if (!in.ReadVarint64(&offset)) return Malformed("chunks.offset");
    } else if (IsField(tag, kChunkData, WireFormatLite::WIRETYPE_LENGTH_DELIMITED)) {
      uint32_t bytes = 0;
      if (!in.ReadVarint32(&bytes) || bytes > INT_MAX ||
          static_cast<int>(bytes) > in.BytesUntilLimit()) {
        return Malformed("chunks.data");
      }
      if (static_cast<int>(bytes) != in.BytesUntilLimit()) {
        held.emplace();
        if (!in.ReadString(&*held, static_cast<int>(bytes))) return Malformed("chunks.data");
        continue;
      }
      // The last field of the chunk: tensor and offset are final, so is the destination.
      held.reset();
      absl::StatusOr<char*> destination = claim(tensor, offset, bytes);
      if (!destination.ok()) return destination.status();
      if (*destination == nullptr) {
        if (!in.Skip(static_cast<int>(bytes))) return Malformed("chunks.data");
      } else {
        if (!in.ReadRaw(*destination, static_cast<int>(bytes))) return Malformed("chunks.data");
        if (absl::Status s = staged(*destination, bytes); !s.ok()) return s;
      }
      done = true;
    } else if (!WireFormatLite::SkipField(&in, tag)) {
      return Malformed("chunks: an unknown field");
    }
  }
  if (!in.ConsumedEntireMessage() || in.BytesUntilLimit() != 0) {
    return Malformed("chunks: truncated");
  }
  if (done) return absl::OkStatus();
  const std::string data = held.has_value() ? *std::move(held) : std::string();
  absl::StatusOr<char*> destination = claim(tensor, offset, data.size());
  if (!destination.ok()) return destination.status();
  if (*destination == nullptr) return absl::OkStatus();
  std::memcpy(*destination, data.data(), data.size());
  return staged(*destination, data.size());
}

// Reads the message: its header into *header when header is non-null (else a header is
// skipped, or INVALID_ARGUMENT unless header_allowed); its chunks when claim is non-null.
absl::Status ReadMessage(MessageSlices message, bool header_allowed, v1::PushHeader* header,
                         bool* has_header, const ClaimChunkFn* claim,
                         const ChunkStagedFn* staged) {
  SliceInputStream stream(message);
  CodedInputStream in(&stream);
  for (uint32_t tag = in.ReadTag(); tag != 0; tag = in.ReadTag()) {
    if (IsField(tag, kRequestHeader, WireFormatLite::WIRETYPE_LENGTH_DELIMITED)) {
      if (!header_allowed) {
        return absl::InvalidArgumentError("header may appear only in the first message");
      }
      if (header == nullptr) {
        if (!WireFormatLite::SkipField(&in, tag)) return Malformed("header");
        continue;
      }
      std::string bytes;
      if (!WireFormatLite::ReadString(&in, &bytes) || !header->MergeFromString(bytes)) {
        return Malformed("header");
      }
      *has_header = true;
    } else if (IsField(tag, kRequestChunks, WireFormatLite::WIRETYPE_LENGTH_DELIMITED)) {
      if (claim == nullptr) {
        if (!WireFormatLite::SkipField(&in, tag)) return Malformed("chunks");
        continue;
      }
      uint32_t length = 0;
      if (!in.ReadVarint32(&length) || length > INT_MAX) return Malformed("chunks");
      const CodedInputStream::Limit limit = in.PushLimit(static_cast<int>(length));
      if (absl::Status s = ReadChunk(in, *claim, *staged); !s.ok()) return s;
      in.PopLimit(limit);
    } else if (!WireFormatLite::SkipField(&in, tag)) {
      return Malformed("an unknown field");
    }
  }
  if (!in.ConsumedEntireMessage()) return Malformed("truncated");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::optional<v1::PushHeader>> ReadPushHeader(MessageSlices message) {
  v1::PushHeader header;
  bool has_header = false;
  if (absl::Status s = ReadMessage(message, /*header_allowed=*/true, &header, &has_header,
                                   nullptr, nullptr);
      !s.ok()) {
    return s;
  }
  if (!has_header) return std::optional<v1::PushHeader>();
  return std::optional<v1::PushHeader>(std::move(header));
}

absl::Status ReadPushChunks(MessageSlices message, bool header_allowed, ClaimChunkFn claim,
                            ChunkStagedFn staged) {
  return ReadMessage(message, header_allowed, nullptr, nullptr, &claim, &staged);
}

}  // namespace fusedps
