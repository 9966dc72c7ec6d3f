#include "server/metrics/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/metrics/metrics_test_util.h"

namespace fusedps {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// The contract of DESIGN.md "Metrics" and docs/metrics.md, with each name's type.
constexpr std::pair<const char*, const char*> kContract[] = {
    {"fusedps_push_requests_total", "counter"},
    {"fusedps_push_bytes_total", "counter"},
    {"fusedps_push_duration_seconds", "histogram"},
    {"fusedps_stage_duration_seconds", "histogram"},
    {"fusedps_push_ingest_seconds", "histogram"},
    {"fusedps_staging_pool_capacity_bytes", "gauge"},
    {"fusedps_staging_pool_in_use_bytes", "gauge"},
    {"fusedps_staging_pool_waiters", "gauge"},
    {"fusedps_kernel_launches_total", "counter"},
    {"fusedps_optimizer_steps_total", "counter"},
    {"fusedps_optimizer_steps_skipped_total", "counter"},
    {"fusedps_pull_requests_total", "counter"},
    {"fusedps_pull_bytes_total", "counter"},
    {"fusedps_parameters", "gauge"},
    {"fusedps_device_memory_bytes", "gauge"},
    {"fusedps_model_version", "gauge"},
    {"fusedps_model_memory_bytes", "gauge"},
    {"fusedps_models", "gauge"},
    {"fusedps_build_info", "gauge"},
    {"fusedps_table_rows", "gauge"},
    {"fusedps_table_pushed_keys_total", "counter"},
    {"fusedps_table_lookup_keys_total", "counter"},
};

class MetricsTest : public ::testing::Test {
 protected:
  MetricsTest() : metrics_({"1.2.3", "cpu", "cpu (2 threads)"}, [this] { return shard_.values; }) {}

  struct {
    ShardMetrics values;
  } shard_;  // What the shard reports on the next scrape.
  Metrics metrics_;
};

TEST_F(MetricsTest, ExportsEveryContractNameWithItsType) {
  // Families without a series are not exported; the shard gives these theirs.
  shard_.values = {
      {{"default", 0, 0, 0, {{"words", 0}}}}, {{"cpu_adamw_apply", 0}}, {{"params", 0}}};
  const std::string text = metrics_.ScrapeText();
  for (const auto& [name, type] : kContract) {
    EXPECT_THAT(text, HasSubstr(absl::StrCat("# TYPE ", name, " ", type, "\n"))) << name;
    EXPECT_THAT(text, HasSubstr(absl::StrCat("# HELP ", name, " "))) << name;
  }
  EXPECT_EQ(
      Sample(text,
             R"x(fusedps_build_info{backend="cpu",device="cpu (2 threads)",version="1.2.3"})x"),
      1);
}

TEST_F(MetricsTest, SeriesThatAlertsReadStartAtZero) {
  shard_.values.models = {{"default", 0, 0, 0, {}}};
  const std::string text = metrics_.ScrapeText();
  EXPECT_EQ(Sample(text, R"(fusedps_push_requests_total{code="OK"})"), 0);
  EXPECT_EQ(Sample(text, R"(fusedps_pull_requests_total{code="OK"})"), 0);
  EXPECT_EQ(Sample(text, R"(fusedps_optimizer_steps_skipped_total{model="default",)"
                         R"(reason="non_finite_grad"})"),
            0);
  for (const char* stage : {"receive", "h2d", "apply", "ack"}) {
    EXPECT_EQ(Sample(text, absl::StrCat(R"(fusedps_stage_duration_seconds_count{stage=")", stage,
                                        R"("})")),
              0);
  }
}

