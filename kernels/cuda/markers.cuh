// markers.cuh (CUDA backend only): the markers of kernels/backend.h as CUDA events. A marker is
// an event recorded in the apply stream; a step's marker also carries the events that time its
// wait for gradients and its kernel. Events come from a pool and go back to it when Wait
// returns, so a server that steps forever creates only as many as are pending at once.
//
// Usage:
//   absl::StatusOr<StepEvents> events = markers.TakeStepEvents();
//   cudaEventRecord(events->reached, stream);  ... wait for grads ...
//   cudaEventRecord(events->begin, stream);    ... launch ...
//   cudaEventRecord(events->done, stream);
//   Marker marker = markers.Add(*events);
//   absl::StatusOr<WorkDone> done = markers.Wait(marker);  // From any thread.
#ifndef FUSEDPS_KERNELS_CUDA_MARKERS_CUH_
#define FUSEDPS_KERNELS_CUDA_MARKERS_CUH_

#include <cuda_runtime.h>

#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"
#include "kernels/backend.h"

namespace fusedps {
namespace gpu {

// The events of one marker.
struct StepEvents {
  cudaEvent_t reached = nullptr;  // A step only: the stream reached it (before its grads wait).
  cudaEvent_t begin = nullptr;    // A step only: its kernel starts.
  cudaEvent_t done = nullptr;     // The marker itself; for a step, after its kernel.
};

// Thread-safe. Events are created on the calling thread's current device: the backend's.
class MarkerTable {
 public:
  MarkerTable() = default;
  MarkerTable(const MarkerTable&) = delete;
  MarkerTable& operator=(const MarkerTable&) = delete;
  ~MarkerTable() { Free(); }

  // Three events for a step. Errors: INTERNAL when CUDA cannot create one.
  absl::StatusOr<StepEvents> TakeStepEvents() ABSL_LOCKS_EXCLUDED(mu_);
  // Gives back events that were not made a marker (a step that failed to queue).
  void Return(const StepEvents& events) ABSL_LOCKS_EXCLUDED(mu_);
  // Makes recorded events a marker.
  Marker Add(const StepEvents& events) ABSL_LOCKS_EXCLUDED(mu_);

  // A marker after the work queued on `stream` so far.
  absl::StatusOr<Marker> Mark(cudaStream_t stream) ABSL_LOCKS_EXCLUDED(mu_);

  // Blocks until the marker's event is done and returns its events to the pool. For a step's
  // marker, device_seconds is begin -> done and copy_wait_seconds reached -> begin.
  // Errors: INVALID_ARGUMENT for a marker that is not pending; INTERNAL when the device failed.
  absl::StatusOr<WorkDone> Wait(Marker marker) ABSL_LOCKS_EXCLUDED(mu_);

  // Destroys every event. REQUIRES: the device is current and the streams are drained.
  void Free() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::StatusOr<cudaEvent_t> Take() ABSL_LOCKS_EXCLUDED(mu_);

  Mutex mu_;
  Marker last_marker_ ABSL_GUARDED_BY(mu_) = 0;
  // Markers not waited for yet.
  std::unordered_map<Marker, StepEvents> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<cudaEvent_t> free_ ABSL_GUARDED_BY(mu_);  // The pool.
};

}  // namespace gpu
}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_CUDA_MARKERS_CUH_
