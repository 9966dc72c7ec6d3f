// Tests of the Client's deadlines and keepalive, against the fake ParameterService made to hang,
// and through a TCP proxy that can stop forwarding as a network partition would.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client_test_util.h"
#include "client/fake_parameter_service.h"
#include "fusedps/client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace fusedps::client {
namespace {

using testing::Normal;

// Forwards TCP connections from a loopback port of its own to backend_port, until Freeze():
// from then on it moves no byte either way and closes nothing, as a partition would.
class FreezableProxy {
 public:
  explicit FreezableProxy(int backend_port) : backend_port_(backend_port) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address = Loopback(0);
    socklen_t length = sizeof(address);
    if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
        listen(listen_fd_, 16) != 0 ||
        getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
      ADD_FAILURE() << "proxy: cannot listen on 127.0.0.1:0";
      return;
    }
    port_ = ntohs(address.sin_port);
    threads_.emplace_back([this] { AcceptLoop(); });
  }
  FreezableProxy(const FreezableProxy&) = delete;
  FreezableProxy& operator=(const FreezableProxy&) = delete;
  ~FreezableProxy() {
    stopping_ = true;
    for (std::thread& thread : threads_) thread.join();  // Pumps started by AcceptLoop, too.
    close(listen_fd_);
    for (int fd : fds_) close(fd);
  }

  int port() const { return port_; }
  void Freeze() { frozen_ = true; }

 private:
  static sockaddr_in Loopback(int port) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return address;
  }

  // Polls fd for input for up to 20 ms; true when there is some.
  static bool Readable(int fd) {
    pollfd entry{fd, POLLIN, 0};
    return poll(&entry, 1, 20) > 0;
  }

  void AcceptLoop() {
    std::vector<std::thread> pumps;
    while (!stopping_) {
      if (!Readable(listen_fd_)) continue;
      const int client = accept(listen_fd_, nullptr, nullptr);
      if (client < 0) continue;
      const int backend = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in address = Loopback(backend_port_);
      if (connect(backend, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
        close(client);
        close(backend);
        continue;
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        fds_.push_back(client);
        fds_.push_back(backend);
      }
      pumps.emplace_back([this, client, backend] { Pump(client, backend); });
      pumps.emplace_back([this, client, backend] { Pump(backend, client); });
    }
    for (std::thread& pump : pumps) pump.join();
  }

  void Pump(int from, int to) {
    char buffer[16384];
    while (!stopping_) {
      if (frozen_) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        continue;
      }
      // Frozen while it waited: leave what came in unread.
      if (!Readable(from) || frozen_) continue;
      const ssize_t n = read(from, buffer, sizeof(buffer));
      if (n <= 0) {
        shutdown(to, SHUT_WR);
        return;
      }
      for (ssize_t sent = 0; sent < n;) {
        const ssize_t m = write(to, buffer + sent, static_cast<size_t>(n - sent));
        if (m <= 0) return;
        sent += m;
      }
    }
  }

  const int backend_port_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> frozen_{false};
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::vector<int> fds_;
  std::vector<std::thread> threads_;
};

class ClientDeadlineTest : public testing::FakeServerTest {};

TEST(ClientOptionsTest, DefaultsAreFinite) {
  const ClientOptions options;
  EXPECT_EQ(options.timeout, absl::Seconds(30));
  EXPECT_EQ(options.min_bytes_per_second, 10'000'000u);
  EXPECT_EQ(options.keepalive_time, absl::Seconds(30));
  EXPECT_EQ(options.keepalive_timeout, absl::Seconds(10));
}

TEST(ClientOptionsTest, DeadlinesAndKeepaliveMustBePositive) {
  ClientOptions options;
  options.timeout = absl::ZeroDuration();
  EXPECT_EQ(Client::Create("127.0.0.1:1", options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = {};
  options.keepalive_time = absl::ZeroDuration();
  EXPECT_EQ(Client::Create("127.0.0.1:1", options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = {};
  options.keepalive_timeout = -absl::Seconds(1);
  EXPECT_EQ(Client::Create("127.0.0.1:1", options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = {};
  options.timeout = absl::InfiniteDuration();
  options.keepalive_time = absl::InfiniteDuration();
  EXPECT_TRUE(Client::Create("127.0.0.1:1", options).ok());
}

TEST_F(ClientDeadlineTest, CallThatIsNeverAnsweredFailsAtItsDeadline) {
  service_.hang_get_info();
  ClientOptions options;
  options.timeout = absl::Milliseconds(300);
  std::unique_ptr<Client> client = Connect(options);
  const absl::Time start = absl::Now();
  absl::StatusOr<ServerInfo> info = client->GetInfo();
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_EQ(info.status().code(), absl::StatusCode::kDeadlineExceeded) << info.status();
  EXPECT_GE(elapsed, absl::Milliseconds(290));
  EXPECT_LT(elapsed, absl::Seconds(2));
}

TEST_F(ClientDeadlineTest, StalledPullFailsAtTimeoutPlusItsAnnouncedBytes) {
  ClientOptions options;
  options.timeout = absl::Milliseconds(200);
  options.min_bytes_per_second = 1'000'000;
  std::unique_ptr<Client> client = Connect(options);
  const std::vector<float> values = Normal(100'000, 1);  // 400 KB: 0.4 s at 1 MB/s.
  ASSERT_TRUE(client->RegisterTensors({{"w", {100'000}, "", values}}).ok());
  service_.hang_pull_after_header();
  const absl::Time start = absl::Now();
  absl::StatusOr<PullResult> pulled = client->PullParameters({});
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_EQ(pulled.status().code(), absl::StatusCode::kDeadlineExceeded) << pulled.status();
  EXPECT_GE(elapsed, absl::Milliseconds(590));
  EXPECT_LT(elapsed, absl::Seconds(2));
}

TEST_F(ClientDeadlineTest, SlowPullWithinItsBytesAllowanceSucceeds) {
  ClientOptions options;
  options.timeout = absl::Milliseconds(200);
  options.min_bytes_per_second = 1'000'000;
  options.max_chunk_bytes = 100'000;
  std::unique_ptr<Client> client = Connect(options);
  const std::vector<float> values = Normal(250'000, 2);  // 1 MB: 1 s at 1 MB/s.
  ASSERT_TRUE(client->RegisterTensors({{"w", {250'000}, "", values}}).ok());
  service_.pull_message_delay(absl::Milliseconds(60));  // 10 chunks: 0.6 s, past the 0.2 s.
  absl::StatusOr<PullResult> pulled = client->PullParameters({});
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(pulled->tensors.at("w").values, values);
}

TEST_F(ClientDeadlineTest, KeepaliveFindsAPartitionedServer) {
  FreezableProxy proxy(port_);
  ClientOptions options;
  options.timeout = absl::InfiniteDuration();  // Only keepalive can end the call.
  options.keepalive_time = absl::Milliseconds(200);
  options.keepalive_timeout = absl::Milliseconds(200);
  std::unique_ptr<Client> client = Connect(options, proxy.port());
  ASSERT_TRUE(client->ListTensors().ok());  // Connected through the proxy.
  proxy.Freeze();
  const absl::Time start = absl::Now();
  absl::StatusOr<ServerInfo> info = client->GetInfo();
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_EQ(info.status().code(), absl::StatusCode::kUnavailable) << info.status();
  EXPECT_LT(elapsed, absl::Seconds(3));
}

}  // namespace
}  // namespace fusedps::client
