// tls.h: the gRPC port's transport security (--tls-cert, --tls-key, --tls-client-ca).
//
// Without a certificate the port is plaintext. With one it is TLS only: a plaintext client's
// handshake fails (the client sees UNAVAILABLE). With --tls-client-ca it is mutual TLS: the
// handshake requires a client certificate that the CA signed, and refuses any other client.
//
// Rotation: gRPC's FileWatcherCertificateProvider reads the three files again every
// `reload_interval`. A changed certificate and key are used for the handshakes of new
// connections from then on; connections already open keep their session, and their calls go
// on (nothing fails). Write the new files the way cert-manager and Kubernetes Secrets do
// (atomically: a new directory, then a renamed symlink), or the key and the certificate last;
// a pair that does not match is refused by gRPC, which keeps the previous one.
//
// Start checks the files once: each must exist and hold PEM, and the key must belong to the
// certificate, so that a wrong path fails at start rather than at the first handshake.
#ifndef FUSEDPS_SERVER_AUTH_TLS_H_
#define FUSEDPS_SERVER_AUTH_TLS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/security/server_credentials.h"

namespace fusedps {

struct TlsOptions {
  std::string cert_file;       // PEM certificate chain, leaf first; empty: plaintext.
  std::string key_file;        // PEM private key of the leaf.
  std::string client_ca_file;  // PEM CA bundle: require and verify client certificates.
  // How often the files are read again (whole seconds, at least 1).
  absl::Duration reload_interval = absl::Seconds(10);
};

// The gRPC port's credentials for `options`: insecure without cert_file. Errors:
// INVALID_ARGUMENT naming the flag: cert_file without key_file or the reverse, client_ca_file
// without cert_file, a file that cannot be read or holds no PEM certificate (or key), or a key
// that does not belong to the certificate.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const TlsOptions& options);

// When the first certificate of `cert_file` (the leaf) expires, in Unix seconds: what the port
// serves once gRPC has read the file. Errors: INVALID_ARGUMENT for a file that cannot be read
// or holds no PEM certificate.
absl::StatusOr<double> CertificateNotAfter(const std::string& cert_file);

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_AUTH_TLS_H_
