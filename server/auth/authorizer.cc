#include "server/auth/authorizer.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_io.h"
#include "common/logging.h"

namespace fusedps {

const char* RpcName(Rpc rpc) {
  switch (rpc) {
    case Rpc::kRegisterParamGroup:
      return "RegisterParamGroup";
    case Rpc::kRegisterTensors:
      return "RegisterTensors";
    case Rpc::kPushGradients:
      return "PushGradients";
    case Rpc::kPullParameters:
      return "PullParameters";
    case Rpc::kGetInfo:
      return "GetInfo";
    case Rpc::kCheckpoint:
      return "Checkpoint";
    case Rpc::kListTensors:
      return "ListTensors";
    case Rpc::kSetHyperparameters:
      return "SetHyperparameters";
    case Rpc::kLoadState:
      return "LoadState";
    case Rpc::kCreateModel:
      return "CreateModel";
    case Rpc::kListModels:
      return "ListModels";
    case Rpc::kDeleteModel:
      return "DeleteModel";
    case Rpc::kWriteBuffers:
      return "WriteBuffers";
    case Rpc::kPullBuffers:
      return "PullBuffers";
    case Rpc::kOpenWorkspace:
      return "OpenWorkspace";
    case Rpc::kLookupRows:
      return "LookupRows";
  }
  return "unknown";
}

Role RequiredRole(Rpc rpc) {
  switch (rpc) {
    case Rpc::kPullParameters:
    case Rpc::kGetInfo:
    case Rpc::kListTensors:
    case Rpc::kListModels:
    case Rpc::kPullBuffers:
    case Rpc::kLookupRows:
      return Role::kReader;
    case Rpc::kPushGradients:
    case Rpc::kWriteBuffers:
    case Rpc::kOpenWorkspace:
      return Role::kTrainer;
    case Rpc::kRegisterParamGroup:
    case Rpc::kRegisterTensors:
    case Rpc::kCheckpoint:
    case Rpc::kSetHyperparameters:
    case Rpc::kLoadState:
    case Rpc::kCreateModel:
    case Rpc::kDeleteModel:
      return Role::kAdmin;
  }
  return Role::kAdmin;
}

Authorizer::Authorizer(AuthOptions options) : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<Authorizer>> Authorizer::Create(AuthOptions options) {
  std::unique_ptr<Authorizer> authorizer(new Authorizer(std::move(options)));
  if (authorizer->options_.tokens_file.empty()) return authorizer;
  if (absl::Status s = authorizer->Reload(); !s.ok()) return s;
  authorizer->watcher_ = std::thread([self = authorizer.get()] { self->WatchLoop(); });
  return authorizer;
}

Authorizer::~Authorizer() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  stop_.SignalAll();
  if (watcher_.joinable()) watcher_.join();
}

absl::Status Authorizer::Reload() {
  absl::StatusOr<std::string> text = file_io::ReadFile(options_.tokens_file);
  if (!text.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--auth-tokens: ", text.status().message()));
  }
  {
    MutexLock lock(&mu_);
    if (tokens_ != nullptr && *text == tokens_text_) return absl::OkStatus();
  }
  absl::StatusOr<TokenTable> table = TokenTable::Parse(*text, options_.tokens_file);
  if (!table.ok()) return table.status();
  const size_t size = table->size();
  MutexLock lock(&mu_);
  const bool first = tokens_ == nullptr;
  tokens_ = std::make_shared<const TokenTable>(*std::move(table));
  tokens_text_ = *std::move(text);
  last_error_.clear();
  LOG(INFO) << (first ? "loaded " : "reloaded ") << size << " tokens from --auth-tokens "
            << options_.tokens_file;
  return absl::OkStatus();
}

void Authorizer::WatchLoop() {
  mu_.Lock();
  while (true) {
    const auto due =
        std::chrono::steady_clock::now() + absl::ToChronoMilliseconds(options_.reload_interval);
    while (!stopping_ && !stop_.WaitWithDeadline(&mu_, due)) {
    }
    if (stopping_) break;
    mu_.Unlock();
    const absl::Status s = Reload();
    mu_.Lock();
    if (!s.ok() && s.ToString() != last_error_) {
      // Logged once per distinct error: the file is checked every reload_interval.
      LOG(ERROR) << s.message() << "; the tokens loaded before stay in force";
      last_error_ = s.ToString();
    }
  }
  mu_.Unlock();
}

