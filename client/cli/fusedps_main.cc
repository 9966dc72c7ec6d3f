// fusedps: a command-line client of a fusedps server, for trying it out and for operations.
//
//   fusedps --target=localhost:50051 info
//   fusedps register --shapes=w:1024x1024,b:1024
//   fusedps push --steps=10 --dtype=bf16
//   fusedps pull --out=params.safetensors
//   fusedps set-lr --group=default --lr=3e-4
//   fusedps plan --shards=4 --tensors-file=model.json
//   fusedps --tls-ca=ca.crt --token-file=/var/run/fusedps/token info
//
// Exit status: 0 on success, 1 when a call fails, 2 for a usage error.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/cli/models_command.h"
#include "client/cli/security_flags.h"
#include "common/dtype_names.h"
#include "common/flag_usage.h"
#include "common/safetensors.h"
#include "fusedps/client.h"
#include "fusedps/plan.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, target, "localhost:50051", "Server address, HOST:PORT.");
ABSL_FLAG(absl::Duration, timeout, fusedps::client::ClientOptions().timeout,
          "Deadline of each call: this, plus the tensor data the call moves at 10 MB/s (the "
          "client library's default), e.g. 30s, 5m; inf: no deadline.");
ABSL_FLAG(int64_t, max_chunk_bytes, 1 << 20, "Payload bytes of tensor data per message.");
ABSL_FLAG(std::string, service, "",
          "health: the gRPC service to ask about; empty means the whole server.");
ABSL_FLAG(int32_t, streams, 1,
          "Concurrent calls (connections) for register and pull; push sends each push as "
          "that many parts.");
ABSL_FLAG(std::string, tensors, "", "push, pull: comma-separated tensor names (empty: all).");
ABSL_FLAG(std::string, shapes, "",
          "register: comma-separated NAME:DIMxDIM... entries, e.g. w:1024x768,b:768,scale: "
          "(nothing after ':' is a 0-dim tensor).");
ABSL_FLAG(std::string, group, "default", "register, set-lr: the param group.");
ABSL_FLAG(double, init_std, 0.02, "register: standard deviation of the normal initial values.");
ABSL_FLAG(uint64_t, seed, 0, "register, push: random seed of the synthetic values.");
ABSL_FLAG(std::string, dtype, "",
          "push: gradient wire dtype fp32|bf16|fp16 (default bf16, as the client library); "
          "pull: wire dtype fp32|bf16 (default fp32).");
ABSL_FLAG(int32_t, steps, 1, "push: how many pushes (optimizer steps).");
ABSL_FLAG(std::string, client_id, "",
          "push: trainer id for retry detection; sequence numbers are then the push time in "
          "microseconds. Empty: no retry detection.");
ABSL_FLAG(std::string, field, "param", "pull: param|exp_avg|exp_avg_sq|max_exp_avg_sq.");
ABSL_FLAG(std::string, out, "", "pull: the output file (safetensors, see help).");
ABSL_FLAG(double, lr, -1.0, "set-lr: the new learning rate (>= 0).");
ABSL_FLAG(int32_t, shards, 0, "plan: the number of servers (>= 1).");
ABSL_FLAG(uint64_t, slice_elements, fusedps::client::ShardPlan::kDefaultSliceElements,
          "plan: the largest slice of a tensor, in elements.");
ABSL_FLAG(std::string, tensors_file, "",
          "plan: a JSON list of the model's tensors, each {\"name\": ..., \"shape\": [...]} "
          "with an optional \"param_group\".");

