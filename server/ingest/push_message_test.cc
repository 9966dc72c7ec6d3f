#include "server/ingest/push_message.h"

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"
#include "gtest/gtest.h"

namespace fusedps {
namespace {

using google::protobuf::internal::WireFormatLite;

// These bytes, cut into slices of `slice_bytes` (so reads cross slices), as gRPC hands them.
class Buffer {
 public:
  explicit Buffer(std::string bytes, size_t slice_bytes = 7) : bytes_(std::move(bytes)) {
    for (size_t at = 0; at < bytes_.size(); at += slice_bytes) {
      slices_.push_back(absl::string_view(bytes_).substr(at, slice_bytes));
    }
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  operator MessageSlices() const { return slices_; }

 private:
  const std::string bytes_;
  std::vector<absl::string_view> slices_;
};

struct Received {
  std::string tensor;
  uint64_t offset;
  std::string data;
};

// Reads chunks into `out`, each claimed into its own buffer; counts staged calls.
absl::Status ReadAll(MessageSlices buffer, bool header_allowed, std::vector<Received>* out,
                     int* staged_calls) {
  std::vector<std::unique_ptr<std::vector<char>>> storage;
  absl::Status s = ReadPushChunks(
      buffer, header_allowed,
      [&](absl::string_view tensor, uint64_t offset, uint64_t bytes) -> absl::StatusOr<char*> {
        if (tensor == "refused") return absl::NotFoundError("refused");
        out->push_back({std::string(tensor), offset, std::string()});
        if (bytes == 0) return nullptr;
        storage.push_back(std::make_unique<std::vector<char>>(bytes));
        return storage.back()->data();
      },
      [&](char* data, uint64_t bytes) {
        ++*staged_calls;
        out->back().data.assign(data, bytes);
        return absl::OkStatus();
      });
  return s;
}

v1::PushGradientsRequest Request() {
  v1::PushGradientsRequest request;
  request.mutable_header()->set_client_id("trainer");
  request.mutable_header()->add_tensors("w");
  v1::TensorChunk* a = request.add_chunks();
  a->set_tensor("w");
  a->set_offset(0);  // proto3 leaves it out of the bytes
  a->set_data(std::string(40, 'a'));
  v1::TensorChunk* b = request.add_chunks();
  b->set_tensor("b");
  b->set_offset(12345678901ull);
  b->set_data("0123456789abcdef");
  v1::TensorChunk* empty = request.add_chunks();
  empty->set_tensor("e");
  return request;
}

TEST(PushMessageTest, ReadsWhatProtobufWrote) {
  const v1::PushGradientsRequest request = Request();
  Buffer buffer(request.SerializeAsString());
  absl::StatusOr<std::optional<v1::PushHeader>> header = ReadPushHeader(buffer);
  ASSERT_TRUE(header.ok()) << header.status();
  ASSERT_TRUE(header->has_value());
  EXPECT_EQ((*header)->client_id(), "trainer");
  ASSERT_EQ((*header)->tensors_size(), 1);

  std::vector<Received> got;
  int staged = 0;
  ASSERT_TRUE(ReadAll(buffer, /*header_allowed=*/true, &got, &staged).ok());
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(staged, 2);  // Not for the empty chunk.
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(got[i].tensor, request.chunks(i).tensor());
    EXPECT_EQ(got[i].offset, request.chunks(i).offset());
    EXPECT_EQ(got[i].data, request.chunks(i).data());
  }
}

TEST(PushMessageTest, MessageWithoutHeader) {
  v1::PushGradientsRequest request = Request();
  request.clear_header();
  Buffer buffer(request.SerializeAsString());
  absl::StatusOr<std::optional<v1::PushHeader>> header = ReadPushHeader(buffer);
  ASSERT_TRUE(header.ok());
  EXPECT_FALSE(header->has_value());
  std::vector<Received> got;
  int staged = 0;
  EXPECT_TRUE(ReadAll(buffer, /*header_allowed=*/false, &got, &staged).ok());
  EXPECT_EQ(got.size(), 3u);
}

TEST(PushMessageTest, HeaderWhereNoneMayBeIsInvalidArgument) {
  Buffer buffer(Request().SerializeAsString());
  std::vector<Received> got;
  int staged = 0;
  const absl::Status s = ReadAll(buffer, /*header_allowed=*/false, &got, &staged);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_EQ(s.message(), "header may appear only in the first message");
}

TEST(PushMessageTest, ClaimErrorsStopTheRead) {
  v1::PushGradientsRequest request = Request();
  request.mutable_chunks(1)->set_tensor("refused");
  Buffer buffer(request.SerializeAsString());
  std::vector<Received> got;
  int staged = 0;
  EXPECT_TRUE(absl::IsNotFound(ReadAll(buffer, true, &got, &staged)));
  EXPECT_EQ(got.size(), 1u);  // The first chunk only.
}

// Writes a chunk's fields in the order given (protobuf allows any order, and repeats:
// the last value of a field wins), plus an unknown field 9.
std::string UnusualChunk() {
  std::string chunk;
  {
    google::protobuf::io::StringOutputStream stream(&chunk);
    google::protobuf::io::CodedOutputStream out(&stream);
    WireFormatLite::WriteBytes(3, "first data, replaced", &out);
    WireFormatLite::WriteString(1, "late-name", &out);
    WireFormatLite::WriteUInt64(9, 77, &out);
    WireFormatLite::WriteBytes(3, "last data", &out);
    WireFormatLite::WriteUInt64(2, 5, &out);
  }
  std::string message;
  {
    google::protobuf::io::StringOutputStream stream(&message);
    google::protobuf::io::CodedOutputStream out(&stream);
    WireFormatLite::WriteBytes(2, chunk, &out);
    WireFormatLite::WriteUInt64(15, 1, &out);  // An unknown field of the request.
  }
  return message;
}

TEST(PushMessageTest, FieldsInAnyOrderAndUnknownFields) {
  const std::string bytes = UnusualChunk();
  v1::PushGradientsRequest parsed;  // What protobuf makes of it: the reference.
  ASSERT_TRUE(parsed.ParseFromString(bytes));
  ASSERT_EQ(parsed.chunks_size(), 1);
  Buffer buffer(bytes, 3);
  std::vector<Received> got;
  int staged = 0;
  ASSERT_TRUE(ReadAll(buffer, false, &got, &staged).ok());
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].tensor, parsed.chunks(0).tensor());
  EXPECT_EQ(got[0].offset, parsed.chunks(0).offset());
  EXPECT_EQ(got[0].data, parsed.chunks(0).data());
  EXPECT_EQ(got[0].data, "last data");
}

