// backend.h: the interface every optimizer backend (CPU, CUDA) implements.
//
// A backend owns the flat arenas of one shard (fp32 params, exp_avg, exp_avg_sq, optional
// max_exp_avg_sq, optional bf16/fp16 param copy), the per-tensor step counters, and the param
// group hyperparameters. Tensors are numbered 0..N-1 in registration order and never removed.
// Every tensor starts on a 16-byte boundary in every arena.
//
// Thread safety: none. The caller (server/shard_store) serializes writers and lets readers in
// only while no writer runs.
//
// Usage:
//   std::unique_ptr<OptimizerBackend> backend = MakeCpuBackend(options);
//   backend->SetParamGroup(0, AdamWHyperparameters{});
//   backend->AddTensors({{.numel = 1024, .param_group = 0}});
//   backend->WriteParams(0, 0, values);
//   StepOutcome outcome = backend->Step(request).value();
#ifndef FUSEDPS_KERNELS_BACKEND_H_
#define FUSEDPS_KERNELS_BACKEND_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/adamw_math.h"

namespace fusedps {

// Which stored array a read returns. Values match proto fusedps.v1.TensorField.
enum class TensorField : uint8_t { kParam = 1, kExpAvg = 2, kExpAvgSq = 3, kMaxExpAvgSq = 4 };

// The low-precision copy of the params that a backend may keep for pulls.
enum class ParamCopyDType : uint8_t { kNone = 0, kBFloat16 = 2, kFloat16 = 3 };

struct BackendOptions {
  ParamCopyDType param_copy_dtype = ParamCopyDType::kNone;
  int threads = 0;  // CPU backend worker threads; 0 means one per hardware thread.
  int device_ordinal = 0;  // CUDA backend: which GPU.
};

struct NewTensor {
  uint64_t numel = 0;
  uint32_t param_group = 0;
};

// The gradients of one push, in one dtype.
// Tensor tensors[i]'s grads are elements [grad_offsets[i], grad_offsets[i] + numel) of grads.
// grads == nullptr means the backend's own staging, filled earlier by StageGrads (on a GPU
// backend: device memory, so the step copies nothing); StageGrads checked those for finiteness.
// REQUIRES: tensors are distinct and registered; grad_offsets[i] is a multiple of 8 (16 bytes
// in any dtype) so that vector loads are legal.
struct StepRequest {
  absl::Span<const uint32_t> tensors;
  absl::Span<const uint64_t> grad_offsets;
  const void* grads = nullptr;
  GradDType grad_dtype = GradDType::kFloat32;
  float grad_scale = 0.0f;  // <= 0: none.
  // The caller already checked every gradient for non-finite values (as grads arrived); the
  // backend then uses grads_finite instead of reading them again.
  bool grads_checked = false;
  bool grads_finite = true;
};

struct StepOutcome {
  bool skipped = false;  // A non-finite gradient: nothing changed, no step advanced.
  uint32_t tensors_updated = 0;
};

class OptimizerBackend {
 public:
  virtual ~OptimizerBackend() = default;

  virtual std::string name() const = 0;    // "cpu" or "cuda".
  virtual std::string device() const = 0;  // Human-readable device description.
  virtual ParamCopyDType param_copy_dtype() const = 0;

  // Creates or replaces the hyperparameters of group `group` (0-based, dense).
  virtual absl::Status SetParamGroup(uint32_t group, const AdamWHyperparameters& hyper) = 0;

  // Appends tensors. Their params, states and steps start at zero.
  // Errors: RESOURCE_EXHAUSTED when memory runs out (nothing is added);
  // INVALID_ARGUMENT for an unknown group.
  virtual absl::Status AddTensors(absl::Span<const NewTensor> tensors) = 0;

  // Writes fp32 params [offset, offset + values.size()) of a tensor (and its low-precision copy).
  // REQUIRES: the range lies inside the tensor.
  virtual absl::Status WriteParams(uint32_t tensor, uint64_t offset,
                                   absl::Span<const float> values) = 0;

  // Reads `count` elements of a field of a tensor, starting at `offset`, into out as fp32
  // (4 bytes each) or bf16 (2 bytes each). A bf16 read of params is served from the bf16 copy
  // when the backend keeps one. REQUIRES: the range lies inside the tensor.
  // Errors: FAILED_PRECONDITION for max_exp_avg_sq of a tensor whose group has no amsgrad.
  virtual absl::Status Read(TensorField field, uint32_t tensor, uint64_t offset, uint64_t count,
                            GradDType dtype, void* out) const = 0;

  virtual int64_t step(uint32_t tensor) const = 0;
  virtual uint32_t tensor_count() const = 0;
  virtual uint64_t numel(uint32_t tensor) const = 0;

  // Applies one AdamW step (kernels/adamw_math.h) to every tensor of the request, all or
  // nothing: if any gradient is non-finite (after conversion to fp32), nothing changes and the
  // outcome says skipped. Each updated tensor's step advances by one.
  virtual absl::StatusOr<StepOutcome> Step(const StepRequest& request) = 0;

  // Copies `count` gradients of one dtype from host memory into the backend's staging at
  // byte_offset (growing it as needed), for a later Step with grads == nullptr, and checks them
  // for non-finite values (after division by grad_scale, <= 0: none): the next such Step is
  // skipped if any staged since the previous one was not finite. Stage payloads only, never
  // the padding between tensors.
  virtual absl::Status StageGrads(uint64_t byte_offset, const void* data, uint64_t count,
                                  GradDType dtype, float grad_scale) = 0;

  // Host memory for staging pushes, `bytes` long, allocated once and owned by the backend:
  // page-locked on a GPU backend, with a device mirror at the same offsets, so that a range can
  // move to the device as soon as it is written (CopyStagingToDevice). A Step whose grads lie
  // in the arena reads them from the mirror. Errors: RESOURCE_EXHAUSTED.
  virtual absl::StatusOr<char*> AllocateStagingArena(uint64_t bytes) = 0;

  // Starts copying [offset, offset + bytes) of the staging arena to its device mirror: on a GPU
  // backend asynchronously, on a copy stream that the next Step waits for; elsewhere nothing.
  // Thread-safe (unlike the rest of this interface).
  virtual absl::Status CopyStagingToDevice(uint64_t offset, uint64_t bytes) = 0;

  // Kernel launches (CUDA) or parallel passes (CPU) so far, for metrics.
  virtual uint64_t launches_total() const = 0;

  // The same launches by kernel name, counted where each is launched (the CUDA backend's
  // launch wrapper; the CPU backend's parallel pass "cpu_adamw_apply"). Sums to launches_total().
  virtual std::map<std::string, uint64_t> launch_counts() const = 0;

  // Bytes allocated for each arena, for metrics: "params", "exp_avg", "exp_avg_sq",
  // "max_exp_avg_sq", "param_copy", "grad_staging" (device memory on a GPU backend, host memory
  // on the CPU backend; 0 for an arena not in use).
  virtual std::map<std::string, uint64_t> memory_bytes() const = 0;

  // Seconds the device spent on the last Step's kernels, from CUDA events around them; the
  // CPU backend reports its wall time.
  virtual double last_step_device_seconds() const = 0;
};

// Rounds an element count up so that the next tensor starts on a 16-byte boundary in every
// arena of any element size (2 or 4 bytes).
inline uint64_t AlignedNumel(uint64_t numel) { return (numel + 7) & ~uint64_t{7}; }

std::unique_ptr<OptimizerBackend> MakeCpuBackend(const BackendOptions& options);

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_BACKEND_H_
