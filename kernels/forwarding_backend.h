// forwarding_backend.h: an OptimizerBackend that forwards every call to another one, for
// decorators that change a few calls (fault injection, tests' hooks) and keep the rest.
#ifndef FUSEDPS_KERNELS_FORWARDING_BACKEND_H_
#define FUSEDPS_KERNELS_FORWARDING_BACKEND_H_

#include <map>
#include <memory>
#include <string>
#include <utility>

#include "kernels/backend.h"

namespace fusedps {

class ForwardingBackend : public OptimizerBackend {
 public:
  // REQUIRES: inner != nullptr.
  explicit ForwardingBackend(std::unique_ptr<OptimizerBackend> inner) : inner_(std::move(inner)) {}

  std::string name() const override { return inner_->name(); }
  std::string device() const override { return inner_->device(); }
  ParamCopyDType param_copy_dtype() const override { return inner_->param_copy_dtype(); }
  absl::Status SetParamGroup(uint32_t group, const AdamWHyperparameters& hyper) override {
    return inner_->SetParamGroup(group, hyper);
  }
  absl::StatusOr<uint32_t> AddTensors(absl::Span<const NewTensor> tensors) override {
    return inner_->AddTensors(tensors);
  }
  absl::Status TruncateTensors(uint32_t count) override { return inner_->TruncateTensors(count); }
  absl::Status WriteParams(uint32_t tensor, uint64_t offset,
                           absl::Span<const float> values) override {
    return inner_->WriteParams(tensor, offset, values);
  }
  absl::Status Write(const WriteRequest& request) override { return inner_->Write(request); }
  absl::Status SetStep(uint32_t tensor, int64_t step) override {
    return inner_->SetStep(tensor, step);
  }
  absl::StatusOr<void*> AllocateHostBuffer(uint64_t bytes) override {
    return inner_->AllocateHostBuffer(bytes);
  }
  void FreeHostBuffer(void* buffer) override { inner_->FreeHostBuffer(buffer); }
  absl::StatusOr<StepOutcome> Step(const StepRequest& request) override {
    return inner_->Step(request);
  }
  absl::StatusOr<Marker> Accumulate(const StepRequest& request, bool first) override {
    return inner_->Accumulate(request, first);
  }
  absl::Status Read(const ReadRequest& request) override { return inner_->Read(request); }
  absl::Status ReadRows(const ReadRowsRequest& request) override {
    return inner_->ReadRows(request);
  }
  absl::StatusOr<void*> AllocateSnapshot(uint64_t bytes) override {
    return inner_->AllocateSnapshot(bytes);
  }
  absl::Status FreeSnapshot(void* snapshot) override { return inner_->FreeSnapshot(snapshot); }
  absl::Status CopyFromSnapshot(const void* snapshot, uint64_t offset, uint64_t bytes,
                                void* dst) override {
    return inner_->CopyFromSnapshot(snapshot, offset, bytes, dst);
  }
  absl::StatusOr<Marker> Mark() override { return inner_->Mark(); }
  absl::StatusOr<WorkDone> Wait(Marker marker) override { return inner_->Wait(marker); }
  int64_t step(uint32_t tensor) const override { return inner_->step(tensor); }
  uint32_t tensor_count() const override { return inner_->tensor_count(); }
  uint64_t numel(uint32_t tensor) const override { return inner_->numel(tensor); }
  TensorLayout layout(uint32_t tensor) const override { return inner_->layout(tensor); }
  absl::Status StageGrads(uint64_t byte_offset, const void* data, uint64_t count, GradDType dtype,
                          float grad_scale) override {
    return inner_->StageGrads(byte_offset, data, count, dtype, grad_scale);
  }
  absl::StatusOr<char*> AllocateStagingArena(uint64_t bytes) override {
    return inner_->AllocateStagingArena(bytes);
  }
  StagingArena staging_arena() const override { return inner_->staging_arena(); }
  absl::Status ShareStagingArena(const StagingArena& arena) override {
    return inner_->ShareStagingArena(arena);
  }
  absl::Status CopyStagingToDevice(uint64_t offset, uint64_t bytes) override {
    return inner_->CopyStagingToDevice(offset, bytes);
  }
  absl::StatusOr<SharedDeviceMemory> AllocateSharedDeviceMemory(uint64_t bytes) const override {
    return inner_->AllocateSharedDeviceMemory(bytes);
  }
  void FreeSharedDeviceMemory(void* data) const override { inner_->FreeSharedDeviceMemory(data); }
  absl::StatusOr<GradCheck> CopyDeviceToStaging(absl::Span<const DeviceStagingCopy> copies,
                                                GradDType dtype) override {
    return inner_->CopyDeviceToStaging(copies, dtype);
  }
  std::map<std::string, uint64_t> launch_counts() const override { return inner_->launch_counts(); }
  uint64_t launches_total() const override { return inner_->launches_total(); }
  std::map<std::string, uint64_t> memory_bytes() const override { return inner_->memory_bytes(); }

 protected:
  OptimizerBackend& inner() { return *inner_; }

 private:
  const std::unique_ptr<OptimizerBackend> inner_;
};

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_FORWARDING_BACKEND_H_
