#include "common/logging.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <limits>

namespace fusedps {

void InitLogging(const char* argv0) {
  if (google::IsGoogleLoggingInitialized()) return;
  FLAGS_logtostderr = true;  // no log files (glog would write them under /tmp)
  FLAGS_colorlogtostderr = isatty(STDERR_FILENO) == 1;
  google::InitGoogleLogging(argv0);
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
  google::InstallFailureSignalHandler();
#endif
}

namespace logging_internal {
namespace {

int64_t SteadyNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t PeriodNs(double seconds) {
  if (!(seconds > 0)) return 0;
  constexpr int64_t kLongest = int64_t{1} << 61;  // 73 years: now + period cannot overflow
  const double ns = std::ceil(seconds * 1e9);
  return ns >= static_cast<double>(kLongest) ? kLongest : static_cast<int64_t>(ns);
}

}  // namespace

EverySeconds::EverySeconds(double seconds)
    : period_ns_(PeriodNs(seconds)), next_ns_(std::numeric_limits<int64_t>::min()) {}

bool EverySeconds::ShouldLog() {
  const int64_t now = SteadyNowNs();
  int64_t next = next_ns_.load(std::memory_order_relaxed);
  if (now < next) return false;
  // Of the callers that saw the window open, the one whose exchange lands logs.
  return next_ns_.compare_exchange_strong(next, now + period_ns_, std::memory_order_relaxed);
}

}  // namespace logging_internal
}  // namespace fusedps
