// load_runner.h: drives concurrent trainers' pushes against a fusedps server and times them, for
// fusedps-bench (bench/load_generator.cc).
//
// Each simulated trainer is its own fusedps::client::Client on its own gRPC channel and TCP
// connection (or, with several targets, its own ShardedClient with a connection to each),
// pushing from its own thread. Every push carries gradients for every tensor of the
// model, so the server applies it as one AdamW step of the whole model. Gradients are standard
// normal, generated once per trainer from a fixed seed and rounded to the wire dtype by the
// client library on every push, as a trainer's fp32 gradients would be.
//
// A run: register the model (optional) → every trainer connects, generates its gradients and
// pushes its warmup steps → once all are done, the timed window opens → each trainer pushes its
// steps (or until the duration has passed) → the window closes when the last push returns.
// The first failed call stops every trainer and is returned.
//
// Usage:
//   absl::StatusOr<LoadModel> model = MakeLoadModel("gpt2", 0.1, 0, 0);
//   LoadConfig config;
//   config.target = "localhost:50051";
//   config.clients = 4;
//   config.steps = 20;
//   absl::StatusOr<LoadResult> result = RunLoad(config, *model, nullptr);
#ifndef FUSEDPS_BENCH_LOAD_RUNNER_H_
#define FUSEDPS_BENCH_LOAD_RUNNER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "bench/reader_probe.h"
#include "fusedps/client.h"

namespace fusedps {

// The tensors a load run registers and pushes. Shapes are flat ({numel}).
struct LoadModel {
  std::string name;         // "gpt2", "one_large", ... or "synthetic".
  std::string description;  // e.g. "GPT-2 small, 148 tensors, 124M at scale 0.1".
  std::vector<std::string> tensor_names;
  std::vector<uint64_t> numels;

  uint64_t total_numel() const;
  // Gradient payload bytes of one push of every tensor in `dtype`.
  uint64_t push_bytes(client::DType dtype) const;
};

// A model by name: a workload of bench/workloads.h (gpt2, one_large, t1000x100k, t10000x1k) at
// `scale`, or "synthetic": synthetic_tensors tensors of synthetic_numel elements each.
// Tensor names are "fusedps-bench/<model tag>/<index>", the tag holding the sizes (for example
// "gpt2@0.1" or "synthetic-3x1000"), so models of other sizes never collide on one server.
// Errors: INVALID_ARGUMENT for an unknown name, a scale outside (0, 1000], or a synthetic
// model without tensors or elements.
absl::StatusOr<LoadModel> MakeLoadModel(absl::string_view name, double scale,
                                        int64_t synthetic_tensors, int64_t synthetic_numel);

struct LoadConfig {
  std::string target;  // HOST:PORT of the server.
  // HOST:PORT of several servers, each one shard of the model. When not empty, `target` is not
  // used: the model is planned over them (fusedps/plan.h, the default slice size) and every
  // trainer pushes it whole through a client::ShardedClient, one push of its slices to each
  // server at once; a push's bytes are those of every shard. The reader probe needs one target.
  std::vector<std::string> targets;
  int clients = 1;  // Concurrent trainers. REQUIRES: >= 1.
  // Connections per trainer; with more than one, each push travels as that many parts at once
  // (client::ClientOptions::streams). REQUIRES: 1 <= streams <= 64.
  int streams = 1;
  client::DType grad_dtype = client::DType::kBFloat16;
  // Timed pushes per trainer; when 0, every trainer pushes until `duration` has passed.
  int64_t steps = 0;
  absl::Duration duration = absl::Seconds(10);
  int64_t warmup_steps = 2;  // Untimed pushes per trainer before the window opens.
  size_t max_chunk_bytes = 1 << 20;
  absl::Duration timeout = absl::Seconds(60);  // Deadline of each call.
  // Register the model's tensors (normal(0, 0.02) values) before the run. Tensors already
  // registered with the same shapes are left as they are.
  bool register_tensors = true;
  // Trainer i pushes with client_id "<prefix><i>" and sequence numbers from the clock, as
  // `fusedps push` does; an empty prefix sends no client_id (no retry detection on the server).
  std::string client_id_prefix = "fusedps-bench-";
  uint64_t seed = 1;  // Trainer i's gradients come from seed + 1 + i; initial values from seed.
  // A reader probe during the timed window (bench/reader_probe.h); an interval of 0: none.
  absl::Duration probe_interval = absl::ZeroDuration();
  uint64_t probe_pull_bytes = 1 << 20;
  // What every connection starts from: TLS and the token (ClientOptions::tls*, token*); the
  // fields above override its chunk size, timeout and streams.
  client::ClientOptions client_options;
};

// What one trainer did in the timed window.
struct ClientLoadResult {
  int client = 0;
  std::string client_id;
  std::vector<double> latencies_ms;  // Wall time of each timed PushGradients call, in order.
  uint64_t grad_bytes = 0;           // Gradient payload of the timed pushes (with --streams=1 the
                                     // server's grad_bytes replies are checked to equal it).
  uint64_t skipped_steps = 0;        // Timed pushes the server skipped (non-finite gradients).
  double seconds = 0.0;              // From the window's opening to this trainer's last reply.
};

struct LoadResult {
  std::string backend;  // The server's (the first shard's) GetInfo at the start.
  std::string device;
  uint64_t tensors_created = 0;  // By the registration (0 without one).
  uint64_t tensors_existing = 0;
  // Server model version when the window opened, and afterwards; with several targets, the
  // lowest of the shards' versions.
  uint64_t version_before = 0;
  uint64_t version_after = 0;
  double seconds = 0.0;  // The timed window: its opening to the last reply of any trainer.
  // CPU time this process (every trainer: rounding to the wire dtype, serialization, gRPC) used
  // from the window's opening to the end of the run.
  double client_cpu_seconds = 0.0;
  std::vector<ClientLoadResult> clients;
  ProbeResult probe;  // The reader probe's latencies, when it ran.
};

// A snapshot of the timed window so far.
struct LoadProgress {
  double seconds = 0.0;
  uint64_t pushes = 0;
  uint64_t grad_bytes = 0;
};

// Runs the load described above. `progress`, when set, is called from the calling thread about
// once a second while the window is open.
// Errors: the first failed call's status, its code kept and its message prefixed with the
// trainer and push (ToString() reads "UNAVAILABLE: client 1, timed push 3: Socket closed");
// FAILED_PRECONDITION when the server treats a push as a retry (another run using the same
// client ids at the same time); INVALID_ARGUMENT for a config outside its REQUIRES, or a
// reader probe with several targets.
absl::StatusOr<LoadResult> RunLoad(const LoadConfig& config, const LoadModel& model,
                                   const std::function<void(const LoadProgress&)>& progress);

}  // namespace fusedps

#endif  // FUSEDPS_BENCH_LOAD_RUNNER_H_
