// device_copy.h (CUDA builds only): the copy roof of a GPU, measured in the same run as the
// step it is compared with.
#ifndef FUSEDPS_BENCH_DEVICE_COPY_H_
#define FUSEDPS_BENCH_DEVICE_COPY_H_

#include <cstdint>

#include "absl/status/statusor.h"

namespace fusedps {

// Median milliseconds of a cudaMemcpyAsync of `bytes` from one device buffer to another on
// device `ordinal`, timed with CUDA events, after `warmup` untimed copies. The buffers are
// filled with non-zero bytes first. `queued`: the copies are queued back to back, each timed
// from the event after the previous one (no host launch latency in it); else each waits for
// the one before. Errors: INTERNAL with CUDA's message.
absl::StatusOr<double> DeviceCopyMs(int ordinal, uint64_t bytes, int warmup, int iters,
                                    bool queued);

}  // namespace fusedps

#endif  // FUSEDPS_BENCH_DEVICE_COPY_H_