TEST_F(MetricsTest, BucketsResolveAKernelAndASlowPush) {
  const std::vector<double>& b = Metrics::DurationBuckets();
  ASSERT_FALSE(b.empty());
  EXPECT_DOUBLE_EQ(b.front(), 50e-6);
  EXPECT_DOUBLE_EQ(b.back(), 10);
  for (size_t i = 1; i < b.size(); ++i) {
    EXPECT_GT(b[i], b[i - 1]);
    EXPECT_LE(b[i] / b[i - 1], 2.5 + 1e-9) << "a gap wider than 2.5x at " << b[i];
  }
  // A 100 µs kernel and a 1 s push each sit exactly on a boundary (the SLO threshold is 1 s).
  EXPECT_NE(std::find(b.begin(), b.end(), 100e-6), b.end());
  EXPECT_NE(std::find(b.begin(), b.end(), 1.0), b.end());
}

TEST_F(MetricsTest, SuccessfulPushObservesEveryStageAndTheirSum) {
  metrics_.RecordPush(grpc::StatusCode::OK, 4096, {0.002, 0.0001, 0.0005, 0.00005, 0.0015});
  const std::string text = metrics_.ScrapeText();
  EXPECT_EQ(Sample(text, R"(fusedps_push_requests_total{code="OK"})"), 1);
  EXPECT_EQ(Sample(text, "fusedps_push_bytes_total"), 4096);
  EXPECT_EQ(Sample(text, "fusedps_push_duration_seconds_count"), 1);
  EXPECT_NEAR(Sample(text, "fusedps_push_duration_seconds_sum"), 0.00265, 1e-12);
  EXPECT_EQ(Sample(text, R"(fusedps_push_duration_seconds_bucket{le="0.0025"})"), 0);
  EXPECT_EQ(Sample(text, R"(fusedps_push_duration_seconds_bucket{le="0.005"})"), 1);
  EXPECT_EQ(Sample(text, R"(fusedps_stage_duration_seconds_bucket{stage="h2d",le="0.0001"})"), 1);
  EXPECT_EQ(Sample(text, R"(fusedps_stage_duration_seconds_bucket{stage="h2d",le="5e-05"})"), 0);
  EXPECT_EQ(Sample(text, R"(fusedps_stage_duration_seconds_count{stage="ack"})"), 1);
  EXPECT_EQ(Sample(text, "fusedps_push_ingest_seconds_count"), 1);
  EXPECT_NEAR(Sample(text, "fusedps_push_ingest_seconds_sum"), 0.0015, 1e-12);
  EXPECT_NEAR(Sample(text, R"(fusedps_stage_duration_seconds_sum{stage="receive"})"), 0.002, 1e-12);
}

TEST_F(MetricsTest, FailedPushCountsItsCodeAndBytesButNoDuration) {
  metrics_.RecordPush(grpc::StatusCode::INVALID_ARGUMENT, 100, {});
  metrics_.RecordPush(grpc::StatusCode::NOT_FOUND, 0, {});
  const std::string text = metrics_.ScrapeText();
  EXPECT_EQ(Sample(text, R"(fusedps_push_requests_total{code="INVALID_ARGUMENT"})"), 1);
  EXPECT_EQ(Sample(text, R"(fusedps_push_requests_total{code="NOT_FOUND"})"), 1);
  EXPECT_EQ(Sample(text, R"(fusedps_push_requests_total{code="OK"})"), 0);
  EXPECT_EQ(Sample(text, "fusedps_push_bytes_total"), 100);
  EXPECT_EQ(Sample(text, "fusedps_push_duration_seconds_count"), 0);
}

TEST_F(MetricsTest, StepsAndPulls) {
  metrics_.RecordStep("default", false, "");
  metrics_.RecordStep("default", false, "");
  metrics_.RecordStep("default", true, "non_finite_grad");
  metrics_.RecordPull(grpc::StatusCode::OK, 1 << 20);
  metrics_.RecordPull(grpc::StatusCode::CANCELLED, 16);
  const std::string text = metrics_.ScrapeText();
  EXPECT_EQ(Sample(text, R"(fusedps_optimizer_steps_total{model="default"})"), 2);
  EXPECT_EQ(Sample(text, R"(fusedps_optimizer_steps_skipped_total{model="default",)"
                         R"(reason="non_finite_grad"})"),
            1);
  EXPECT_EQ(Sample(text, R"(fusedps_pull_requests_total{code="OK"})"), 1);
  EXPECT_EQ(Sample(text, R"(fusedps_pull_requests_total{code="CANCELLED"})"), 1);
  EXPECT_EQ(Sample(text, "fusedps_pull_bytes_total"), (1 << 20) + 16);
}

