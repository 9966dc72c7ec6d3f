// The safetensors module against the format's definition: bytes checked by hand here (the
// header length, JSON, alignment, data), and a corrupt file of every kind refused. The Python
// side (tests/e2e: the CLI's pull read by an independent reader) checks the other direction.
#include "common/safetensors.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "zlib.h"

namespace fusedps::safetensors {
namespace {

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/safetensors_test_", getpid(), "_", name);
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void Spit(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

template <typename T>
absl::Span<const uint8_t> Bytes(const std::vector<T>& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(T)};
}

// A file with two tensors and metadata, as the CLI writes one.
std::string WriteSample(const std::string& name, WriteResult* result = nullptr) {
  static const std::vector<float> w = {1.0f, -2.5f, 3.25f, 0.0f, 1e-30f, -7.0f};
  static const std::vector<uint16_t> b = {0x3f80, 0xc000, 0x7f80};  // bf16 1, -2, inf.
  const std::string path = TempPath(name);
  WriteOptions options;
  options.metadata = {{"fusedps.version", "42"}, {"note", "\"quoted\" \xc3\xa9"}};
  absl::StatusOr<WriteResult> written = WriteFile(
      path, {{"w", DType::kF32, {2, 3}, Bytes(w)}, {"b", DType::kBF16, {3}, Bytes(b)}}, options);
  EXPECT_TRUE(written.ok()) << written.status();
  if (result != nullptr && written.ok()) *result = *written;
  return path;
}

TEST(SafetensorsTest, WritesTheFormatByteForByte) {
  WriteResult result;
  const std::string path = WriteSample("layout", &result);
  const std::string bytes = Slurp(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);  // Little-endian host (x86-64, aarch64).
  ASSERT_LE(8 + n, bytes.size());
  EXPECT_EQ((8 + n) % 8, 0u) << "the data starts 8-byte aligned";
  const std::string header = bytes.substr(8, n);
  EXPECT_EQ(header.front(), '{');
  EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}')) << "padded with spaces only";
  EXPECT_NE(header.find(R"("w":{"data_offsets":[0,24],"dtype":"F32","shape":[2,3]})"),
            std::string::npos)
      << header;
  EXPECT_NE(header.find(R"("b":{"data_offsets":[24,30],"dtype":"BF16","shape":[3]})"),
            std::string::npos)
      << header;
  EXPECT_NE(header.find(R"("__metadata__":{"fusedps.version":"42")"), std::string::npos);
  EXPECT_EQ(bytes.size(), 8 + n + 30);
  EXPECT_EQ(result.bytes, bytes.size());
  float w1;
  std::memcpy(&w1, bytes.data() + 8 + n + 4, 4);
  EXPECT_EQ(w1, -2.5f);
  EXPECT_EQ(static_cast<uint8_t>(bytes[8 + n + 24]), 0x80);  // bf16 1.0, little-endian.
  EXPECT_EQ(static_cast<uint8_t>(bytes[8 + n + 25]), 0x3f);
  std::remove(path.c_str());
}

TEST(SafetensorsTest, PadsEveryHeaderToAnAlignedDataStart) {
  const std::vector<float> one = {1.0f};
  const std::string path = TempPath("align");
  for (size_t length = 1; length <= 8; ++length) {  // Every header length modulo 8.
    ASSERT_TRUE(WriteFile(path, {{std::string(length, 'x'), DType::kF32, {1}, Bytes(one)}}).ok());
    const std::string bytes = Slurp(path);
    uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    EXPECT_EQ((8 + n) % 8, 0u) << "name length " << length;
    EXPECT_EQ(bytes.size(), 8 + n + 4);
    EXPECT_TRUE(File::Read(path).ok());
  }
  std::remove(path.c_str());
}

TEST(SafetensorsTest, ReadsBackWhatItWrote) {
  const std::string path = WriteSample("roundtrip");
  absl::StatusOr<File> file = File::Read(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata().at("fusedps.version"), "42");
  EXPECT_EQ(file->metadata().at("note"), "\"quoted\" \xc3\xa9");
  ASSERT_EQ(file->entries().size(), 2u);
  const Entry* w = file->Find("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->dtype, DType::kF32);
  EXPECT_EQ(w->shape, (std::vector<int64_t>{2, 3}));
  std::vector<float> values(6);
  ASSERT_EQ(file->Data(*w).size(), 24u);
  std::memcpy(values.data(), file->Data(*w).data(), 24);
  EXPECT_EQ(values, (std::vector<float>{1.0f, -2.5f, 3.25f, 0.0f, 1e-30f, -7.0f}));
  const Entry* b = file->Find("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->dtype, DType::kBF16);
  EXPECT_EQ(file->Find("nope"), nullptr);
  std::remove(path.c_str());
}

// One-byte elements (int8 optimizer state's codes in checkpoints) of any count: the entry after
// them starts at whatever byte they end on, and both read back exactly.
TEST(SafetensorsTest, U8EntriesOfAnyLengthRoundTrip) {
  const std::string path = TempPath("u8");
  const std::vector<uint8_t> codes = {0, 1, 127, 128, 255};
  const std::vector<uint16_t> after = {0x3f80};
  ASSERT_TRUE(WriteFile(path, {{"codes", DType::kU8, {5}, Bytes(codes)},
                               {"next", DType::kBF16, {1}, Bytes(after)}})
                  .ok());
  absl::StatusOr<File> file = File::Read(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const Entry* c = file->Find("codes");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->dtype, DType::kU8);
  EXPECT_STREQ(DTypeName(c->dtype), "U8");
  EXPECT_EQ(DTypeSize(DType::kU8), 1u);
  EXPECT_EQ(c->begin, 0u);
  EXPECT_EQ(c->end, 5u);
  const absl::Span<const uint8_t> data = file->Data(*c);
  EXPECT_EQ(std::vector<uint8_t>(data.begin(), data.end()), codes);
  EXPECT_EQ(file->Find("next")->begin, 5u);
  EXPECT_NE(Slurp(path).find(R"("dtype":"U8")"), std::string::npos);
  std::remove(path.c_str());
}

// An empty tensor between two others starts where the next one does; the header (a JSON object)
// lists names in their own order, here the next one's first.
TEST(SafetensorsTest, AnEmptyTensorBetweenOthersReadsBack) {
  const std::string path = TempPath("empty_between");
  const std::vector<float> two = {1.0f, 2.0f};
  const std::vector<float> none;
  ASSERT_TRUE(WriteFile(path, {{"a", DType::kF32, {2}, Bytes(two)},
                               {"z", DType::kF32, {0}, Bytes(none)},
                               {"b", DType::kF32, {2}, Bytes(two)}})
                  .ok());
  absl::StatusOr<File> file = File::Read(path);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(file->entries().size(), 3u);
  EXPECT_EQ(file->entries()[1].name, "z");
  EXPECT_EQ(file->Find("z")->begin, 8u);
  EXPECT_EQ(file->Find("b")->begin, 8u);
  std::remove(path.c_str());
}

TEST(SafetensorsTest, ScalarsEmptyTensorsAndNoTensors) {
  const std::string path = TempPath("edge");
  const std::vector<float> scalar = {0.5f};
  const std::vector<float> none;
  ASSERT_TRUE(WriteFile(path, {{"s", DType::kF32, {}, Bytes(scalar)},
                               {"empty", DType::kF32, {0, 4}, Bytes(none)}})
                  .ok());
  absl::StatusOr<File> file = File::Read(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->Find("s")->shape, std::vector<int64_t>{});
  EXPECT_EQ(file->Data(*file->Find("empty")).size(), 0u);
  ASSERT_TRUE(WriteFile(path, {}).ok());
  file = File::Read(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(file->entries().empty());
  EXPECT_TRUE(file->metadata().empty());
  std::remove(path.c_str());
}

TEST(SafetensorsTest, BadInputIsInvalidArgumentAndWritesNothing) {
  const std::string path = TempPath("bad");
  std::remove(path.c_str());
  const std::vector<float> three = {1, 2, 3};
  const std::vector<std::vector<TensorView>> bad = {
      {{"w", DType::kF32, {2, 2}, Bytes(three)}},                                      // Size.
      {{"w", DType::kF32, {3}, Bytes(three)}, {"w", DType::kF32, {3}, Bytes(three)}},  // Twice.
      {{"", DType::kF32, {3}, Bytes(three)}},
      {{"__metadata__", DType::kF32, {3}, Bytes(three)}},
      {{"w", DType::kF32, {-1, -3}, Bytes(three)}},
      {{"\xff\xfe", DType::kF32, {3}, Bytes(three)}},  // Not UTF-8.
  };
  for (const std::vector<TensorView>& tensors : bad) {
    absl::StatusOr<WriteResult> written = WriteFile(path, tensors);
    EXPECT_EQ(written.status().code(), absl::StatusCode::kInvalidArgument) << written.status();
    EXPECT_NE(access(path.c_str(), F_OK), 0) << "a file was created";
  }
}

uint32_t ZlibCrc32(const std::string& bytes) {  // The reference implementation.
  return static_cast<uint32_t>(
      crc32(0, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(bytes.size())));
}

TEST(SafetensorsTest, ChecksumIsZlibsCrc32OfTheWholeFile) {
  const std::string check = "123456789";  // The CRC-32 catalogue's check input.
  EXPECT_EQ(Crc32(0, check.data(), check.size()), 0xcbf43926u);
  EXPECT_EQ(Crc32(Crc32(0, check.data(), 4), check.data() + 4, 5), 0xcbf43926u);  // In pieces.
  WriteResult result;
  const std::string sample = WriteSample("crc_sample", &result);
  const std::string bytes = Slurp(sample);
  EXPECT_EQ(result.bytes, bytes.size());
  EXPECT_EQ(result.crc32, ZlibCrc32(bytes));
  std::remove(sample.c_str());
}

TEST(SafetensorsTest, ReaderStreamsTheDataWithTheFilesChecksum) {
  std::vector<float> a(3 << 20), b(1 << 20 | 3);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i % 9973);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(i % 13);
  const std::string path = TempPath("large");
  absl::StatusOr<WriteResult> written =
      WriteFile(path, {{"a", DType::kF32, {static_cast<int64_t>(a.size())}, Bytes(a)},
                       {"b", DType::kF32, {static_cast<int64_t>(b.size())}, Bytes(b)}});
  ASSERT_TRUE(written.ok()) << written.status();
  absl::StatusOr<Reader> reader = Reader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  ASSERT_EQ(reader->entries().size(), 2u);
  EXPECT_EQ(reader->entries()[1].name, "b");
  EXPECT_EQ(reader->entries()[1].begin, a.size() * 4);
  std::string data(reader->data_left(), '\0');
  for (size_t at = 0, piece = 1000003; at < data.size(); at += piece) {  // Odd-sized pieces.
    ASSERT_TRUE(reader->Read(data.data() + at, piece).ok());
  }
  EXPECT_EQ(reader->data_left(), 0u);
  EXPECT_EQ(std::memcmp(data.data(), a.data(), a.size() * 4), 0);
  EXPECT_EQ(std::memcmp(data.data() + a.size() * 4, b.data(), b.size() * 4), 0);
  EXPECT_EQ(reader->crc32(), written->crc32);
  EXPECT_EQ(reader->crc32(), ZlibCrc32(Slurp(path)));

  // A file shorter than its header says is refused at Open; one that shrinks later, by Read.
  const std::string whole = Slurp(path);
  Spit(path, whole.substr(0, whole.size() - 4));
  EXPECT_EQ(Reader::Open(path).status().code(), absl::StatusCode::kDataLoss);
  Spit(path, whole);
  reader = Reader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  ASSERT_EQ(truncate(path.c_str(), 4096), 0);
  EXPECT_EQ(reader->Read(data.data(), data.size()).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(Reader::Open(TempPath("missing")).status().code(), absl::StatusCode::kNotFound);
  std::remove(path.c_str());
}

TEST(SafetensorsTest, AFullDiskIsResourceExhausted) {
  if (access("/dev/full", W_OK) != 0) GTEST_SKIP() << "no /dev/full";
  const std::vector<float> values(1 << 16, 1.0f);
  absl::StatusOr<WriteResult> written =
      WriteFile("/dev/full", {{"w", DType::kF32, {1 << 16}, Bytes(values)}});
  EXPECT_EQ(written.status().code(), absl::StatusCode::kResourceExhausted) << written.status();
}

TEST(SafetensorsTest, EveryKindOfCorruptionIsDataLossNamingTheFile) {
  const std::string good = Slurp(WriteSample("corrupt_source"));
  uint64_t n = 0;
  std::memcpy(&n, good.data(), 8);
  const auto with_header = [&](std::string header) {
    header.append((8 - header.size() % 8) % 8, ' ');
    std::string bytes(8, '\0');
    const uint64_t length = header.size();
    std::memcpy(bytes.data(), &length, 8);
    return bytes + header + good.substr(8 + n);
  };
  std::string huge_length = good;
  huge_length[7] = 0x7f;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"empty", ""},
      {"truncated data", good.substr(0, good.size() - 1)},
      {"extra data", good + "x"},
      {"truncated header", good.substr(0, 8 + n / 2)},
      {"huge header length", huge_length},
      {"not json", with_header("{\"w\": [")},
      {"not an object", with_header("[1, 2]")},
      {"bad dtype", with_header(R"({"w":{"dtype":"F64","shape":[2,3],"data_offsets":[0,24]},)"
                                R"("b":{"dtype":"BF16","shape":[3],"data_offsets":[24,30]}})")},
      {"offsets disagree", with_header(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":)"
                                       R"([0,24]},"b":{"dtype":"BF16","shape":[3],)"
                                       R"("data_offsets":[24,30]}})")},
      {"gap", with_header(R"({"w":{"dtype":"F32","shape":[5],"data_offsets":[0,20]},)"
                          R"("b":{"dtype":"BF16","shape":[3],"data_offsets":[24,30]}})")},
      {"overlap", with_header(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
                              R"("b":{"dtype":"BF16","shape":[3],"data_offsets":[20,26]}})")},
      {"metadata not strings", with_header(R"({"__metadata__":{"v":1},)"
                                           R"("w":{"dtype":"F32","shape":[2,3],)"
                                           R"("data_offsets":[0,24]},"b":{"dtype":"BF16",)"
                                           R"("shape":[3],"data_offsets":[24,30]}})")},
  };
  for (const auto& [what, bytes] : cases) {
    const std::string path = TempPath("corrupt");
    Spit(path, bytes);
    absl::StatusOr<File> file = File::Read(path);
    EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss) << what << ": " << file.status();
    EXPECT_NE(file.status().message().find(path), std::string::npos) << what;
    // The streaming reader checks the header against the file alike.
    absl::StatusOr<Reader> reader = Reader::Open(path);
    EXPECT_EQ(reader.status().code(), absl::StatusCode::kDataLoss)
        << what << ": " << reader.status();
    std::remove(path.c_str());
  }
  // The unmodified bytes parse: the cases above fail for their own reason.
  EXPECT_TRUE(File::Parse(good, "good").ok());
  EXPECT_TRUE(File::Parse(with_header(good.substr(8, n)), "good, re-padded").ok());
}

TEST(SafetensorsTest, AMissingFileIsNotFound) {
  EXPECT_EQ(File::Read(TempPath("missing")).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace fusedps::safetensors
