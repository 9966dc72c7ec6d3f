#include "common/safetensors.h"

#include <fcntl.h>
#include <libdeflate.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <memory>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/file_io.h"
#include "nlohmann/json.hpp"

namespace fusedps::safetensors {
namespace {

using file_io::Errno;
using file_io::Fd;
using file_io::WriteAll;
using nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;  // The reference loader's limit.

absl::StatusOr<uint64_t> Elements(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("dimension ", d, " < 0"));
    if (d != 0 && n > (uint64_t{1} << 62) / static_cast<uint64_t>(d)) {
      return absl::InvalidArgumentError("more than 2^62 elements");
    }
    n *= static_cast<uint64_t>(d);
  }
  return n;
}

struct DTypeInfo {
  DType dtype;
  const char* name;  // The format's spelling.
  size_t size;       // Bytes per element.
};
// Every DType, in enum order (Info indexes it).
constexpr DTypeInfo kDTypes[] = {
    {DType::kF32, "F32", 4},   {DType::kBF16, "BF16", 2}, {DType::kF16, "F16", 2},
    {DType::kU8, "U8", 1},     {DType::kF64, "F64", 8},   {DType::kI64, "I64", 8},
    {DType::kI32, "I32", 4},   {DType::kI16, "I16", 2},   {DType::kI8, "I8", 1},
    {DType::kBool, "BOOL", 1},
};
constexpr bool InEnumOrder() {
  for (size_t i = 0; i < std::size(kDTypes); ++i) {
    if (static_cast<size_t>(kDTypes[i].dtype) != i) return false;
  }
  return true;
}
static_assert(InEnumOrder(), "kDTypes lists every DType in enum order");
const DTypeInfo& Info(DType dtype) { return kDTypes[static_cast<size_t>(dtype)]; }

}  // namespace

const char* DTypeName(DType dtype) { return Info(dtype).name; }
size_t DTypeSize(DType dtype) { return Info(dtype).size; }

absl::StatusOr<DType> DTypeOfName(const std::string& name) {
  for (const DTypeInfo& info : kDTypes) {
    if (name == info.name) return info.dtype;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("dtype \"", name, "\" is not one of ", DTypeNames()));
}

std::string DTypeNames() {
  std::string names;
  for (const DTypeInfo& info : kDTypes) {
    absl::StrAppend(&names, names.empty() ? "" : ", ", info.name);
  }
  return names;
}

uint32_t Crc32(uint32_t crc, const void* data, size_t bytes) {
  return libdeflate_crc32(crc, data, bytes);
}

struct Writer::State {
  std::string path;
  Fd fd{-1};
  uint32_t crc = 0;
  bool fsync = false;
  uint64_t bytes = 0;     // Written so far.
  uint64_t expected = 0;  // The file's size once every tensor's data is appended.
};

Writer::Writer() = default;
Writer::~Writer() = default;
Writer::Writer(Writer&&) noexcept = default;
Writer& Writer::operator=(Writer&&) noexcept = default;

