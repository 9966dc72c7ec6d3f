// connection.h (client internal): one of a Client's connections, for the files that implement
// Client (client.cc, server_calls.cc, push_transaction.cc, pull_into.cc).
#ifndef FUSEDPS_CLIENT_CONNECTION_H_
#define FUSEDPS_CLIENT_CONNECTION_H_

#include <memory>

#include "fusedps/client.h"
#include "fusedps/v1/parameter_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace fusedps::client {

// A gRPC stub over one channel (its own TCP connection: CreateChannel).
struct Client::Connection {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::ParameterService::Stub> stub;
};

}  // namespace fusedps::client

#endif  // FUSEDPS_CLIENT_CONNECTION_H_
