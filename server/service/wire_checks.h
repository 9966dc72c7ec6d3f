// wire_checks.h (server internal): the checks and conversions that the service's handlers
// share: absl::Status to grpc::Status (the one place), dtypes, chunks, push headers.
#ifndef FUSEDPS_SERVER_SERVICE_WIRE_CHECKS_H_
#define FUSEDPS_SERVER_SERVICE_WIRE_CHECKS_H_

#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "fusedps/v1/parameter_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/ingest/chunk_assembler.h"
#include "server/store/shard_store.h"

namespace fusedps {

inline constexpr char kSkipNonFiniteGrad[] = "non_finite_grad";

// The same code and message.
grpc::Status ToGrpc(const absl::Status& s);

// INVALID_ARGUMENT naming `field` for anything but FLOAT32, BFLOAT16 or FLOAT16.
absl::StatusOr<GradDType> GradDTypeFromProto(v1::DType d, absl::string_view field);

// Adds one chunk; a chunk of a tensor the shard does not have is NOT_FOUND.
absl::Status AddChunk(ChunkAssembler& assembler, const ShardStore& store,
                      const v1::TensorChunk& chunk);

// AddChunk's checks without the copy: ChunkAssembler::Claim, and NOT_FOUND as AddChunk.
absl::StatusOr<std::optional<uint64_t>> ClaimChunk(ChunkAssembler& assembler,
                                                   const ShardStore& store,
                                                   absl::string_view tensor, uint64_t offset,
                                                   uint64_t bytes);

// Checks a push header and returns its tensors (all of the shard's when it names none).
absl::StatusOr<std::vector<TensorInfo>> CheckPushHeader(const v1::PushHeader& header,
                                                        const ShardStore& store);

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_SERVICE_WIRE_CHECKS_H_
