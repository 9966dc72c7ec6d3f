#include "server/auth/tls.h"

#include <openssl/bio.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <algorithm>
#include <cstdio>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"

namespace fusedps {
namespace {

struct BioDeleter {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
struct X509Deleter {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyDeleter {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};
using Bio = std::unique_ptr<BIO, BioDeleter>;

absl::StatusOr<Bio> OpenPem(const std::string& path, const char* flag) {
  Bio bio(BIO_new_file(path.c_str(), "r"));
  if (bio == nullptr)
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": cannot be read"));
  return bio;
}

// The first certificate of `path`.
absl::StatusOr<std::unique_ptr<X509, X509Deleter>> ReadCertificate(const std::string& path,
                                                                   const char* flag) {
  absl::StatusOr<Bio> bio = OpenPem(path, flag);
  if (!bio.ok()) return bio.status();
  std::unique_ptr<X509, X509Deleter> cert(PEM_read_bio_X509(bio->get(), nullptr, nullptr, nullptr));
  if (cert == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": no PEM certificate"));
  }
  return cert;
}

}  // namespace

absl::StatusOr<double> CertificateNotAfter(const std::string& cert_file) {
  absl::StatusOr<std::unique_ptr<X509, X509Deleter>> cert =
      ReadCertificate(cert_file, "--tls-cert");
  if (!cert.ok()) return cert.status();
  std::tm tm{};
  if (ASN1_TIME_to_tm(X509_get0_notAfter(cert->get()), &tm) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-cert ", cert_file, ": the certificate's notAfter cannot be read"));
  }
  return static_cast<double>(timegm(&tm));
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const TlsOptions& options) {
  if (options.cert_file.empty() != options.key_file.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (options.cert_file.empty()) {
    if (!options.client_ca_file.empty()) {
      return absl::InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key");
    }
    return grpc::InsecureServerCredentials();
  }
  absl::StatusOr<std::unique_ptr<X509, X509Deleter>> cert =
      ReadCertificate(options.cert_file, "--tls-cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<Bio> key_bio = OpenPem(options.key_file, "--tls-key");
  if (!key_bio.ok()) return key_bio.status();
  std::unique_ptr<EVP_PKEY, KeyDeleter> key(
      PEM_read_bio_PrivateKey(key_bio->get(), nullptr, nullptr, nullptr));
  if (key == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-key ", options.key_file, ": no PEM private key (or it is encrypted)"));
  }
  if (X509_check_private_key(cert->get(), key.get()) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls-key ", options.key_file, " does not belong to --tls-cert ", options.cert_file));
  }
  if (!options.client_ca_file.empty()) {
    absl::StatusOr<std::unique_ptr<X509, X509Deleter>> ca =
        ReadCertificate(options.client_ca_file, "--tls-client-ca");
    if (!ca.ok()) return ca.status();
  }
  const auto seconds = static_cast<unsigned int>(
      std::max<int64_t>(1, absl::ToInt64Seconds(options.reload_interval)));
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      options.key_file, options.cert_file, options.client_ca_file, seconds);
  grpc::experimental::TlsServerCredentialsOptions tls(provider);
  tls.watch_identity_key_cert_pairs();
  if (options.client_ca_file.empty()) {
    tls.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  } else {
    tls.watch_root_certs();
    tls.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  return grpc::experimental::TlsServerCredentials(tls);
}

}  // namespace fusedps
