// fusedps-bench: a load generator for a fusedps server. N concurrent trainers (each a
// fusedps::client::Client on its own connection, in its own thread) push gradients for a whole
// model as fast as the server takes them; it prints throughput (GB/s of gradients, pushes/s)
// and push latency percentiles. bench/load_runner.h says what a run does.
//
// Latency is the wall time of one PushGradients call: rounding the fp32 gradients to the wire
// dtype in the client library, sending the chunks, the server's AdamW step, and the reply.
// Throughput is the gradient payload pushed (over a single call, the server's grad_bytes reply
// must equal it) over the timed window.
// Progress goes to stderr once a second; a table (or, with --json, one JSON object) to stdout.
//
// Usage:
//   fusedps-bench --target=localhost:50051 --clients=4 --model=gpt2 --duration=30s
//   fusedps-bench --target=localhost:50051 --model=synthetic --numel=1000000 --steps=200 --json
//   fusedps-bench --targets=ps0:50051,ps1:50051 --clients=4 --model=gpt2  # a sharded model
//
// Exit status: 0 on success, 1 when a call fails (the status goes to stderr), 2 for a usage
// error.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "bench/load_runner.h"
#include "bench/load_stats.h"
#include "client/cli/security_flags.h"
#include "common/flag_usage.h"
#include "common/json_string.h"
#include "fusedps/client.h"

ABSL_FLAG(std::string, target, "localhost:50051", "Server address, HOST:PORT.");
ABSL_FLAG(std::string, targets, "",
          "HOST:PORT,HOST:PORT,...: several servers, each one shard of the model (docs/"
          "sharding.md); overrides --target. Each client pushes the whole model through a "
          "ShardedClient, to every server at once; throughput counts every shard's bytes.");
ABSL_FLAG(int32_t, clients, 1,
          "Concurrent trainers, each its own client and connection, pushing from its own thread; "
          "0 with --probe-interval runs the reader probe alone for --duration.");
ABSL_FLAG(int32_t, streams, 1,
          "Connections per client; above 1 each push travels as that many parts at once.");
ABSL_FLAG(std::string, model, "gpt2",
          "gpt2 (GPT-2 small's 148 tensors), one_large (1 x 100M), t1000x100k, t10000x1k (all "
          "from bench/workloads.h, sized by --scale), or synthetic (--tensors x --numel).");
ABSL_FLAG(double, scale, 1.0, "Multiplies each tensor's element count of a workload model.");
ABSL_FLAG(int64_t, tensors, 1, "synthetic: number of tensors.");
ABSL_FLAG(int64_t, numel, 1000000, "synthetic: elements per tensor.");
ABSL_FLAG(std::string, dtype, "bf16", "Gradient wire dtype: fp32, bf16 or fp16.");
ABSL_FLAG(absl::Duration, duration, absl::Seconds(10),
          "Length of the timed window, e.g. 10s, 2m (ignored when --steps > 0).");
ABSL_FLAG(int64_t, steps, 0, "Timed pushes per client; 0 means push for --duration.");
ABSL_FLAG(int64_t, warmup_steps, 2, "Untimed pushes per client before the timed window.");
ABSL_FLAG(int64_t, max_chunk_bytes, 1 << 20, "Payload bytes of gradient data per message.");
ABSL_FLAG(bool, register, true,
          "Register the model's tensors (random normal values) first; tensors already there "
          "with the same shapes are left as they are.");
ABSL_FLAG(std::string, client_id_prefix, "fusedps-bench-",
          "Client i pushes as client_id PREFIX<i> (retry detection on); empty sends none.");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(60), "Deadline of each call.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the initial values and gradients.");
ABSL_FLAG(bool, json, false, "Print one JSON object instead of the table.");
ABSL_FLAG(absl::Duration, probe_interval, absl::ZeroDuration(),
          "During the timed window, a reader on its own connection calls GetInfo and pulls a "
          "tensor of --probe-pull-bytes every this long, timing each (0: no probe).");
ABSL_FLAG(uint64_t, probe_pull_bytes, 1 << 20,
          "Size of the tensor the probe pulls (it registers it); 0: GetInfo only.");

namespace fusedps {
namespace {

using client::DTypeName;

// What was asked for, echoed in the output.
struct Run {
  LoadConfig config;
  LoadModel model;
  double scale = 1.0;
};

absl::StatusOr<Run> RunFromFlags() {
  Run run;
  absl::StatusOr<client::DType> dtype = client::ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--dtype ", dtype.status().message()));
  }
  run.scale = absl::GetFlag(FLAGS_scale);
  absl::StatusOr<LoadModel> model =
      MakeLoadModel(absl::GetFlag(FLAGS_model), run.scale, absl::GetFlag(FLAGS_tensors),
                    absl::GetFlag(FLAGS_numel));
  if (!model.ok()) return model.status();
  run.model = *std::move(model);

