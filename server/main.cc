// fusedps-server: serves one shard of parameters and AdamW state over gRPC.
//
//   fusedps-server --listen=0.0.0.0:50051 --device=auto --metrics-listen=0.0.0.0:9464
//
// Prometheus metrics (docs/metrics.md) are served at http://<--metrics-listen>/metrics.
//
// Checkpoints (docs/checkpoints.md): with --checkpoint-dir the server restores the newest good
// checkpoint there at start (--restore), writes one every --checkpoint-interval-seconds and/or
// --checkpoint-every-versions, on the Checkpoint RPC (`fusedps checkpoint`), and on SIGTERM.
//
// Security (docs/operations/security.md): --tls-cert/--tls-key serve gRPC over TLS only,
// --tls-client-ca requires client certificates (mTLS), --auth-tokens requires a bearer token
// with a role on every ParameterService call. Health and reflection stay open for probes.
// Certificates and tokens are read again every --credentials-reload-seconds: rotate them by
// replacing the files, with no restart.
//
// SIGTERM or SIGINT: stop accepting calls, finish the calls in flight (at most
// --shutdown-grace-seconds), apply every complete push, write a checkpoint (with
// --checkpoint-dir), exit 0.
//
// Exit status: 0 after SIGTERM/SIGINT; 1 when the server cannot start (also: a checkpoint that
// --restore names does not load); 2 for a bad flag; 3 when the shard faulted (a device error,
// docs/errors.md): health turned NOT_SERVING, every call got UNAVAILABLE for
// --fault-drain-seconds, and the orchestrator should restart the server; 4 when the checkpoint
// on SIGTERM failed (the last good one stays).
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/flag_usage.h"
#include "common/logging.h"
#include "common/port_file.h"
#include "kernels/backend_factory.h"
#include "kernels/fault_injection.h"
#include "server/server.h"
#include "server/server_options.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:50051", "gRPC address, HOST:PORT; port 0 picks one");
ABSL_FLAG(std::string, port_file, "",
          "once serving, write the bound gRPC port to this file (atomically)");
ABSL_FLAG(std::string, device, "auto", "optimizer backend: auto, cpu, cuda or cuda:N");
ABSL_FLAG(int, threads, 0, "CPU backend worker threads; 0 means one per core");
ABSL_FLAG(fusedps::ParamCopyDType, param_copy_dtype, fusedps::ParamCopyDType::kNone,
          "low-precision param copy kept for pulls: none, bf16 or fp16");
ABSL_FLAG(uint64_t, max_message_bytes, 8 << 20, "gRPC max receive and send message size");
ABSL_FLAG(uint64_t, staging_pool_bytes, uint64_t{2} << 30,
          "host staging shared by the pushes, pulls and registrations in flight; when it is "
          "spent, calls wait (back-pressure), and a push larger than all of it is "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(uint64_t, window_bytes, 32 << 20,
          "the most staging one pull or one registration holds at a time (it streams through "
          "a window of this size, at most a quarter of --staging-pool-bytes, whatever its "
          "total size)");
ABSL_FLAG(uint64_t, pull_snapshot_bytes, uint64_t{4} << 30,
          "memory (device memory on a GPU) for pulls larger than one window, read at one "
          "version while steps go on; a pull larger than all of it is RESOURCE_EXHAUSTED");
ABSL_FLAG(std::string, workspace_dir, "/dev/shm",
          "where same-host workspaces' files go (shared memory that trainers on this host "
          "push and pull through instead of gRPC; docs/operations/deploy.md, \"Same-host "
          "workspaces\"); empty: off");
ABSL_FLAG(uint64_t, workspace_budget_bytes, uint64_t{64} << 30,
          "the most that open same-host workspaces hold in all (a workspace past it is "
          "RESOURCE_EXHAUSTED)");
ABSL_FLAG(double, call_idle_seconds, 60,
          "a call whose client sends (or, for a pull, reads) nothing for this long ends with "
          "DEADLINE_EXCEEDED and gives back the staging it holds; 0: no limit");
ABSL_FLAG(double, keepalive_seconds, 30,
          "HTTP/2 keepalive pings on idle connections (a peer that does not answer within 10 s "
          "is dropped, and its calls end)");
ABSL_FLAG(uint64_t, retry_table_clients, 10000,
          "how many clients' recent pushes the retry table remembers (least recently used "
          "forgotten first); a retry is applied exactly once within that bound");
ABSL_FLAG(int64_t, testing_fault_at_step, 0,
          "for fault-handling tests only: the backend fails (as a device would) when it queues "
          "this step (1-based); 0: never");
ABSL_FLAG(int, fault_drain_seconds, 2,
          "after a shard fault, how long calls in flight get to receive their UNAVAILABLE "
          "before the server exits with status 3");
ABSL_FLAG(double, push_part_wait_seconds, 30,
          "a push sent in parts fails (DEADLINE_EXCEEDED) when its parts have not all arrived "
          "within this many seconds of its first");
ABSL_FLAG(std::string, metrics_listen, "0.0.0.0:9464",
          "HTTP address of Prometheus /metrics, HOST:PORT; port 0 picks one; empty disables");
ABSL_FLAG(std::string, metrics_port_file, "",
          "once serving, write the bound /metrics port to this file (atomically)");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "where checkpoints go (docs/checkpoints.md); empty: none are written");
