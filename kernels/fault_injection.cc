#include "kernels/fault_injection.h"

#include <atomic>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/mutex.h"
#include "kernels/forwarding_backend.h"

namespace fusedps {
namespace {

class FaultInjectingBackend final : public ForwardingBackend {
 public:
  FaultInjectingBackend(std::unique_ptr<OptimizerBackend> inner, const InjectedFaults& faults)
      : ForwardingBackend(std::move(inner)), faults_(faults) {}

  absl::Status SetParamGroup(uint32_t group, const AdamWHyperparameters& hyper) override {
    if (absl::Status s = Sticky(); !s.ok()) return s;
    return ForwardingBackend::SetParamGroup(group, hyper);
  }
  absl::StatusOr<uint32_t> AddTensors(absl::Span<const NewTensor> tensors) override {
    if (absl::Status s = Sticky(); !s.ok()) return s;
    if (++add_tensors_calls_ == faults_.add_tensors) {
      return absl::ResourceExhaustedError("injected: device memory: cannot allocate");
    }
    return ForwardingBackend::AddTensors(tensors);
  }
  absl::Status TruncateTensors(uint32_t count) override {
    if (absl::Status s = Sticky(); !s.ok()) return s;
    return ForwardingBackend::TruncateTensors(count);
  }
  absl::Status WriteParams(uint32_t tensor, uint64_t offset,
                           absl::Span<const float> values) override {
    if (absl::Status s = Sticky(); !s.ok()) return s;
    return ForwardingBackend::WriteParams(tensor, offset, values);
  }
  absl::StatusOr<StepOutcome> Step(const StepRequest& request) override {
    if (absl::Status s = Sticky(); !s.ok()) return s;
    const int64_t n = ++step_calls_;
    if (n == faults_.step) return Fault("Step");
    absl::StatusOr<StepOutcome> outcome = ForwardingBackend::Step(request);
    if (outcome.ok() && n == faults_.step_wait) {
      MutexLock lock(&mu_);
      if (outcome->marker == 0) {
        absl::StatusOr<Marker> marker = inner().Mark();
        if (!marker.ok()) return marker.status();
        outcome->marker = *marker;
      }
      faulty_markers_.insert(outcome->marker);
    }
    return outcome;
  }
  absl::Status Read(const ReadRequest& request) override {
    if (absl::Status s = Sticky(); !s.ok()) return s;
    return ForwardingBackend::Read(request);
  }
  absl::Status ReadRows(const ReadRowsRequest& request) override {
    if (absl::Status s = Sticky(); !s.ok()) return s;
    return ForwardingBackend::ReadRows(request);
  }
  absl::StatusOr<void*> AllocateSnapshot(uint64_t bytes) override {
    if (absl::Status s = Sticky(); !s.ok()) return s;
    return ForwardingBackend::AllocateSnapshot(bytes);
  }
  absl::Status CopyFromSnapshot(const void* snapshot, uint64_t offset, uint64_t bytes,
                                void* dst) override {
    if (absl::Status s = Sticky(); !s.ok()) return s;
    return ForwardingBackend::CopyFromSnapshot(snapshot, offset, bytes, dst);
  }
  absl::StatusOr<Marker> Mark() override {
    if (absl::Status s = Sticky(); !s.ok()) return s;
    return ForwardingBackend::Mark();
  }
  absl::StatusOr<WorkDone> Wait(Marker marker) override {
    absl::StatusOr<WorkDone> done = ForwardingBackend::Wait(marker);
    {
      MutexLock lock(&mu_);
      if (faulty_markers_.erase(marker) > 0) return Fault("a step's kernel");
    }
    if (absl::Status s = Sticky(); !s.ok()) return s;
    return done;
  }
  absl::Status CopyStagingToDevice(uint64_t offset, uint64_t bytes) override {
    if (absl::Status s = Sticky(); !s.ok()) return s;
    return ForwardingBackend::CopyStagingToDevice(offset, bytes);
  }
  absl::StatusOr<GradCheck> CopyDeviceToStaging(absl::Span<const DeviceStagingCopy> copies,
                                                GradDType dtype) override {
    if (absl::Status s = Sticky(); !s.ok()) return s;
    return ForwardingBackend::CopyDeviceToStaging(copies, dtype);
  }

 private:
  absl::Status Fault(absl::string_view where) {
    faulted_.store(true);
    return absl::InternalError(absl::StrCat("injected device fault in ", where,
                                            ": an illegal memory access was encountered"));
  }
  absl::Status Sticky() const {
    if (!faulted_.load()) return absl::OkStatus();
    return absl::InternalError("injected: a device fault happened earlier (sticky)");
  }

  const InjectedFaults faults_;
  std::atomic<bool> faulted_{false};
  int64_t add_tensors_calls_ = 0, step_calls_ = 0;
  Mutex mu_;
  std::set<Marker> faulty_markers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<OptimizerBackend> MakeFaultInjectingBackend(std::unique_ptr<OptimizerBackend> inner,
                                                            const InjectedFaults& faults) {
  return std::make_unique<FaultInjectingBackend>(std::move(inner), faults);
}

}  // namespace fusedps
