// models_command.h: `fusedps models ...`, the CLI's commands of a server's models (its
// namespaces; docs/api.md, "Models"), and the --model flag every command takes:
//   fusedps models list                    every model the caller may reach
//   fusedps models create NAME [--mode=... --replicas-to-aggregate=K --total-replicas=N
//                               --round-timeout=30s --max-staleness=S --staleness-lr-scaling]
//   fusedps models describe NAME           one model: version, sizes, consistency, memory
//   fusedps models delete NAME             its tensors, state, memory and checkpoints
#ifndef FUSEDPS_CLIENT_CLI_MODELS_COMMAND_H_
#define FUSEDPS_CLIENT_CLI_MODELS_COMMAND_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "fusedps/client.h"

namespace fusedps::client {

// --model: the model every other command is about ("" is "default").
std::string ModelFlag();

// Runs `fusedps models ARGS...` (args: the words after "models"). INVALID_ARGUMENT for a
// usage error (a missing or unknown subcommand, a missing NAME).
absl::Status RunModels(Client& client, const std::vector<std::string>& args);

// A consistency as `info` and `models` print it.
std::string DescribeConsistency(const Consistency& c);

// These flags' --help text (common/flag_usage.h).
std::string ModelsFlagsHelp();

}  // namespace fusedps::client

#endif  // FUSEDPS_CLIENT_CLI_MODELS_COMMAND_H_