absl::Status Authorizer::Refuse(absl::StatusCode code, const std::string& reason,
                                const std::string& message,
                                const grpc::ServerContextBase& context) const {
  if (options_.on_failure) options_.on_failure(reason);
  const absl::Status status(code, message);
  FUSEDPS_LOG_EVERY_SECONDS(WARNING, 1)
      << "refused a call from " << context.peer() << " (" << reason << "): " << status;
  return status;
}

absl::StatusOr<Caller> Authorizer::Authorize(const grpc::ServerContextBase& context,
                                             Rpc rpc) const {
  Caller caller;
  if (!enabled()) return caller;
  caller.authenticated = true;
  if (options_.tokens_file.empty()) {
    // mTLS alone: the handshake verified the certificate; its names are the principals.
    const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
    if (auth == nullptr || !auth->IsPeerAuthenticated()) {
      return Refuse(absl::StatusCode::kUnauthenticated, "missing_credentials",
                    "this server requires a client certificate (--tls-client-ca)", context);
    }
    for (const grpc::string_ref& name : auth->GetPeerIdentity()) {
      caller.principals.emplace_back(name.data(), name.size());
    }
    caller.role = Role::kAdmin;
    return caller;
  }

  const auto& metadata = context.client_metadata();
  const auto range = metadata.equal_range("authorization");
  if (range.first == range.second) {
    return Refuse(absl::StatusCode::kUnauthenticated, "missing_credentials",
                  "this server requires a token: send 'authorization: Bearer TOKEN' metadata "
                  "(the clients' --token or --token-file)",
                  context);
  }
  if (std::next(range.first) != range.second) {
    return Refuse(absl::StatusCode::kUnauthenticated, "invalid_token",
                  "the call carries more than one 'authorization' metadata entry", context);
  }
  const absl::string_view value(range.first->second.data(), range.first->second.size());
  constexpr absl::string_view kScheme = "bearer ";
  if (value.size() <= kScheme.size() ||
      !absl::EqualsIgnoreCase(value.substr(0, kScheme.size()), kScheme)) {
    return Refuse(absl::StatusCode::kUnauthenticated, "invalid_token",
                  "the 'authorization' metadata must be 'Bearer TOKEN'", context);
  }
  std::shared_ptr<const TokenTable> tokens;
  {
    MutexLock lock(&mu_);
    tokens = tokens_;
  }
  std::optional<Identity> identity = tokens->Find(value.substr(kScheme.size()));
  if (!identity.has_value()) {
    return Refuse(absl::StatusCode::kUnauthenticated, "invalid_token",
                  "the token is not one of the server's (--auth-tokens)", context);
  }
  if (static_cast<int>(identity->role) < static_cast<int>(RequiredRole(rpc))) {
    return Refuse(absl::StatusCode::kPermissionDenied, "wrong_role",
                  absl::StrCat("principal '", identity->principal, "' has role ",
                               RoleName(identity->role), ", which may not call ", RpcName(rpc),
                               ": it needs role ", RoleName(RequiredRole(rpc)),
                               RequiredRole(rpc) == Role::kAdmin ? "" : " or above"),
                  context);
  }
  caller.role = identity->role;
  caller.principals.push_back(std::move(identity->principal));
  caller.models = std::move(identity->models);
  return caller;
}

bool Caller::MayReach(absl::string_view model) const {
  return models.empty() || std::find(models.begin(), models.end(), model) != models.end();
}

absl::Status Authorizer::CheckModel(const Caller& caller, absl::string_view model,
                                    const grpc::ServerContextBase& context) const {
  if (caller.MayReach(model)) return absl::OkStatus();
  return Refuse(absl::StatusCode::kPermissionDenied, "wrong_model",
                absl::StrCat("principal '", absl::StrJoin(caller.principals, "', '"),
                             "' may not reach model '", model, "': its token is limited to ",
                             "models '", absl::StrJoin(caller.models, "', '"), "'"),
                context);
}

absl::Status Authorizer::CheckClientId(const Caller& caller, absl::string_view client_id,
                                       const grpc::ServerContextBase& context) const {
  if (!caller.authenticated) return absl::OkStatus();
  for (const std::string& principal : caller.principals) {
    if (principal == client_id) return absl::OkStatus();
  }
  return Refuse(
      absl::StatusCode::kPermissionDenied, "client_id_mismatch",
      absl::StrCat("PushHeader.client_id '", client_id, "' is not the caller's principal ('",
                   absl::StrJoin(caller.principals, "', '"),
                   "'): with authentication on, a client pushes under its own "
                   "identity"),
      context);
}

}  // namespace fusedps
