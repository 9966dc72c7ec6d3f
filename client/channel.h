// channel.h (client internal): what every connection and every call of a Client carries, from
// ClientOptions: the channel's credentials and arguments (CreateChannel, public in
// fusedps/client.h) and each call's metadata.
#ifndef FUSEDPS_CLIENT_CHANNEL_H_
#define FUSEDPS_CLIENT_CHANNEL_H_

#include <cstdint>
#include <memory>
#include <string>

#include "fusedps/client.h"
#include "grpcpp/grpcpp.h"

namespace fusedps::client::internal {

// The credentials of the channels `options` asks for: plaintext, or TLS with the PEM files
// read now. Errors: INVALID_ARGUMENT naming the option, as CreateChannel's.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const ClientOptions& options);

// A channel to `target` with `credentials` and the arguments of `options` (CreateChannel,
// with the credentials made once for all of a client's streams).
std::shared_ptr<grpc::Channel> NewChannel(
    const std::string& target, const std::shared_ptr<grpc::ChannelCredentials>& credentials,
    const ClientOptions& options);

// Reads options->token_file into options->token. Errors: INVALID_ARGUMENT when both are set,
// or for a file that cannot be read or holds only whitespace.
absl::Status LoadToken(ClientOptions* options);

// What every call's context carries: wait_for_ready, and the bearer token's metadata.
void ConfigureCall(const ClientOptions& options, grpc::ClientContext* context);

// A call's deadline (CallTimeout of payload_bytes from now; none when that is infinite) and
// wait_for_ready.
void ConfigureContext(const ClientOptions& options, grpc::ClientContext* context,
                      uint64_t payload_bytes = 0);

}  // namespace fusedps::client::internal

#endif  // FUSEDPS_CLIENT_CHANNEL_H_