ABSL_FLAG(double, checkpoint_interval_seconds, 0,
          "write a checkpoint this often (when the shard changed); 0: no timer");
ABSL_FLAG(uint64_t, checkpoint_every_versions, 0,
          "write a checkpoint when the version has advanced by this many pushes; 0: never");
ABSL_FLAG(int, checkpoint_keep, 3, "how many complete checkpoints to keep (>= 1)");
ABSL_FLAG(uint64_t, checkpoint_host_buffer_bytes, 0,
          "the most page-locked host memory a checkpoint's snapshot may take; a larger shard is "
          "checkpointed tensor by tensor while steps wait; 0: as much as the shard needs");
ABSL_FLAG(bool, checkpoint_on_sigterm, true,
          "with --checkpoint-dir, write a checkpoint after the SIGTERM drain, before exiting");
ABSL_FLAG(std::string, restore, "latest",
          "what the shard starts from: latest (the newest good checkpoint in --checkpoint-dir, "
          "else empty), none, or a checkpoint directory's path (which must load)");
ABSL_FLAG(fusedps::ConsistencyMode, mode, fusedps::ConsistencyMode::kAsync,
          "how pushes become optimizer steps: async (each push is a step), sync (K of N pushes "
          "averaged per version) or bounded (a push at most --max-staleness versions behind is "
          "a step); docs/consistency.md");
ABSL_FLAG(uint32_t, total_replicas, 1, "sync: N, the trainers pushing to this shard");
ABSL_FLAG(uint32_t, replicas_to_aggregate, 0,
          "sync: K, the pushes from distinct client_ids averaged per round (the other N - K are "
          "backups); 0 means N");
ABSL_FLAG(double, round_timeout_seconds, 30,
          "sync: a round with fewer than K pushes this long after its first is applied with the "
          "pushes it has; 0 waits for ever");
ABSL_FLAG(uint64_t, max_staleness, 0,
          "bounded: the most versions a push's base_version may be behind the shard's");
ABSL_FLAG(bool, staleness_lr_scaling, false,
          "bounded: the step of a push with staleness tau uses lr / (1 + tau)");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain of the gRPC port: with --tls-key, the port serves TLS only "
          "(a plaintext client cannot connect); empty: plaintext");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: clients must present a certificate it signed (mutual TLS); without "
          "--auth-tokens each such client is an admin whose principals are its certificate's "
          "names");
ABSL_FLAG(std::string, auth_tokens, "",
          "file of bearer tokens, one 'TOKEN ROLE PRINCIPAL' per line (roles reader, trainer, "
          "admin); every ParameterService call must then carry 'authorization: Bearer TOKEN', "
          "and a push's client_id must be its principal; empty: no tokens");
ABSL_FLAG(double, credentials_reload_seconds, 10,
          "how often --tls-cert, --tls-key, --tls-client-ca and --auth-tokens are read again; "
          "changes apply without a restart (certificates: whole seconds, at least 1)");
ABSL_FLAG(int, shutdown_grace_seconds, 30,
          "on SIGTERM/SIGINT, how long calls in flight may take to finish");

