// fusedps-server: serves one shard of parameters and AdamW state over gRPC.
//
//   fusedps-server --listen=0.0.0.0:50051 --device=auto --metrics-listen=0.0.0.0:9464
//
// Prometheus metrics (docs/metrics.md) are served at http://<--metrics-listen>/metrics.
//
// SIGTERM or SIGINT: stop accepting calls, finish the calls in flight (at most
// --shutdown-grace-seconds), apply every complete push, exit 0.
#include <csignal>
#include <cstdio>
#include <string>
#include <vector>

#include "common/port_file.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/flag_usage.h"
#include "common/kebab_flags.h"
#include "common/logging.h"
#include "server/server.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:50051", "gRPC address, HOST:PORT; port 0 picks one");
ABSL_FLAG(std::string, port_file, "",
          "once serving, write the bound gRPC port to this file (atomically)");
ABSL_FLAG(std::string, device, "auto", "optimizer backend: auto, cpu, cuda or cuda:N");
ABSL_FLAG(int, threads, 0, "CPU backend worker threads; 0 means one per core");
ABSL_FLAG(std::string, param_copy_dtype, "none",
          "low-precision param copy kept for pulls: none, bf16 or fp16");
ABSL_FLAG(uint64_t, max_message_bytes, 8 << 20, "gRPC max receive and send message size");
ABSL_FLAG(uint64_t, staging_pool_bytes, uint64_t{2} << 30,
          "host staging shared by the pushes in flight; when it is spent, pushes wait "
          "(back-pressure), and one larger than all of it is RESOURCE_EXHAUSTED");
ABSL_FLAG(double, push_part_wait_seconds, 30,
          "a push sent in parts fails (DEADLINE_EXCEEDED) when its parts have not all arrived "
          "within this many seconds of its first");
ABSL_FLAG(std::string, metrics_listen, "0.0.0.0:9464",
          "HTTP address of Prometheus /metrics, HOST:PORT; port 0 picks one; empty disables");
ABSL_FLAG(std::string, metrics_port_file, "",
          "once serving, write the bound /metrics port to this file (atomically)");
ABSL_FLAG(int, shutdown_grace_seconds, 30,
          "on SIGTERM/SIGINT, how long calls in flight may take to finish");

int main(int argc, char** argv) {
  fusedps::InitLogging(argv[0]);
  absl::SetProgramUsageMessage(
      "fusedps-server: a gRPC parameter service applying AdamW on the server's device.\n"
      "  fusedps-server --listen=0.0.0.0:50051 --device=auto");
  if (fusedps::HelpRequested(argc, argv)) {
    fusedps::PrintHelp(__FILE__);
    return 0;
  }
  std::vector<std::string> arg_storage;
  std::vector<char*> args = fusedps::KebabToSnakeFlags(argc, argv, arg_storage);
  absl::ParseCommandLine(static_cast<int>(args.size()), args.data());

  // Block the stop signals in every thread; one thread below waits for them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  if (pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr) != 0) {
    std::perror("fusedps-server: pthread_sigmask");
    return 1;
  }

  fusedps::ServerOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.device = absl::GetFlag(FLAGS_device);
  options.backend.threads = absl::GetFlag(FLAGS_threads);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.staging_pool_bytes = absl::GetFlag(FLAGS_staging_pool_bytes);
  if (!(absl::GetFlag(FLAGS_push_part_wait_seconds) > 0)) {
    std::fprintf(stderr, "fusedps-server: --push-part-wait-seconds must be > 0\n");
    return 2;
  }
  options.push_part_wait = absl::Seconds(absl::GetFlag(FLAGS_push_part_wait_seconds));
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  absl::StatusOr<fusedps::ParamCopyDType> copy =
      fusedps::ParseParamCopyDType(absl::GetFlag(FLAGS_param_copy_dtype));
  if (!copy.ok()) {
    std::fprintf(stderr, "fusedps-server: %s\n", std::string(copy.status().message()).c_str());
    return 2;
  }
  options.backend.param_copy_dtype = *copy;

  absl::StatusOr<std::unique_ptr<fusedps::Server>> server = fusedps::Server::Start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "fusedps-server: %s\n", server.status().ToString().c_str());
    return 1;
  }
  const std::string host = options.listen.substr(0, options.listen.rfind(':'));
  std::fprintf(stderr, "fusedps-server listening on %s:%d (backend %s, device %s)\n",
               host.c_str(), (*server)->port(), (*server)->store().backend_name().c_str(),
               (*server)->store().device().c_str());
  if (!options.metrics_listen.empty()) {
    const std::string metrics_host =
        options.metrics_listen.substr(0, options.metrics_listen.rfind(':'));
    std::fprintf(stderr, "fusedps-server metrics on http://%s:%d/metrics\n", metrics_host.c_str(),
                 (*server)->metrics_port());
  }
  // The metrics port file first: once the gRPC port file exists, both are there.
  const std::string metrics_port_file = absl::GetFlag(FLAGS_metrics_port_file);
  if (!metrics_port_file.empty() &&
      !fusedps::WritePortFile(metrics_port_file, (*server)->metrics_port())) {
    std::fprintf(stderr, "fusedps-server: cannot write --metrics-port-file %s\n",
                 metrics_port_file.c_str());
    return 1;
  }
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty() && !fusedps::WritePortFile(port_file, (*server)->port())) {
    std::fprintf(stderr, "fusedps-server: cannot write --port-file %s\n", port_file.c_str());
    return 1;
  }

  int signal = 0;
  sigwait(&stop_signals, &signal);
  std::fprintf(stderr, "fusedps-server: %s, draining for up to %ds\n", strsignal(signal),
               absl::GetFlag(FLAGS_shutdown_grace_seconds));
  (*server)->Shutdown(absl::Seconds(absl::GetFlag(FLAGS_shutdown_grace_seconds)));
  (*server)->Wait();
  server->reset();
  std::fprintf(stderr, "fusedps-server: stopped\n");
  return 0;
}
