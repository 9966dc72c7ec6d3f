#include "kernels/fault_injection.h"

#include <atomic>
#include <mutex>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fusedps {
namespace {

class FaultInjectingBackend final : public OptimizerBackend {
 public:
  FaultInjectingBackend(std::unique_ptr<OptimizerBackend> inner, const InjectedFaults& faults)
      : inner_(std::move(inner)), faults_(faults) {}

  std::string name() const override { return inner_->name(); }
  std::string device() const override { return inner_->device(); }
  ParamCopyDType param_copy_dtype() const override { return inner_->param_copy_dtype(); }

  absl::Status SetParamGroup(uint32_t group, const AdamWHyperparameters& hyper) override {
    if (absl::Status s = Sticky(); !s.ok()) return s;
    return inner_->SetParamGroup(group, hyper);
  }
  absl::StatusOr<uint32_t> AddTensors(absl::Span<const NewTensor> tensors) override {
    if (absl::Status s = Sticky(); !s.ok()) return s;
    if (++add_tensors_calls_ == faults_.add_tensors) {
      return absl::ResourceExhaustedError("injected: device memory: cannot allocate");
    }
    return inner_->AddTensors(tensors);
  }
  absl::Status TruncateTensors(uint32_t count) override {
    if (absl::Status s = Sticky(); !s.ok()) return s;
    return inner_->TruncateTensors(count);
  }
  absl::Status WriteParams(uint32_t tensor, uint64_t offset,
                           absl::Span<const float> values) override {
    if (absl::Status s = Sticky(); !s.ok()) return s;
    if (++write_params_calls_ == faults_.write_params) return Fault("WriteParams");
    return inner_->WriteParams(tensor, offset, values);
  }
  absl::StatusOr<StepOutcome> Step(const StepRequest& request) override {
    if (absl::Status s = Sticky(); !s.ok()) return s;
    const int64_t n = ++step_calls_;
    if (n == faults_.step) return Fault("Step");
    absl::StatusOr<StepOutcome> outcome = inner_->Step(request);
    if (outcome.ok() && n == faults_.step_wait) {
      std::lock_guard<std::mutex> lock(mu_);
      if (outcome->marker == 0) {
        absl::StatusOr<Marker> marker = inner_->Mark();
        if (!marker.ok()) return marker.status();
        outcome->marker = *marker;
      }
      faulty_markers_.insert(outcome->marker);
    }
    return outcome;
  }
  absl::Status Read(const ReadRequest& request) override {
    if (absl::Status s = Sticky(); !s.ok()) return s;
    if (++read_calls_ == faults_.read) return Fault("Read");
    return inner_->Read(request);
  }
  absl::StatusOr<void*> AllocateSnapshot(uint64_t bytes) override {
    if (absl::Status s = Sticky(); !s.ok()) return s;
    return inner_->AllocateSnapshot(bytes);
  }
  absl::Status FreeSnapshot(void* snapshot) override { return inner_->FreeSnapshot(snapshot); }
  absl::Status CopyFromSnapshot(const void* snapshot, uint64_t offset, uint64_t bytes,
                                void* dst) override {
    if (absl::Status s = Sticky(); !s.ok()) return s;
    return inner_->CopyFromSnapshot(snapshot, offset, bytes, dst);
  }
  absl::StatusOr<Marker> Mark() override {
    if (absl::Status s = Sticky(); !s.ok()) return s;
    return inner_->Mark();
  }
  absl::StatusOr<WorkDone> Wait(Marker marker) override {
    absl::StatusOr<WorkDone> done = inner_->Wait(marker);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (faulty_markers_.erase(marker) > 0) return Fault("a step's kernel");
    }
    if (absl::Status s = Sticky(); !s.ok()) return s;
    return done;
  }
  int64_t step(uint32_t tensor) const override { return inner_->step(tensor); }
  uint32_t tensor_count() const override { return inner_->tensor_count(); }
  uint64_t numel(uint32_t tensor) const override { return inner_->numel(tensor); }
  absl::Status StageGrads(uint64_t byte_offset, const void* data, uint64_t count,
                          GradDType dtype, float grad_scale) override {
    return inner_->StageGrads(byte_offset, data, count, dtype, grad_scale);
  }
  absl::StatusOr<char*> AllocateStagingArena(uint64_t bytes) override {
    return inner_->AllocateStagingArena(bytes);
  }
  absl::Status CopyStagingToDevice(uint64_t offset, uint64_t bytes) override {
    if (absl::Status s = Sticky(); !s.ok()) return s;
    return inner_->CopyStagingToDevice(offset, bytes);
  }
  std::map<std::string, uint64_t> launch_counts() const override {
    return inner_->launch_counts();
  }
  uint64_t launches_total() const override { return inner_->launches_total(); }
  std::map<std::string, uint64_t> memory_bytes() const override {
    return inner_->memory_bytes();
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

  const std::unique_ptr<OptimizerBackend> inner_;
  const InjectedFaults faults_;
  std::atomic<bool> faulted_{false};
  int64_t add_tensors_calls_ = 0, write_params_calls_ = 0, step_calls_ = 0, read_calls_ = 0;
  std::mutex mu_;
  std::set<Marker> faulty_markers_;  // Guarded by mu_.
};

}  // namespace

std::unique_ptr<OptimizerBackend> MakeFaultInjectingBackend(std::unique_ptr<OptimizerBackend> inner,
                                                            const InjectedFaults& faults) {
  return std::make_unique<FaultInjectingBackend>(std::move(inner), faults);
}

}  // namespace fusedps
