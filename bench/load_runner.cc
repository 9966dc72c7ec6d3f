#include "bench/load_runner.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <ctime>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "bench/workloads.h"
#include "fusedps/plan.h"
#include "fusedps/sharded_client.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace fusedps {
namespace {

using Clock = std::chrono::steady_clock;

// Registration sends initial values in calls of at most this many elements (64 MB of fp32),
// so that a large model never needs all of its initial values in memory at once.
constexpr uint64_t kRegisterBatchNumel = 16u << 20;
constexpr double kInitStd = 0.02;

double SecondsBetween(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

// CPU time of the whole process (all threads) so far.
double ProcessCpuSeconds() { return static_cast<double>(std::clock()) / CLOCKS_PER_SEC; }

absl::Status WithContext(const absl::Status& status, absl::string_view context) {
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

client::ClientOptions ClientOptionsOf(const LoadConfig& config) {
  client::ClientOptions options = config.client_options;
  options.max_chunk_bytes = config.max_chunk_bytes;
  options.timeout = config.timeout;
  options.streams = config.streams;
  options.wait_for_ready = true;
  return options;
}

// What a trainer's push did, over one server or every shard.
struct PushSummary {
  uint64_t version = 0;       // The server's version afterwards (one server only).
  uint64_t grad_bytes = 0;    // The servers' grad_bytes replies, summed.
  bool step_skipped = false;  // On any shard.
  bool duplicate = false;     // On any shard.
};

// A trainer's (or the run's own) link to the servers: a Client of config.target, or with
// config.targets a ShardedClient following `plan`. Each has connections of its own to each
// server (client::CreateChannel), one per stream, as trainers in separate processes would. Calls
// wait for their connection (up to --timeout): on the GPU host a connect among hundreds at once
// failed now and then, which would otherwise end the run.
class Connection {
 public:
  static absl::StatusOr<Connection> Open(const LoadConfig& config, const client::ShardPlan* plan) {
    Connection connection;
    const client::ClientOptions options = ClientOptionsOf(config);
    if (config.targets.empty()) {
      absl::StatusOr<std::unique_ptr<client::Client>> single =
          client::Client::Create(config.target, options);
      if (!single.ok()) return single.status();
      connection.single_ = *std::move(single);
      return connection;
    }
    absl::StatusOr<std::unique_ptr<client::ShardedClient>> sharded =
        client::ShardedClient::Create(config.targets, options);
    if (!sharded.ok()) return sharded.status();
    if (absl::Status status = (*sharded)->SetPlan(*plan); !status.ok()) return status;
    connection.sharded_ = *std::move(sharded);
    return connection;
  }

  // The first server's GetInfo, with the lowest version of any shard.
  absl::StatusOr<client::ServerInfo> Info() {
    if (single_) return single_->GetInfo();
    client::ServerInfo info;
    for (size_t i = 0; i < sharded_->shard_count(); ++i) {
      absl::StatusOr<client::ServerInfo> shard = sharded_->shard(i).GetInfo();
      if (!shard.ok()) return WithContext(shard.status(), absl::StrCat("shard ", i));
      if (i == 0) {
        info = *std::move(shard);
      } else {
        info.version = std::min(info.version, shard->version);
      }
    }
    return info;
  }

  absl::Status Register(absl::Span<const client::TensorInit> inits, LoadResult& result) {
    if (single_) {
      absl::StatusOr<client::RegisterTensorsResult> registered = single_->RegisterTensors(inits);
      if (!registered.ok()) return registered.status();
      result.tensors_created += registered->tensors_created;
      result.tensors_existing += registered->tensors_existing;
      return absl::OkStatus();
    }
    absl::StatusOr<std::vector<client::RegisterTensorsResult>> registered =
        sharded_->RegisterTensors(inits);
    if (!registered.ok()) return registered.status();
    for (const client::RegisterTensorsResult& shard : *registered) {
      result.tensors_created += shard.tensors_created;
      result.tensors_existing += shard.tensors_existing;
    }
    return absl::OkStatus();
  }

  // One push of `grads`; a ShardedClient sends each shard the version it last saw as base.
  absl::StatusOr<PushSummary> Push(const client::PushOptions& options,
                                   absl::Span<const client::TensorGrad> grads) {
    PushSummary summary;
    if (single_) {
      absl::StatusOr<client::PushResult> result = single_->PushGradients(options, grads);
      if (!result.ok()) return result.status();
      return PushSummary{result->version, result->grad_bytes, result->step_skipped,
                         result->duplicate};
    }
    absl::StatusOr<std::vector<client::PushResult>> results =
        sharded_->PushGradients(options, grads);
    if (!results.ok()) return results.status();
    for (const client::PushResult& shard : *results) {
      summary.grad_bytes += shard.grad_bytes;
      summary.step_skipped = summary.step_skipped || shard.step_skipped;
      summary.duplicate = summary.duplicate || shard.duplicate;
    }
    return summary;
  }

 private:
  std::unique_ptr<client::Client> single_;
  std::unique_ptr<client::ShardedClient> sharded_;
};

std::vector<std::vector<float>> NormalValues(const LoadModel& model, size_t first, size_t last,
                                             double stddev, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, static_cast<float>(stddev));
  std::vector<std::vector<float>> values(last - first);
  for (size_t i = first; i < last; ++i) {
    values[i - first].resize(model.numels[i]);
    for (float& x : values[i - first]) x = normal(rng);
  }
  return values;
}

absl::Status Register(Connection& connection, const LoadModel& model, uint64_t seed,
                      LoadResult& result) {
  std::mt19937_64 rng(seed);
  size_t first = 0;
  while (first < model.numels.size()) {
    size_t last = first;
    uint64_t batch_numel = 0;
    while (last < model.numels.size() &&
           (last == first || batch_numel + model.numels[last] <= kRegisterBatchNumel)) {
      batch_numel += model.numels[last++];
    }
    const std::vector<std::vector<float>> values = NormalValues(model, first, last, kInitStd, rng);
    std::vector<client::TensorInit> inits;
    for (size_t i = first; i < last; ++i) {
      inits.push_back({model.tensor_names[i],
                       {static_cast<int64_t>(model.numels[i])},
                       "default",
                       values[i - first]});
    }
    if (absl::Status status = connection.Register(inits, result); !status.ok()) {
      return WithContext(status, "registering the model");
    }
    first = last;
  }
  return absl::OkStatus();
}

// What the trainers share: the first error, the gate that opens the timed window, the count of
// finished trainers, and running totals for progress reports.
class RunState {
 public:
  explicit RunState(int trainers) : trainers_(trainers) {}

  // Keeps the first error and wakes every waiter.
  void Fail(absl::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.ok()) error_ = std::move(status);
    failed_.store(true);
    cv_.notify_all();
  }
  bool failed() const { return failed_.load(); }
  absl::Status error() const {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

  // Counts a trainer ready for the window; true for the last one, which must then call Open().
  bool Arrive() {
    std::lock_guard<std::mutex> lock(mu_);
    return ++arrived_ == trainers_;
  }
  void Open(uint64_t version_before) {
    std::lock_guard<std::mutex> lock(mu_);
    version_before_ = version_before;
    cpu_seconds_at_open_ = ProcessCpuSeconds();
    start_ = Clock::now();
    cv_.notify_all();
  }
  // The window's opening, or nullopt when the run failed first.
  std::optional<Clock::time_point> WaitForOpen() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return start_.has_value() || !error_.ok(); });
    if (!error_.ok()) return std::nullopt;
    return start_;
  }
  std::optional<Clock::time_point> start() const {
    std::lock_guard<std::mutex> lock(mu_);
    return start_;
  }
  uint64_t version_before() const {
    std::lock_guard<std::mutex> lock(mu_);
    return version_before_;
  }
  double cpu_seconds_at_open() const {
    std::lock_guard<std::mutex> lock(mu_);
    return cpu_seconds_at_open_;
  }

  void Finish() {
    std::lock_guard<std::mutex> lock(mu_);
    ++finished_;
    cv_.notify_all();
  }
  // True once every trainer has finished; false after `timeout` otherwise.
  bool WaitForFinish(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return finished_ == trainers_; });
  }

  void CountPush(uint64_t grad_bytes) {
    pushes_.fetch_add(1, std::memory_order_relaxed);
    grad_bytes_.fetch_add(grad_bytes, std::memory_order_relaxed);
  }
  uint64_t pushes() const { return pushes_.load(std::memory_order_relaxed); }
  uint64_t grad_bytes() const { return grad_bytes_.load(std::memory_order_relaxed); }

 private:
  const int trainers_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  absl::Status error_;
  std::atomic<bool> failed_{false};
  int arrived_ = 0;
  int finished_ = 0;
  std::optional<Clock::time_point> start_;
  uint64_t version_before_ = 0;
  double cpu_seconds_at_open_ = 0.0;
  std::atomic<uint64_t> pushes_{0};
  std::atomic<uint64_t> grad_bytes_{0};
};

