// server_options.h: what a fusedps server is started with (ServerOptions), the one check of
// those options that main runs before starting (ValidateServerOptions), and the flag syntax of
// the option types that main.cc's flags name by text (--param-copy-dtype, --mode).
//
// main.cc turns its flags into a ServerOptions without judging them, then validates it:
//   ServerOptions options = ...;  // from the flags
//   if (absl::Status s = ValidateServerOptions(options); !s.ok()) { /* exit 2 */ }
//   absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(options);
// Each error names the flag (--call-idle-seconds ...) and its limit, in the flags' words.
#ifndef FUSEDPS_SERVER_SERVER_OPTIONS_H_
#define FUSEDPS_SERVER_SERVER_OPTIONS_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "server/auth/tls.h"
#include "server/checkpoint/checkpointer.h"
#include "server/engine/consistency.h"
#include "server/workspace/workspace.h"

namespace fusedps {

struct ServerOptions {
  std::string listen = "0.0.0.0:50051";  // Port 0 picks a free port.
  std::string device = "auto";           // auto | cpu | cuda | cuda:N
  BackendOptions backend;
  uint64_t max_message_bytes = 8 << 20;  // gRPC max receive and send message size.
  // Host staging shared by the pushes, pulls and registrations in flight; a call waits for its
  // share (back-pressure), and a push that needs more than all of it is RESOURCE_EXHAUSTED.
  uint64_t staging_pool_bytes = uint64_t{2} << 30;
  // The most staging one pull or one registration holds at a time.
  uint64_t window_bytes = 32 << 20;
  // Snapshot memory (device memory on a GPU) for pulls larger than one window; a pull larger
  // than all of it is RESOURCE_EXHAUSTED.
  uint64_t pull_snapshot_bytes = uint64_t{4} << 30;
  // Same-host workspaces (proto OpenWorkspace, server/workspace/workspace.h): where their
  // files go (empty: off) and the most they hold in all.
  WorkspaceOptions workspaces;
  // A push sent in parts fails (DEADLINE_EXCEEDED) when its parts have not all arrived within
  // this long of its first; the parts that came give their staging back.
  absl::Duration push_part_wait = absl::Seconds(30);
  // A call whose peer sends (or, for a pull, reads) nothing for this long ends with
  // DEADLINE_EXCEEDED and gives back what it holds. InfiniteDuration: no limit.
  absl::Duration call_idle = absl::Seconds(60);
  // HTTP/2 keepalive pings on idle connections, and how long to wait for their answer.
  absl::Duration keepalive = absl::Seconds(30);
  absl::Duration keepalive_timeout = absl::Seconds(10);
  // How pushes become steps: async, sync rounds or bounded staleness (server/engine/
  // consistency.h): the default model's, and that of models created without their own. Start
  // fails with INVALID_ARGUMENT for options ValidateConsistency refuses.
  ConsistencyOptions consistency;
  // Clients whose recent pushes each model's retry table remembers (LRU).
  size_t retry_table_clients = 10000;
  // HTTP address of /metrics, HOST:PORT (port 0 picks a free port); empty: not served (the
  // metrics are still kept, see Server::metrics()).
  std::string metrics_listen;
  // Checkpoints (docs/checkpoints.md); checkpoint.root empty: none are written.
  checkpoint::CheckpointerOptions checkpoint;
  // What the models start from: "latest" (each its newest good checkpoint under checkpoint.root,
  // or empty when there is none), "none" (empty), or a checkpoint directory's path (which must
  // load) for the default model (the others then restore their latest). The models the root
  // lists are made again either way (models/model_files.h). Health is NOT_SERVING and every
  // call UNAVAILABLE until the restore is done.
  std::string restore = "latest";
  // Transport security of the gRPC port (auth/tls.h): TLS with tls.cert_file, mutual TLS with
  // tls.client_ca_file; plaintext without. /metrics stays plain HTTP (docs/operations.md,
  // "Security": keep it on a private network).
  TlsOptions tls;
  // The bearer tokens (auth/token_table.h), read again every auth_tokens_reload; empty: none.
  // With tokens or with client certificates, callers are authenticated and a push's client_id
  // must be the caller's principal (auth/authorizer.h).
  std::string auth_tokens_file;
  absl::Duration auth_tokens_reload = absl::Seconds(10);
  // Tests: makes the backends instead of `device` (e.g. one that injects faults): one that owns
  // the staging arena, then one per model.
  std::function<absl::StatusOr<std::unique_ptr<OptimizerBackend>>()> backend_factory;
  // Runs once if the shard faults, after health has turned NOT_SERVING (on the thread that
  // saw the fault; it must not block).
  std::function<void(const absl::Status& cause)> on_fault;
  // Tests: runs in each push call after its header is checked, just before the call joins its
  // push (on a gRPC thread; it may block that call).
  std::function<void()> testing_before_push_join;
};

// The options that fusedps-server's flags set, checked as main.cc checks them before starting:
// INVALID_ARGUMENT naming the flag and its limit for the first bad value (push_part_wait > 0;
// call_idle >= 0, keepalive > 0, window_bytes >= 4096; checkpoint.interval >= 0,
// checkpoint.keep >= 1, restore not empty; checkpoint.interval and checkpoint.every_versions
// only with checkpoint.root; the credentials' reload intervals > 0; ValidateConsistency). OK
// otherwise. Server::Start itself checks only the consistency (tests start servers with smaller
// windows than the flags allow).
absl::Status ValidateServerOptions(const ServerOptions& options);

// absl flag syntax of the option types named by text (absl/flags/marshalling.h): a flag of one
// of these types parses with ParseParamCopyDType (kernels/backend.h; the error is its message
// after "--param-copy-dtype = ") or ParseConsistencyMode (its message), and shows its value by
// name.
bool AbslParseFlag(absl::string_view text, ParamCopyDType* copy, std::string* error);
std::string AbslUnparseFlag(ParamCopyDType copy);
bool AbslParseFlag(absl::string_view text, ConsistencyMode* mode, std::string* error);
std::string AbslUnparseFlag(ConsistencyMode mode);

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_SERVER_OPTIONS_H_
