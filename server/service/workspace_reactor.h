// workspace_reactor.h (server internal): OpenWorkspace on gRPC's callback API, one reactor per
// call. The call is the workspace's lease (proto OpenWorkspace; server/workspace/workspace.h):
// the reactor opens the workspace, writes its one response, and holds it until the call ends
// (the client cancels it, its connection closes, or the server shuts down), then closes it. No
// thread waits meanwhile.
#ifndef FUSEDPS_SERVER_SERVICE_WORKSPACE_REACTOR_H_
#define FUSEDPS_SERVER_SERVICE_WORKSPACE_REACTOR_H_

#include "fusedps/v1/parameter_service.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/service/service_context.h"

namespace fusedps {

grpc::ServerWriteReactor<v1::OpenWorkspaceResponse>* NewWorkspaceReactor(
    grpc::CallbackServerContext* context, const v1::OpenWorkspaceRequest* request,
    const ServiceContext& services);

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_SERVICE_WORKSPACE_REACTOR_H_
