// Shared by the client's tests (client_test.cc, client_deadline_test.cc): a fixture that serves
// the fake ParameterService (client/fake_parameter_service.h) on 127.0.0.1 for each test, and
// reproducible random values.
#ifndef FUSEDPS_CLIENT_CLIENT_TEST_UTIL_H_
#define FUSEDPS_CLIENT_CLIENT_TEST_UTIL_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/fake_parameter_service.h"
#include "client/wire.h"
#include "fusedps/client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace fusedps::client::testing {

// The fake on a free loopback port, accepting messages as large as the real server does and
// keepalive pings as often as the deadline tests send them (as fusedps-server does).
class FakeServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    builder.SetMaxReceiveMessageSize(static_cast<int>(internal::kMaxMessageBytes));
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_NE(port_, 0);
  }
  void TearDown() override {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }

  // A client of the fake (or of `port`, e.g. a proxy in front of it).
  std::unique_ptr<Client> Connect(const ClientOptions& options = {}, int port = 0) {
    return Client::Create(absl::StrCat("127.0.0.1:", port == 0 ? port_ : port), options).value();
  }

  FakeParameterService service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

// n values drawn from normal(0, 1), the same for the same seed.
inline std::vector<float> Normal(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(n);
  for (float& v : values) v = normal(rng);
  return values;
}

}  // namespace fusedps::client::testing

#endif  // FUSEDPS_CLIENT_CLIENT_TEST_UTIL_H_