TEST_F(MetricsTest, ShardValuesAreReadOnEachScrape) {
  shard_.values = {{{"default", 1000, 7, 8000, {}}, {"job-b", 10, 3, 80, {}}},
                   {{"fusedps_adamw_apply", 5}},
                   {{"params", 4000}, {"exp_avg", 4000}}};
  std::string text = metrics_.ScrapeText();
  EXPECT_EQ(Sample(text, R"(fusedps_parameters{model="default"})"), 1000);
  EXPECT_EQ(Sample(text, R"(fusedps_model_version{model="default"})"), 7);
  EXPECT_EQ(Sample(text, R"(fusedps_model_memory_bytes{model="default"})"), 8000);
  EXPECT_EQ(Sample(text, R"(fusedps_parameters{model="job-b"})"), 10);
  EXPECT_EQ(Sample(text, R"(fusedps_model_version{model="job-b"})"), 3);
  EXPECT_EQ(Sample(text, "fusedps_models"), 2);
  EXPECT_EQ(Sample(text, R"(fusedps_kernel_launches_total{kernel="fusedps_adamw_apply"})"), 5);
  EXPECT_EQ(Sample(text, R"(fusedps_device_memory_bytes{kind="params"})"), 4000);
  EXPECT_EQ(Sample(text, "fusedps_staging_pool_capacity_bytes"), 0);

  shard_.values.staging_capacity_bytes = 1 << 30;
  shard_.values.staging_in_use_bytes = 4096;
  shard_.values.staging_waiters = 2;
  text = metrics_.ScrapeText();
  EXPECT_EQ(Sample(text, "fusedps_staging_pool_capacity_bytes"), 1 << 30);
  EXPECT_EQ(Sample(text, "fusedps_staging_pool_in_use_bytes"), 4096);
  EXPECT_EQ(Sample(text, "fusedps_staging_pool_waiters"), 2);

  shard_.values.kernel_launches["fusedps_adamw_apply"] = 12;
  shard_.values.models[0].version = 8;
  shard_.values.models.pop_back();  // job-b deleted: its series go.
  text = metrics_.ScrapeText();
  EXPECT_EQ(Sample(text, R"(fusedps_kernel_launches_total{kernel="fusedps_adamw_apply"})"), 12);
  EXPECT_EQ(Sample(text, R"(fusedps_model_version{model="default"})"), 8);
  EXPECT_THAT(text, Not(HasSubstr(R"(model="job-b")")));
  EXPECT_EQ(Sample(text, "fusedps_models"), 1);
  // Scraping again adds nothing: the counter follows the backend's count, it does not sum it.
  text = metrics_.ScrapeText();
  EXPECT_EQ(Sample(text, R"(fusedps_kernel_launches_total{kernel="fusedps_adamw_apply"})"), 12);
}

