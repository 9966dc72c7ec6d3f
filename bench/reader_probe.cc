#include "bench/reader_probe.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace fusedps {

absl::StatusOr<std::unique_ptr<ReaderProbe>> ReaderProbe::Create(const ProbeConfig& config) {
  client::ClientOptions options = config.client_options;
  options.timeout = absl::Seconds(60);
  options.wait_for_ready = true;
  absl::StatusOr<std::unique_ptr<client::Client>> client =
      client::Client::Create(config.target, options);
  if (!client.ok()) return client.status();
  std::unique_ptr<ReaderProbe> probe(new ReaderProbe(config, *std::move(client)));
  if (config.pull_bytes > 0) {
    const int64_t numel = static_cast<int64_t>(config.pull_bytes / sizeof(float));
    probe->tensor_ = absl::StrCat("fusedps-bench/probe/", config.pull_bytes);
    const std::vector<float> values(static_cast<size_t>(numel), 0.5f);
    absl::StatusOr<client::RegisterTensorsResult> registered =
        probe->client_->RegisterTensors({{probe->tensor_, {numel}, "default", values}});
    if (!registered.ok()) return registered.status();
  }
  return probe;
}

void ReaderProbe::Begin() {
  if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
}

ReaderProbe::~ReaderProbe() { Stop(); }

ProbeResult ReaderProbe::Stop() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  return result_;
}

void ReaderProbe::Run() {
  const auto ms_since = [](absl::Time start) {
    return absl::ToDoubleMilliseconds(absl::Now() - start);
  };
  while (!stop_) {
    const absl::Time round = absl::Now();
    absl::Time start = absl::Now();
    if (client_->GetInfo().ok()) {
      result_.get_info_ms.push_back(ms_since(start));
    } else {
      ++result_.errors;
    }
    if (!tensor_.empty()) {
      start = absl::Now();
      client::PullOptions pull;
      pull.tensors = {tensor_};
      if (client_->PullParameters(pull).ok()) {
        result_.pull_ms.push_back(ms_since(start));
      } else {
        ++result_.errors;
      }
    }
    absl::SleepFor(config_.interval - (absl::Now() - round));
  }
}

}  // namespace fusedps
