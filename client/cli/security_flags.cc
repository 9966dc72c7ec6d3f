#include "client/cli/security_flags.h"

#include <string>

#include "absl/flags/flag.h"
#include "common/flag_usage.h"

ABSL_FLAG(bool, tls, false,
          "connect with TLS, checking the server's certificate against gRPC's default roots "
          "(implied by --tls-ca, --tls-cert and --tls-key)");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM roots that the server's certificate must chain to (its --tls-cert's CA)");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM client certificate, with --tls-key, for a server with --tls-client-ca (mTLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert");
ABSL_FLAG(std::string, token, "",
          "bearer token for a server with --auth-tokens (visible to `ps`: prefer --token-file)");
ABSL_FLAG(std::string, token_file, "", "a file holding the bearer token");

namespace fusedps::client {

void ApplySecurityFlags(ClientOptions* options) {
  options->tls = absl::GetFlag(FLAGS_tls);
  options->tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
  options->tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options->tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options->token = absl::GetFlag(FLAGS_token);
  options->token_file = absl::GetFlag(FLAGS_token_file);
}

std::string SecurityFlagsHelp() { return FlagsHelp(__FILE__); }

}  // namespace fusedps::client
