#include "server/service/call_watchdog.h"

#include <algorithm>
#include <chrono>
#include <utility>
#include <vector>

#include "absl/time/clock.h"

namespace fusedps {

void CallWatchdog::Handle::Arm() {
  MutexLock lock(&mu_);
  armed_ = true;
  since_ = absl::Now();
}

void CallWatchdog::Handle::Disarm() {
  MutexLock lock(&mu_);
  armed_ = false;
}

void CallWatchdog::Handle::Stop() {
  MutexLock lock(&mu_);
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
    MutexLock lock(&mu_);
    stop_ = true;
  }
  stop_cv_.SignalAll();
  if (checker_.joinable()) checker_.join();
}

std::shared_ptr<CallWatchdog::Handle> CallWatchdog::Watch(std::function<void()> on_idle) {
  auto handle = std::make_shared<Handle>(std::move(on_idle));
  if (idle_limit_ == absl::InfiniteDuration()) return handle;
  MutexLock lock(&mu_);
  handles_.push_back(handle);
  return handle;
}

void CallWatchdog::Run() {
  const absl::Duration period = std::min(absl::Seconds(1), idle_limit_ / 4);
  absl::Time next_periodic = absl::Now();
  mu_.Lock();
  while (true) {
    const auto due = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(period);
    while (!stop_ && !stop_cv_.WaitWithDeadline(&mu_, due)) {
    }
    if (stop_) break;
    std::vector<std::shared_ptr<Handle>> live;
    for (auto it = handles_.begin(); it != handles_.end();) {
      if (std::shared_ptr<Handle> handle = it->lock()) {
        live.push_back(std::move(handle));
        ++it;
      } else {
        it = handles_.erase(it);
      }
    }
    mu_.Unlock();
    const absl::Time now = absl::Now();
    if (periodic_ && now >= next_periodic) {
      periodic_();
      next_periodic = now + absl::Seconds(1);
    }
    for (const std::shared_ptr<Handle>& handle : live) {
      MutexLock handle_lock(&handle->mu_);
      if (!handle->armed_ || !handle->on_idle_ || now - handle->since_ < idle_limit_) continue;
      std::function<void()> on_idle = std::move(handle->on_idle_);
      handle->on_idle_ = nullptr;
      handle->armed_ = false;
      on_idle();  // Under the handle's lock: Stop waits for it.
    }
    live.clear();
    mu_.Lock();
  }
  mu_.Unlock();
}

}  // namespace fusedps
