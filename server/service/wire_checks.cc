#include "server/service/wire_checks.h"

#include <cmath>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace fusedps {

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

absl::StatusOr<GradDType> GradDTypeFromProto(v1::DType d, absl::string_view field) {
  switch (d) {
    case v1::DTYPE_FLOAT32:
      return GradDType::kFloat32;
    case v1::DTYPE_BFLOAT16:
      return GradDType::kBFloat16;
    case v1::DTYPE_FLOAT16:
      return GradDType::kFloat16;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          field, " = ", static_cast<int>(d), " must be FLOAT32, BFLOAT16 or FLOAT16"));
  }
}

namespace {

// NOT_FOUND for a chunk of a tensor that the call does not name and the shard does not have.
absl::Status CheckChunkTensor(const ChunkAssembler& assembler, const ShardStore& store,
                              absl::string_view tensor) {
  if (!assembler.Expects(tensor) && !store.Lookup({std::string(tensor)}).ok()) {
    return absl::NotFoundError(absl::StrCat("chunks.tensor '", tensor, "' is not registered"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status AddChunk(ChunkAssembler& assembler, const ShardStore& store,
                      const v1::TensorChunk& chunk) {
  if (absl::Status s = CheckChunkTensor(assembler, store, chunk.tensor()); !s.ok()) return s;
  return assembler.AddChunk(chunk.tensor(), chunk.offset(), chunk.data());
}

absl::StatusOr<std::optional<uint64_t>> ClaimChunk(ChunkAssembler& assembler,
                                                   const ShardStore& store,
                                                   absl::string_view tensor, uint64_t offset,
                                                   uint64_t bytes) {
  if (absl::Status s = CheckChunkTensor(assembler, store, tensor); !s.ok()) return s;
  return assembler.Claim(tensor, offset, bytes);
}

absl::StatusOr<std::vector<TensorInfo>> CheckPushHeader(const v1::PushHeader& header,
                                                        const ShardStore& store) {
  absl::StatusOr<GradDType> dtype = GradDTypeFromProto(header.grad_dtype(), "header.grad_dtype");
  if (!dtype.ok()) return dtype.status();
  if (header.has_grad_scale() &&
      !(std::isfinite(header.grad_scale()) && header.grad_scale() > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("header.grad_scale = ", header.grad_scale(),
                                                   " must be finite and > 0"));
  }
  if (header.worker_count() > 1) {
    return absl::UnimplementedError(absl::StrCat(
        "header.worker_count = ", header.worker_count(),
        ": synchronous aggregation is not implemented; use 0 or 1"));
  }
  absl::flat_hash_set<absl::string_view> seen;
  for (int i = 0; i < header.tensors_size(); ++i) {
    if (!seen.insert(header.tensors(i)).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header.tensors[", i, "] names tensor '", header.tensors(i), "' a second time"));
    }
  }
  return store.Lookup({header.tensors().begin(), header.tensors().end()});
}

}  // namespace fusedps
