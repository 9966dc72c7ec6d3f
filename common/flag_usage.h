// flag_usage.h: `--help` for our programs: the usage message and the program's own flags,
// spelled as the README spells them (--port-file, not --port_file).
//
// absl's own --help lists only flags defined in a file named after the program
// (fusedps-server.cc), so for our main files it prints "No flags matched"; --helpfull lists
// every flag of every library, snake_case. These list the flags defined in one file: the
// caller's, through __FILE__.
//
// Usage (in main, before parsing):
//   absl::SetProgramUsageMessage("fusedps-server: ...");
//   if (fusedps::HelpRequested(argc, argv)) {
//     fusedps::PrintHelp(__FILE__);
//     return 0;
//   }
#ifndef FUSEDPS_COMMON_FLAG_USAGE_H_
#define FUSEDPS_COMMON_FLAG_USAGE_H_

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

}  // namespace fusedps

#endif  // FUSEDPS_COMMON_FLAG_USAGE_H_