absl::StatusOr<Writer> Writer::Create(const std::string& path, absl::Span<const TensorView> tensors,
                                      const WriteOptions& options) {
  json header = json::object();
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const TensorView& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__" || !names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor name \"", t.name, "\" is empty, reserved or repeated"));
    }
    absl::StatusOr<uint64_t> elements = Elements(t.shape);
    if (!elements.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", t.name, "\": ", elements.status().message()));
    }
    const uint64_t bytes = *elements * DTypeSize(t.dtype);
    if (!options.data_appended && bytes != t.data.size()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor \"", t.name, "\" has ", t.data.size(),
                                                     " bytes of data, its shape "
                                                     "and dtype need ",
                                                     bytes));
    }
    header[t.name] = {{"dtype", DTypeName(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!options.metadata.empty()) header["__metadata__"] = options.metadata;
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception&) {  // Invalid UTF-8 (type_error 316).
    return absl::InvalidArgumentError("a tensor name or metadata string is not valid UTF-8");
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // The data starts 8-byte aligned.
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(uint64_t{text.size()} >> (8 * i));

  Writer writer;
  writer.state_ = std::make_unique<State>();
  State& state = *writer.state_;
  state.path = path;
  state.fsync = options.fsync;
  state.expected = sizeof(length) + text.size() + offset;
  state.fd.Reset(open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (state.fd.get() < 0) return Errno("cannot create", path);
  if (absl::Status s = writer.Append(length, sizeof(length)); !s.ok()) return s;
  if (absl::Status s = writer.Append(text.data(), text.size()); !s.ok()) return s;
  return writer;
}

absl::Status Writer::Append(const void* data, size_t bytes) {
  State& state = *state_;
  if (state.bytes + bytes > state.expected) {
    return absl::InternalError(absl::StrCat(state.path, ": ", state.bytes + bytes,
                                            " bytes appended, the header holds ", state.expected));
  }
  state.bytes += bytes;
  state.crc = Crc32(state.crc, data, bytes);
  return WriteAll(state.fd.get(), data, bytes, state.path);
}

absl::StatusOr<WriteResult> Writer::Finish() {
  State& state = *state_;
  if (state.bytes != state.expected) {
    return absl::InternalError(absl::StrCat(state.path, ": ", state.bytes,
                                            " bytes appended, the header holds ", state.expected));
  }
  if (state.fsync && fsync(state.fd.get()) != 0) return Errno("cannot fsync", state.path);
  if (absl::Status s = state.fd.Close(state.path); !s.ok()) return s;
  return WriteResult{state.bytes, state.crc};
}

absl::StatusOr<WriteResult> WriteFile(const std::string& path, absl::Span<const TensorView> tensors,
                                      const WriteOptions& options) {
  WriteOptions with_data = options;
  with_data.data_appended = false;
  absl::StatusOr<Writer> writer = Writer::Create(path, tensors, with_data);
  if (!writer.ok()) return writer.status();
  for (const TensorView& t : tensors) {
    if (absl::Status s = writer->Append(t.data.data(), t.data.size()); !s.ok()) return s;
  }
  return writer->Finish();
}

absl::StatusOr<File> File::Read(const std::string& path) {
  absl::StatusOr<std::string> bytes = file_io::ReadFile(path);
  if (!bytes.ok()) return bytes.status();
  return Parse(*std::move(bytes), path);
}

absl::StatusOr<File> File::Parse(std::string bytes, const std::string& what) {
  uint64_t data_start = 0;
  absl::StatusOr<File> file = ParseHeader(bytes, bytes.size(), what, &data_start);
  if (!file.ok()) return file.status();
  file->data_start_ = data_start;
  file->bytes_ = std::move(bytes);
  return file;
}

absl::StatusOr<File> File::ParseHeader(absl::string_view head, uint64_t file_bytes,
                                       const std::string& what, uint64_t* data_start) {
  const auto corrupt = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat(what, " is not a valid safetensors file: ", why));
  };
  if (file_bytes < 8 || head.size() < 8) {
    return corrupt(absl::StrCat("only ", file_bytes, " bytes"));
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(head[static_cast<size_t>(i)]);
  if (n > kMaxHeaderBytes || n > file_bytes - 8 || n > head.size() - 8) {
    return corrupt(absl::StrCat("a header of ", n, " bytes in a file of ", file_bytes));
  }
  const json header = json::parse(head.begin() + 8, head.begin() + 8 + static_cast<long>(n),
                                  /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (!header.is_object()) return corrupt("the header is not a JSON object");
  File file;
  *data_start = 8 + n;
  const uint64_t data_bytes = file_bytes - *data_start;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) return corrupt("__metadata__ is not an object");
      for (const auto& [key, v] : value.items()) {
        if (!v.is_string()) return corrupt(absl::StrCat("__metadata__.", key, " not a string"));
        file.metadata_[key] = v.get<std::string>();
      }
      continue;
    }
    // C++17 lambdas cannot capture a structured binding (clang refuses): a named copy.
    const std::string tensor = name;
    const auto bad = [&](const std::string& why) {
      return corrupt(absl::StrCat(tensor, ": ", why));
    };
    if (!value.is_object() || !value.contains("dtype") || !value["dtype"].is_string() ||
        !value.contains("shape") || !value["shape"].is_array() || !value.contains("data_offsets") ||
        !value["data_offsets"].is_array() || value["data_offsets"].size() != 2) {
      return bad("needs dtype, shape and data_offsets [begin, end]");
    }
    Entry entry;
    entry.name = name;
    absl::StatusOr<DType> dtype = DTypeOfName(value["dtype"].get<std::string>());
    if (!dtype.ok()) return bad(std::string(dtype.status().message()));
    entry.dtype = *dtype;
    for (const json& d : value["shape"]) {
      if (!d.is_number_integer()) return bad("a dimension is not an integer");
      entry.shape.push_back(d.get<int64_t>());
    }
    for (const json& o : value["data_offsets"]) {
      if (!o.is_number_unsigned()) return bad("an offset is not an unsigned integer");
    }
    entry.begin = value["data_offsets"][0].get<uint64_t>();
    entry.end = value["data_offsets"][1].get<uint64_t>();
    absl::StatusOr<uint64_t> elements = Elements(entry.shape);
    if (!elements.ok()) return bad(std::string(elements.status().message()));
    if (entry.end < entry.begin || entry.end - entry.begin != *elements * DTypeSize(entry.dtype)) {
      return bad("data_offsets disagree with the shape and dtype");
    }
    file.entries_.push_back(std::move(entry));
  }
  // By offset, and an empty tensor before a non-empty one at the same offset (it lies between
  // the one before and that one).
  std::sort(file.entries_.begin(), file.entries_.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t covered = 0;
  for (const Entry& e : file.entries_) {
    if (e.begin != covered) return corrupt(absl::StrCat(e.name, " leaves a gap or overlaps"));
    covered = e.end;
  }
  if (covered != data_bytes) {
    return corrupt(
        absl::StrCat("the tensors cover ", covered, " bytes of data, the file has ", data_bytes));
  }
  return file;
}

