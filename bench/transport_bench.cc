// fusedps-transport-bench: how fast one trainer moves a step's bytes to and from a fusedps
// server over gRPC, against raw TCP on loopback measured in the same run.
//
// For each stream count in --streams it registers --mib MiB of fp32 parameters (tensors of
// --tensor-mib), then times --iters rounds of:
//   push: one PushTransaction of every tensor (BeginPush, Write of every tensor from host
//     memory, Commit): what RemoteAdamW(overlap=True) sends per step. The time includes the
//     server's apply of the step (a GPU applies 256 MiB in about a millisecond).
//   pull: PullInto of every tensor, one call per tensor, the tensors split over the streams
//     (each stream's calls one after the other): what its pull pipeline does.
// and, in the same process, raw TCP: --mib MiB sent over 1 and over N loopback connections
// (send() of 4 MiB buffers, recv() into 4 MiB buffers), the ceiling gRPC runs under.
// Throughput is payload bytes over wall time, GB/s (1e9); the table reports the median round
// and the best.
//
// Usage:
//   fusedps-transport-bench --target=127.0.0.1:50051 --mib=256 --streams=1,8 --iters=5
//   fusedps-transport-bench --tcp-only --mib=1024
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/flag_usage.h"
#include "fusedps/client.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "fusedps server host:port");
ABSL_FLAG(int, mib, 256, "payload per round, MiB (fp32 parameters, as pushed and pulled)");
ABSL_FLAG(int, tensor_mib, 16, "size of each registered tensor, MiB");
ABSL_FLAG(std::string, streams, "1,8", "comma list of stream counts to measure");
ABSL_FLAG(int, iters, 5, "timed rounds per measurement (after one warm-up round)");
ABSL_FLAG(int, chunk_mib, 4, "max_chunk_bytes of the client, MiB");
ABSL_FLAG(std::string, dtype, "fp32", "wire dtype of pushes and pulls: fp32 or bf16");
ABSL_FLAG(std::string, prefix, "transport-bench/", "tensor name prefix on the server");
ABSL_FLAG(bool, tcp_only, false, "measure raw loopback TCP only (no server needed)");