// One trainer: connect, generate gradients, warm up, wait for the window, push timed steps.
absl::Status RunTrainer(int index, const LoadConfig& config, const LoadModel& model,
                        const client::ShardPlan* plan, RunState& state, ClientLoadResult& out) {
  absl::StatusOr<Connection> connection = Connection::Open(config, plan);
  if (!connection.ok()) return WithContext(connection.status(), absl::StrCat("client ", index));
  std::mt19937_64 rng(config.seed + 1 + static_cast<uint64_t>(index));
  const std::vector<std::vector<float>> grads =
      NormalValues(model, 0, model.numels.size(), 1.0, rng);
  std::vector<client::TensorGrad> pushed;
  for (size_t i = 0; i < grads.size(); ++i) pushed.push_back({model.tensor_names[i], grads[i]});

  client::PushOptions options;
  options.grad_dtype = config.grad_dtype;
  // The payload of one push, counted here rather than taken from the reply: with
  // --streams > 1 a server that knows nothing of parts (the gRPC sink) answers each part with
  // its own share.
  const uint64_t push_bytes = model.push_bytes(config.grad_dtype);
  if (!config.client_id_prefix.empty()) {
    options.client_id = absl::StrCat(config.client_id_prefix, index);
  }
  out.client = index;
  out.client_id = options.client_id;

  auto push = [&](absl::string_view what, int64_t step) -> absl::StatusOr<PushSummary> {
    if (!options.client_id.empty()) {
      options.sequence_number =
          std::max<uint64_t>(options.sequence_number + 1, absl::ToUnixMicros(absl::Now()));
    }
    absl::StatusOr<PushSummary> result = connection->Push(options, pushed);
    const std::string context = absl::StrCat("client ", index, ", ", what, " push ", step + 1);
    if (!result.ok()) return WithContext(result.status(), context);
    if (result->duplicate) {
      return absl::FailedPreconditionError(
          absl::StrCat(context,
                       ": the server took it for a retry of an applied push (is another run using "
                       "client id ",
                       options.client_id, "? try another --client-id-prefix)"));
    }
    // A single call's reply says what the server received; it must be all of it.
    if (config.streams == 1 && result->grad_bytes != push_bytes) {
      return absl::InternalError(absl::StrCat(context, ": the server received ", result->grad_bytes,
                                              " gradient bytes of ", push_bytes));
    }
    options.base_version = result->version;
    return result;
  };

  for (int64_t step = 0; step < config.warmup_steps && !state.failed(); ++step) {
    absl::StatusOr<PushSummary> result = push("warmup", step);
    if (!result.ok()) return result.status();
  }
  if (state.Arrive()) {
    absl::StatusOr<client::ServerInfo> info = connection->Info();
    if (!info.ok()) return WithContext(info.status(), "GetInfo before the timed window");
    state.Open(info->version);
  }
  const std::optional<Clock::time_point> start = state.WaitForOpen();
  if (!start) return absl::OkStatus();  // Another trainer failed; its error is the run's.

  const Clock::time_point deadline =
      *start + std::chrono::microseconds(absl::ToInt64Microseconds(config.duration));
  Clock::time_point last_reply = *start;
  for (int64_t step = 0; !state.failed(); ++step) {
    if (config.steps > 0 ? step >= config.steps : Clock::now() >= deadline) break;
    const Clock::time_point sent = Clock::now();
    absl::StatusOr<PushSummary> result = push("timed", step);
    last_reply = Clock::now();
    if (!result.ok()) return result.status();
    out.latencies_ms.push_back(SecondsBetween(sent, last_reply) * 1e3);
    out.grad_bytes += push_bytes;
    if (result->step_skipped) ++out.skipped_steps;
    state.CountPush(push_bytes);
  }
  out.seconds = SecondsBetween(*start, last_reply);
  return absl::OkStatus();
}

}  // namespace

