// tsan.h: happens-before edges that ThreadSanitizer cannot see for itself.
//
// Debian's gRPC (and the abseil under it) is not built with TSan, so the hand-offs gRPC makes
// between threads are invisible to it: a reactor built on one thread and called back on
// another, or a reaction that runs after an operation started elsewhere. gRPC promises those
// orders (a reaction runs after the operation that it completes; OnDone after every other
// reaction), and these macros tell TSan about them. They compile to nothing without TSan.
//
// Usage, in a reactor: FUSEDPS_HAPPENS_BEFORE(this) after construction and before each
// operation it starts (StartRead, StartWrite, Finish); FUSEDPS_HAPPENS_AFTER(this) first thing
// in each reaction (OnReadDone, OnWriteDone, OnCancel, OnDone).
#ifndef FUSEDPS_COMMON_TSAN_H_
#define FUSEDPS_COMMON_TSAN_H_

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#define FUSEDPS_HAPPENS_BEFORE(address) __tsan_release(static_cast<void*>(address))
#define FUSEDPS_HAPPENS_AFTER(address) __tsan_acquire(static_cast<void*>(address))
#else
#define FUSEDPS_HAPPENS_BEFORE(address) static_cast<void>(0)
#define FUSEDPS_HAPPENS_AFTER(address) static_cast<void>(0)
#endif

#endif  // FUSEDPS_COMMON_TSAN_H_