const Entry* File::Find(const std::string& name) const {
  for (const Entry& e : entries_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

absl::Span<const uint8_t> File::Data(const Entry& entry) const {
  return {reinterpret_cast<const uint8_t*>(bytes_.data()) + data_start_ + entry.begin,
          entry.end - entry.begin};
}

Reader::Reader() = default;
Reader::~Reader() = default;
Reader::Reader(Reader&&) noexcept = default;
Reader& Reader::operator=(Reader&&) noexcept = default;

absl::StatusOr<Reader> Reader::Open(const std::string& path) {
  Reader reader;
  reader.path_ = path;
  reader.fd_ = std::make_unique<Fd>(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  const int fd = reader.fd_->get();
  if (fd < 0) return Errno("cannot open", path);
  struct stat info;
  if (fstat(fd, &info) != 0) return Errno("cannot stat", path);
  posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  const uint64_t file_bytes = static_cast<uint64_t>(info.st_size);
  // The length, then the header it names (bounded by the format's limit).
  std::string head(std::min<uint64_t>(file_bytes, 8), '\0');
  if (absl::Status s = file_io::ReadAll(fd, head.data(), head.size(), path); !s.ok()) return s;
  uint64_t n = 0;
  for (size_t i = head.size(); i-- > 0;) n = (n << 8) | static_cast<uint8_t>(head[i]);
  if (head.size() == 8 && n <= std::min(kMaxHeaderBytes, file_bytes - 8)) {
    head.resize(8 + n);
    if (absl::Status s = file_io::ReadAll(fd, head.data() + 8, n, path); !s.ok()) return s;
  }
  uint64_t data_start = 0;
  absl::StatusOr<File> header = File::ParseHeader(head, file_bytes, path, &data_start);
  if (!header.ok()) return header.status();
  reader.header_ = *std::move(header);
  reader.data_left_ = file_bytes - data_start;
  reader.crc_ = Crc32(0, head.data(), head.size());
  return reader;
}

absl::Status Reader::Read(void* dst, size_t bytes) {
  bytes = static_cast<size_t>(std::min<uint64_t>(bytes, data_left_));
  if (absl::Status s = file_io::ReadAll(fd_->get(), dst, bytes, path_); !s.ok()) return s;
  data_left_ -= bytes;
  crc_ = Crc32(crc_, dst, bytes);
  return absl::OkStatus();
}

}  // namespace fusedps::safetensors
