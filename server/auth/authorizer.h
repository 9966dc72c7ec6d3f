// authorizer.h: who may call what. Every ParameterService handler asks the Authorizer first,
// before it reads anything; grpc.health.v1 and reflection do not (probes stay open).
//
// Who the caller is:
//   - with --auth-tokens (token_table.h): the token in the call's `authorization: Bearer TOKEN`
//     metadata gives the caller's role and principal. A call without one is UNAUTHENTICATED
//     ("missing_credentials"), as is one whose token is malformed or not in the file
//     ("invalid_token"). Over mTLS the client certificate is checked too (at the handshake),
//     but the token decides.
//   - with --tls-client-ca and no token file: every client whose certificate the CA signed is
//     an admin, and its principals are the certificate's subject alternative names (or its
//     common name when it has none): gRPC's peer identity.
//   - with neither: no authentication; anyone who can reach the port may call anything, and
//     a push's client_id is whatever the client says.
//
// What each role may call (wrong role: PERMISSION_DENIED, "wrong_role"):
//   reader:  PullParameters, GetInfo, ListTensors, ListModels
//   trainer: those and PushGradients
//   admin:   everything: also RegisterParamGroup, RegisterTensors, SetHyperparameters,
//            LoadState, Checkpoint, CreateModel and DeleteModel
// A token may also be limited to some models (token_table.h, models=): CheckModel refuses
// the others (PERMISSION_DENIED, "wrong_model"). Client certificates reach every model.
//
// The identity binding: once the caller is authenticated, a push's PushHeader.client_id must be
// one of its principals (CheckClientId; else PERMISSION_DENIED, "client_id_mismatch"). The
// retry table is keyed by client_id, so it is then keyed by the authenticated identity: no one
// can make another trainer's pushes look like duplicates, or count as another replica of a
// sync round.
//
// Reloading: the token file is read again every `reload_interval`; a changed file that parses
// replaces the table at once (calls in flight keep the identity they were admitted with). One
// that does not parse, or cannot be read, leaves the last good table in force and logs an
// error each time it is seen.
//
// Thread safety: Authorize and CheckClientId may be called from any thread. Lifetime: the
// Server owns it; it outlives the gRPC server, and its destructor stops the reload thread.
#ifndef FUSEDPS_SERVER_AUTH_AUTHORIZER_H_
#define FUSEDPS_SERVER_AUTH_AUTHORIZER_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "grpcpp/grpcpp.h"
#include "server/auth/token_table.h"

namespace fusedps {

// The ParameterService RPCs, for the role table.
enum class Rpc : uint8_t {
  kRegisterParamGroup,
  kRegisterTensors,
  kPushGradients,
  kPullParameters,
  kGetInfo,
  kCheckpoint,
  kListTensors,
  kSetHyperparameters,
  kLoadState,
  kCreateModel,
  kListModels,
  kDeleteModel,
  kWriteBuffers,
  kPullBuffers,
  kOpenWorkspace,
  kLookupRows,
};

// "PushGradients", ...
const char* RpcName(Rpc rpc);
// The least role that may call `rpc`.
Role RequiredRole(Rpc rpc);

struct AuthOptions {
  // --auth-tokens: the token file; empty: no tokens.
  std::string tokens_file;
  // --tls-client-ca was given: clients present certificates the CA signed.
  bool client_certificates = false;
  // How often the token file is checked for changes.
  absl::Duration reload_interval = absl::Seconds(10);
  // Called for each refused call with its reason (the metric's label).
  std::function<void(const std::string& reason)> on_failure;
};

// An admitted caller.
struct Caller {
  bool authenticated = false;  // False when the server has no authentication.
  Role role = Role::kAdmin;
  std::vector<std::string> principals;  // Who it is; empty when not authenticated.
  std::vector<std::string> models;      // The models it may reach; empty: every model.

  // True when the caller may reach `model`.
  bool MayReach(absl::string_view model) const;
};

class Authorizer {
 public:
  // Reads the token file (when there is one) and starts watching it. Errors: INVALID_ARGUMENT
  // for a token file that cannot be read or parsed (TokenTable::Parse).
  static absl::StatusOr<std::unique_ptr<Authorizer>> Create(AuthOptions options);
  ~Authorizer();
  Authorizer(const Authorizer&) = delete;
  Authorizer& operator=(const Authorizer&) = delete;

  // True when callers are authenticated (a token file or client certificates).
  bool enabled() const { return !options_.tokens_file.empty() || options_.client_certificates; }

  // Who is calling `rpc` on `context`, when it may. Errors: UNAUTHENTICATED (no token, or an
  // unknown one), PERMISSION_DENIED (its role may not call `rpc`); each is also reported to
  // on_failure.
  absl::StatusOr<Caller> Authorize(const grpc::ServerContextBase& context, Rpc rpc) const;

  // OK when `caller` may push under `client_id` on `context`: always without authentication,
  // else when client_id is one of its principals. Errors: PERMISSION_DENIED naming both.
  absl::Status CheckClientId(const Caller& caller, absl::string_view client_id,
                             const grpc::ServerContextBase& context) const;

  // OK when `caller` may reach `model` (Caller::MayReach). Errors: PERMISSION_DENIED naming
  // the model and the ones the caller's token is limited to.
  absl::Status CheckModel(const Caller& caller, absl::string_view model,
                          const grpc::ServerContextBase& context) const;

 private:
  explicit Authorizer(AuthOptions options);
  // Reads and parses the token file; replaces the table when the text changed and parses.
  absl::Status Reload() ABSL_LOCKS_EXCLUDED(mu_);
  void WatchLoop() ABSL_LOCKS_EXCLUDED(mu_);
  // Reports a refusal of the call on `context` to on_failure and the log (with its peer, at
  // most a line a second), and returns it.
  absl::Status Refuse(absl::StatusCode code, const std::string& reason, const std::string& message,
                      const grpc::ServerContextBase& context) const;

  const AuthOptions options_;
  mutable Mutex mu_;
  std::shared_ptr<const TokenTable> tokens_ ABSL_GUARDED_BY(mu_);
  std::string tokens_text_ ABSL_GUARDED_BY(mu_);  // The text `tokens_` came from.
  std::string last_error_ ABSL_GUARDED_BY(mu_);   // The last reload's error, if any.
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  CondVar stop_;
  std::thread watcher_;
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_AUTH_AUTHORIZER_H_
