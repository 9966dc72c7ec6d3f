// reader_probe.h: how long readers wait while trainers push, for fusedps-bench --probe-interval.
//
// A probe is one more client on a connection of its own that, every `interval`, calls GetInfo
// and then pulls one tensor of `pull_bytes` (registered by the probe as
// "fusedps-bench/probe/<bytes>", fp32), and records each call's wall time. Readers should never
// wait for the device: on a server where GetInfo and pulls wait for the shard's lock across a
// step, these latencies follow the steps; where they do not, they stay near a round trip.
//
// Usage:
//   absl::StatusOr<std::unique_ptr<ReaderProbe>> probe = ReaderProbe::Create(
//       {"localhost:50051", absl::Milliseconds(10), 1 << 20});
//   (*probe)->Begin();   // when the timed window opens
//   ProbeResult latencies = (*probe)->Stop();
#ifndef FUSEDPS_BENCH_READER_PROBE_H_
#define FUSEDPS_BENCH_READER_PROBE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "fusedps/client.h"

namespace fusedps {

struct ProbeConfig {
  std::string target;
  absl::Duration interval = absl::Milliseconds(10);  // Between the starts of two rounds.
  uint64_t pull_bytes = 1 << 20;                     // 0: GetInfo only.
  client::ClientOptions client_options;  // TLS and the token; timeouts are the probe's own.
};

struct ProbeResult {
  std::vector<double> get_info_ms;  // Wall time of each GetInfo.
  std::vector<double> pull_ms;      // Wall time of each pull of the probe tensor.
  uint64_t errors = 0;              // Calls that failed (not timed).
};

class ReaderProbe {
 public:
  // Connects and registers the probe tensor.
  static absl::StatusOr<std::unique_ptr<ReaderProbe>> Create(const ProbeConfig& config);
  ~ReaderProbe();
  // Starts probing on a thread of its own. Once.
  void Begin();
  // Stops probing and returns what it measured.
  ProbeResult Stop();

 private:
  ReaderProbe(const ProbeConfig& config, std::unique_ptr<client::Client> client)
      : config_(config), client_(std::move(client)) {}
  void Run();

  const ProbeConfig config_;
  std::unique_ptr<client::Client> client_;
  std::string tensor_;
  std::atomic<bool> stop_{false};
  ProbeResult result_;  // Written by the probe's thread until Stop joins it.
  std::thread thread_;
};

}  // namespace fusedps

#endif  // FUSEDPS_BENCH_READER_PROBE_H_
