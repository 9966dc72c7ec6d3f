// wire_checks.h (server internal): the checks and conversions that the service's handlers
// share: absl::Status to grpc::Status (the one place), dtypes, chunks, push headers.
#ifndef FUSEDPS_SERVER_WIRE_CHECKS_H_
#define FUSEDPS_SERVER_WIRE_CHECKS_H_

#include <functional>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "fusedps/v1/parameter_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/chunk_assembler.h"
#include "server/shard_store.h"

namespace fusedps {

inline constexpr char kSkipNonFiniteGrad[] = "non_finite_grad";

// The same code and message.
grpc::Status ToGrpc(const absl::Status& s);

// INVALID_ARGUMENT naming `field` for anything but FLOAT32, BFLOAT16 or FLOAT16.
absl::StatusOr<GradDType> GradDTypeFromProto(v1::DType d, absl::string_view field);

// Adds one chunk; a chunk of a tensor the shard does not have is NOT_FOUND. `staged_at` as in
// ChunkAssembler::AddChunk.
absl::Status AddChunk(ChunkAssembler& assembler, const ShardStore& store,
                      const v1::TensorChunk& chunk, std::optional<uint64_t>* staged_at = nullptr);

// AddChunk's checks without the copy: ChunkAssembler::Claim, and NOT_FOUND as AddChunk.
absl::StatusOr<std::optional<uint64_t>> ClaimChunk(ChunkAssembler& assembler,
                                                   const ShardStore& store,
                                                   absl::string_view tensor, uint64_t offset,
                                                   uint64_t bytes);

// Called for each chunk copied into staging, with the byte offset it landed at; an error
// stops the message.
using OnStaged = std::function<absl::Status(const v1::TensorChunk& chunk, uint64_t staged_at)>;

// Adds one message's chunks with AddChunk. `first`: the message that carries the header; a
// header in any other is INVALID_ARGUMENT.
template <typename Request>
absl::Status AddChunks(ChunkAssembler& assembler, const ShardStore& store, const Request& request,
                       bool first, const OnStaged& on_staged = nullptr) {
  if (!first && request.has_header()) {
    return absl::InvalidArgumentError("header may appear only in the first message");
  }
  for (const v1::TensorChunk& chunk : request.chunks()) {
    std::optional<uint64_t> staged_at;
    if (absl::Status s = AddChunk(assembler, store, chunk, &staged_at); !s.ok()) return s;
    if (on_staged && staged_at.has_value()) {
      if (absl::Status s = on_staged(chunk, *staged_at); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

// Checks a push header and returns its tensors (all of the shard's when it names none).
absl::StatusOr<std::vector<TensorInfo>> CheckPushHeader(const v1::PushHeader& header,
                                                        const ShardStore& store);

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_WIRE_CHECKS_H_
