// security_flags.h: the command-line flags of a client's transport security and token, shared
// by the `fusedps` CLI and fusedps-bench:
//   --tls             TLS with gRPC's default roots (implied by any --tls-* file)
//   --tls-ca=FILE     PEM roots that the server's certificate must chain to
//   --tls-cert=FILE   PEM client certificate (with --tls-key), for a server with --tls-client-ca
//   --tls-key=FILE    its PEM private key
//   --token=TOKEN     bearer token (the server's --auth-tokens); visible in `ps`: prefer
//   --token-file=FILE a file holding it
#ifndef FUSEDPS_CLIENT_CLI_SECURITY_FLAGS_H_
#define FUSEDPS_CLIENT_CLI_SECURITY_FLAGS_H_

#include <string>

#include "fusedps/client.h"

namespace fusedps::client {

// Copies the flags into `options` (Create reads the files and checks them).
void ApplySecurityFlags(ClientOptions* options);

// These flags' --help text (common/flag_usage.h), for the programs that link them.
std::string SecurityFlagsHelp();

}  // namespace fusedps::client

#endif  // FUSEDPS_CLIENT_CLI_SECURITY_FLAGS_H_