uint64_t LoadModel::push_bytes(client::DType dtype) const {
  return total_numel() * client::ElementBytes(dtype);
}

uint64_t LoadModel::total_numel() const {
  uint64_t total = 0;
  for (uint64_t n : numels) total += n;
  return total;
}

absl::StatusOr<LoadModel> MakeLoadModel(absl::string_view name, double scale,
                                        int64_t synthetic_tensors, int64_t synthetic_numel) {
  LoadModel model;
  model.name = std::string(name);
  std::string tag;
  if (name == "synthetic") {
    if (synthetic_tensors < 1 || synthetic_numel < 1) {
      return absl::InvalidArgumentError("a synthetic model needs --tensors >= 1 and --numel >= 1");
    }
    model.numels.assign(static_cast<size_t>(synthetic_tensors),
                        static_cast<uint64_t>(synthetic_numel));
    tag = absl::StrCat("synthetic-", synthetic_tensors, "x", synthetic_numel);
    model.description = absl::StrCat(synthetic_tensors, " tensors x ", synthetic_numel);
  } else {
    absl::StatusOr<std::vector<Workload>> workloads = MakeWorkloads(name, scale);
    if (!workloads.ok()) return workloads.status();
    if (workloads->size() != 1) {
      return absl::InvalidArgumentError(absl::StrCat("--model=", name, " names no single model"));
    }
    Workload& workload = workloads->front();
    model.numels = std::move(workload.numels);
    tag = absl::StrFormat("%s@%g", name, scale);
    model.description = absl::StrFormat("%s at scale %g", workload.description, scale);
  }
  for (size_t i = 0; i < model.numels.size(); ++i) {
    model.tensor_names.push_back(absl::StrFormat("fusedps-bench/%s/%05d", tag, i));
  }
  return model;
}

