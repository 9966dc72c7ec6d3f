// markers.cu: markers as pooled CUDA events (markers.cuh).
#include "absl/strings/str_cat.h"
#include "common/mutex.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/markers.cuh"

namespace fusedps {
namespace gpu {

absl::StatusOr<cudaEvent_t> MarkerTable::Take() {
  {
    MutexLock lock(&mu_);
    if (!free_.empty()) {
      cudaEvent_t e = free_.back();
      free_.pop_back();
      return e;
    }
  }
  cudaEvent_t e = nullptr;  // Timing enabled: a step's events measure it.
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
  return e;
}

absl::StatusOr<StepEvents> MarkerTable::TakeStepEvents() {
  StepEvents events;
  for (cudaEvent_t* e : {&events.reached, &events.begin, &events.done}) {
    absl::StatusOr<cudaEvent_t> event = Take();
    if (!event.ok()) {
      Return(events);
      return event.status();
    }
    *e = *event;
  }
  return events;
}

void MarkerTable::Return(const StepEvents& events) {
  MutexLock lock(&mu_);
  for (cudaEvent_t e : {events.reached, events.begin, events.done}) {
    if (e != nullptr) free_.push_back(e);
  }
}

Marker MarkerTable::Add(const StepEvents& events) {
  MutexLock lock(&mu_);
  const Marker marker = ++last_marker_;
  pending_[marker] = events;
  return marker;
}

absl::StatusOr<Marker> MarkerTable::Mark(cudaStream_t stream) {
  StepEvents events;
  absl::StatusOr<cudaEvent_t> done = Take();
  if (!done.ok()) return done.status();
  events.done = *done;
  if (const cudaError_t err = cudaEventRecord(events.done, stream); err != cudaSuccess) {
    Return(events);
    return absl::InternalError(absl::StrCat("cudaEventRecord: ", cudaGetErrorString(err)));
  }
  return Add(events);
}

absl::StatusOr<WorkDone> MarkerTable::Wait(Marker marker) {
  StepEvents events;
  {
    MutexLock lock(&mu_);
    const auto it = pending_.find(marker);
    if (it == pending_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("marker ", marker, " is not pending (waited for already?)"));
    }
    events = it->second;
    pending_.erase(it);
  }
  WorkDone done;
  cudaError_t err = cudaEventSynchronize(events.done);
  if (err == cudaSuccess && events.begin != nullptr) {
    float kernel_ms = 0, wait_ms = 0;
    err = cudaEventElapsedTime(&kernel_ms, events.begin, events.done);
    if (err == cudaSuccess) err = cudaEventElapsedTime(&wait_ms, events.reached, events.begin);
    done.device_seconds = kernel_ms * 1e-3;
    done.copy_wait_seconds = wait_ms * 1e-3;
  }
  Return(events);
  if (err != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("waiting for marker ", marker, ": ", cudaGetErrorString(err)));
  }
  return done;
}

void MarkerTable::Free() {
  MutexLock lock(&mu_);
  for (const auto& marker_events : pending_) {
    const StepEvents& events = marker_events.second;
    for (cudaEvent_t e : {events.reached, events.begin, events.done}) {
      if (e != nullptr) cudaEventDestroy(e);
    }
  }
  pending_.clear();
  for (cudaEvent_t e : free_) cudaEventDestroy(e);
  free_.clear();
}

}  // namespace gpu
}  // namespace fusedps
