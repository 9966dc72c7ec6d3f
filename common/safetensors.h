// safetensors.h: reads and writes safetensors files, the format of `fusedps pull --out` and of
// the tensor data in checkpoints. One module for both (tested in safetensors_test.cc).
//
// The format (https://huggingface.co/docs/safetensors; the reference loader is
// safetensors.torch.load_file):
//   8 bytes     N, the header's length, unsigned little-endian
//   N bytes     a JSON object, UTF-8, padded at the end with spaces: each tensor's name maps to
//               {"dtype": a DTypeName below, "shape": [d0, d1, ...],
//               "data_offsets": [begin, end]},
//               and "__metadata__" (optional) maps to an object of string values
//   the data    every tensor's bytes, row-major, little-endian; offsets are relative to the
//               data's start, and the tensors cover it exactly, with no gap and no overlap
// The writer pads the header so that the data starts 8-byte aligned, and lays tensors out in
// the order given. The JSON is made and parsed with nlohmann::json. Checksums are CRC-32 (the
// zlib/gzip polynomial: Python's zlib.crc32), computed with libdeflate.
#ifndef FUSEDPS_COMMON_SAFETENSORS_H_
#define FUSEDPS_COMMON_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/file_io.h"

namespace fusedps::safetensors {

// The element types fusedps reads and writes: fp32 params, optimizer state and scales; bf16
// params and state, bf16 or fp16 param copies; the one-byte codes of int8 optimizer state; and
// the dtypes of a model's buffers (torch's float64, int64, ..., bool).
enum class DType { kF32, kBF16, kF16, kU8, kF64, kI64, kI32, kI16, kI8, kBool };
// The format's spelling: "F32", "BF16", "F16", "U8", "F64", "I64", "I32", "I16", "I8", "BOOL".
const char* DTypeName(DType dtype);
size_t DTypeSize(DType dtype);  // Bytes per element: 4, 2, 2, 1, 8, 8, 4, 2, 1, 1.
std::string DTypeNames();       // "F32, BF16, ...": every name, for error messages.
// The DType of a name (DTypeName's inverse). INVALID_ARGUMENT naming the dtype and the names.
absl::StatusOr<DType> DTypeOfName(const std::string& name);

struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;      // Each dimension >= 0; {} is a scalar (one element).
  absl::Span<const uint8_t> data;  // Exactly elements × DTypeSize(dtype) bytes.
};

struct WriteOptions {
  std::map<std::string, std::string> metadata;  // "__metadata__"; omitted when empty.
  bool fsync = false;  // fsync(2) the file before returning (durability, for checkpoints).
  // Writer::Create only: the tensors' data comes later through Append (TensorView::data is
  // not looked at).
  bool data_appended = false;
};

struct WriteResult {
  uint64_t bytes = 0;  // The file's size.
  uint32_t crc32 = 0;  // Of the whole file: the checkpoint manifest's checksum.
};

// CRC-32 of `bytes` at `data`, continuing from `crc` (0 to start): zlib's crc32().
uint32_t Crc32(uint32_t crc, const void* data, size_t bytes);

// A file written in order: Create writes the header, Append the tensors' data (in the order
// given, in pieces of any size), Finish checks that all of it came and syncs. For data that is
// not in memory all at once (a checkpoint written tensor by tensor). The checksum is computed
// as the data is appended. Errors as WriteFile's; INTERNAL for more or less data than the
// header holds. Not thread-safe.
class Writer {
 public:
  static absl::StatusOr<Writer> Create(const std::string& path,
                                       absl::Span<const TensorView> tensors,
                                       const WriteOptions& options);
  absl::Status Append(const void* data, size_t bytes);
  absl::StatusOr<WriteResult> Finish();

  Writer(Writer&&) noexcept;
  Writer& operator=(Writer&&) noexcept;
  ~Writer();

 private:
  Writer();
  struct State;
  std::unique_ptr<State> state_;
};

// Writes `tensors`, in this order, to `path` (created or truncated).
// Errors: INVALID_ARGUMENT for an empty or duplicate name, the name "__metadata__", a negative
// dimension, or data whose size does not match the shape and dtype (nothing is written then);
// the errno's status (e.g. RESOURCE_EXHAUSTED for ENOSPC, PERMISSION_DENIED) when the file
// cannot be written, in which case the file may be partial: callers commit by renaming.
absl::StatusOr<WriteResult> WriteFile(const std::string& path, absl::Span<const TensorView> tensors,
                                      const WriteOptions& options = {});

// One tensor of a file's header.
struct Entry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // Byte offsets into the data.
};

// A file read whole into memory and validated.
class File {
 public:
  // Errors: the errno's status when the file cannot be read (NOT_FOUND, ...); DATA_LOSS when it
  // is not a valid safetensors file: shorter than its header says, a header that is not a JSON
  // object of the form above, a dtype not in DTypeNames(), offsets that disagree
  // with the shape, or tensors that do not cover the data exactly. The message names the file
  // and what is wrong.
  static absl::StatusOr<File> Read(const std::string& path);
  // The same, from bytes already in memory; `what` names them in errors.
  static absl::StatusOr<File> Parse(std::string bytes, const std::string& what);
  // The same, from a file's first bytes (at least its 8-byte length and the header it names)
  // and its size. Sets *data_start to where the data begins. For Reader, and tools that read
  // headers alone.
  static absl::StatusOr<File> ParseHeader(absl::string_view head, uint64_t file_bytes,
                                          const std::string& what, uint64_t* data_start);

  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::vector<Entry>& entries() const { return entries_; }  // In data order.
  const Entry* Find(const std::string& name) const;               // nullptr when absent.
  absl::Span<const uint8_t> Data(const Entry& entry) const;

 private:
  std::string bytes_;
  uint64_t data_start_ = 0;
  std::map<std::string, std::string> metadata_;
  std::vector<Entry> entries_;
};

// A file read in order, for data too large to hold at once (a checkpoint's restore): Open reads
// and validates the header (as File::Read, against the file's size), Read hands out the data
// piece by piece, and crc32() is the CRC-32 of what was read so far, header included (the whole
// file's once data_left() is 0). Not thread-safe.
class Reader {
 public:
  // Errors as File::Read's.
  static absl::StatusOr<Reader> Open(const std::string& path);

  const std::string& path() const { return path_; }
  const std::vector<Entry>& entries() const { return header_.entries(); }  // In data order.
  const std::map<std::string, std::string>& metadata() const { return header_.metadata(); }
  uint64_t data_left() const { return data_left_; }
  uint32_t crc32() const { return crc_; }

  // Reads the next min(bytes, data_left()) bytes of the data into dst. Errors: the errno's
  // status; DATA_LOSS when the file ends early (it shrank since Open).
  absl::Status Read(void* dst, size_t bytes);

  Reader(Reader&&) noexcept;
  Reader& operator=(Reader&&) noexcept;
  ~Reader();

 private:
  Reader();
  std::string path_;
  std::unique_ptr<file_io::Fd> fd_;
  File header_;
  uint64_t data_left_ = 0;
  uint32_t crc_ = 0;
};

}  // namespace fusedps::safetensors

#endif  // FUSEDPS_COMMON_SAFETENSORS_H_