TEST(PushMessageTest, TruncatedOrGarbageIsMalformed) {
  const std::string bytes = Request().SerializeAsString();
  for (const std::string& bad :
       {bytes.substr(0, bytes.size() - 3), bytes.substr(0, bytes.size() / 2),
        std::string("\x12\xff\xff\xff\xff\x0f", 6), std::string("\x00\x01", 2), bytes + "\x12"}) {
    SCOPED_TRACE(absl::StrCat("bytes: ", bad.size()));
    v1::PushGradientsRequest reference;
    EXPECT_FALSE(reference.ParseFromString(bad));  // protobuf refuses it too
    Buffer buffer(bad);
    std::vector<Received> got;
    int staged = 0;
    const absl::Status s = ReadAll(buffer, true, &got, &staged);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "malformed PushGradientsRequest")) << s;
  }
}

// Reads a message's chunks and commit, as the assembly does.
absl::Status ReadWithCommit(MessageSlices buffer, std::optional<v1::PushCommit>* commit) {
  std::vector<Received> got;
  int staged = 0;
  std::vector<char> sink(64);
  return ReadPushChunks(
      buffer, /*header_allowed=*/true,
      [&](absl::string_view, uint64_t, uint64_t bytes) -> absl::StatusOr<char*> {
        sink.resize(bytes);
        return bytes == 0 ? nullptr : sink.data();
      },
      [&](char*, uint64_t) {
        ++staged;
        return absl::OkStatus();
      },
      commit);
}

