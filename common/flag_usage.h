// flag_usage.h: `--help` for our programs: the usage message and the program's own flags,
// spelled as the README spells them (--port-file, not --port_file).
//
// absl's own --help lists only flags defined in a file named after the program
// (fusedps-server.cc), so for our main files it prints "No flags matched"; --helpfull lists
// every flag of every library, snake_case. These list the flags defined in one file: the
// caller's, through __FILE__.
//
// Usage (first in main):
//   absl::SetProgramUsageMessage("fusedps-server: ...");
//   std::vector<std::string> positional;
//   if (std::optional<int> exit_code = fusedps::ParseProgramFlags(argc, argv, {__FILE__},
//                                                                  &positional)) {
//     return *exit_code;
//   }
#ifndef FUSEDPS_COMMON_FLAG_USAGE_H_
#define FUSEDPS_COMMON_FLAG_USAGE_H_

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace fusedps {

// True when an argument before "--" is --help, -help, -h or --helpshort (absl's short help).
// --helpfull and absl's other help flags are left to absl::ParseCommandLine.
bool HelpRequested(int argc, char** argv);

// The flags defined in `main_file` (pass __FILE__), sorted by name, kebab-case, each as
//   --name (default: VALUE)
//       help text, wrapped
// String defaults are quoted, so that an empty one shows as "".
std::string FlagsHelp(absl::string_view main_file);

// Prints absl::ProgramUsageMessage(), then FlagsHelp(main_file), to stdout.
void PrintHelp(absl::string_view main_file);

// Checks the flags of `args` (argv after KebabToSnakeFlags, args[0] the program; up to "--")
// as absl::ParseCommandLine would parse them, without exiting: every --name (or --noname of a
// bool) must be a defined flag and every value must parse. Returns "" when they do, else the
// first error, naming the flag. absl::ParseCommandLine exits 1 on these; our programs exit 2
// for a bad flag (docs/errors.md), so they call this first.
std::string CheckFlags(const std::vector<char*>& args);

// How a program reads its command line (ParseProgramFlags).
struct ProgramFlags {
  // Implicit, so that a call may pass {__FILE__}.
  ProgramFlags(absl::string_view main_file) : main_file(main_file) {}  // NOLINT
  // The file whose flags --help lists: the caller's __FILE__.
  absl::string_view main_file;
  // Printed after the flags by --help (flags of the program's libraries, say).
  std::string extra_help;
  // Prints --help instead of PrintHelp(main_file) and extra_help, when set.
  std::function<void()> print_help;
  // How many arguments that are not flags the program takes (argv[0] not counted); -1: any.
  int max_positional = 0;
};

// Parses the command line as every fusedps program does, in one place:
//   - --help, -h or --helpshort (HelpRequested) prints the help; the program exits 0;
//   - flag names may be spelled --a-b as well as --a_b (kebab_flags.h);
//   - a flag that is not defined or whose value does not parse (CheckFlags), or more arguments
//     that are not flags than `max_positional`, is named on stderr, after the program's name,
//     and the program exits 2 (docs/errors.md; absl::ParseCommandLine alone exits 1).
// Returns the code to exit with now, or nullopt when the program should run; then the flags are
// set and *positional (when not null) holds the arguments that are not flags, argv[0] left out.
// Call absl::SetProgramUsageMessage first.
std::optional<int> ParseProgramFlags(int argc, char** argv, const ProgramFlags& how,
                                     std::vector<std::string>* positional = nullptr);

}  // namespace fusedps

#endif  // FUSEDPS_COMMON_FLAG_USAGE_H_
