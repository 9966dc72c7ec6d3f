#include "client/cli/models_command.h"

#include <iostream>

#include "absl/flags/flag.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "common/flag_usage.h"

ABSL_FLAG(std::string, model, "",
          "The model (server namespace) the command is about; empty: \"default\".");
ABSL_FLAG(std::string, mode, "",
          "models create: async|sync|bounded; empty: the server's flags (--mode ...).");
ABSL_FLAG(uint32_t, replicas_to_aggregate, 1, "models create --mode=sync: K.");
ABSL_FLAG(uint32_t, total_replicas, 1, "models create --mode=sync: N.");
ABSL_FLAG(absl::Duration, round_timeout, absl::Seconds(30),
          "models create --mode=sync: the round timeout (0: none).");
ABSL_FLAG(uint64_t, max_staleness, 0, "models create --mode=bounded: s.");
ABSL_FLAG(bool, staleness_lr_scaling, false, "models create --mode=bounded: lr / (1 + staleness).");

namespace fusedps::client {
namespace {

void PrintModel(const ModelInfo& m) {
  std::cout << absl::StrFormat(
      "model        %s\nversion      %d\ntensors      %d\nparams       %d\nconsistency  %s\n"
      "memory       %d bytes\nplan hash    %s\n",
      m.name, m.version, m.tensor_count, m.parameter_count, DescribeConsistency(m.consistency),
      m.memory_bytes, m.plan_hash.empty() ? "none" : m.plan_hash);
}

}  // namespace

std::string ModelFlag() { return absl::GetFlag(FLAGS_model); }

std::string DescribeConsistency(const Consistency& c) {
  if (c.mode == "sync") {
    return absl::StrFormat("sync (%d of %d per round, round timeout %s)", c.replicas_to_aggregate,
                           c.total_replicas, absl::FormatDuration(c.round_timeout));
  }
  if (c.mode == "bounded") {
    return absl::StrFormat("bounded (max staleness %d%s)", c.max_staleness,
                           c.staleness_lr_scaling ? ", lr / (1 + staleness)" : "");
  }
  return c.mode.empty() ? "async (not reported)" : c.mode;
}

absl::Status RunModels(Client& client, const std::vector<std::string>& args) {
  const std::string sub = args.empty() ? "" : args[0];
  const bool named = sub == "create" || sub == "describe" || sub == "delete";
  if (sub == "list" ? args.size() != 1 : !named || args.size() != 2) {
    return absl::InvalidArgumentError(
        "usage: fusedps models list | create NAME | describe NAME | delete NAME");
  }
  if (sub == "list") {
    absl::StatusOr<std::vector<ModelInfo>> models = client.ListModels();
    if (!models.ok()) return models.status();
    std::cout << absl::StrFormat("%-24s  %10s  %8s  %14s  %14s  %s\n", "model", "version",
                                 "tensors", "params", "memory_bytes", "consistency");
    for (const ModelInfo& m : *models) {
      std::cout << absl::StrFormat("%-24s  %10d  %8d  %14d  %14d  %s\n", m.name, m.version,
                                   m.tensor_count, m.parameter_count, m.memory_bytes,
                                   DescribeConsistency(m.consistency));
    }
    return absl::OkStatus();
  }
  const std::string& name = args[1];
  if (sub == "create") {
    Consistency c;
    c.mode = absl::GetFlag(FLAGS_mode);
    c.replicas_to_aggregate = absl::GetFlag(FLAGS_replicas_to_aggregate);
    c.total_replicas = absl::GetFlag(FLAGS_total_replicas);
    c.round_timeout = absl::GetFlag(FLAGS_round_timeout);
    c.max_staleness = absl::GetFlag(FLAGS_max_staleness);
    c.staleness_lr_scaling = absl::GetFlag(FLAGS_staleness_lr_scaling);
    absl::StatusOr<CreateModelResult> created = client.CreateModel(name, c);
    if (!created.ok()) return created.status();
    std::cout << (created->created ? "created\n" : "exists already (same consistency)\n");
    PrintModel(created->model);
    return absl::OkStatus();
  }
  if (sub == "describe") {
    absl::StatusOr<std::vector<ModelInfo>> models = client.ListModels();
    if (!models.ok()) return models.status();
    for (const ModelInfo& m : *models) {
      if (m.name == name) {
        PrintModel(m);
        return absl::OkStatus();
      }
    }
    return absl::NotFoundError(
        absl::StrCat("model '", name, "' does not exist (or the token ", "may not reach it)"));
  }
  absl::StatusOr<DeleteModelResult> deleted = client.DeleteModel(name);
  if (!deleted.ok()) return deleted.status();
  std::cout << absl::StrFormat(
      "deleted model %s: %d bytes %s\n", name, deleted->freed_bytes,
      deleted->memory_freed ? "freed" : "freed once its calls in flight end");
  return absl::OkStatus();
}

std::string ModelsFlagsHelp() { return FlagsHelp(__FILE__); }

}  // namespace fusedps::client
