#include "server/service/call_watchdog.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/time/clock.h"

namespace fusedps {

void CallWatchdog::Handle::Arm() {
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = true;
  since_ = absl::Now();
}

void CallWatchdog::Handle::Disarm() {
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = false;
}

void CallWatchdog::Handle::Stop() {
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = false;
  on_idle_ = nullptr;
}

CallWatchdog::CallWatchdog(absl::Duration idle_limit, std::function<void()> periodic)
    : idle_limit_(idle_limit), periodic_(std::move(periodic)) {
  if (idle_limit_ != absl::InfiniteDuration() || periodic_) {
    checker_ = std::thread([this] { Run(); });
  }
}

CallWatchdog::~CallWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (checker_.joinable()) checker_.join();
}

std::shared_ptr<CallWatchdog::Handle> CallWatchdog::Watch(std::function<void()> on_idle) {
  auto handle = std::make_shared<Handle>(std::move(on_idle));
  if (idle_limit_ == absl::InfiniteDuration()) return handle;
  std::lock_guard<std::mutex> lock(mu_);
  handles_.push_back(handle);
  return handle;
}

void CallWatchdog::Run() {
  const absl::Duration period = std::min(absl::Seconds(1), idle_limit_ / 4);
  absl::Time next_periodic = absl::Now();
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_cv_.wait_for(lock, absl::ToChronoNanoseconds(period), [this] { return stop_; })) {
    std::vector<std::shared_ptr<Handle>> live;
    for (auto it = handles_.begin(); it != handles_.end();) {
      if (std::shared_ptr<Handle> handle = it->lock()) {
        live.push_back(std::move(handle));
        ++it;
      } else {
        it = handles_.erase(it);
      }
    }
    lock.unlock();
    const absl::Time now = absl::Now();
    if (periodic_ && now >= next_periodic) {
      periodic_();
      next_periodic = now + absl::Seconds(1);
    }
    for (const std::shared_ptr<Handle>& handle : live) {
      std::lock_guard<std::mutex> handle_lock(handle->mu_);
      if (!handle->armed_ || !handle->on_idle_ || now - handle->since_ < idle_limit_) continue;
      std::function<void()> on_idle = std::move(handle->on_idle_);
      handle->on_idle_ = nullptr;
      handle->armed_ = false;
      on_idle();  // Under the handle's lock: Stop waits for it.
    }
    live.clear();
    lock.lock();
  }
}

}  // namespace fusedps
