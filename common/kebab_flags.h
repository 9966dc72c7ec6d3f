// kebab_flags.h: lets absl flags be spelled kebab-style on the command line.
//
// absl::ParseCommandLine matches flag names exactly, and C++ identifiers cannot hold '-', so
// `--port-file=x` would be an unknown flag for ABSL_FLAG(..., port_file, ...). This rewrites each
// argument's flag name (up to '=') from dashes to underscores, leaving values and positional
// arguments untouched. Both spellings work afterwards.
//
// Usage (in main):
//   std::vector<char*> args = fusedps::KebabToSnakeFlags(argc, argv, storage);
//   absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
#ifndef FUSEDPS_COMMON_KEBAB_FLAGS_H_
#define FUSEDPS_COMMON_KEBAB_FLAGS_H_

#include <algorithm>
#include <string>
#include <vector>

namespace fusedps {

// storage keeps the rewritten strings alive as long as the returned pointers are used.
inline std::vector<char*> KebabToSnakeFlags(int argc, char** argv,
                                            std::vector<std::string>& storage) {
  storage.assign(argv, argv + argc);
  bool flags_ended = false;
  for (size_t i = 1; i < storage.size(); ++i) {
    std::string& arg = storage[i];
    if (flags_ended || arg.size() < 3 || arg[0] != '-') continue;
    if (arg == "--") {
      flags_ended = true;
      continue;
    }
    const size_t name_begin = arg[1] == '-' ? 2 : 1;
    const size_t name_end = arg.find('=');
    for (size_t c = name_begin; c < std::min(name_end, arg.size()); ++c) {
      if (arg[c] == '-') arg[c] = '_';
    }
  }
  std::vector<char*> args;
  for (std::string& s : storage) args.push_back(s.data());
  return args;
}

}  // namespace fusedps

#endif  // FUSEDPS_COMMON_KEBAB_FLAGS_H_
