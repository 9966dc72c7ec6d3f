// push_message_fuzz: server/ingest/push_message.h's readers (ReadPushHeader, ReadPushChunks) on
// any bytes, against protobuf's own parser.
//
// Input (fuzz_input.h): mode, slicing, then one serialized PushGradientsRequest (no length
// prefix), cut into slices as gRPC's receive buffer is. With mode bit 2, the claim refuses the
// chunk numbered mode % 4.
//
// The reference is protobuf's parse of the same bytes without a schema (UnknownFieldSet: any
// field number, no UTF-8 check), then of each chunk's bytes the same way, and of each header's
// bytes as a PushHeader. For every input:
//   - ReadPushHeader succeeds exactly when the message and its headers parse; its header is the
//     reference's (the same bytes once serialized);
//   - ReadPushChunks succeeds exactly when the message and its chunks parse and no chunk names
//     bytes in a workspace (workspace_bytes > 0: the calls here name none); it claims every
//     chunk once, in order, with the chunk's last tensor, offset and data size; it stages each
//     claimed destination once, right after its claim, and the staged bytes are the chunk's
//     data;
//   - without a header allowed, a message with a header is INVALID_ARGUMENT;
//   - a refused claim's status comes back as it is;
//   - every other error is INVALID_ARGUMENT, and the slicing changes nothing (the same status
//     and the same chunks as one slice).
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fusedps/v1/parameter_service.pb.h"
#include "google/protobuf/unknown_field_set.h"
#include "server/ingest/push_message.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/fuzz_shards.h"

