// On a GPU: fusedps_kernel_launches_total, as /metrics exports it, equals CUPTI's count of the
// kernels that ran during N real pushes over gRPC. Skips without a CUDA device.
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "fusedps/client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/backend_factory.h"
#include "kernels/cupti_kernel_counter.h"
#include "server/server.h"

namespace fusedps {
namespace {

// Sum of the values of every sample of `name` in Prometheus text.
double SampleSum(const std::string& text, const std::string& name) {
  double sum = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::StartsWith(line, name + "{") && !absl::StartsWith(line, name + " ")) continue;
    double value = 0;
    if (absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &value)) sum += value;
  }
  return sum;
}

TEST(MetricsCuptiTest, KernelLaunchMetricEqualsCuptiCount) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.device = "cuda:0";
  auto server = Server::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = client::Client::Create("127.0.0.1:" + std::to_string((*server)->port()));
  ASSERT_TRUE(client.ok()) << client.status();

  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::vector<std::pair<std::string, int>> shapes = {
      {"embedding", 50000}, {"w1", 4096}, {"b1", 7}, {"w2", 300001}};
  std::map<std::string, std::vector<float>> values;
  std::vector<client::TensorInit> specs;
  for (const auto& [name, n] : shapes) {
    values[name].resize(n);
    for (float& x : values[name]) x = normal(rng);
    specs.push_back({name, {n}, "default", values[name]});
  }
  ASSERT_TRUE((*client)->RegisterTensors(specs).ok());

  const std::string before = (*server)->metrics().ScrapeText();
  CuptiKernelCounter cupti;
  ASSERT_TRUE(cupti.Start().ok());
  constexpr int kPushes = 20;
  for (int i = 0; i < kPushes; ++i) {
    std::vector<client::TensorGrad> grads;
    for (const auto& [name, n] : shapes) {
      if (i % 2 == 1 && name == "w1") continue;  // Odd pushes cover only some tensors.
      grads.push_back({name, values[name]});
    }
    client::PushOptions push;
    push.grad_dtype = i % 3 == 0 ? client::DType::kBFloat16 : client::DType::kFloat32;
    auto result = (*client)->PushGradients(push, grads);
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_FALSE(result->step_skipped);
  }
  auto kernels = cupti.Stop();
  ASSERT_TRUE(kernels.ok()) << kernels.status();
  const std::string after = (*server)->metrics().ScrapeText();

  uint64_t cupti_total = 0;
  for (const auto& [name, count] : *kernels) cupti_total += count;
  const double metric = SampleSum(after, "fusedps_kernel_launches_total") -
                        SampleSum(before, "fusedps_kernel_launches_total");
  EXPECT_EQ(static_cast<uint64_t>(metric), cupti_total);
  EXPECT_EQ(cupti_total, static_cast<uint64_t>(kPushes));  // One launch per push.
  EXPECT_EQ(SampleSum(after, "fusedps_optimizer_steps_total") -
                SampleSum(before, "fusedps_optimizer_steps_total"),
            kPushes);
  std::printf("pushes %d, fusedps_kernel_launches_total +%.0f, CUPTI kernels %lu\n", kPushes,
              metric, static_cast<unsigned long>(cupti_total));
}

}  // namespace
}  // namespace fusedps
