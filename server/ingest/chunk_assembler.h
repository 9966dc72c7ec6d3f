// chunk_assembler.h: reassembles tensors that arrive as chunks, checking every chunk.
//
// A push (or a registration) names a list of tensors; their data then arrives as chunks
// (tensor, offset, bytes) in any order and any split. The assembler copies each chunk's payload
// once into one staging buffer, in which tensor i occupies elements
// [staging_offsets()[i], staging_offsets()[i] + numel) (offsets are multiples of 8 elements, so
// every tensor starts on a 16-byte boundary), and tracks which elements have arrived.
//
// Errors name the field and the limit: INVALID_ARGUMENT for a chunk of a tensor that is not in
// the list, a payload that is not a whole number of elements, a range past the tensor's end, a
// range that overlaps data already received, and (from Finish) elements never received.
//
// Usage:
//   ChunkAssembler assembler({{"w", 1000}, {"b", 10}}, /*element_size=*/2);
//   for (chunk : chunks) RETURN_IF_ERROR(assembler.AddChunk(chunk.tensor, chunk.offset, data));
//   (or Claim, then copy the payload to staging() + the returned offset yourself)
//   RETURN_IF_ERROR(assembler.Finish());
//   use assembler.staging(), assembler.staging_offsets()
#ifndef FUSEDPS_SERVER_INGEST_CHUNK_ASSEMBLER_H_
#define FUSEDPS_SERVER_INGEST_CHUNK_ASSEMBLER_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/store/shard_view.h"

namespace fusedps {

class ChunkAssembler {
 public:
  struct Expected {
    std::string name;
    uint64_t numel;
    // False: chunks of this tensor are checked like any other (range, overlap) but not
    // stored, and Finish does not require them (a re-registered tensor's values).
    bool required = true;
  };

  // The staging bytes Create will allocate for these tensors (each at a 16-byte boundary).
  static uint64_t StagingBytes(const std::vector<Expected>& tensors, int element_size);

  // REQUIRES: names are distinct (the caller has checked). element_size is 2 or 4.
  // `memory`, when given, is the staging (StagingBytes long, 16-byte aligned, outliving the
  // assembler); else the assembler allocates its own, failing with RESOURCE_EXHAUSTED when it
  // cannot.
  static absl::StatusOr<ChunkAssembler> Create(std::vector<Expected> tensors, int element_size,
                                               char* memory = nullptr);

  // An assembler that only tracks which elements arrived, with no staging: use Claim (its
  // offsets are into a staging that does not exist), never AddChunk or staging().
  static ChunkAssembler Tracker(std::vector<Expected> tensors, int element_size);

  // Checks one chunk and copies its payload into staging (unless it is a chunk of a tensor
  // that is not required). On error nothing is copied.
  absl::Status AddChunk(absl::string_view tensor, uint64_t offset, absl::string_view data);

  // AddChunk without the copy: checks a chunk of `bytes` payload bytes and records its range
  // as received; returns the byte offset into staging() where the caller must copy the payload
  // (nullopt for an empty chunk or a tensor that is not required). The caller copies after
  // this returns, so that copies of different chunks may run concurrently; Finish() and the
  // staging are valid once every claimed copy is done. On error nothing is recorded.
  absl::StatusOr<std::optional<uint64_t>> Claim(absl::string_view tensor, uint64_t offset,
                                                uint64_t bytes);

  // True when `tensor` is one of the tensors this assembler expects.
  bool Expects(absl::string_view tensor) const { return index_.contains(tensor); }
  // Its position in the list given to Create or Tracker. REQUIRES: Expects(tensor).
  uint32_t IndexOf(absl::string_view tensor) const { return index_.at(tensor); }

  // OK when every element of every tensor has arrived exactly once.
  absl::Status Finish() const;

  const std::vector<uint64_t>& staging_offsets() const { return staging_offsets_; }
  const void* staging() const { return memory_; }
  uint64_t bytes_received() const { return bytes_received_; }

 private:
  ChunkAssembler(std::vector<Expected> tensors, int element_size);
  // Indexes tensors_ and lays out their staging offsets; returns the staging's elements.
  uint64_t IndexTensors();

  std::vector<Expected> tensors_;
  int element_size_;
  absl::flat_hash_map<std::string, uint32_t> index_;
  std::vector<uint64_t> staging_offsets_;             // In elements.
  std::vector<uint64_t> received_;                    // Elements received, per tensor.
  std::vector<std::map<uint64_t, uint64_t>> ranges_;  // Per tensor: begin -> end received.
  std::vector<uint64_t> owned_;  // 8-byte words, so 16-byte-aligned tensors stay so.
  char* memory_ = nullptr;       // owned_'s data, or the caller's memory.
  uint64_t bytes_received_ = 0;
};

// assembler.Claim, except that a chunk of a tensor the call does not name and the shard does not
// have is NOT_FOUND (one the shard has, but the call does not name, stays INVALID_ARGUMENT).
absl::StatusOr<std::optional<uint64_t>> ClaimChunk(ChunkAssembler& assembler, const ShardView& view,
                                                   absl::string_view tensor, uint64_t offset,
                                                   uint64_t bytes);

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_INGEST_CHUNK_ASSEMBLER_H_