namespace {

// What fusedps-server runs with: the server's options, and what main does around the server.
struct MainOptions {
  fusedps::ServerOptions server;
  std::string port_file;          // --port-file; empty: none.
  std::string metrics_port_file;  // --metrics-port-file; empty: none.
  int fault_drain_seconds = 2;
  int shutdown_grace_seconds = 30;
  bool checkpoint_on_sigterm = true;
};

// A --*-seconds flag's value as a duration. NaN is no duration: -infinity, which every limit
// (> 0, >= 0) refuses.
absl::Duration FlagSeconds(double seconds) {
  return std::isnan(seconds) ? -absl::InfiniteDuration() : absl::Seconds(seconds);
}

// The options the flags say, unchecked (fusedps::ValidateServerOptions checks them).
MainOptions OptionsFromFlags() {
  MainOptions main_options;
  main_options.port_file = absl::GetFlag(FLAGS_port_file);
  main_options.metrics_port_file = absl::GetFlag(FLAGS_metrics_port_file);
  main_options.fault_drain_seconds = absl::GetFlag(FLAGS_fault_drain_seconds);
  main_options.shutdown_grace_seconds = absl::GetFlag(FLAGS_shutdown_grace_seconds);
  main_options.checkpoint_on_sigterm = absl::GetFlag(FLAGS_checkpoint_on_sigterm);

  fusedps::ServerOptions& options = main_options.server;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.device = absl::GetFlag(FLAGS_device);
  options.backend.threads = absl::GetFlag(FLAGS_threads);
  options.backend.param_copy_dtype = absl::GetFlag(FLAGS_param_copy_dtype);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.staging_pool_bytes = absl::GetFlag(FLAGS_staging_pool_bytes);
  options.window_bytes = absl::GetFlag(FLAGS_window_bytes);
  options.pull_snapshot_bytes = absl::GetFlag(FLAGS_pull_snapshot_bytes);
  options.workspaces.dir = absl::GetFlag(FLAGS_workspace_dir);
  options.workspaces.budget_bytes = absl::GetFlag(FLAGS_workspace_budget_bytes);
  options.push_part_wait = FlagSeconds(absl::GetFlag(FLAGS_push_part_wait_seconds));
  const double idle = absl::GetFlag(FLAGS_call_idle_seconds);
  options.call_idle = idle == 0 ? absl::InfiniteDuration() : FlagSeconds(idle);
  options.keepalive = FlagSeconds(absl::GetFlag(FLAGS_keepalive_seconds));
  options.retry_table_clients = absl::GetFlag(FLAGS_retry_table_clients);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);

  options.checkpoint.root = absl::GetFlag(FLAGS_checkpoint_dir);
  options.checkpoint.keep = absl::GetFlag(FLAGS_checkpoint_keep);
  options.checkpoint.interval = FlagSeconds(absl::GetFlag(FLAGS_checkpoint_interval_seconds));
  options.checkpoint.every_versions = absl::GetFlag(FLAGS_checkpoint_every_versions);
  options.checkpoint.host_buffer_bytes = absl::GetFlag(FLAGS_checkpoint_host_buffer_bytes);
  options.restore = absl::GetFlag(FLAGS_restore);

  options.consistency.mode = absl::GetFlag(FLAGS_mode);
  options.consistency.total_replicas = absl::GetFlag(FLAGS_total_replicas);
  options.consistency.replicas_to_aggregate = absl::GetFlag(FLAGS_replicas_to_aggregate);
  if (options.consistency.replicas_to_aggregate == 0) {
    options.consistency.replicas_to_aggregate = options.consistency.total_replicas;
  }
  const double round_timeout = absl::GetFlag(FLAGS_round_timeout_seconds);
  options.consistency.round_timeout =
      round_timeout >= 0 ? absl::Seconds(round_timeout) : absl::InfiniteDuration();
  options.consistency.max_staleness = absl::GetFlag(FLAGS_max_staleness);
  options.consistency.staleness_lr_scaling = absl::GetFlag(FLAGS_staleness_lr_scaling);

  options.tls.cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls.key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls.client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  options.auth_tokens_file = absl::GetFlag(FLAGS_auth_tokens);
  const absl::Duration reload = FlagSeconds(absl::GetFlag(FLAGS_credentials_reload_seconds));
  options.tls.reload_interval = reload;
  options.auth_tokens_reload = reload;

  // After every backend option: the factory copies them.
  if (const int64_t step = absl::GetFlag(FLAGS_testing_fault_at_step); step > 0) {
    options.backend_factory =
        [device = options.device, backend = options.backend,
         step]() -> absl::StatusOr<std::unique_ptr<fusedps::OptimizerBackend>> {
      absl::StatusOr<std::unique_ptr<fusedps::OptimizerBackend>> inner =
          fusedps::MakeBackend(device, backend);
      if (!inner.ok()) return inner;
      fusedps::InjectedFaults faults;
      faults.step = step;
      return fusedps::MakeFaultInjectingBackend(*std::move(inner), faults);
    };
  }
  return main_options;
}

