// channel.h (client internal): what every connection and every call of a Client carries, from
// ClientOptions: the channel's credentials and arguments (CreateChannel, public in
// fusedps/client.h) and each call's metadata.
#ifndef FUSEDPS_CLIENT_CHANNEL_H_
#define FUSEDPS_CLIENT_CHANNEL_H_

#include "fusedps/client.h"
#include "grpcpp/grpcpp.h"

namespace fusedps::client::internal {

// Reads options->token_file into options->token. Errors: INVALID_ARGUMENT when both are set,
// or for a file that cannot be read or holds only whitespace.
absl::Status LoadToken(ClientOptions* options);

// What every call's context carries: wait_for_ready, and the bearer token's metadata.
void ConfigureCall(const ClientOptions& options, grpc::ClientContext* context);

}  // namespace fusedps::client::internal

#endif  // FUSEDPS_CLIENT_CHANNEL_H_
