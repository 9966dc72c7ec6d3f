#include "server/ingest/push_message.h"

#include <climits>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/slice_input_stream.h"
#include "common/tensor_chunk_reader.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace fusedps {
namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;

constexpr int kRequestHeader = v1::PushGradientsRequest::kHeaderFieldNumber;
constexpr int kRequestChunks = v1::PushGradientsRequest::kChunksFieldNumber;
constexpr int kRequestCommit = v1::PushGradientsRequest::kCommitFieldNumber;
constexpr int kRequestTableRows = v1::PushGradientsRequest::kTableRowsFieldNumber;

absl::Status Malformed(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("malformed PushGradientsRequest: ", what));
}

// Reads the message: its header into *header when header is non-null (else a header is
// skipped, or INVALID_ARGUMENT unless header_allowed); its chunks when claim is non-null; its
// commit into *commit when commit is non-null (else it is skipped); its table rows appended to
// *table_rows when table_rows is non-null (else skipped).
absl::Status ReadMessage(MessageSlices message, bool header_allowed, v1::PushHeader* header,
                         bool* has_header, const ClaimChunkFn* claim, const ChunkStagedFn* staged,
                         std::optional<v1::PushCommit>* commit, ChunkWorkspace workspace,
                         std::vector<v1::TableRows>* table_rows) {
  SliceInputStream stream(message);
  CodedInputStream in(&stream);
  for (uint32_t tag = in.ReadTag(); tag != 0; tag = in.ReadTag()) {
    if (IsWireField(tag, kRequestHeader, WireFormatLite::WIRETYPE_LENGTH_DELIMITED)) {
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
    } else if (IsWireField(tag, kRequestCommit, WireFormatLite::WIRETYPE_LENGTH_DELIMITED)) {
      if (commit == nullptr) {
        if (!WireFormatLite::SkipField(&in, tag)) return Malformed("commit");
        continue;
      }
      // protobuf merges a repeated singular field; a push takes one commit, so it refuses two.
      if (commit->has_value()) return absl::InvalidArgumentError("a message carries two commits");
      std::string bytes;
      v1::PushCommit parsed;
      if (!WireFormatLite::ReadString(&in, &bytes) || !parsed.ParseFromString(bytes)) {
        return Malformed("commit");
      }
      *commit = std::move(parsed);
    } else if (IsWireField(tag, kRequestTableRows, WireFormatLite::WIRETYPE_LENGTH_DELIMITED)) {
      if (table_rows == nullptr) {
        if (!WireFormatLite::SkipField(&in, tag)) return Malformed("table_rows");
        continue;
      }
      std::string bytes;
      v1::TableRows parsed;
      if (!WireFormatLite::ReadString(&in, &bytes) || !parsed.ParseFromString(bytes)) {
        return Malformed("table_rows");
      }
      table_rows->push_back(std::move(parsed));
    } else if (IsWireField(tag, kRequestChunks, WireFormatLite::WIRETYPE_LENGTH_DELIMITED)) {
      if (claim == nullptr) {
        if (!WireFormatLite::SkipField(&in, tag)) return Malformed("chunks");
        continue;
      }
      uint32_t length = 0;
      if (!in.ReadVarint32(&length) || length > INT_MAX) return Malformed("chunks");
      const CodedInputStream::Limit limit = in.PushLimit(static_cast<int>(length));
      if (absl::Status s = ReadTensorChunk(in, *claim, *staged, Malformed, workspace); !s.ok()) {
        return s;
      }
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
  if (absl::Status s = ReadMessage(message, /*header_allowed=*/true, &header, &has_header, nullptr,
                                   nullptr, nullptr, {}, nullptr);
      !s.ok()) {
    return s;
  }
  if (!has_header) return std::optional<v1::PushHeader>();
  return std::optional<v1::PushHeader>(std::move(header));
}

absl::Status ReadPushChunks(MessageSlices message, bool header_allowed, ClaimChunkFn claim,
                            ChunkStagedFn staged, std::optional<v1::PushCommit>* commit,
                            ChunkWorkspace workspace, std::vector<v1::TableRows>* table_rows) {
  if (commit != nullptr) commit->reset();
  return ReadMessage(message, header_allowed, nullptr, nullptr, &claim, &staged, commit, workspace,
                     table_rows);
}

}  // namespace fusedps