namespace fusedps::client {
namespace {

constexpr char kUsage[] = R"(fusedps: command-line client of a fusedps parameter server.

Usage: fusedps [flags] COMMAND    (flags may also follow COMMAND; --a-b and --a_b both work)

Commands:
  info      Print the server's version, backend, device, tensor and parameter counts, and
            param groups.
  list      List tensors: name, shape, param group, step, how the server stores the params
            and the state (fp32, bf16 or int8), elements (every tensor, however many: a large
            shard is read a page at a time).
  register  Register tensors of --shapes in --group, with normal(0, --init-std) values.
  push      Push --steps synthetic gradients (standard normal, from --seed) for every tensor
            or for --tensors, in --dtype; prints the version each push produced, or why it
            was skipped.
  pull      Pull --field of every tensor or of --tensors and write them to --out.
  set-lr    Set the lr of param group --group to --lr.
  checkpoint  Have the server write a checkpoint of its shard now (it needs --checkpoint-dir;
            docs/checkpoints.md) holding every push acknowledged before; prints its version
            and directory once it is durable.
  health    Ask grpc.health.v1 about the server (or --service); exit 0 only when SERVING.
  models list | create NAME | describe NAME | delete NAME
            The server's models (namespaces, each a shard of its own: docs/api.md, "Models").
            create takes --mode and its options (the server's flags when --mode is empty);
            delete frees the model's memory and removes its checkpoints. Every other command
            is about --model ("default" when empty).
  plan      Print the sharding plan (docs/sharding.md) of the tensors of --tensors-file over
            --shards servers in slices of at most --slice-elements, as one line of JSON:
            {"hash", "shards", "slice_elements", "slices": [[tensor, begin, end, shard], ...]}.
            Calls no server.
  help      Print this text.

pull's output is a safetensors file (https://huggingface.co/docs/safetensors): 8 bytes of
little-endian header length N, N bytes of JSON header (padded with spaces), then the data.
The header maps each tensor name to {"dtype": "F32", "shape": [...], "data_offsets":
[begin, end]} (byte offsets into the data, which holds row-major little-endian fp32 values
in name order), and "__metadata__" to strings: fusedps.version (the model version read),
fusedps.field, and fusedps.steps (a JSON object of each tensor's optimizer step). Values
pulled in bf16 are widened to fp32. safetensors.torch.load_file() reads it.
)";

void PrintHelp() {
  std::cout << kUsage << "\nFlags:\n"
            << FlagsHelp(__FILE__) << ModelsFlagsHelp() << SecurityFlagsHelp();
}

// --dtype, or `fallback` when it is empty.
absl::StatusOr<DType> DTypeFlag(const std::string& text, DType fallback) {
  if (text.empty()) return fallback;
  absl::StatusOr<DType> dtype = ParseDType(text);
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--dtype ", dtype.status().message()));
  }
  return dtype;
}

absl::StatusOr<TensorField> ParseField(const std::string& text) {
  absl::StatusOr<v1::TensorField> field = dtypes::ParseTensorField(text);
  if (!field.ok())
    return absl::InvalidArgumentError(absl::StrCat("--field ", field.status().message()));
  return static_cast<TensorField>(*field);  // The proto's codes (wire.cc's static_asserts).
}

std::vector<std::string> SplitNames(const std::string& text) {
  return absl::StrSplit(text, ',', absl::SkipEmpty());
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::string OptionalString(const std::optional<double>& value) {
  return value ? absl::StrCat(*value) : "?";
}
std::string OptionalString(const std::optional<bool>& value) {
  return value ? (*value ? "true" : "false") : "?";
}

std::string DescribeGroup(const ParamGroup& group) {
  const ParamGroupOptions& h = group.hyperparameters;
  std::string mode = "?";
  if (h.weight_decay_mode) {
    mode = *h.weight_decay_mode == WeightDecayMode::kL2 ? "l2" : "decoupled";
  }
  std::string storage;  // Only when the server says (older servers do not).
  if (h.state_dtype) absl::StrAppend(&storage, " state_dtype=", StateDTypeName(*h.state_dtype));
  if (h.params_dtype) absl::StrAppend(&storage, " params_dtype=", DTypeName(*h.params_dtype));
  if (h.rounding_seed) absl::StrAppend(&storage, " rounding_seed=", *h.rounding_seed);
  return absl::StrCat(
      group.name, ": lr=", OptionalString(h.lr), " betas=(", OptionalString(h.beta1), ", ",
      OptionalString(h.beta2), ") eps=", OptionalString(h.eps),
      " weight_decay=", OptionalString(h.weight_decay), " (", mode,
      ") amsgrad=", OptionalString(h.amsgrad), " maximize=", OptionalString(h.maximize), storage);
}

absl::Status RunInfo(Client& client) {
  absl::StatusOr<ServerInfo> info = client.GetInfo();
  if (!info.ok()) return info.status();
  std::string copy = "none";
  if (info->param_copy_dtype) copy = DTypeName(*info->param_copy_dtype);
  std::cout << absl::StrFormat(
      "server       %s\nmodel        %s (%d on the server)\nversion      %d\nbackend      %s\n"
      "device       %s\ntensors      %d\nparams       %d\nmax message  %d bytes\n"
      "param copy   %s\nconsistency  %s\nplan hash    %s\nmemory       %d bytes (server: %d)\n"
      "groups       %d\n",
      info->server_version, info->model, info->model_count, info->version, info->backend,
      info->device, info->tensor_count, info->parameter_count, info->max_message_bytes, copy,
      DescribeConsistency(info->consistency), info->plan_hash.empty() ? "none" : info->plan_hash,
      info->memory_bytes, info->server_memory_bytes, info->param_groups.size());
  for (const ParamGroup& group : info->param_groups) {
    std::cout << "  " << DescribeGroup(group) << "\n";
  }
  return absl::OkStatus();
}

absl::Status RunList(Client& client) {
  absl::StatusOr<TensorList> list = client.ListTensors();
  if (!list.ok()) return list.status();
  size_t name_width = 4, shape_width = 5, group_width = 5;
  for (const TensorInfo& t : list->tensors) {
    name_width = std::max(name_width, t.name.size());
    shape_width = std::max(shape_width, ShapeString(t.shape).size());
    group_width = std::max(group_width, t.param_group.size());
  }
  std::cout << absl::StrFormat("version %d, %d tensors\n", list->version, list->tensors.size());
  std::cout << absl::StrFormat("%-*s  %-*s  %-*s  %8s  %-6s  %-5s  %s\n", name_width, "name",
                               shape_width, "shape", group_width, "group", "step", "params",
                               "state", "numel");
  for (const TensorInfo& t : list->tensors) {
    std::cout << absl::StrFormat("%-*s  %-*s  %-*s  %8d  %-6s  %-5s  %d\n", name_width, t.name,
                                 shape_width, ShapeString(t.shape), group_width, t.param_group,
                                 t.step, DTypeName(t.params_dtype), StateDTypeName(t.state_dtype),
                                 t.numel);
  }
  return absl::OkStatus();
}

// Parses --shapes entries "NAME:DIMxDIM...".
absl::StatusOr<std::vector<std::pair<std::string, std::vector<int64_t>>>> ParseShapes(
    const std::string& text) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  for (absl::string_view entry : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    const size_t colon = entry.rfind(':');
    if (colon == absl::string_view::npos || colon == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--shapes entry '", entry, "' is not NAME:DIMxDIM..."));
    }
    std::vector<int64_t> shape;
    for (absl::string_view dim : absl::StrSplit(entry.substr(colon + 1), 'x', absl::SkipEmpty())) {
      int64_t value;
      if (!absl::SimpleAtoi(dim, &value) || value < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("--shapes entry '", entry, "' has a bad dim '", dim, "'"));
      }
      shape.push_back(value);
    }
    shapes.emplace_back(std::string(entry.substr(0, colon)), std::move(shape));
  }
  if (shapes.empty()) return absl::InvalidArgumentError("register needs --shapes");
  return shapes;
}

absl::Status RunRegister(Client& client) {
  auto shapes = ParseShapes(absl::GetFlag(FLAGS_shapes));
  if (!shapes.ok()) return shapes.status();
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  std::normal_distribution<float> normal(0.0f, static_cast<float>(absl::GetFlag(FLAGS_init_std)));
  std::vector<std::vector<float>> values;
  std::vector<TensorInit> inits;
  for (const auto& [name, shape] : *shapes) {
    int64_t numel = 1;
    for (int64_t dim : shape) numel *= dim;
    std::vector<float>& v = values.emplace_back(numel);
    for (float& x : v) x = normal(rng);
  }
  for (size_t i = 0; i < shapes->size(); ++i) {
    inits.push_back(
        {(*shapes)[i].first, (*shapes)[i].second, absl::GetFlag(FLAGS_group), values[i]});
  }
  absl::StatusOr<RegisterTensorsResult> result = client.RegisterTensors(inits);
  if (!result.ok()) return result.status();
  std::cout << absl::StrFormat("registered: %d created, %d already existed; version %d\n",
                               result->tensors_created, result->tensors_existing, result->version);
  return absl::OkStatus();
}

// The tensors a push or pull names: every tensor, or those of --tensors (which must exist).
absl::StatusOr<std::vector<TensorInfo>> SelectTensors(const TensorList& list) {
  const std::vector<std::string> names = SplitNames(absl::GetFlag(FLAGS_tensors));
  if (names.empty()) return list.tensors;
  absl::flat_hash_map<std::string, const TensorInfo*> by_name;
  for (const TensorInfo& t : list.tensors) by_name[t.name] = &t;
  std::vector<TensorInfo> selected;
  for (const std::string& name : names) {
    auto it = by_name.find(name);
    if (it == by_name.end()) return absl::NotFoundError(absl::StrCat("no tensor named ", name));
    selected.push_back(*it->second);
  }
  return selected;
}

absl::Status RunPush(Client& client) {
  absl::StatusOr<DType> dtype = DTypeFlag(absl::GetFlag(FLAGS_dtype), PushOptions().grad_dtype);
  if (!dtype.ok()) return dtype.status();
  const int steps = absl::GetFlag(FLAGS_steps);
  if (steps < 1) return absl::InvalidArgumentError("--steps must be >= 1");
  absl::StatusOr<TensorList> list = client.ListTensors();
  if (!list.ok()) return list.status();
  absl::StatusOr<std::vector<TensorInfo>> tensors = SelectTensors(*list);
  if (!tensors.ok()) return tensors.status();
  if (tensors->empty()) return absl::FailedPreconditionError("the server has no tensors");

  std::vector<std::vector<float>> grads;
  uint64_t numel = 0;
  for (const TensorInfo& t : *tensors) {
    grads.emplace_back(t.numel);
    numel += t.numel;
  }
  std::vector<TensorGrad> pushed;
  for (size_t i = 0; i < tensors->size(); ++i) pushed.push_back({(*tensors)[i].name, grads[i]});

  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  PushOptions options;
  options.client_id = absl::GetFlag(FLAGS_client_id);
  options.grad_dtype = *dtype;
  options.base_version = list->version;
  std::cout << absl::StrFormat("pushing %d tensors, %d elements, %s, %d steps\n", tensors->size(),
                               numel, DTypeName(*dtype), steps);
  for (int step = 1; step <= steps; ++step) {
    for (std::vector<float>& g : grads) {
      for (float& x : g) x = normal(rng);
    }
    if (!options.client_id.empty()) {
      options.sequence_number =
          std::max<uint64_t>(options.sequence_number + 1, absl::ToUnixMicros(absl::Now()));
    }
    const absl::Time start = absl::Now();
    absl::StatusOr<PushResult> result = client.PushGradients(options, pushed);
    if (!result.ok()) return result.status();
    const double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
    std::string outcome = absl::StrCat("applied to ", result->tensors_updated, " tensors");
    if (result->duplicate) outcome = "duplicate, not applied";
    if (result->step_skipped) outcome = absl::StrCat("skipped (", result->skip_reason, ")");
    std::cout << absl::StrFormat("push %d/%d: version %d, %s, %d bytes, %.2f ms\n", step, steps,
                                 result->version, outcome, result->grad_bytes, ms);
    options.base_version = result->version;
  }
  return absl::OkStatus();
}

// Writes a pull as a safetensors file (see kUsage).
absl::Status WriteSafetensors(const PullResult& pull, const std::string& field,
                              const std::string& path) {
  std::vector<safetensors::TensorView> tensors;
  nlohmann::json steps = nlohmann::json::object();
  for (const auto& [name, tensor] : pull.tensors) {
    tensors.push_back({name,
                       safetensors::DType::kF32,
                       tensor.shape,
                       {reinterpret_cast<const uint8_t*>(tensor.values.data()),
                        tensor.values.size() * sizeof(float)}});
    steps[name] = tensor.step;
  }
  safetensors::WriteOptions options;
  options.metadata = {{"fusedps.version", absl::StrCat(pull.version)},
                      {"fusedps.field", field},
                      {"fusedps.steps", steps.dump()}};
  return safetensors::WriteFile(path, tensors, options).status();
}

absl::Status RunPull(Client& client) {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return absl::InvalidArgumentError("pull needs --out=FILE");
  absl::StatusOr<DType> dtype = DTypeFlag(absl::GetFlag(FLAGS_dtype), PullOptions().dtype);
  if (!dtype.ok()) return dtype.status();
  absl::StatusOr<TensorField> field = ParseField(absl::GetFlag(FLAGS_field));
  if (!field.ok()) return field.status();
  PullOptions options;
  options.tensors = SplitNames(absl::GetFlag(FLAGS_tensors));
  options.dtype = *dtype;
  options.field = *field;
  const absl::Time start = absl::Now();
  absl::StatusOr<PullResult> pull = client.PullParameters(options);
  if (!pull.ok()) return pull.status();
  const double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  uint64_t numel = 0;
  for (const auto& [name, tensor] : pull->tensors) numel += tensor.values.size();
  if (absl::Status status = WriteSafetensors(*pull, absl::GetFlag(FLAGS_field), out);
      !status.ok()) {
    return status;
  }
  std::cout << absl::StrFormat("pulled %d tensors, %d elements at version %d in %.2f ms -> %s\n",
                               pull->tensors.size(), numel, pull->version, ms, out);
  return absl::OkStatus();
}

absl::Status RunSetLr(Client& client) {
  const double lr = absl::GetFlag(FLAGS_lr);
  if (!(lr >= 0.0) || !std::isfinite(lr)) {
    return absl::InvalidArgumentError("set-lr needs --lr >= 0");
  }
  ParamGroupOptions changes;
  changes.lr = lr;
  absl::StatusOr<ParamGroup> group = client.SetHyperparameters(absl::GetFlag(FLAGS_group), changes);
  if (!group.ok()) return group.status();
  std::cout << DescribeGroup(*group) << "\n";
  return absl::OkStatus();
}

absl::Status RunCheckpoint(Client& client) {
  absl::StatusOr<Client::CheckpointWritten> written = client.Checkpoint();
  if (!written.ok()) return written.status();
  std::cout << "version " << written->version << " " << written->path << "\n";
  return absl::OkStatus();
}

// Exits 0 only when the server (or --service) is SERVING: for container health checks.
absl::Status RunHealth(Client& client) {
  const std::string service = absl::GetFlag(FLAGS_service);
  absl::StatusOr<bool> serving = client.CheckHealth(service);
  if (!serving.ok()) return serving.status();
  std::cout << (*serving ? "SERVING" : "NOT_SERVING") << "\n";
  if (!*serving) return absl::UnavailableError("not serving");
  return absl::OkStatus();
}

// Reads --tensors-file: [{"name": ..., "shape": [...], "param_group": ...}, ...].
absl::StatusOr<std::vector<PlanTensor>> ReadPlanTensors(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("plan needs --tensors-file=FILE");
  std::ifstream file(path);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  const nlohmann::json json = nlohmann::json::parse(file, nullptr, /*allow_exceptions=*/false);
  if (!json.is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a JSON list"));
  }
  std::vector<PlanTensor> tensors;
  for (const nlohmann::json& entry : json) {
    const bool ok = entry.is_object() && entry.contains("name") && entry["name"].is_string() &&
                    entry.contains("shape") && entry["shape"].is_array() &&
                    (!entry.contains("param_group") || entry["param_group"].is_string());
    PlanTensor& tensor = tensors.emplace_back();
    bool dims_ok = ok;
    if (ok) {
      tensor.name = entry["name"].get<std::string>();
      for (const nlohmann::json& dim : entry["shape"]) {
        dims_ok = dims_ok && dim.is_number_integer();
        if (dims_ok) tensor.shape.push_back(dim.get<int64_t>());
      }
      tensor.param_group = entry.value("param_group", std::string("default"));
    }
    if (!dims_ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": entry ", tensors.size() - 1,
          " is not {\"name\": string, \"shape\": [int, ...], \"param_group\": string}"));
    }
  }
  return tensors;
}

