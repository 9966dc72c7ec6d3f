#include "common/flag_usage.h"

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <map>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/kebab_flags.h"

namespace fusedps {
namespace {

constexpr size_t kLineWidth = 100;
constexpr absl::string_view kHelpIndent = "      ";

// absl records a flag's __FILE__ with its leading slashes removed; so do we.
absl::string_view WithoutLeadingSlashes(absl::string_view path) {
  while (absl::ConsumePrefix(&path, "/")) {
  }
  return path;
}

// The same file, whether either path is absolute, relative to the build, or to the source.
bool SameFile(absl::string_view a, absl::string_view b) {
  a = WithoutLeadingSlashes(a);
  b = WithoutLeadingSlashes(b);
  if (a.size() < b.size()) std::swap(a, b);
  return absl::EndsWith(a, b) && (a.size() == b.size() || a[a.size() - b.size() - 1] == '/');
}

// Words of `text` on lines of at most kLineWidth columns, each line starting with kHelpIndent.
std::string Wrap(absl::string_view text) {
  std::string out;
  std::string line(kHelpIndent);
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipWhitespace())) {
    if (line.size() > kHelpIndent.size() && line.size() + 1 + word.size() > kLineWidth) {
      absl::StrAppend(&out, line, "\n");
      line = std::string(kHelpIndent);
    }
    if (line.size() > kHelpIndent.size()) line += ' ';
    absl::StrAppend(&line, word);
  }
  if (line.size() > kHelpIndent.size()) absl::StrAppend(&out, line, "\n");
  return out;
}

}  // namespace

bool HelpRequested(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") return false;
    if (arg == "--help" || arg == "-help" || arg == "-h" || arg == "--helpshort") return true;
  }
  return false;
}

std::string FlagsHelp(absl::string_view main_file) {
  std::map<std::string, const absl::CommandLineFlag*> ours;  // sorted by kebab name
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!SameFile(flag->Filename(), main_file)) continue;
    std::string kebab(name);
    std::replace(kebab.begin(), kebab.end(), '_', '-');
    ours.emplace(std::move(kebab), flag);
  }
  std::string out;
  for (const auto& [name, flag] : ours) {
    const std::string default_value = flag->IsOfType<std::string>()
                                          ? absl::StrCat("\"", flag->DefaultValue(), "\"")
                                          : flag->DefaultValue();
    absl::StrAppend(&out, "  --", name, " (default: ", default_value, ")\n", Wrap(flag->Help()));
  }
  return out;
}

std::string CheckFlags(const std::vector<char*>& args) {
  for (size_t i = 1; i < args.size(); ++i) {
    absl::string_view arg = args[i];
    if (arg == "--") break;
    if (!absl::ConsumePrefix(&arg, "-")) continue;  // A positional argument.
    absl::ConsumePrefix(&arg, "-");
    const size_t eq = arg.find('=');
    const absl::string_view name = arg.substr(0, eq);
    // absl's usage flags (--helpfull, --helpon=..., --version...) are not registered flags:
    // absl::ParseCommandLine handles them.
    static constexpr absl::string_view kUsageFlags[] = {"helpfull",       "helpshort",   "helpon",
                                                        "helpmatch",      "helppackage", "version",
                                                        "only_check_args"};
    if (std::find(std::begin(kUsageFlags), std::end(kUsageFlags), name) != std::end(kUsageFlags)) {
      continue;
    }
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && absl::StartsWith(name, "no") && eq == absl::string_view::npos) {
      absl::CommandLineFlag* negated = absl::FindCommandLineFlag(name.substr(2));
      if (negated != nullptr && negated->IsOfType<bool>()) continue;
    }
    std::string kebab(name);  // As the user wrote it (KebabToSnakeFlags made it snake_case).
    std::replace(kebab.begin(), kebab.end(), '_', '-');
    if (flag == nullptr) return absl::StrCat("unknown flag --", kebab, " (see --help)");
    std::string value;
    if (eq != absl::string_view::npos) {
      value = std::string(arg.substr(eq + 1));
    } else if (flag->IsOfType<bool>()) {
      value = "true";
    } else if (i + 1 < args.size()) {
      value = args[++i];  // absl takes "--name value" for a flag that is not a bool.
    } else {
      return absl::StrCat("flag --", kebab, " is missing its value");
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      return absl::StrCat("flag --", kebab, ": ", error);
    }
  }
  return "";
}

void PrintHelp(absl::string_view main_file) {
  const std::string help =
      absl::StrCat(absl::ProgramUsageMessage(),
                   "\n\nFlags (--a-b and --a_b both work; --helpfull lists every library's "
                   "flags too):\n",
                   FlagsHelp(main_file));
  std::fwrite(help.data(), 1, help.size(), stdout);
  std::fflush(stdout);
}

std::optional<int> ParseProgramFlags(int argc, char** argv, const ProgramFlags& how,
                                     std::vector<std::string>* positional) {
  if (HelpRequested(argc, argv)) {
    if (how.print_help) {
      how.print_help();
    } else {
      PrintHelp(how.main_file);
      std::fputs(how.extra_help.c_str(), stdout);
    }
    return 0;
  }
  absl::string_view program = argc > 0 ? argv[0] : "fusedps";
  program = program.substr(program.rfind('/') + 1);  // npos + 1 == 0: no slash.
  std::vector<std::string> storage;
  std::vector<char*> args = KebabToSnakeFlags(argc, argv, storage);
  if (const std::string bad = CheckFlags(args); !bad.empty()) {
    std::fprintf(stderr, "%s: %s\n", std::string(program).c_str(), bad.c_str());
    return 2;
  }
  const std::vector<char*> rest =
      absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  if (how.max_positional >= 0 && rest.size() > static_cast<size_t>(how.max_positional) + 1) {
    std::fprintf(stderr, "%s: unexpected argument '%s'\n", std::string(program).c_str(),
                 rest[static_cast<size_t>(how.max_positional) + 1]);
    return 2;
  }
  if (positional != nullptr) positional->assign(rest.begin() + 1, rest.end());
  return std::nullopt;
}

}  // namespace fusedps
