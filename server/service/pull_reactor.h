// pull_reactor.h (server internal): PullParameters on gRPC's callback API, one reactor per call.
//
// A pull is read at one version, in stream order after the steps queued before it, and streamed
// through a bounded window of staging:
//   - a pull of at most one window (ServiceLimits::window_bytes) reserves that much staging,
//     and the engine copies the tensors straight into it (on a GPU: one device-to-host copy per
//     tensor into page-locked memory);
//   - a larger pull first reserves its size in the snapshot budget (--pull-snapshot-bytes), and
//     the engine copies the tensors into a snapshot (device memory on a GPU) at one point of the
//     stream order; the reactor then copies it out one window at a time while later steps run.
// Either way the pull holds at most one window of staging however slowly its client reads, and
// every chunk was read at the version in its header. The first message carries the header
// (version, dtype, tensor_count, as many TensorInfo as fit in a message); TensorInfo that did
// not fit follow in the next messages; then chunks of at most max_chunk_bytes.
//
// The request is checked and its read laid out in ingest (server/ingest/pull_request.h,
// PlanPull); the reactor finds the model, executes the plan and translates its errors.
//
// No gRPC thread waits for a kernel: the read is acknowledged from the engine's completion
// path. A window's copy out of a snapshot runs on the thread that finished the last write (it
// waits for that copy alone, never for a step).
#ifndef FUSEDPS_SERVER_SERVICE_PULL_REACTOR_H_
#define FUSEDPS_SERVER_SERVICE_PULL_REACTOR_H_

#include "fusedps/v1/parameter_service.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/service/service_context.h"

namespace fusedps {

// `request` is a serialized PullParametersRequest; the reactor's messages are serialized
// PullParametersResponses whose chunk payloads are slices of the pull's staging window, when the
// pull fits in one (no copy), or copies of it otherwise.
grpc::ServerWriteReactor<grpc::ByteBuffer>* NewPullReactor(grpc::CallbackServerContext* context,
                                                           const grpc::ByteBuffer* request,
                                                           const ServiceContext& services);

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_SERVICE_PULL_REACTOR_H_
