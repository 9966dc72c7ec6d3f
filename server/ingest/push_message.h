// push_message.h (server internal): reads a serialized PushGradientsRequest straight from
// gRPC's receive buffer (its slices, as string views), so that each chunk's payload is copied
// once, from gRPC's slices into staging, instead of into a protobuf string first and into
// staging after. Free of gRPC: the caller hands over the message's slices.
//
// The wire format is proto/fusedps/v1's PushGradientsRequest {PushHeader header = 1;
// repeated TensorChunk chunks = 2; PushCommit commit = 3; repeated TableRows table_rows = 4},
// TensorChunk {string tensor = 1; uint64 offset = 2; bytes data = 3; ...; workspace_offset_bytes =
// 5; workspace_bytes = 6}. Every protobuf serializer writes a chunk's fields in that order, so
// `data` is last (a chunk whose bytes are in a workspace has none) and its destination is known
// when it starts: the payload is then read directly into it. A chunk whose `data` is followed by
// other fields (legal protobuf, from an unusual writer) is still read correctly, through a
// temporary copy. Unknown fields are skipped, as protobuf does.
//
// Errors: INVALID_ARGUMENT for bytes that are not a PushGradientsRequest ("malformed ...") and
// for a header in a message that may not carry one; a claim's or a staged chunk's own error
// stops the read and is returned as it is.
#ifndef FUSEDPS_SERVER_INGEST_PUSH_MESSAGE_H_
#define FUSEDPS_SERVER_INGEST_PUSH_MESSAGE_H_

#include <cstdint>
#include <optional>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/slice_input_stream.h"
#include "common/tensor_chunk_reader.h"
#include "fusedps/v1/parameter_service.pb.h"

namespace fusedps {

// The message's header, or nullopt when it has none. Chunks are skipped, not copied.
absl::StatusOr<std::optional<v1::PushHeader>> ReadPushHeader(MessageSlices message);

// Reads the message's chunks in order: for each, claim, copy the payload once to the claimed
// destination, then staged. `header_allowed`: whether the message may carry a header (the
// first message of a call), which is then skipped; elsewhere a header is INVALID_ARGUMENT.
// The message's commit (PushHeader.commit_at_end), if any, goes to *commit (reset first);
// with commit null it is skipped. Two commits in one message are INVALID_ARGUMENT.
// `workspace`: the push's workspace (PushHeader.workspace), from which chunks with
// workspace_bytes are copied (or handed to its on_device); empty when the push names none
// (ReadTensorChunk). The
// message's embedding-table rows (table_rows) are appended to *table_rows, parsed (one copy);
// with table_rows null they are skipped.
absl::Status ReadPushChunks(MessageSlices message, bool header_allowed, ClaimChunkFn claim,
                            ChunkStagedFn staged, std::optional<v1::PushCommit>* commit = nullptr,
                            ChunkWorkspace workspace = {},
                            std::vector<v1::TableRows>* table_rows = nullptr);

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_INGEST_PUSH_MESSAGE_H_
