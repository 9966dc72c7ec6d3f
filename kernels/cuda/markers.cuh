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

#include <mutex>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
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
  absl::StatusOr<StepEvents> TakeStepEvents();
  // Gives back events that were not made a marker (a step that failed to queue).
  void Return(const StepEvents& events);
  // Makes recorded events a marker.
  Marker Add(const StepEvents& events);

  // A marker after the work queued on `stream` so far.
  absl::StatusOr<Marker> Mark(cudaStream_t stream);

  // Blocks until the marker's event is done and returns its events to the pool. For a step's
  // marker, device_seconds is begin -> done and copy_wait_seconds reached -> begin.
  // Errors: INVALID_ARGUMENT for a marker that is not pending; INTERNAL when the device failed.
  absl::StatusOr<WorkDone> Wait(Marker marker);

  // Destroys every event. REQUIRES: the device is current and the streams are drained.
  void Free();

 private:
  absl::StatusOr<cudaEvent_t> Take();

  std::mutex mu_;
  Marker last_marker_ = 0;
  std::unordered_map<Marker, StepEvents> pending_;  // Markers not waited for yet.
  std::vector<cudaEvent_t> free_;                   // The pool.
};

}  // namespace gpu
}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_CUDA_MARKERS_CUH_