absl::StatusOr<LoadResult> RunLoad(const LoadConfig& config, const LoadModel& model,
                                   const std::function<void(const LoadProgress&)>& progress) {
  const bool probe_only = config.clients == 0 && config.probe_interval > absl::ZeroDuration();
  if ((config.clients < 1 && !probe_only) || config.steps < 0 || config.warmup_steps < 0 ||
      (config.steps == 0 && config.duration <= absl::ZeroDuration())) {
    return absl::InvalidArgumentError(
        "need clients >= 1 (0 only with a probe), warmup steps >= 0, and steps >= 1 or a "
        "positive duration");
  }
  if (!config.targets.empty() && config.probe_interval > absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the reader probe needs one target, not several");
  }
  // With several targets: the model's plan, the same for every trainer.
  std::optional<client::ShardPlan> plan;
  if (!config.targets.empty()) {
    std::vector<client::PlanTensor> tensors;
    for (size_t i = 0; i < model.numels.size(); ++i) {
      tensors.push_back({model.tensor_names[i], {static_cast<int64_t>(model.numels[i])}});
    }
    absl::StatusOr<client::ShardPlan> made =
        client::ShardPlan::Make(tensors, static_cast<uint32_t>(config.targets.size()));
    if (!made.ok()) return made.status();
    plan = *std::move(made);
  }
  const client::ShardPlan* plan_ptr = plan ? &*plan : nullptr;
  LoadResult result;
  absl::StatusOr<Connection> admin = Connection::Open(config, plan_ptr);
  if (!admin.ok()) return admin.status();
  absl::StatusOr<client::ServerInfo> info = admin->Info();
  if (!info.ok()) return WithContext(info.status(), "GetInfo");
  result.backend = info->backend;
  result.device = info->device;
  if (config.register_tensors) {
    if (absl::Status status = Register(*admin, model, config.seed, result); !status.ok()) {
      return status;
    }
  }

  std::unique_ptr<ReaderProbe> probe;
  if (config.probe_interval > absl::ZeroDuration()) {
    absl::StatusOr<std::unique_ptr<ReaderProbe>> created = ReaderProbe::Create(
        {config.target, config.probe_interval, config.probe_pull_bytes, config.client_options});
    if (!created.ok()) return WithContext(created.status(), "starting the reader probe");
    probe = *std::move(created);
  }

  if (probe_only) {  // A reader beside trainers in other processes, for --duration.
    probe->Begin();
    absl::SleepFor(config.duration);
    result.probe = probe->Stop();
    result.seconds = absl::ToDoubleSeconds(config.duration);
    return result;
  }

  RunState state(config.clients);
  result.clients.resize(static_cast<size_t>(config.clients));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(config.clients));
  for (int i = 0; i < config.clients; ++i) {
    threads.emplace_back([&, i] {
      absl::Status status = RunTrainer(i, config, model, plan_ptr, state, result.clients[i]);
      if (!status.ok()) state.Fail(std::move(status));
      state.Finish();
    });
  }
  // Checked often at first, so that the probe begins as the window opens.
  while (!state.WaitForFinish(std::chrono::milliseconds(!probe || state.start() ? 1000 : 5))) {
    const std::optional<Clock::time_point> start = state.start();
    if (probe && start) probe->Begin();
    if (progress && start && !state.failed()) {
      progress({SecondsBetween(*start, Clock::now()), state.pushes(), state.grad_bytes()});
    }
  }
  for (std::thread& thread : threads) thread.join();
  if (probe) result.probe = probe->Stop();
  result.client_cpu_seconds = ProcessCpuSeconds() - state.cpu_seconds_at_open();
  if (absl::Status error = state.error(); !error.ok()) return error;

  result.version_before = state.version_before();
  for (const ClientLoadResult& c : result.clients) {
    result.seconds = std::max(result.seconds, c.seconds);
  }
  info = admin->Info();
  if (!info.ok()) return WithContext(info.status(), "GetInfo after the timed window");
  result.version_after = info->version;
  return result;
}

}  // namespace fusedps
