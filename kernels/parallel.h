// parallel.h: how many OpenMP threads a parallel region of the CPU code may use.
#ifndef FUSEDPS_KERNELS_PARALLEL_H_
#define FUSEDPS_KERNELS_PARALLEL_H_

#include <omp.h>

namespace fusedps {

// `requested` threads (<= 0: every hardware thread), or 1 in ThreadSanitizer builds
// (FUSEDPS_TSAN): libgomp is not built with TSan, so its barriers are invisible to it, and
// every write of a worker thread would be reported as a race with the thread that waits.
inline int OmpThreads(int requested = 0) {
#ifdef FUSEDPS_TSAN
  (void)requested;
  return 1;
#else
  return requested > 0 ? requested : omp_get_num_procs();
#endif
}

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_PARALLEL_H_
