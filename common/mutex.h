// mutex.h: the mutexes, scoped locks and condition variable of our code. They are the standard
// library's (std::mutex, std::shared_mutex, std::condition_variable) under absl::Mutex's
// interface and with Abseil's thread-safety annotations, so that clang's -Wthread-safety
// (scripts/check_thread_safety.sh, .ci/run's stage threads) checks every member marked
// ABSL_GUARDED_BY against the locks its readers and writers hold.
//
// Not absl::Mutex itself: Debian's abseil is not built with ThreadSanitizer, which then cannot
// see absl::Mutex's happens-before edges and reports every access it guards as a race
// (docs/architecture.md); TSan sees the standard library's mutexes through pthreads. With an
// abseil built for TSan, these names can become aliases of absl's.
//
// Usage:
//   class Counter {
//    public:
//     void Add() ABSL_LOCKS_EXCLUDED(mu_) {
//       MutexLock lock(&mu_);
//       ++count_;
//       changed_.SignalAll();
//     }
//     void WaitFor(int n) ABSL_LOCKS_EXCLUDED(mu_) {
//       MutexLock lock(&mu_);
//       while (count_ < n) changed_.Wait(&mu_);
//     }
//    private:
//     Mutex mu_;
//     CondVar changed_;
//     int count_ ABSL_GUARDED_BY(mu_) = 0;
//   };
#ifndef FUSEDPS_COMMON_MUTEX_H_
#define FUSEDPS_COMMON_MUTEX_H_

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <shared_mutex>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"

namespace fusedps {

// An exclusive lock: std::mutex.
class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  // Takes the lock if it is free; true when it did.
  bool TryLock() ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true) { return mu_.try_lock(); }

 private:
  friend class CondVar;
  std::mutex mu_;
};

// A lock that readers share and a writer holds alone: std::shared_mutex.
class ABSL_LOCKABLE SharedMutex {
 public:
  SharedMutex() = default;
  SharedMutex(const SharedMutex&) = delete;
  SharedMutex& operator=(const SharedMutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  void ReaderLock() ABSL_SHARED_LOCK_FUNCTION() { mu_.lock_shared(); }
  void ReaderUnlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock_shared(); }

 private:
  std::shared_mutex mu_;
};

// Holds `mu` from construction to destruction.
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// A MutexLock that can let go early: Release() unlocks, and the destructor then does nothing.
class ABSL_SCOPED_LOCKABLE ReleasableMutexLock {
 public:
  explicit ReleasableMutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) {
    mu_->Lock();
  }
  ~ReleasableMutexLock() ABSL_UNLOCK_FUNCTION() {
    if (mu_ != nullptr) mu_->Unlock();
  }
  ReleasableMutexLock(const ReleasableMutexLock&) = delete;
  ReleasableMutexLock& operator=(const ReleasableMutexLock&) = delete;

  // REQUIRES: not released yet.
  void Release() ABSL_UNLOCK_FUNCTION() {
    mu_->Unlock();
    mu_ = nullptr;
  }

 private:
  Mutex* mu_;
};

// Holds `mu` shared from construction to destruction.
class ABSL_SCOPED_LOCKABLE ReaderMutexLock {
 public:
  explicit ReaderMutexLock(SharedMutex* mu) ABSL_SHARED_LOCK_FUNCTION(mu) : mu_(mu) {
    mu_->ReaderLock();
  }
  ~ReaderMutexLock() ABSL_UNLOCK_FUNCTION() { mu_->ReaderUnlock(); }
  ReaderMutexLock(const ReaderMutexLock&) = delete;
  ReaderMutexLock& operator=(const ReaderMutexLock&) = delete;

 private:
  SharedMutex* const mu_;
};

// Holds `mu` exclusively from construction to destruction.
class ABSL_SCOPED_LOCKABLE WriterMutexLock {
 public:
  explicit WriterMutexLock(SharedMutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) {
    mu_->Lock();
  }
  ~WriterMutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  WriterMutexLock(const WriterMutexLock&) = delete;
  WriterMutexLock& operator=(const WriterMutexLock&) = delete;

 private:
  SharedMutex* const mu_;
};

// A condition variable over a Mutex: std::condition_variable. Each wait unlocks `mu`, sleeps
// until signalled (or spuriously woken, or timed out) and locks `mu` again before it returns,
// so callers wait in a loop on their condition.
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  void Wait(Mutex* mu) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();  // `mu` stays locked: the caller's lock owns it.
  }
  // Waits at most `timeout`, measured on the steady clock. True when the time ran out.
  bool WaitWithTimeout(Mutex* mu, absl::Duration timeout) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const bool timed_out =
        cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout)) == std::cv_status::timeout;
    lock.release();
    return timed_out;
  }
  // Waits until `deadline` at most, on the system clock (absl::Time's). True when it passed.
  bool WaitWithDeadline(Mutex* mu, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return WaitUntil(mu, absl::ToChronoTime(deadline));
  }
  // Waits until `deadline` at most, on the steady clock: for a bound that loops of waits share
  // and that a change of the system's time must not move. True when it passed.
  bool WaitWithDeadline(Mutex* mu, std::chrono::steady_clock::time_point deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return WaitUntil(mu, deadline);
  }

  void Signal() { cv_.notify_one(); }     // Wakes one waiter, if any.
  void SignalAll() { cv_.notify_all(); }  // Wakes every waiter.

 private:
  template <typename TimePoint>
  bool WaitUntil(Mutex* mu, TimePoint deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const bool timed_out = cv_.wait_until(lock, deadline) == std::cv_status::timeout;
    lock.release();
    return timed_out;
  }

  std::condition_variable cv_;
};

}  // namespace fusedps

#endif  // FUSEDPS_COMMON_MUTEX_H_