TEST(PushMessageTest, ReadsACommitBesideTheChunks) {
  v1::PushGradientsRequest request = Request();
  request.mutable_commit()->set_grad_scale(0.5f);
  Buffer buffer(request.SerializeAsString());
  std::optional<v1::PushCommit> commit;
  ASSERT_TRUE(ReadWithCommit(buffer, &commit).ok());
  ASSERT_TRUE(commit.has_value());
  EXPECT_EQ(commit->grad_scale(), 0.5f);
  // A commit without a scale is a commit all the same; a message without one leaves none.
  request.mutable_commit()->clear_grad_scale();
  Buffer unscaled(request.SerializeAsString());
  ASSERT_TRUE(ReadWithCommit(unscaled, &commit).ok());
  ASSERT_TRUE(commit.has_value());
  EXPECT_FALSE(commit->has_grad_scale());
  request.clear_commit();
  Buffer none(request.SerializeAsString());
  ASSERT_TRUE(ReadWithCommit(none, &commit).ok());
  EXPECT_FALSE(commit.has_value());
  // Without a place for it, a commit is skipped like an unknown field.
  request.mutable_commit()->set_grad_scale(2.0f);
  Buffer skipped(request.SerializeAsString());
  std::vector<Received> got;
  int staged = 0;
  EXPECT_TRUE(ReadAll(skipped, true, &got, &staged).ok());
  EXPECT_EQ(got.size(), 3u);
}

TEST(PushMessageTest, TwoCommitsInOneMessageAreInvalidArgument) {
  // protobuf would merge them into one; a push takes one commit.
  v1::PushGradientsRequest first, second;
  first.mutable_commit()->set_grad_scale(2.0f);
  second.mutable_commit()->set_grad_scale(3.0f);
  Buffer buffer(first.SerializeAsString() + second.SerializeAsString());
  std::optional<v1::PushCommit> commit;
  const absl::Status s = ReadWithCommit(buffer, &commit);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_EQ(s.message(), "a message carries two commits");
}

// A message whose chunks lie in the call's workspace: from a host workspace each is copied to
// its claimed destination and staged; from a device workspace each is handed to on_device with
// where it lies, nothing is copied on the host (its memory may be a GPU's) and staged is not
// called. An inline chunk beside them is staged as always.
TEST(PushMessageTest, WorkspaceChunksAreCopiedOnTheHostOrHandedToTheDevice) {
  v1::PushGradientsRequest request;
  v1::TensorChunk* a = request.add_chunks();
  a->set_tensor("w");
  a->set_workspace_offset_bytes(8);
  a->set_workspace_bytes(4);
  v1::TensorChunk* b = request.add_chunks();
  b->set_tensor("b");
  b->set_offset(2);
  b->set_data("xy");
  Buffer buffer(request.SerializeAsString());
  std::string memory = "0123456789abcdef";
  std::vector<std::string> destinations = {"....", ".."};
  for (const bool device : {false, true}) {
    SCOPED_TRACE(device ? "device" : "host");
    destinations = {"....", ".."};
    size_t claimed = 0;
    std::vector<std::string> staged, handed;
    const auto hand = [&](char* destination, uint64_t offset, uint64_t bytes) {
      handed.push_back(
          absl::StrCat(destination == destinations[0].data() ? "w" : "?", "@", offset, "+", bytes));
      return absl::OkStatus();
    };
    const DeviceChunkFn on_device = hand;  // A reference: hand outlives it.
    const absl::Span<const char> span(memory.data(), memory.size());
    const absl::Status s = ReadPushChunks(
        buffer, /*header_allowed=*/false,
        [&](absl::string_view, uint64_t, uint64_t) -> absl::StatusOr<char*> {
          return destinations[claimed++].data();
        },
        [&](char* data, uint64_t bytes) {
          staged.emplace_back(data, bytes);
          return absl::OkStatus();
        },
        nullptr, device ? ChunkWorkspace(span, &on_device) : ChunkWorkspace(span));
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(claimed, 2u);
    if (device) {
      EXPECT_EQ(handed, (std::vector<std::string>{"w@8+4"}));
      EXPECT_EQ(destinations[0], "....");  // Not touched on the host.
      EXPECT_EQ(staged, (std::vector<std::string>{"xy"}));
    } else {
      EXPECT_TRUE(handed.empty());
      EXPECT_EQ(destinations[0], "89ab");
      EXPECT_EQ(staged, (std::vector<std::string>{"89ab", "xy"}));
    }
  }
}

}  // namespace
}  // namespace fusedps