namespace fusedps::fuzz {
namespace {

using google::protobuf::UnknownField;
using google::protobuf::UnknownFieldSet;

constexpr int kHeaderField = 1;  // PushGradientsRequest.header
constexpr int kChunksField = 2;  // PushGradientsRequest.chunks

struct Chunk {
  std::string tensor;
  uint64_t offset = 0;
  std::string data;
  bool operator==(const Chunk& o) const {
    return tensor == o.tensor && offset == o.offset && data == o.data;
  }
};

struct Reference {
  bool message_parses = false;  // The message's own fields (chunks and headers as bytes).
  bool chunks_parse = false;    // And every chunk's fields.
  bool headers_parse = false;   // And every header, as a PushHeader.
  bool has_header = false;
  v1::PushHeader header;  // Every header, merged.
  std::vector<Chunk> chunks;
  // The first chunk whose bytes are in a workspace (workspace_bytes, field 6, its last varint,
  // > 0): the fuzzed calls name none, so the read must refuse it.
  std::optional<size_t> workspace_chunk;
};

Reference Parse(absl::string_view message) {
  Reference ref;
  UnknownFieldSet fields;
  if (!fields.ParseFromArray(message.data(), static_cast<int>(message.size()))) return ref;
  ref.message_parses = ref.chunks_parse = ref.headers_parse = true;
  for (int i = 0; i < fields.field_count(); ++i) {
    const UnknownField& field = fields.field(i);
    if (field.type() != UnknownField::TYPE_LENGTH_DELIMITED) continue;
    if (field.number() == kHeaderField) {
      ref.has_header = true;
      if (!ref.header.MergeFromString(field.length_delimited())) ref.headers_parse = false;
    } else if (field.number() == kChunksField) {
      UnknownFieldSet chunk_fields;
      if (!chunk_fields.ParseFromString(field.length_delimited())) {
        ref.chunks_parse = false;
        continue;
      }
      Chunk chunk;
      uint64_t workspace_bytes = 0;
      for (int j = 0; j < chunk_fields.field_count(); ++j) {
        const UnknownField& f = chunk_fields.field(j);
        if (f.number() == 6 && f.type() == UnknownField::TYPE_VARINT) {
          workspace_bytes = f.varint();
        }
        if (f.number() == 1 && f.type() == UnknownField::TYPE_LENGTH_DELIMITED) {
          chunk.tensor = f.length_delimited();
        } else if (f.number() == 2 && f.type() == UnknownField::TYPE_VARINT) {
          chunk.offset = f.varint();
        } else if (f.number() == 3 && f.type() == UnknownField::TYPE_LENGTH_DELIMITED) {
          chunk.data = f.length_delimited();
        }
      }
      if (workspace_bytes > 0 && !ref.workspace_chunk.has_value()) {
        ref.workspace_chunk = ref.chunks.size();
      }
      ref.chunks.push_back(std::move(chunk));
    }
  }
  return ref;
}

// What ReadPushChunks did.
struct ChunksRead {
  absl::Status status;
  std::vector<Chunk> chunks;  // Claimed, with the bytes staged (empty when none were).
  bool too_large = false;     // A claim of more bytes than the whole message.
};

const absl::Status& Refused() {
  static const absl::Status* refused = new absl::Status(absl::NotFoundError("fuzz: refused"));
  return *refused;
}

ChunksRead ReadChunks(MessageSlices slices, size_t message_bytes, bool header_allowed,
                      std::optional<size_t> refuse) {
  ChunksRead read;
  std::vector<std::unique_ptr<char[]>> destinations;
  char* pending = nullptr;  // The destination claimed last, until it is staged.
  uint64_t pending_bytes = 0;
  read.status = ReadPushChunks(
      slices, header_allowed,
      [&](absl::string_view tensor, uint64_t offset, uint64_t bytes) -> absl::StatusOr<char*> {
        Require(pending == nullptr, "a claim before the previous one was staged");
        if (refuse.has_value() && read.chunks.size() == *refuse) return Refused();
        if (bytes > message_bytes) {
          read.too_large = true;
          return absl::OutOfRangeError("fuzz: a claim larger than the message");
        }
        read.chunks.push_back({std::string(tensor), offset, std::string()});
        if (bytes == 0) return nullptr;
        // Exactly `bytes`, so that AddressSanitizer sees a copy past the end.
        destinations.push_back(std::make_unique<char[]>(bytes));
        pending = destinations.back().get();
        pending_bytes = bytes;
        return pending;
      },
      [&](char* data, uint64_t bytes) {
        Require(data == pending && bytes == pending_bytes,
                "staged is not the destination just claimed");
        read.chunks.back().data.assign(data, bytes);
        pending = nullptr;
        return absl::OkStatus();
      });
  if (read.status.ok()) Require(pending == nullptr, "a claimed destination was never staged");
  return read;
}

void CheckHeader(MessageSlices slices, const Reference& ref) {
  absl::StatusOr<std::optional<v1::PushHeader>> header = ReadPushHeader(slices);
  const bool expect_ok = ref.message_parses && ref.headers_parse;
  if (!header.ok()) {
    RequireCode(header.status(), {absl::StatusCode::kInvalidArgument}, "ReadPushHeader");
    Require(!expect_ok, "ReadPushHeader refused a message protobuf parses");
    return;
  }
  Require(expect_ok, "ReadPushHeader took a message protobuf does not parse");
  Require(header->has_value() == ref.has_header, "ReadPushHeader: header present or not");
  if (header->has_value()) {
    Require((*header)->SerializeAsString() == ref.header.SerializeAsString(),
            "ReadPushHeader's header is not protobuf's");
  }
}

void CheckChunks(MessageSlices slices, MessageSlices whole, size_t message_bytes,
                 const Reference& ref, uint8_t mode) {
  const std::optional<size_t> refuse =
      (mode & 4) != 0 ? std::optional<size_t>(mode % 4) : std::nullopt;
  for (const bool header_allowed : {true, false}) {
    const ChunksRead read = ReadChunks(slices, message_bytes, header_allowed, refuse);
    if (slices.size() > 1) {
      const ChunksRead one_slice = ReadChunks(whole, message_bytes, header_allowed, refuse);
      Require(read.status == one_slice.status && read.chunks == one_slice.chunks,
              "the slicing changed what ReadPushChunks read");
    }
    if (read.too_large) Require(!ref.chunks_parse, "a chunk larger than its message parses");
    if (read.status == Refused()) {
      Require(refuse.has_value() && read.chunks.size() == *refuse, "refused, but not claimed");
      continue;
    }
    if (!read.status.ok() && !read.too_large) {
      RequireCode(read.status, {absl::StatusCode::kInvalidArgument}, "ReadPushChunks");
    }
    const bool well_formed = ref.message_parses && ref.chunks_parse;
    if (!well_formed) {
      Require(!read.status.ok(), "ReadPushChunks took a message protobuf does not parse");
      continue;
    }
    if (!header_allowed && ref.has_header) {
      Require(!read.status.ok(), "ReadPushChunks took a header where none is allowed");
      continue;
    }
    if (ref.workspace_chunk.has_value()) {
      Require(!read.status.ok(), "ReadPushChunks took workspace bytes in a call without one");
      continue;
    }
    if (refuse.has_value() && ref.chunks.size() > *refuse) {
      Require(false, "ReadPushChunks did not return the claim's refusal");
    }
    Require(read.status.ok(), "ReadPushChunks refused a message protobuf parses");
    Require(read.chunks == ref.chunks, "ReadPushChunks' chunks are not protobuf's");
  }
}

}  // namespace
}  // namespace fusedps::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fusedps::fuzz::QuietProtobufLog();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fusedps::fuzz;
  const FuzzInput input = ParseFuzzInput(data, size, 0);
  const absl::string_view message = input.rest;
  const std::vector<absl::string_view> slices = Slices(message, input.slicing);
  const std::vector<absl::string_view> whole = {message};
  const Reference ref = Parse(message);
  CheckHeader(slices, ref);
  CheckChunks(slices, whole, message.size(), ref, input.mode);
  return 0;
}