// Logs the addresses served and writes the port files. False when a port file cannot be
// written (logged).
bool AnnounceServing(const MainOptions& options, const fusedps::Server& server) {
  const std::string& listen = options.server.listen;
  const std::string& metrics_listen = options.server.metrics_listen;
  LOG(INFO) << "fusedps-server listening on " << listen.substr(0, listen.rfind(':')) << ":"
            << server.port() << " (backend " << server.backend_name() << ", device "
            << server.device() << ")";
  if (!metrics_listen.empty()) {
    LOG(INFO) << "fusedps-server metrics on http://"
              << metrics_listen.substr(0, metrics_listen.rfind(':')) << ":" << server.metrics_port()
              << "/metrics";
  }
  // The metrics port file first: once the gRPC port file exists, both are there.
  if (!options.metrics_port_file.empty() &&
      !fusedps::WritePortFile(options.metrics_port_file, server.metrics_port())) {
    LOG(ERROR) << "cannot write --metrics-port-file " << options.metrics_port_file;
    return false;
  }
  if (!options.port_file.empty() && !fusedps::WritePortFile(options.port_file, server.port())) {
    LOG(ERROR) << "cannot write --port-file " << options.port_file;
    return false;
  }
  return true;
}

// After a shard fault: serves the fault's UNAVAILABLE for the drain, then exits with status 3.
[[noreturn]] void ExitAfterFault(fusedps::Server& server, int drain_seconds) {
  LOG(ERROR) << "the shard faulted (" << server.fault().cause() << "); exiting with status 3";
  // The server keeps serving for the drain, so that every call, in flight or new, gets the
  // fault's UNAVAILABLE (a gRPC shutdown would refuse or cancel new ones instead). Then it
  // stops; a failed device may never answer, so the stop gets a deadline of its own, and the
  // process leaves without destroying the engine.
  absl::SleepFor(absl::Seconds(drain_seconds));
  std::promise<void> stopped;
  std::thread([&server, &stopped] {
    server.Shutdown(absl::Seconds(1));
    server.Wait();
    stopped.set_value();
  }).detach();
  stopped.get_future().wait_for(std::chrono::seconds(5));
  std::_Exit(3);
}

// Checkpoints every model after the SIGTERM drain: 0, or 4 when one failed (logged).
int CheckpointOnExit(fusedps::Server& server) {
  int status = 0;
  // Every push acknowledged was applied in the drain; the checkpoint holds them all.
  for (const auto& [model, written] : server.CheckpointAll()) {
    if (written.ok()) {
      LOG(INFO) << "checkpoint on exit: version " << written->version << " of model '" << model
                << "' in " << written->path;
    } else {
      LOG(ERROR) << "the checkpoint on exit of model '" << model
                 << "' failed: " << written.status();
      status = 4;
    }
  }
  return status;
}

// Starts the server and serves until SIGTERM/SIGINT (drain, checkpoint) or a shard fault.
// Returns the exit status (the header's).
int Run(MainOptions options) {
  // Block the stop signals in every thread; one thread below waits for them. SIGUSR1 is the
  // server's own: a shard fault raises it.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGUSR1);
  if (pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr) != 0) {
    std::perror("fusedps-server: pthread_sigmask");
    return 1;
  }
  // A fault wakes the signal wait below.
  options.server.on_fault = [](const absl::Status&) { kill(getpid(), SIGUSR1); };

  absl::StatusOr<std::unique_ptr<fusedps::Server>> server = fusedps::Server::Start(options.server);
  if (!server.ok()) {
    LOG(ERROR) << "cannot start: " << server.status();
    return 1;
  }
  if (!AnnounceServing(options, **server)) return 1;

  int signal = 0;
  sigwait(&stop_signals, &signal);
  if (signal == SIGUSR1) ExitAfterFault(**server, options.fault_drain_seconds);
  LOG(INFO) << strsignal(signal) << ", draining for up to " << options.shutdown_grace_seconds
            << " s";
  (*server)->Shutdown(absl::Seconds(options.shutdown_grace_seconds));
  (*server)->Wait();
  int status = 0;
  if (!options.server.checkpoint.root.empty() && options.checkpoint_on_sigterm) {
    status = CheckpointOnExit(**server);
  }
  server->reset();
  LOG(INFO) << "fusedps-server stopped";
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  fusedps::InitLogging(argv[0]);
  absl::SetProgramUsageMessage(
      "fusedps-server: a gRPC parameter service applying AdamW on the server's device.\n"
      "  fusedps-server --listen=0.0.0.0:50051 --device=auto");
  if (std::optional<int> exit_code = fusedps::ParseProgramFlags(argc, argv, {__FILE__})) {
    return *exit_code;
  }
  const MainOptions options = OptionsFromFlags();
  if (absl::Status s = fusedps::ValidateServerOptions(options.server); !s.ok()) {
    LOG(ERROR) << s.message();
    return 2;
  }
  return Run(options);
}
