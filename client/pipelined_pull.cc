// PipelinedPull (fusedps/pipelined_pull.h): groups of PullInto calls on a few threads.
#include "fusedps/pipelined_pull.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"

namespace fusedps::client {

PipelinedPull::PipelinedPull(std::vector<Client*> clients, PullOptions options,
                             std::vector<Group> groups, int threads)
    : clients_(std::move(clients)),
      options_(std::move(options)),
      groups_(std::move(groups)),
      landed_(groups_.size(), false),
      status_(groups_.size()),
      versions_(clients_.size(), 0) {
  const int n = std::clamp(threads, 1, 64);
  threads_.reserve(n);
  for (int i = 0; i < n && i < static_cast<int>(groups_.size()); ++i)
    threads_.emplace_back([this] { Run(); });
}

PipelinedPull::~PipelinedPull() {
  for (std::thread& t : threads_) t.join();
}

void PipelinedPull::Run() {
  for (;;) {
    int g;
    absl::Status status;
    {
      MutexLock lock(&mu_);
      if (next_ >= groups()) return;
      g = next_++;
      if (failed_ >= 0) {
        status = absl::CancelledError(absl::StrCat("pull group ", g, " not pulled: group ", failed_,
                                                   " failed: ", status_[failed_].message()));
      }
    }
    if (status.ok()) status = PullGroup(g);
    MutexLock lock(&mu_);
    if (!status.ok()) {
      status_[g] = std::move(status);
      if (failed_ < 0) failed_ = g;
    }
    landed_[g] = true;
    seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    while (prefix_ < groups() && landed_[prefix_]) ++prefix_;
    landed_cv_.SignalAll();
  }
}

absl::Status PipelinedPull::PullGroup(int g) {
  for (const auto& [c, targets] : groups_[g]) {
    if (c < 0 || c >= static_cast<int>(clients_.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("pull group ", g, " names client ", c, " of ", clients_.size()));
    }
    if (targets.empty()) continue;
    absl::StatusOr<PullIntoResult> pulled = clients_[c]->PullInto(options_, targets, g);
    if (!pulled.ok()) return pulled.status();
    MutexLock lock(&mu_);
    versions_[c] = std::max(versions_[c], pulled->version);
  }
  return absl::OkStatus();
}

absl::Status PipelinedPull::WaitUpTo(int g) {
  const int upto = std::min(g, groups() - 1);
  MutexLock lock(&mu_);
  while (prefix_ <= upto) landed_cv_.Wait(&mu_);
  for (int i = 0; i <= upto; ++i) {
    if (!status_[i].ok()) return status_[i];
  }
  return absl::OkStatus();
}

int PipelinedPull::LandedPrefix() {
  MutexLock lock(&mu_);
  return prefix_;
}

double PipelinedPull::Seconds() {
  MutexLock lock(&mu_);
  return seconds_;
}

uint64_t PipelinedPull::Version(int c) {
  MutexLock lock(&mu_);
  return c >= 0 && c < static_cast<int>(versions_.size()) ? versions_[c] : 0;
}

}  // namespace fusedps::client
