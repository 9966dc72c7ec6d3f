#include "server/ingest/chunk_assembler.h"

#include <cstring>
#include <vector>

#include "gtest/gtest.h"

namespace fusedps {
namespace {

absl::string_view Bytes(const std::vector<float>& v, size_t begin, size_t end) {
  return {reinterpret_cast<const char*>(v.data() + begin), (end - begin) * sizeof(float)};
}

TEST(ChunkAssemblerTest, ReassemblesOutOfOrderChunksAtAlignedOffsets) {
  auto a = ChunkAssembler::Create({{"w", 10}, {"b", 3}, {"empty", 0}}, 4);
  ASSERT_TRUE(a.ok());
  std::vector<float> w(10), b = {7, 8, 9};
  for (int i = 0; i < 10; ++i) w[i] = i + 0.5f;
  ASSERT_TRUE(a->AddChunk("w", 6, Bytes(w, 6, 10)).ok());
  ASSERT_TRUE(a->AddChunk("b", 0, Bytes(b, 0, 3)).ok());
  EXPECT_FALSE(a->Finish().ok());
  ASSERT_TRUE(a->AddChunk("w", 0, Bytes(w, 0, 3)).ok());
  ASSERT_TRUE(a->AddChunk("w", 3, Bytes(w, 3, 6)).ok());
  ASSERT_TRUE(a->Finish().ok());
  EXPECT_EQ(a->staging_offsets(), (std::vector<uint64_t>{0, 16, 24}));
  const float* staged = static_cast<const float*>(a->staging());
  EXPECT_EQ(0, std::memcmp(staged, w.data(), 40));
  EXPECT_EQ(0, std::memcmp(staged + 16, b.data(), 12));
  EXPECT_EQ(a->bytes_received(), 52u);
}

TEST(ChunkAssemblerTest, RejectsBadChunksWithoutCopying) {
  auto a = ChunkAssembler::Create({{"w", 10}}, 2);
  ASSERT_TRUE(a.ok());
  const std::string four(4, 'x');
  ASSERT_TRUE(a->AddChunk("w", 2, four).ok());  // Elements [2, 4).
  struct Case {
    const char* what;
    const char* tensor;
    uint64_t offset;
    std::string data;
    const char* message;
  } cases[] = {
      {"unknown tensor", "v", 0, four, "not among"},
      {"odd bytes", "w", 0, std::string(3, 'x'), "not a multiple"},
      {"past the end", "w", 9, four, "past its numel 10"},
      {"offset past the end", "w", 11, "", "past its numel"},
      {"overlap from the left", "w", 1, four, "overlaps"},
      {"overlap inside", "w", 3, std::string(2, 'x'), "overlaps"},
      {"overlap covering", "w", 0, std::string(12, 'x'), "overlaps"},
  };
  for (const Case& c : cases) {
    absl::Status s = a->AddChunk(c.tensor, c.offset, c.data);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_NE(s.message().find(c.message), std::string::npos) << c.what << ": " << s.message();
  }
  EXPECT_EQ(a->bytes_received(), 4u);
  absl::Status missing = a->Finish();
  EXPECT_EQ(missing.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.message().find("received 2 of its 10"), std::string::npos);
}

}  // namespace
}  // namespace fusedps
