// convert.h (server internal): the conversions between the wire API (proto/fusedps/v1) and the
// server's own types, and the one place where absl::Status becomes grpc::Status.
#ifndef FUSEDPS_SERVER_SERVICE_CONVERT_H_
#define FUSEDPS_SERVER_SERVICE_CONVERT_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fusedps/v1/parameter_service.pb.h"
#include "grpcpp/support/status.h"
#include "server/engine/consistency.h"
#include "server/models/model.h"
#include "server/schema/hyperparameters.h"
#include "server/store/buffer_set.h"
#include "server/store/retry_table.h"
#include "server/store/shard_view.h"

namespace fusedps {

// The same code and message.
grpc::Status ToGrpc(const absl::Status& s);

// Every field set, the storage fields included.
void ToProto(const ParamGroupSpec& group, v1::ParamGroup* p);
// With the tensor's own storage (ShardView::layout): FLOAT32 state for a small tensor of an
// INT8 group.
void ToProto(const ShardView& view, uint32_t tensor, int64_t step, v1::TensorInfo* p);
void ToProto(const PushReply& reply, v1::PushGradientsResponse* p);

// Only the fields of its mode are set.
void ToProto(const ConsistencyOptions& c, v1::Consistency* p);
// A CreateModelRequest's consistency. INVALID_ARGUMENT naming the field for a mode that is not
// a ConsistencyMode, a negative or non-finite round_timeout_seconds, and what
// ValidateConsistency refuses.
absl::StatusOr<ConsistencyOptions> ConsistencyFromProto(const v1::Consistency& p);
// The model as ListModels and CreateModel describe it.
void ToProto(const Model& model, v1::ModelInfo* p);

// A WriteBuffers buffer: INVALID_ARGUMENT naming the buffer for a dtype that is not a
// safetensors::DTypeNames() name (its shape and size are CheckBuffer's, the engine's).
absl::StatusOr<BufferValue> BufferFromProto(const v1::Buffer& p);
void ToProto(const BufferValue& buffer, v1::Buffer* p);

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_SERVICE_CONVERT_H_