// Needs no server: prints the plan of --tensors-file.
absl::Status RunPlan() {
  absl::StatusOr<std::vector<PlanTensor>> tensors =
      ReadPlanTensors(absl::GetFlag(FLAGS_tensors_file));
  if (!tensors.ok()) return tensors.status();
  const int32_t shards = absl::GetFlag(FLAGS_shards);
  if (shards < 1) return absl::InvalidArgumentError("plan needs --shards >= 1");
  absl::StatusOr<ShardPlan> plan =
      ShardPlan::Make(*tensors, static_cast<uint32_t>(shards), absl::GetFlag(FLAGS_slice_elements));
  if (!plan.ok()) return plan.status();
  std::cout << plan->ToJson() << "\n";
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "fusedps [flags] info|list|register|push|pull|set-lr|checkpoint|health|models|plan|help");
  ProgramFlags how{__FILE__};
  how.print_help = [] { PrintHelp(); };
  how.max_positional = -1;  // The command and its words, checked below.
  std::vector<std::string> args;
  if (std::optional<int> exit_code = ParseProgramFlags(argc, argv, how, &args)) return *exit_code;
  if (args.empty() || args[0] == "help") {
    PrintHelp();
    return args.empty() ? 2 : 0;
  }
  const std::string command = args[0];
  if (args.size() > 1 && command != "models") {
    std::cerr << "fusedps: unexpected argument " << args[1] << " (see fusedps help)\n";
    return 2;
  }
  const std::vector<std::string> words(args.begin() + 1, args.end());
  if (command == "plan") {
    absl::Status status = RunPlan();
    if (status.ok()) return 0;
    std::cerr << "fusedps plan: " << status << "\n";
    return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  const std::map<std::string, absl::Status (*)(Client&)> commands = {
      {"info", RunInfo},         {"list", RunList},
      {"register", RunRegister}, {"push", RunPush},
      {"pull", RunPull},         {"set-lr", RunSetLr},
      {"health", RunHealth},     {"checkpoint", RunCheckpoint}};
  auto it = commands.find(command);
  if (it == commands.end() && command != "models") {
    std::cerr << "fusedps: unknown command " << command << " (see fusedps help)\n";
    return 2;
  }
  ClientOptions options;
  options.max_chunk_bytes =
      static_cast<size_t>(std::max<int64_t>(absl::GetFlag(FLAGS_max_chunk_bytes), 0));
  options.streams = absl::GetFlag(FLAGS_streams);
  options.timeout = absl::GetFlag(FLAGS_timeout);
  options.model = ModelFlag();
  ApplySecurityFlags(&options);
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Create(absl::GetFlag(FLAGS_target), options);
  absl::Status status = !client.ok()          ? client.status()
                        : command == "models" ? RunModels(**client, words)
                                              : it->second(**client);
  if (!status.ok()) {
    std::cerr << "fusedps " << command << ": " << status << "\n";
    const bool usage = absl::StartsWith(status.message(), "usage:");
    return status.code() == absl::StatusCode::kInvalidArgument && (!client.ok() || usage) ? 2 : 1;
  }
  return 0;
}

}  // namespace
}  // namespace fusedps::client

int main(int argc, char** argv) { return fusedps::client::Main(argc, argv); }
