// logging.h: logging through glog, to stderr only, and a rate limit for per-call errors.
//
// Usage:
//   int main(int argc, char** argv) {
//     fusedps::InitLogging(argv[0]);
//     LOG(INFO) << "serving on " << port;
//   }
//   ...
//   if (!status.ok()) FUSEDPS_LOG_EVERY_SECONDS(WARNING, 10) << "push failed: " << status;
//
// glog's own flags (--v, --minloglevel, ...) are not on our command line: absl parses it. Set
// them through the environment instead, e.g. GLOG_v=1 or GLOG_minloglevel=1.
#ifndef FUSEDPS_COMMON_LOGGING_H_
#define FUSEDPS_COMMON_LOGGING_H_

#include <glog/logging.h>

#include <atomic>
#include <cstdint>

namespace fusedps {

// Sends every log message to stderr and none to files, in colour only when stderr is a
// terminal, and installs glog's failure signal handler (a stack trace on SIGSEGV, SIGABRT, ...;
// not in sanitizer builds, whose own handlers report better). Call it once, first thing in
// main; later calls do nothing. argv0 must outlive the program (argv[0] does).
void InitLogging(const char* argv0);

namespace logging_internal {

// The window of one FUSEDPS_LOG_EVERY_SECONDS statement: the first call logs, then the first
// call at least `seconds` after the last one that logged. Exactly one of concurrent callers
// wins a window.
class EverySeconds {
 public:
  explicit EverySeconds(double seconds);
  bool ShouldLog();

 private:
  const int64_t period_ns_;
  std::atomic<int64_t> next_ns_;  // steady_clock time from which the next call may log
};

}  // namespace logging_internal
}  // namespace fusedps

// LOG(severity), but at most once per `seconds` (a constant) from this statement; the first
// call logs. For errors that may repeat on every call (a bad push, a lost peer). Like LOG_IF it
// is one expression, so it is safe as the body of an unbraced if/else.
//
// Why not glog 0.6's LOG_EVERY_T: it is several statements (it does not compile as the body of
// an unbraced if), concurrent callers can all log in one window, and its first call is silent
// while the machine has been up for less than `seconds` (it starts from steady_clock's 0).
#define FUSEDPS_LOG_EVERY_SECONDS(severity, seconds) \
  LOG_IF(severity, FUSEDPS_LOGGING_INTERNAL_WINDOW(seconds).ShouldLog())

// This statement's own window: a lambda's static, one per expansion of the macro.
#define FUSEDPS_LOGGING_INTERNAL_WINDOW(seconds)                        \
  ([]() -> ::fusedps::logging_internal::EverySeconds& {                 \
    static ::fusedps::logging_internal::EverySeconds window((seconds)); \
    return window;                                                      \
  }())

#endif  // FUSEDPS_COMMON_LOGGING_H_