namespace {

constexpr size_t kBuffer = 4 << 20;  // Raw TCP's send and recv size.

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

struct Rate {
  double median = 0, best = 0;  // GB/s
};

Rate Summarize(std::vector<double> seconds, double bytes) {
  std::sort(seconds.begin(), seconds.end());
  return {bytes / seconds[seconds.size() / 2] / 1e9, bytes / seconds.front() / 1e9};
}

// Raw TCP on loopback: `bytes` over `connections` sockets at once; returns seconds.
double RawTcp(uint64_t bytes, int connections) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      listen(listener, connections) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    std::perror("raw tcp listener");
    std::exit(1);
  }
  const uint64_t share = bytes / connections;
  std::vector<int> clients(connections);
  for (int& fd : clients) {
    fd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
      std::perror("raw tcp connect");
      std::exit(1);
    }
  }
  std::vector<int> servers(connections);
  for (int& fd : servers) fd = accept(listener, nullptr, nullptr);
  std::vector<std::thread> threads;
  const Clock::time_point start = Clock::now();
  for (int i = 0; i < connections; ++i) {
    threads.emplace_back([fd = servers[i], share] {
      std::vector<char> buffer(kBuffer);
      for (uint64_t got = 0; got < share;) {
        const ssize_t n = recv(fd, buffer.data(), buffer.size(), 0);
        if (n <= 0) break;
        got += static_cast<uint64_t>(n);
      }
    });
    threads.emplace_back([fd = clients[i], share] {
      std::vector<char> buffer(kBuffer, 1);
      for (uint64_t sent = 0; sent < share;) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(kBuffer, share - sent));
        const ssize_t w = send(fd, buffer.data(), n, 0);
        if (w <= 0) break;
        sent += static_cast<uint64_t>(w);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  const double seconds = Seconds(start, Clock::now());
  for (int fd : clients) close(fd);
  for (int fd : servers) close(fd);
  close(listener);
  return seconds;
}

void Check(const absl::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, std::string(status.message()).c_str());
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "fusedps-transport-bench: one trainer's push and pull GB/s over gRPC, against raw "
      "loopback TCP in the same run (flags: --a-b and --a_b both work).\n"
      "  fusedps-transport-bench --target=127.0.0.1:50051 --mib=256 --streams=1,8\n"
      "  fusedps-transport-bench --tcp-only --mib=1024");
  if (std::optional<int> exit_code = fusedps::ParseProgramFlags(argc, argv, {__FILE__})) {
    return *exit_code;
  }
  const uint64_t bytes = static_cast<uint64_t>(absl::GetFlag(FLAGS_mib)) << 20;
  const int iters = std::max(1, absl::GetFlag(FLAGS_iters));
  std::vector<int> stream_counts;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_streams), ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(s, &n) || n < 1 || n > 64) {
      std::fprintf(stderr, "--streams: bad count '%s'\n", std::string(s).c_str());
      return 2;
    }
    stream_counts.push_back(n);
  }

  std::printf("%-28s %8s %10s %10s\n", "path", "streams", "GB/s med", "GB/s best");
  for (int n : stream_counts) {
    std::vector<double> seconds;
    for (int i = 0; i <= iters; ++i) {
      const double s = RawTcp(bytes, n);
      if (i > 0) seconds.push_back(s);
    }
    const Rate r = Summarize(seconds, static_cast<double>(bytes));
    std::printf("%-28s %8d %10.2f %10.2f\n", "raw TCP loopback", n, r.median, r.best);
  }
  if (absl::GetFlag(FLAGS_tcp_only)) return 0;

  absl::StatusOr<fusedps::client::DType> dtype =
      fusedps::client::ParseDType(absl::GetFlag(FLAGS_dtype));
  Check(dtype.status(), "--dtype");
  const uint64_t tensor_numel = static_cast<uint64_t>(absl::GetFlag(FLAGS_tensor_mib)) << 18;
  const size_t tensor_count = std::max<uint64_t>(1, bytes / (tensor_numel * 4));
  std::vector<float> values(tensor_numel, 0.001f);
  std::vector<fusedps::client::TensorInit> inits;
  std::vector<fusedps::client::TensorSize> sizes;
  for (size_t t = 0; t < tensor_count; ++t) {
    const std::string name = absl::StrFormat("%sw%03d", absl::GetFlag(FLAGS_prefix), t);
    inits.push_back({name, {static_cast<int64_t>(tensor_numel)}, "", values});
    sizes.push_back({name, tensor_numel});
  }
  const size_t element_bytes = fusedps::client::ElementBytes(*dtype);
  const double payload = static_cast<double>(tensor_count * tensor_numel * element_bytes);
  // The wire bytes of every tensor (small gradients: the step changes the params a little).
  std::vector<std::vector<char>> wire(tensor_count,
                                      std::vector<char>(tensor_numel * element_bytes, 0));
  for (int n : stream_counts) {
    fusedps::client::ClientOptions options;
    options.streams = n;
    options.max_chunk_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_chunk_mib)) << 20;
    auto client = fusedps::client::Client::Create(absl::GetFlag(FLAGS_target), options);
    Check(client.status(), "client");
    Check((*client)->RegisterTensors(inits).status(), "register");
    std::vector<double> push_seconds, pull_seconds;
    for (int i = 0; i <= iters; ++i) {
      fusedps::client::PushOptions push_options;
      push_options.grad_dtype = *dtype;
      const Clock::time_point start = Clock::now();
      auto push = (*client)->BeginPush(push_options, sizes);
      Check(push.status(), "begin push");
      std::vector<fusedps::client::PushTransaction::Piece> pieces;
      for (size_t t = 0; t < tensor_count; ++t) {
        pieces.push_back({t, 0, tensor_numel, wire[t].data()});
      }
      Check((*push)->Write(pieces), "write");
      Check((*push)->Commit(std::nullopt).status(), "commit");
      if (i > 0) push_seconds.push_back(Seconds(start, Clock::now()));

      fusedps::client::PullOptions pull_options;
      pull_options.dtype = *dtype;
      const Clock::time_point pull_start = Clock::now();
      std::vector<std::thread> threads;
      std::atomic<bool> failed{false};
      for (int s = 0; s < n; ++s) {
        threads.emplace_back([&, s] {
          // One call per tensor, as the pull pipeline pulls a group per call.
          for (size_t t = static_cast<size_t>(s); t < tensor_count; t += n) {
            const fusedps::client::PullTarget target{sizes[t].name, wire[t].data(), tensor_numel};
            auto pulled = (*client)->PullInto(pull_options, {&target, 1}, s);
            if (!pulled.ok()) {
              std::fprintf(stderr, "pull: %s\n", std::string(pulled.status().message()).c_str());
              failed = true;
              return;
            }
          }
        });
      }
      for (std::thread& t : threads) t.join();
      if (failed) return 1;
      if (i > 0) pull_seconds.push_back(Seconds(pull_start, Clock::now()));
    }
    const Rate push = Summarize(push_seconds, payload);
    const Rate pull = Summarize(pull_seconds, payload);
    std::printf("%-28s %8d %10.2f %10.2f\n", "gRPC push (transaction)", n, push.median, push.best);
    std::printf("%-28s %8d %10.2f %10.2f\n", "gRPC pull (PullInto)", n, pull.median, pull.best);
  }
  return 0;
}