  LoadConfig& config = run.config;
  config.target = absl::GetFlag(FLAGS_target);
  config.targets = absl::StrSplit(absl::GetFlag(FLAGS_targets), ',', absl::SkipEmpty());
  if (!config.targets.empty()) config.target = absl::StrJoin(config.targets, ",");
  config.clients = absl::GetFlag(FLAGS_clients);
  config.streams = absl::GetFlag(FLAGS_streams);
  config.grad_dtype = *dtype;
  config.steps = absl::GetFlag(FLAGS_steps);
  config.duration = absl::GetFlag(FLAGS_duration);
  config.warmup_steps = absl::GetFlag(FLAGS_warmup_steps);
  config.timeout = absl::GetFlag(FLAGS_timeout);
  client::ApplySecurityFlags(&config.client_options);
  config.register_tensors = absl::GetFlag(FLAGS_register);
  config.client_id_prefix = absl::GetFlag(FLAGS_client_id_prefix);
  config.seed = absl::GetFlag(FLAGS_seed);
  config.probe_interval = absl::GetFlag(FLAGS_probe_interval);
  config.probe_pull_bytes = absl::GetFlag(FLAGS_probe_pull_bytes);
  const int64_t chunk = absl::GetFlag(FLAGS_max_chunk_bytes);
  if (config.target.empty()) return absl::InvalidArgumentError("--target is empty");
  if (!config.targets.empty() && config.probe_interval > absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--probe-interval needs one --target, not --targets");
  }
  if (config.clients < 0 ||
      (config.clients == 0 && config.probe_interval <= absl::ZeroDuration())) {
    return absl::InvalidArgumentError(
        "--clients must be >= 1, or 0 with --probe-interval (a reader probe alone)");
  }
  if (config.steps < 0 || config.warmup_steps < 0) {
    return absl::InvalidArgumentError("--steps and --warmup-steps must be >= 0");
  }
  if (config.steps == 0 && config.duration <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--duration must be positive when --steps is 0");
  }
  if (chunk < 4 || chunk > (15 << 20)) {
    return absl::InvalidArgumentError("--max-chunk-bytes must be in [4, 15 MiB]");
  }
  config.max_chunk_bytes = static_cast<size_t>(chunk);
  return run;
}

std::string RunShape(const LoadConfig& config) {
  const std::string timed = config.steps > 0
                                ? absl::StrCat(config.steps, " timed pushes each")
                                : absl::StrCat(absl::FormatDuration(config.duration), " timed");
  return absl::StrCat(config.clients, " client(s), ", config.warmup_steps,
                      " warmup pushes each, then ", timed);
}

uint64_t TotalPushes(const LoadResult& result) {
  uint64_t pushes = 0;
  for (const ClientLoadResult& c : result.clients) pushes += c.latencies_ms.size();
  return pushes;
}
uint64_t TotalGradBytes(const LoadResult& result) {
  uint64_t bytes = 0;
  for (const ClientLoadResult& c : result.clients) bytes += c.grad_bytes;
  return bytes;
}
uint64_t TotalSkipped(const LoadResult& result) {
  uint64_t skipped = 0;
  for (const ClientLoadResult& c : result.clients) skipped += c.skipped_steps;
  return skipped;
}
LatencySummary AllLatencies(const LoadResult& result) {
  std::vector<double> all;
  for (const ClientLoadResult& c : result.clients) {
    all.insert(all.end(), c.latencies_ms.begin(), c.latencies_ms.end());
  }
  return SummarizeLatencies(std::move(all));
}

std::string TableRow(absl::string_view who, uint64_t pushes, double seconds, uint64_t bytes,
                     const LatencySummary& s) {
  return absl::StrFormat("%-7s %7d %8.3f %9.2f %8.4f %8.2f %8.2f %8.2f %8.2f\n", who, pushes,
                         seconds, PerSecond(static_cast<double>(pushes), seconds),
                         PerSecond(static_cast<double>(bytes), seconds) / 1e9, s.p50_ms, s.p90_ms,
                         s.p99_ms, s.max_ms);
}

void PrintTable(const Run& run, const LoadResult& result) {
  const uint64_t push_bytes = run.model.push_bytes(run.config.grad_dtype);
  absl::PrintF("fusedps-bench against %s: backend %s, device %s\n", run.config.target,
               result.backend, result.device);
  if (!run.config.targets.empty()) {
    absl::PrintF("shards %d servers, a push is one step on each; versions are the lowest shard's\n",
                 run.config.targets.size());
  }
  absl::PrintF("model  %s: %s; %d tensors, %d params\n", run.model.name, run.model.description,
               run.model.numels.size(), run.model.total_numel());
  absl::PrintF("push   all tensors, %s gradients: %.3f MB per push, %d-byte chunks\n",
               DTypeName(run.config.grad_dtype), static_cast<double>(push_bytes) / 1e6,
               run.config.max_chunk_bytes);
  absl::PrintF("run    %s; server versions %d -> %d\n", RunShape(run.config), result.version_before,
               result.version_after);
  absl::PrintF("client %.2f ms of CPU per push in this process (%.0f%% of one core)\n",
               1e3 * PerSecond(result.client_cpu_seconds, static_cast<double>(TotalPushes(result))),
               100.0 * PerSecond(result.client_cpu_seconds, result.seconds));
  if (const uint64_t skipped = TotalSkipped(result); skipped > 0) {
    absl::PrintF("note   %d pushes were skipped by the server (non-finite gradients)\n", skipped);
  }
  absl::PrintF("\n%-7s %7s %8s %9s %8s %8s %8s %8s %8s\n", "client", "pushes", "seconds",
               "pushes/s", "GB/s", "p50 ms", "p90 ms", "p99 ms", "max ms");
  if (result.clients.size() > 1) {
    for (const ClientLoadResult& c : result.clients) {
      absl::PrintF("%s", TableRow(absl::StrCat(c.client), c.latencies_ms.size(), c.seconds,
                                  c.grad_bytes, SummarizeLatencies(c.latencies_ms)));
    }
  }
  absl::PrintF("%s", TableRow("all", TotalPushes(result), result.seconds, TotalGradBytes(result),
                              AllLatencies(result)));
  if (run.config.probe_interval > absl::ZeroDuration()) {
    absl::PrintF("\n%-18s %7s %8s %8s %8s %8s   (reader probe, every %s, %d errors)\n", "reader",
                 "calls", "p50 ms", "p90 ms", "p99 ms", "max ms",
                 absl::FormatDuration(run.config.probe_interval), result.probe.errors);
    for (const auto& [name, samples] :
         {std::make_pair(std::string("GetInfo"), result.probe.get_info_ms),
          std::make_pair(absl::StrCat("pull ", run.config.probe_pull_bytes, " B"),
                         result.probe.pull_ms)}) {
      const LatencySummary s = SummarizeLatencies(samples);
      absl::PrintF("%-18s %7d %8.3f %8.3f %8.3f %8.3f\n", name, s.count, s.p50_ms, s.p90_ms,
                   s.p99_ms, s.max_ms);
    }
  }
}

std::string JsonLatency(const LatencySummary& s) {
  return absl::StrFormat(
      "{\"count\": %d, \"min\": %.6f, \"mean\": %.6f, \"p50\": %.6f, \"p90\": %.6f, "
      "\"p99\": %.6f, \"max\": %.6f}",
      s.count, s.min_ms, s.mean_ms, s.p50_ms, s.p90_ms, s.p99_ms, s.max_ms);
}

// The servers as a JSON list's items: --targets, or --target alone.
std::string JsonTargets(const LoadConfig& config) {
  if (config.targets.empty()) return JsonString(config.target);
  return absl::StrJoin(config.targets, ", ", [](std::string* out, const std::string& target) {
    out->append(JsonString(target));
  });
}

void PrintJson(const Run& run, const LoadResult& result) {
  const LoadConfig& config = run.config;
  const uint64_t pushes = TotalPushes(result);
  const uint64_t bytes = TotalGradBytes(result);
  absl::PrintF(
      "{\"tool\": \"fusedps-bench\", \"target\": %s, \"targets\": [%s], \"shards\": %d,\n"
      " \"backend\": %s, \"device\": %s,\n"
      " \"model\": %s, \"description\": %s, \"scale\": %.17g, \"tensors\": %d, \"params\": %d,\n"
      " \"dtype\": \"%s\", \"push_bytes\": %d, \"max_chunk_bytes\": %d, \"clients\": %d,\n"
      " \"streams\": %d,\n"
      " \"steps\": %d, \"duration_s\": %s, \"warmup_steps\": %d, \"registered\": %s,\n"
      " \"tensors_created\": %d, \"tensors_existing\": %d,\n"
      " \"version_before\": %d, \"version_after\": %d,\n"
      " \"timed_pushes\": %d, \"skipped_steps\": %d, \"grad_bytes\": %d, \"seconds\": %.6f,\n"
      " \"pushes_per_s\": %.4f, \"gbps\": %.6f, \"client_cpu_s\": %.6f,\n"
      " \"latency_ms\": %s,\n"
      " \"probe\": {\"interval_s\": %.6f, \"pull_bytes\": %d, \"errors\": %d,\n"
      "  \"get_info_ms\": %s,\n  \"pull_ms\": %s},\n"
      " \"per_client\": [",
      JsonString(config.target), JsonTargets(config), std::max<size_t>(config.targets.size(), 1),
      JsonString(result.backend), JsonString(result.device), JsonString(run.model.name),
      JsonString(run.model.description), run.scale, run.model.numels.size(),
      run.model.total_numel(), DTypeName(config.grad_dtype),
      run.model.push_bytes(config.grad_dtype), config.max_chunk_bytes, config.clients,
      config.streams, config.steps,
      config.steps > 0 ? "null" : absl::StrFormat("%.6f", absl::ToDoubleSeconds(config.duration)),
      config.warmup_steps, config.register_tensors ? "true" : "false", result.tensors_created,
      result.tensors_existing, result.version_before, result.version_after, pushes,
      TotalSkipped(result), bytes, result.seconds,
      PerSecond(static_cast<double>(pushes), result.seconds),
      PerSecond(static_cast<double>(bytes), result.seconds) / 1e9, result.client_cpu_seconds,
      JsonLatency(AllLatencies(result)), absl::ToDoubleSeconds(config.probe_interval),
      config.probe_pull_bytes, result.probe.errors,
      JsonLatency(SummarizeLatencies(result.probe.get_info_ms)),
      JsonLatency(SummarizeLatencies(result.probe.pull_ms)));
  for (size_t i = 0; i < result.clients.size(); ++i) {
    const ClientLoadResult& c = result.clients[i];
    const double n = static_cast<double>(c.latencies_ms.size());
    absl::PrintF(
        "%s\n  {\"client\": %d, \"client_id\": %s, \"pushes\": %d, \"skipped_steps\": %d, "
        "\"grad_bytes\": %d, \"seconds\": %.6f, \"pushes_per_s\": %.4f, \"gbps\": %.6f, "
        "\"latency_ms\": %s}",
        i == 0 ? "" : ",", c.client, JsonString(c.client_id), c.latencies_ms.size(),
        c.skipped_steps, c.grad_bytes, c.seconds, PerSecond(n, c.seconds),
        PerSecond(static_cast<double>(c.grad_bytes), c.seconds) / 1e9,
        JsonLatency(SummarizeLatencies(c.latencies_ms)));
  }
  absl::PrintF("\n]}\n");
}

void PrintProgress(const LoadProgress& p) {
  absl::FPrintF(stderr, "fusedps-bench: %6.1f s  %8d pushes  %9.2f pushes/s  %8.4f GB/s\n",
                p.seconds, p.pushes, PerSecond(static_cast<double>(p.pushes), p.seconds),
                PerSecond(static_cast<double>(p.grad_bytes), p.seconds) / 1e9);
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Load generator for a fusedps server: N concurrent clients push gradients; prints "
      "GB/s, pushes/s and latency percentiles (flags: --a-b and --a_b both work).\n"
      "  fusedps-bench --target=HOST:PORT --clients=4 --model=gpt2 --scale=0.1 --duration=10s\n"
      "  fusedps-bench --target=HOST:PORT --model=synthetic --tensors=3 --numel=1000 "
      "--steps=5 --json\n"
      "  fusedps-bench --targets=HOST:PORT,HOST:PORT --clients=4 --model=gpt2 --steps=20");
  ProgramFlags how{__FILE__};
  how.extra_help = client::SecurityFlagsHelp();
  if (std::optional<int> exit_code = ParseProgramFlags(argc, argv, how)) return *exit_code;
  absl::StatusOr<Run> run = RunFromFlags();
  if (!run.ok()) {
    absl::FPrintF(stderr, "fusedps-bench: %s\n", run.status().ToString());
    return 2;
  }
  absl::FPrintF(stderr, "fusedps-bench: %s (%d tensors, %d params, %s) against %s: %s%s\n",
                run->model.name, run->model.numels.size(), run->model.total_numel(),
                DTypeName(run->config.grad_dtype), run->config.target,
                run->config.register_tensors ? "registering, then " : "", RunShape(run->config));
  absl::StatusOr<LoadResult> result = RunLoad(run->config, run->model, PrintProgress);
  if (!result.ok()) {
    absl::FPrintF(stderr, "fusedps-bench: %s\n", result.status().ToString());
    return 1;
  }
  if (absl::GetFlag(FLAGS_json)) {
    PrintJson(*run, *result);
  } else {
    PrintTable(*run, *result);
  }
  return 0;
}

}  // namespace
}  // namespace fusedps

int main(int argc, char** argv) { return fusedps::Main(argc, argv); }
