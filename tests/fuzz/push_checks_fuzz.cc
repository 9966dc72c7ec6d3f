// push_checks_fuzz: a push's checks as the server runs them on one call's messages: the header
// (ReadPushHeader, CheckPushHeader against the shard's view), then every chunk (ReadPushChunks
// claiming through ClaimChunk and a ChunkAssembler over exactly-sized staging, as
// PushAssembly::AddMessage does), then ChunkAssembler::Finish.
//
// Input (fuzz_input.h): mode (mode % 3 picks the shard of PushViews()), slicing, then the call's
// serialized PushGradientsRequests: the first carries the header.
//
// A model of the checks runs beside them: a chunk is taken when its tensor is one the header
// names, its data is whole elements of the header's dtype, its range lies inside the tensor and
// no element of it has arrived. For every input:
//   - a header CheckPushHeader takes has a known dtype, valid parts, distinct registered
//     tensors (all of the shard's when it names none); one it refuses is INVALID_ARGUMENT,
//     NOT_FOUND, UNIMPLEMENTED or FAILED_PRECONDITION;
//   - the staging layout is the model's (each tensor at a multiple of 8 elements);
//   - every claim is taken or refused as the model says, with the model's code (NOT_FOUND for a
//     tensor the shard does not have, else INVALID_ARGUMENT) and the model's staging offset,
//     and what it takes lies inside its tensor's staging (AddressSanitizer watches the rest);
//   - Finish succeeds exactly when every element of every named tensor arrived once.
#include <cstdint>
#include <cstring>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fusedps/v1/parameter_service.pb.h"
#include "kernels/grad_check.h"
#include "server/ingest/chunk_assembler.h"
#include "server/ingest/push_assembly.h"
#include "server/ingest/push_message.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/fuzz_shards.h"

namespace fusedps::fuzz {
namespace {

constexpr size_t kMaxMessages = 8;

// Staging of exactly `bytes`, 16-byte aligned, as a reservation of the staging pool is.
class Staging {
 public:
  explicit Staging(uint64_t bytes)
      : bytes_(bytes), data_(static_cast<char*>(::operator new[](bytes, kAlign))) {}
  ~Staging() { ::operator delete[](data_, kAlign); }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  char* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }

 private:
  static constexpr std::align_val_t kAlign{16};
  const uint64_t bytes_;
  char* const data_;
};

// The chunk checks, written from the API's contract (proto/fusedps/v1 and chunk_assembler.h).
class Model {
 public:
  Model(const ShardView& view, const std::vector<uint32_t>& tensors, int element_size)
      : view_(view), element_size_(element_size) {
    uint64_t at = 0;
    for (uint32_t i = 0; i < tensors.size(); ++i) {
      const uint64_t numel = view.tensor(tensors[i]).numel;
      index_.emplace(view.tensor(tensors[i]).name, i);
      numel_.push_back(numel);
      offsets_.push_back(at);
      received_.emplace_back(numel, false);
      at += (numel + 7) / 8 * 8;
    }
    staging_bytes_ = at * element_size;
  }

  const std::vector<uint64_t>& offsets() const { return offsets_; }
  uint64_t staging_bytes() const { return staging_bytes_; }

  // The verdict on a chunk: its byte offset in staging (nullopt: nothing to copy), or the code
  // of its refusal. Records the elements of a chunk it takes.
  absl::StatusOr<std::optional<uint64_t>> Claim(absl::string_view tensor, uint64_t offset,
                                                uint64_t bytes) {
    auto it = index_.find(tensor);
    if (it == index_.end()) {
      return view_.FindTensor(tensor).has_value() ? absl::InvalidArgumentError("not named")
                                                  : absl::NotFoundError("not registered");
    }
    const uint32_t t = it->second;
    if (bytes % element_size_ != 0) return absl::InvalidArgumentError("not whole elements");
    const uint64_t count = bytes / element_size_;
    if (offset > numel_[t] || count > numel_[t] - offset) {
      return absl::InvalidArgumentError("past the end");
    }
    if (count == 0) return std::optional<uint64_t>();
    for (uint64_t i = offset; i < offset + count; ++i) {
      if (received_[t][i]) return absl::InvalidArgumentError("overlap");
    }
    for (uint64_t i = offset; i < offset + count; ++i) received_[t][i] = true;
    return std::optional<uint64_t>((offsets_[t] + offset) * element_size_);
  }

  // The tensor a staging byte range lies in, or -1.
  int TensorOf(uint64_t at, uint64_t bytes) const {
    for (size_t t = 0; t < numel_.size(); ++t) {
      const uint64_t begin = offsets_[t] * element_size_;
      const uint64_t end = begin + numel_[t] * element_size_;
      if (at >= begin && at + bytes <= end) return static_cast<int>(t);
    }
    return -1;
  }

  bool Complete() const {
    for (const std::vector<bool>& r : received_) {
      for (bool b : r) {
        if (!b) return false;
      }
    }
    return true;
  }

