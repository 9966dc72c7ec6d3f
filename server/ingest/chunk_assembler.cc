#include "server/ingest/chunk_assembler.h"

#include <cstring>
#include <new>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"

namespace fusedps {

ChunkAssembler::ChunkAssembler(std::vector<Expected> tensors, int element_size)
    : tensors_(std::move(tensors)), element_size_(element_size) {}

uint64_t ChunkAssembler::StagingBytes(const std::vector<Expected>& tensors, int element_size) {
  uint64_t numel = 0;
  for (const Expected& t : tensors) {
    if (t.required) numel += AlignedNumel(t.numel);
  }
  return numel * static_cast<uint64_t>(element_size);
}

absl::StatusOr<ChunkAssembler> ChunkAssembler::Create(std::vector<Expected> tensors,
                                                      int element_size, char* memory) {
  ChunkAssembler a(std::move(tensors), element_size);
  const uint64_t bytes = a.IndexTensors() * element_size;
  if (memory != nullptr) {
    a.memory_ = memory;
    return a;
  }
  try {
    a.owned_.resize((bytes + 7) / 8);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat("staging of ", bytes, " bytes"));
  }
  a.memory_ = reinterpret_cast<char*>(a.owned_.data());
  return a;
}

ChunkAssembler ChunkAssembler::Tracker(std::vector<Expected> tensors, int element_size) {
  ChunkAssembler a(std::move(tensors), element_size);
  a.IndexTensors();  // No staging: memory_ stays null.
  return a;
}

uint64_t ChunkAssembler::IndexTensors() {
  uint64_t total = 0;
  staging_offsets_.reserve(tensors_.size());
  for (uint32_t i = 0; i < tensors_.size(); ++i) {
    index_.emplace(tensors_[i].name, i);
    staging_offsets_.push_back(total);
    if (tensors_[i].required) total += AlignedNumel(tensors_[i].numel);
  }
  received_.assign(tensors_.size(), 0);
  ranges_.resize(tensors_.size());
  return total;
}

absl::Status ChunkAssembler::AddChunk(absl::string_view tensor, uint64_t offset,
                                      absl::string_view data) {
  absl::StatusOr<std::optional<uint64_t>> at = Claim(tensor, offset, data.size());
  if (!at.ok()) return at.status();
  if (at->has_value()) std::memcpy(memory_ + **at, data.data(), data.size());
  return absl::OkStatus();
}

absl::StatusOr<std::optional<uint64_t>> ChunkAssembler::Claim(absl::string_view tensor,
                                                              uint64_t offset, uint64_t bytes) {
  auto it = index_.find(tensor);
  if (it == index_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("chunks.tensor ", QuoteName(tensor),
                                                   " is not among the tensors this call names"));
  }
  const uint32_t t = it->second;
  if (bytes % element_size_ != 0) {
    return absl::InvalidArgumentError(absl::StrCat("chunks.data of ", QuoteName(tensor), " has ",
                                                   bytes, " bytes, not a multiple of the ",
                                                   element_size_, "-byte element size"));
  }
  const uint64_t count = bytes / element_size_;
  const uint64_t numel = tensors_[t].numel;
  if (offset > numel || count > numel - offset) {
    return absl::InvalidArgumentError(absl::StrCat("chunk of ", QuoteName(tensor),
                                                   " covers elements [", offset, ", ",
                                                   offset + count, ") past its numel ", numel));
  }
  if (count == 0) return std::optional<uint64_t>();
  std::map<uint64_t, uint64_t>& ranges = ranges_[t];
  auto next = ranges.upper_bound(offset);
  const bool overlaps_next = next != ranges.end() && next->first < offset + count;
  const bool overlaps_prev = next != ranges.begin() && std::prev(next)->second > offset;
  if (overlaps_next || overlaps_prev) {
    return absl::InvalidArgumentError(absl::StrCat("chunk of ", QuoteName(tensor), " at elements [",
                                                   offset, ", ", offset + count,
                                                   ") overlaps elements already received"));
  }
  // Extend a neighbouring range instead of adding one, so in-order chunks keep one entry.
  if (next != ranges.begin() && std::prev(next)->second == offset) {
    std::prev(next)->second = offset + count;
  } else {
    ranges.emplace(offset, offset + count);
  }
  received_[t] += count;
  if (!tensors_[t].required) return std::optional<uint64_t>();
  bytes_received_ += bytes;
  return std::optional<uint64_t>((staging_offsets_[t] + offset) *
                                 static_cast<uint64_t>(element_size_));
}

absl::Status ChunkAssembler::Finish() const {
  for (uint32_t t = 0; t < tensors_.size(); ++t) {
    if (tensors_[t].required && received_[t] != tensors_[t].numel) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", QuoteName(tensors_[t].name), " received ", received_[t],
                       " of its ", tensors_[t].numel, " elements: chunks are missing"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<uint64_t>> ClaimChunk(ChunkAssembler& assembler, const ShardView& view,
                                                   absl::string_view tensor, uint64_t offset,
                                                   uint64_t bytes) {
  if (!assembler.Expects(tensor) && !view.FindTensor(tensor).has_value()) {
    return absl::NotFoundError(
        absl::StrCat("chunks.tensor ", QuoteName(tensor), " is not registered"));
  }
  return assembler.Claim(tensor, offset, bytes);
}

}  // namespace fusedps
