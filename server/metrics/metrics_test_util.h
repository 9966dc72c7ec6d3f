// metrics_test_util.h: tests' reading of the Prometheus text that Metrics::ScrapeText writes
// (metrics_test.cc, the service's integration tests).
#ifndef FUSEDPS_SERVER_METRICS_METRICS_TEST_UTIL_H_
#define FUSEDPS_SERVER_METRICS_METRICS_TEST_UTIL_H_

#include <string>

#include "gtest/gtest.h"

namespace fusedps {

// The value of the one sample line that starts with `series` followed by a space (e.g.
// `fusedps_push_requests_total{code="OK"}`); a test failure, and -1, when there is none.
inline double Sample(const std::string& text, const std::string& series) {
  const std::string prefix = series + " ";
  size_t at = text.rfind("\n" + prefix);
  if (at == std::string::npos) {
    ADD_FAILURE() << "no sample " << series << " in\n" << text;
    return -1;
  }
  at += 1 + prefix.size();
  return std::stod(text.substr(at, text.find('\n', at) - at));
}

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_METRICS_METRICS_TEST_UTIL_H_
