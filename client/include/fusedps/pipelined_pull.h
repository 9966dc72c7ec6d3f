// fusedps/pipelined_pull.h: a pull of many groups of tensors, several in flight at once, that
// the caller waits for group by group (RemoteAdamW(overlap=True) pulls a model this way and lets
// each module's forward wait only for the groups up to its own parameters).
//
// Each group is one Client::PullInto call per client (shard) that holds some of its tensors,
// writing raw wire elements into the caller's memory. Groups are started in their order, on
// `threads` threads of the pull's own, group g on stream g of each client, so the first groups
// land first. Once a group has failed, the groups not yet started are not pulled (they report
// CANCELLED naming the failed group); groups in flight finish.
//
// Usage:
//   std::vector<fusedps::client::PipelinedPull::Group> groups = ...;  // forward order
//   fusedps::client::PipelinedPull pull({client.get()}, options, std::move(groups), 8);
//   pull.WaitUpTo(0);  // the first group is in its targets' memory
//   ...
//   pull.WaitUpTo(pull.groups() - 1);  // all of it
//
// Lifetimes: the clients and every target's memory outlive the PipelinedPull; the destructor
// waits for the groups in flight (it does not cancel them) and starts no more.
// Thread safety: WaitUpTo, LandedPrefix, Version and Seconds may be called from any threads at
// once.
#ifndef FUSEDPS_CLIENT_PIPELINED_PULL_H_
#define FUSEDPS_CLIENT_PIPELINED_PULL_H_

#include <chrono>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "common/mutex.h"
#include "fusedps/client.h"

namespace fusedps::client {

class PipelinedPull {
 public:
  // One group: (index into the clients, the targets that client holds), one entry per client.
  using Group = std::vector<std::pair<int, std::vector<PullTarget>>>;

  // Starts pulling every group. options.tensors is ignored (the groups name them). threads is
  // clamped to [1, 64]. A group naming a client index out of range fails with INVALID_ARGUMENT
  // at its wait.
  PipelinedPull(std::vector<Client*> clients, PullOptions options, std::vector<Group> groups,
                int threads);
  ~PipelinedPull();

  PipelinedPull(const PipelinedPull&) = delete;
  PipelinedPull& operator=(const PipelinedPull&) = delete;

  int groups() const { return static_cast<int>(groups_.size()); }

  // Blocks until groups 0..g have landed (each written to its targets, or failed); returns the
  // first error among them, OK otherwise. g past the last group waits for all of them.
  absl::Status WaitUpTo(int g) ABSL_LOCKS_EXCLUDED(mu_);

  // The number of leading groups that have landed (0..groups()), without waiting.
  int LandedPrefix() ABSL_LOCKS_EXCLUDED(mu_);

  // The highest version any landed group read from client `c` (0 before one has).
  uint64_t Version(int c) ABSL_LOCKS_EXCLUDED(mu_);

  // Seconds from the start to the last group that has landed so far (0 before one has).
  double Seconds() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Run() ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status PullGroup(int g) ABSL_LOCKS_EXCLUDED(mu_);

  const std::vector<Client*> clients_;
  const PullOptions options_;
  const std::vector<Group> groups_;
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();

  Mutex mu_;
  CondVar landed_cv_;
  int next_ ABSL_GUARDED_BY(mu_) = 0;    // The next group a thread starts.
  int prefix_ ABSL_GUARDED_BY(mu_) = 0;  // Groups [0, prefix_) have landed.
  std::vector<bool> landed_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Status> status_ ABSL_GUARDED_BY(mu_);
  int failed_ ABSL_GUARDED_BY(mu_) = -1;  // The first group that failed.
  std::vector<uint64_t> versions_ ABSL_GUARDED_BY(mu_);
  double seconds_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> threads_;  // Last: they start once everything above is made.
};

}  // namespace fusedps::client

#endif  // FUSEDPS_CLIENT_PIPELINED_PULL_H_
