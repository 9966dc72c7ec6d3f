#include "client/channel.h"

#include <algorithm>
#include <climits>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/wire.h"
#include "common/file_io.h"
#include "common/grpc_args.h"

namespace fusedps::client {
namespace {

// Milliseconds for an int channel argument.
int Milliseconds(absl::Duration duration) {
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(duration), INT_MAX));
}

// The channel arguments of a connection made by CreateChannel.
grpc::ChannelArguments ChannelArgs(const ClientOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(internal::kMaxMessageBytes);
  args.SetMaxReceiveMessageSize(internal::kMaxMessageBytes);
  // A connection of its own rather than gRPC's global subchannel, shared by every channel to
  // the same target: each stream (and each client) moves its data on its own TCP connection.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  if (options.keepalive_time != absl::InfiniteDuration()) {
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, Milliseconds(options.keepalive_time));
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, Milliseconds(options.keepalive_timeout));
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0);
    // gRPC otherwise stops pinging after 2 pings without data, that is, while a call waits on
    // the server (a push being applied) a dead peer would go unnoticed from the third on.
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  }
  ForEachTransportArg([&](const std::string& name, int value) { args.SetInt(name, value); });
  return args;
}

// A whole file, for ClientOptions' `option`. Errors: INVALID_ARGUMENT naming the option.
absl::StatusOr<std::string> ReadOptionFile(const std::string& path, const char* option) {
  absl::StatusOr<std::string> text = file_io::ReadFile(path);
  if (!text.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(option, ": ", text.status().message()));
  }
  return text;
}

}  // namespace

namespace internal {

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const ClientOptions& options) {
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError("tls_cert_file and tls_key_file go together");
  }
  if (!options.tls && options.tls_ca_file.empty() && options.tls_cert_file.empty()) {
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions ssl;
  if (!options.tls_ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadOptionFile(options.tls_ca_file, "tls_ca_file");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *std::move(ca);
  }
  if (!options.tls_cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadOptionFile(options.tls_cert_file, "tls_cert_file");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadOptionFile(options.tls_key_file, "tls_key_file");
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *std::move(cert);
    ssl.pem_private_key = *std::move(key);
  }
  return grpc::SslCredentials(ssl);
}

std::shared_ptr<grpc::Channel> NewChannel(
    const std::string& target, const std::shared_ptr<grpc::ChannelCredentials>& credentials,
    const ClientOptions& options) {
  return grpc::CreateCustomChannel(target, credentials, ChannelArgs(options));
}

}  // namespace internal

absl::StatusOr<std::shared_ptr<grpc::Channel>> CreateChannel(const std::string& target,
                                                             const ClientOptions& options) {
  if (target.empty()) return absl::InvalidArgumentError("empty target");
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      internal::ChannelCredentials(options);
  if (!credentials.ok()) return credentials.status();
  return internal::NewChannel(target, *credentials, options);
}

namespace internal {

absl::Status LoadToken(ClientOptions* options) {
  if (options->token_file.empty()) return absl::OkStatus();
  if (!options->token.empty()) {
    return absl::InvalidArgumentError("token and token_file are exclusive");
  }
  absl::StatusOr<std::string> text = ReadOptionFile(options->token_file, "token_file");
  if (!text.ok()) return text.status();
  const absl::string_view token = absl::StripAsciiWhitespace(*text);
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("token_file ", options->token_file, " holds no token"));
  }
  options->token = std::string(token);
  options->token_file.clear();
  return absl::OkStatus();
}

void ConfigureCall(const ClientOptions& options, grpc::ClientContext* context) {
  if (options.wait_for_ready) context->set_wait_for_ready(true);
  if (!options.token.empty()) context->AddMetadata("authorization", "Bearer " + options.token);
}

void ConfigureContext(const ClientOptions& options, grpc::ClientContext* context,
                      uint64_t payload_bytes) {
  internal::ConfigureCall(options, context);
  const absl::Duration timeout = internal::CallTimeout(options, payload_bytes);
  if (timeout != absl::InfiniteDuration()) {
    context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  }
}

}  // namespace internal
}  // namespace fusedps::client