 private:
  const ShardView& view_;
  const int element_size_;
  absl::flat_hash_map<std::string, uint32_t> index_;
  std::vector<uint64_t> numel_, offsets_;
  std::vector<std::vector<bool>> received_;
  uint64_t staging_bytes_ = 0;
};

void CheckCheckedHeader(const v1::PushHeader& header, const CheckedPushHeader& checked,
                        const ShardView& view) {
  Require(checked.dtype == *GradDTypeFromProto(header.grad_dtype(), "grad_dtype"),
          "CheckPushHeader: dtype");
  Require(checked.part_count >= 1 && checked.part_count <= kMaxPushParts &&
              header.part_index() < checked.part_count,
          "CheckPushHeader: parts");
  Require(!header.has_grad_scale() || header.grad_scale() > 0, "CheckPushHeader: grad_scale");
  Require(header.worker_count() <= 1, "CheckPushHeader: worker_count");
  Require(header.plan_hash() == view.plan_hash(), "CheckPushHeader: plan_hash");
  absl::flat_hash_set<uint32_t> seen;
  for (uint32_t t : checked.tensors) {
    Require(t < view.tensor_count() && seen.insert(t).second, "CheckPushHeader: tensors");
  }
  if (header.tensors().empty()) {
    Require(checked.tensors.size() == view.tensor_count(), "CheckPushHeader: every tensor");
  } else {
    Require(checked.tensors.size() == static_cast<size_t>(header.tensors_size()),
            "CheckPushHeader: the tensors named");
    for (int i = 0; i < header.tensors_size(); ++i) {
      Require(view.tensor(checked.tensors[i]).name == header.tensors(i),
              "CheckPushHeader: a tensor's index");
    }
  }
}

void RunPush(const FuzzInput& input, const ShardView& view) {
  absl::StatusOr<std::optional<v1::PushHeader>> read =
      ReadPushHeader(Slices(input.messages[0], input.slicing));
  if (!read.ok()) {
    RequireCode(read.status(), {absl::StatusCode::kInvalidArgument}, "ReadPushHeader");
    return;
  }
  if (!read->has_value()) return;  // The reactor's INVALID_ARGUMENT.
  const v1::PushHeader& header = **read;
  absl::StatusOr<CheckedPushHeader> checked = CheckPushHeader(header, view);
  if (!checked.ok()) {
    RequireCode(checked.status(),
                {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound,
                 absl::StatusCode::kUnimplemented, absl::StatusCode::kFailedPrecondition},
                "CheckPushHeader");
    return;
  }
  CheckCheckedHeader(header, *checked, view);

  const int element_size = DTypeSize(checked->dtype);
  std::vector<ChunkAssembler::Expected> expected;
  for (uint32_t t : checked->tensors)
    expected.push_back({view.tensor(t).name, view.tensor(t).numel});
  Model model(view, checked->tensors, element_size);
  const uint64_t staging_bytes = ChunkAssembler::StagingBytes(expected, element_size);
  Require(staging_bytes == model.staging_bytes(), "StagingBytes is not the model's");
  Staging staging(staging_bytes);
  absl::StatusOr<ChunkAssembler> assembler =
      ChunkAssembler::Create(std::move(expected), element_size, staging.data());
  Require(assembler.ok(), "ChunkAssembler::Create with memory failed");
  Require(assembler->staging_offsets() == model.offsets(), "staging layout is not the model's");
  const float grad_scale = header.has_grad_scale() ? header.grad_scale() : 0.0f;

  for (size_t m = 0; m < input.messages.size(); ++m) {
    uint64_t staged_bytes = 0;
    const absl::Status status = ReadPushChunks(
        Slices(input.messages[m], input.slicing), /*header_allowed=*/m == 0,
        [&](absl::string_view tensor, uint64_t offset, uint64_t bytes) -> absl::StatusOr<char*> {
          const uint64_t before = assembler->bytes_received();
          absl::StatusOr<std::optional<uint64_t>> at =
              ClaimChunk(*assembler, view, tensor, offset, bytes);
          absl::StatusOr<std::optional<uint64_t>> want = model.Claim(tensor, offset, bytes);
          Require(at.status().code() == want.status().code(),
                  "ClaimChunk's verdict is not the model's");
          if (!at.ok()) {
            Require(assembler->bytes_received() == before, "a refused chunk was recorded");
            return at.status();
          }
          Require(*at == *want, "ClaimChunk's staging offset is not the model's");
          if (!at->has_value()) return nullptr;
          Require(model.TensorOf(**at, bytes) >= 0, "a chunk lies outside its tensor");
          return staging.data() + **at;
        },
        [&](char* data, uint64_t bytes) {
          Require(data >= staging.data() && data + bytes <= staging.data() + staging.bytes(),
                  "staged outside staging");
          staged_bytes += bytes;
          GradsAllFinite(data, checked->dtype, bytes / element_size, grad_scale,
                         /*parallel=*/false);
          return absl::OkStatus();
        });
    if (!status.ok()) {
      RequireCode(status, {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound},
                  "ReadPushChunks");
      return;  // The push fails.
    }
  }
  const absl::Status finished = assembler->Finish();
  Require(finished.ok() == model.Complete(), "Finish's verdict is not the model's");
  if (!finished.ok()) {
    RequireCode(finished, {absl::StatusCode::kInvalidArgument}, "Finish");
  }
}

}  // namespace
}  // namespace fusedps::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fusedps::fuzz::QuietProtobufLog();
  fusedps::fuzz::PushViews();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fusedps::fuzz;
  const FuzzInput input = ParseFuzzInput(data, size, kMaxMessages);
  if (input.messages.empty()) return 0;
  const auto& views = PushViews();
  RunPush(input, *views[input.mode % views.size()]);
  return 0;
}
