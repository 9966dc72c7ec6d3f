// push_reactor.h (server internal): PushGradients on gRPC's callback API, one reactor per call.
//
// The reactor is the transport of a PushAssembly part (server/ingest/push_assembly.h): it reads
// the call's messages as gRPC's raw buffers, checks the header's client_id against the caller
// (server/auth) and finds its model (server/models), then translates what ingest decides about
// the header (server/ingest/push_admission.h: refused, answered from the retry table, waiting
// for the original, or admitted into an assembly), and ends the call with the reply the
// assembly gives it. Nothing here blocks a gRPC thread: staging is granted asynchronously, and
// the step is acknowledged from the engine's completion path.
//
// Rules that keep the call object safe (gRPC may free it once Finish has run and OnDone
// returned): every gRPC operation (StartRead, Finish) is issued under the reactor's lock and
// only while the call is not finished; gRPC never runs a reaction inline from those calls on
// this API (their tags are not inlineable), so holding the lock there cannot deadlock. The
// reactor deletes itself after OnDone only once nothing else holds it: a message being added
// (possibly on the staging pool's thread), or a retry waiting in the retry table (held from
// before the admission, whose waiter may run on another thread before it returns, until the
// waiter has run or the verdict says it never will).
#ifndef FUSEDPS_SERVER_SERVICE_PUSH_REACTOR_H_
#define FUSEDPS_SERVER_SERVICE_PUSH_REACTOR_H_

#include "grpcpp/grpcpp.h"
#include "server/service/service_context.h"

namespace fusedps {

// PushGradients is a raw method: `response` receives a serialized PushGradientsResponse, and
// the reactor reads serialized PushGradientsRequests (server/ingest/push_message.h).
grpc::ServerReadReactor<grpc::ByteBuffer>* NewPushReactor(grpc::CallbackServerContext* context,
                                                          grpc::ByteBuffer* response,
                                                          const ServiceContext& services);

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_SERVICE_PUSH_REACTOR_H_
