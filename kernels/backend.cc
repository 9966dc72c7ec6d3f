#include "kernels/backend.h"

namespace fusedps {

absl::Status ReadNow(OptimizerBackend& backend, const ReadRequest& request) {
  if (absl::Status s = backend.Read(request); !s.ok()) return s;
  absl::StatusOr<Marker> marker = backend.Mark();
  if (!marker.ok()) return marker.status();
  return backend.Wait(*marker).status();
}

absl::Status ReadTensor(OptimizerBackend& backend, TensorField field, uint32_t tensor,
                        float* out) {
  const uint64_t offset = 0;
  ReadRequest request;
  request.field = field;
  request.tensors = absl::MakeConstSpan(&tensor, 1);
  request.dst_offsets = absl::MakeConstSpan(&offset, 1);
  request.dst = out;
  return ReadNow(backend, request);
}

}  // namespace fusedps
