// temp_dir.h: a fresh directory for a test, removed with everything in it when destroyed.
//
// Usage (a fixture member, declared before what lives in it so that it goes last):
//   TempDir dir_{"fusedps-workspace-test"};   // /tmp/fusedps-workspace-test-XXXXXX
//   WorkspaceTable table{{dir_.path(), 1 << 20}, nullptr};
#ifndef FUSEDPS_COMMON_TEMP_DIR_H_
#define FUSEDPS_COMMON_TEMP_DIR_H_

#include <stdlib.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <system_error>

namespace fusedps {

class TempDir {
 public:
  // Makes /tmp/<prefix>-XXXXXX (mkdtemp). Aborts when it cannot: a test has nowhere to go.
  explicit TempDir(const std::string& prefix) {
    std::string pattern = "/tmp/" + prefix + "-XXXXXX";
    if (mkdtemp(pattern.data()) == nullptr) {
      std::perror(("mkdtemp " + pattern).c_str());
      std::abort();
    }
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;  // Best effort: a test's leftovers under /tmp are harmless.
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace fusedps

#endif  // FUSEDPS_COMMON_TEMP_DIR_H_