TEST_F(MetricsTest, TablesRowsPushesAndLookupsByModelAndTable) {
  shard_.values.models = {{"default", 5000, 2, 40000, {{"words", 1000}, {"tags", 50}}},
                          {"job-b", 800, 1, 6400, {{"words", 100}}}};
  std::string text = metrics_.ScrapeText();
  EXPECT_EQ(Sample(text, R"(fusedps_table_rows{model="default",table="words"})"), 1000);
  EXPECT_EQ(Sample(text, R"(fusedps_table_rows{model="default",table="tags"})"), 50);
  EXPECT_EQ(Sample(text, R"(fusedps_table_rows{model="job-b",table="words"})"), 100);
  // The counters exist from the first scrape, at zero (rate() needs their start).
  EXPECT_EQ(Sample(text, R"(fusedps_table_pushed_keys_total{model="job-b",table="words"})"), 0);
  EXPECT_EQ(Sample(text, R"(fusedps_table_lookup_keys_total{model="default",table="tags"})"), 0);

  EXPECT_EQ(Sample(text, R"(fusedps_table_evictions_total{model="default",table="words"})"), 0);
  EXPECT_EQ(Sample(text, R"(fusedps_table_lookup_misses_total{model="job-b",table="words"})"), 0);

  metrics_.RecordTablePush("default", "words", 64, 5);
  metrics_.RecordTablePush("default", "words", 3, 2);
  metrics_.RecordTableLookup("default", "words", 40, 9);
  metrics_.RecordTableLookup("job-b", "words", 7, 0);
  text = metrics_.ScrapeText();
  EXPECT_EQ(Sample(text, R"(fusedps_table_evictions_total{model="default",table="words"})"), 7);
  EXPECT_EQ(Sample(text, R"(fusedps_table_lookup_misses_total{model="default",table="words"})"), 9);
  EXPECT_EQ(Sample(text, R"(fusedps_table_lookup_misses_total{model="job-b",table="words"})"), 0);
  EXPECT_EQ(Sample(text, R"(fusedps_table_pushed_keys_total{model="default",table="words"})"), 67);
  EXPECT_EQ(Sample(text, R"(fusedps_table_lookup_keys_total{model="default",table="words"})"), 40);
  EXPECT_EQ(Sample(text, R"(fusedps_table_lookup_keys_total{model="job-b",table="words"})"), 7);
  EXPECT_EQ(Sample(text, R"(fusedps_table_pushed_keys_total{model="job-b",table="words"})"), 0);

  shard_.values.models.pop_back();  // job-b deleted: its tables' series go.
  text = metrics_.ScrapeText();
  EXPECT_THAT(text, Not(HasSubstr(R"(model="job-b")")));
  EXPECT_EQ(Sample(text, R"(fusedps_table_rows{model="default",table="words"})"), 1000);
}

TEST(StatusCodeNameTest, SpellsGrpcCodes) {
  EXPECT_EQ(StatusCodeName(grpc::StatusCode::OK), "OK");
  EXPECT_EQ(StatusCodeName(grpc::StatusCode::INVALID_ARGUMENT), "INVALID_ARGUMENT");
  EXPECT_EQ(StatusCodeName(grpc::StatusCode::RESOURCE_EXHAUSTED), "RESOURCE_EXHAUSTED");
  EXPECT_EQ(StatusCodeName(grpc::StatusCode::UNAUTHENTICATED), "UNAUTHENTICATED");
  EXPECT_EQ(StatusCodeName(static_cast<grpc::StatusCode>(99)), "UNKNOWN");
}

// GET http://127.0.0.1:port/path; returns the whole response (headers and body).
std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &address.sin_addr);
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0) {
    const std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;) response.append(buffer, n);
    }
  }
  close(fd);
  return response;
}

TEST_F(MetricsTest, ServesMetricsOverHttpOnAPortOfItsOwn) {
  EXPECT_EQ(metrics_.port(), 0);
  ASSERT_TRUE(metrics_.Serve("127.0.0.1:0").ok());
  ASSERT_GT(metrics_.port(), 0);
  metrics_.RecordStep("default", false, "");
  const std::string response = HttpGet(metrics_.port(), "/metrics");
  EXPECT_THAT(response, HasSubstr(" 200 "));
  EXPECT_THAT(response, HasSubstr("\nfusedps_optimizer_steps_total{model=\"default\"} 1\n"));
  EXPECT_EQ(metrics_.Serve("127.0.0.1:0").code(), absl::StatusCode::kFailedPrecondition);

  // A second endpoint on the same port cannot bind.
  Metrics other({"1.2.3", "cpu", "cpu"}, [] { return ShardMetrics{}; });
  const absl::Status taken = other.Serve(absl::StrCat("127.0.0.1:", metrics_.port()));
  EXPECT_EQ(taken.code(), absl::StatusCode::kUnavailable) << taken;
}

}  // namespace
}  // namespace fusedps
