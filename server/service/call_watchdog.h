// call_watchdog.h: ends calls whose peer has gone quiet, so that a dead or stalled client cannot
// hold staging, a snapshot or a registration's turn for longer than --call-idle-seconds.
//
// A call is watched while it waits on its peer: a push or registration waiting for its next
// message, a pull waiting for the client to take the last one (gRPC flow control). It is not
// watched while it waits on the server (for staging, or for the engine). When a watched call has
// seen no progress for the idle limit, the watchdog runs its `on_idle` once. (TCP keepalive,
// set on the server, notices dead hosts; this also catches live clients that stop reading or
// writing.)
//
// Lifetimes: Watch returns a Handle shared by the call and the watchdog. `on_idle` runs on the
// watchdog's thread under the handle's lock, so that Stop() (which takes that lock) returns only
// once no `on_idle` runs or will run: a call stops its watch before it goes away. on_idle must
// not call its own handle's methods.
//
// Thread-safe.
//
// Usage:
//   std::shared_ptr<CallWatchdog::Handle> watch = watchdog.Watch([this] { TryCancel(); });
//   watch->Arm();      // waiting for the peer
//   watch->Disarm();   // waiting on the server
//   watch->Stop();     // the call is over
#ifndef FUSEDPS_SERVER_SERVICE_CALL_WATCHDOG_H_
#define FUSEDPS_SERVER_SERVICE_CALL_WATCHDOG_H_

#include <functional>
#include <list>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "common/mutex.h"

namespace fusedps {

class CallWatchdog {
 public:
  class Handle {
   public:
    explicit Handle(std::function<void()> on_idle) : on_idle_(std::move(on_idle)) {}
    // Waiting for the peer from now: idle time counts from this call.
    void Arm() ABSL_LOCKS_EXCLUDED(mu_);
    // Waiting on the server: idle time does not count.
    void Disarm() ABSL_LOCKS_EXCLUDED(mu_);
    // No on_idle from the moment this returns.
    void Stop() ABSL_LOCKS_EXCLUDED(mu_);

   private:
    friend class CallWatchdog;
    Mutex mu_;
    // Cleared by Stop and after it runs.
    std::function<void()> on_idle_ ABSL_GUARDED_BY(mu_);
    bool armed_ ABSL_GUARDED_BY(mu_) = false;
    absl::Time since_ ABSL_GUARDED_BY(mu_);  // When it was armed.
  };

  // An infinite limit watches nothing. `periodic`, when set, runs on the watchdog's thread
  // about once a second (for checks of the same kind, e.g. a staging pool whose line stalls).
  explicit CallWatchdog(absl::Duration idle_limit, std::function<void()> periodic = nullptr);
  ~CallWatchdog();
  CallWatchdog(const CallWatchdog&) = delete;
  CallWatchdog& operator=(const CallWatchdog&) = delete;

  absl::Duration idle_limit() const { return idle_limit_; }

  // A new watch, disarmed.
  std::shared_ptr<Handle> Watch(std::function<void()> on_idle) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Run() ABSL_LOCKS_EXCLUDED(mu_);

  const absl::Duration idle_limit_;
  const std::function<void()> periodic_;
  Mutex mu_;
  CondVar stop_cv_;
  std::list<std::weak_ptr<Handle>> handles_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread checker_;
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_SERVICE_CALL_WATCHDOG_H_
