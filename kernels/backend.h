// backend.h: the interface every optimizer backend (CPU, CUDA) implements.
//
// A backend owns the flat arenas of one shard (fp32 params, exp_avg, exp_avg_sq, optional
// max_exp_avg_sq, optional bf16/fp16 param copy), the per-tensor step counters, and the param
// group hyperparameters. Tensors are numbered 0..N-1 in registration order; only the newest
// ones can be removed (TruncateTensors, to undo a registration that failed). Every tensor starts
// on a 16-byte boundary in every arena.
//
// Work is queued in order ("stream order"). Step, SetParamGroup and Read return once their work
// is queued; the work they queued is done once Wait returns for a marker taken after it (Mark,
// or the marker of StepOutcome). On the CUDA backend the order is that of its apply stream, and
// a step can be queued while the previous one still runs; the CPU backend does the work inside
// the call, so its markers are done at once. Queued work reads the state it finds when it runs:
// a Read queued after a Step sees that step's results.
//
// Thread safety: one thread at a time (server/engine's) calls the methods that change or read
// the shard's state. Methods marked "Thread-safe" may be called from any thread at any time.
//
// Errors: expected ones have their own codes (RESOURCE_EXHAUSTED when memory runs out,
// INVALID_ARGUMENT, FAILED_PRECONDITION), and a call that fails with one of them changes
// nothing. INTERNAL means the device failed (a CUDA error): the shard's state can no longer be
// trusted, and the caller must stop using the backend (docs/errors.md).
//
// Usage:
//   std::unique_ptr<OptimizerBackend> backend = MakeCpuBackend(options);
//   backend->SetParamGroup(0, AdamWHyperparameters{});
//   uint32_t first = backend->AddTensors({{.numel = 1024, .param_group = 0}}).value();
//   backend->WriteParams(first, 0, values);
//   StepOutcome outcome = backend->Step(request).value();
//   WorkDone done = backend->Wait(outcome.marker).value();  // the step has run
#ifndef FUSEDPS_KERNELS_BACKEND_H_
#define FUSEDPS_KERNELS_BACKEND_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/adamw_math.h"
#include "kernels/tensor_layout.h"

namespace fusedps {

// Which stored array a read returns. Values match proto fusedps.v1.TensorField, but for the
// scales of int8 state, which never travel on the wire: the fp32 absmax of each block of
// kQuantBlock elements of exp_avg and exp_avg_sq (quant_math.h), read and written only in their
// stored form, by checkpoints.
enum class TensorField : uint8_t {
  kParam = 1,
  kExpAvg = 2,
  kExpAvgSq = 3,
  kMaxExpAvgSq = 4,
  kExpAvgAbsmax = 101,
  kExpAvgSqAbsmax = 102,
};

// "param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax":
// the fields' names as clients spell them (fusedps pull --field, Client.pull_state) and as
// checkpoints name their files.
const char* TensorFieldName(TensorField field);

// The int8 scales field of a moment: kExpAvgAbsmax for kExpAvg, kExpAvgSqAbsmax for kExpAvgSq.
TensorField ScalesField(TensorField moment);

// The stored form of a field of a tensor of `numel` elements with this layout
// (tensor_layout.h): its element size in bytes, and its element count (0: the tensor has no
// such field: scales of a tensor without int8 state; max_exp_avg_sq is counted as stored,
// whether or not its group has amsgrad).
int StoredElementBytes(TensorLayout layout, TensorField field);
uint64_t StoredCount(TensorLayout layout, TensorField field, uint64_t numel);

// The low-precision copy of the params that a backend may keep for pulls.
enum class ParamCopyDType : uint8_t { kNone = 0, kBFloat16 = 2, kFloat16 = 3 };
// "none", "bf16", "fp16": the spelling of --param-copy-dtype and of checkpoint manifests.
const char* ParamCopyDTypeName(ParamCopyDType copy);
// Its inverse. Errors: INVALID_ARGUMENT "'NAME' must be none, bf16 or fp16".
absl::StatusOr<ParamCopyDType> ParseParamCopyDType(absl::string_view name);

// CUDA backend: which kernel applies a step. kAuto picks per launch (kernels/cuda/adamw_kernel.cuh,
// RunsChunkBlocks); the others force one wherever it can apply the launch, for tests and
// benchmarks. Both give the same bits.
enum class StepKernel : uint8_t { kAuto = 0, kPersistent = 1, kChunkBlocks = 2 };

struct BackendOptions {
  ParamCopyDType param_copy_dtype = ParamCopyDType::kNone;
  int threads = 0;         // CPU backend worker threads; 0 means one per hardware thread.
  int device_ordinal = 0;  // CUDA backend: which GPU. Every call runs on it, from any thread.
  StepKernel step_kernel = StepKernel::kAuto;  // CUDA backend only.
};

struct NewTensor {
  uint64_t numel = 0;
  uint32_t param_group = 0;
  // Stochastic rounding's key of the tensor (TensorRoundingKey of its name), for groups with
  // bf16 params.
  uint64_t rounding_key = 0;
  // An embedding table's dim (>= 1, dividing numel); 0 for a dense tensor. A table with int8
  // state keeps a scale per row (tensor_layout.h).
  uint64_t table_dim = 0;
};

// The gradient rows of one embedding table in a step (docs/dev/embedding-tables.md). A dense-id
// table is a registered tensor of rows * dim elements, read as a row-major [rows, dim] matrix,
// whose group has fp32 params and state, no amsgrad and decoupled weight decay (row_sparse.h
// refuses the rest). A step updates the rows it names only, with torch.optim.SparseAdam's math
// (sparse_adam_math.h): the gradients of duplicate keys summed, one step count for the table
// (the tensor's step, advanced once per step whatever rows it names).
struct TableRows {
  uint32_t tensor = 0;
  uint64_t dim = 0;                     // >= 1, dividing the tensor's numel.
  absl::Span<const int64_t> keys = {};  // Row indices in [0, rows); duplicates are summed.
  // [keys.size(), dim] fp32, row-major (row i is keys[i]'s), host memory, unchanged until the
  // step's marker is done.
  absl::Span<const float> grads = {};
  // Rows that start over in this step (a hashed table's new rows, server/engine): when the step
  // is applied, row init_rows[i]'s params become row i of init_params ([init_rows.size(), dim]
  // fp32, host memory, unchanged until the marker is done) and its moments zero, and then the
  // step updates it as any pushed row. Each is one of keys, once. Nothing when skipped.
  absl::Span<const int64_t> init_rows = {};
  absl::Span<const float> init_params = {};
};

// A read of some rows of one field of an embedding table (TableRows' tensor and dim), as fp32:
// row keys[i] goes to dst[i * dim, (i + 1) * dim). For lookups.
struct ReadRowsRequest {
  TensorField field = TensorField::kParam;  // kParam, kExpAvg or kExpAvgSq.
  uint32_t tensor = 0;
  uint64_t dim = 0;
  absl::Span<const int64_t> keys = {};  // Row indices in [0, rows); any order, repeats allowed.
  float* dst = nullptr;                 // keys.size() * dim floats of host memory.
};

// The gradients of one push, in one dtype.
// Tensor tensors[i]'s grads are elements [grad_offsets[i], grad_offsets[i] + numel) of grads.
// grads may lie in the staging arena (AllocateStagingArena; the step then reads the arena's
// device mirror, after the copies queued by CopyStagingToDevice before the Step call), in other
// host memory (copied to the device by the step), or be nullptr: the backend's own staging,
// filled earlier by StageGrads, which checked them for finiteness.
// REQUIRES: tensors are distinct and registered; grad_offsets[i] is a multiple of 8 (16 bytes
// in any dtype) so that vector loads are legal; grads stay valid and unchanged until the step's
// marker is done.
struct StepRequest {
  absl::Span<const uint32_t> tensors;
  absl::Span<const uint64_t> grad_offsets;
  const void* grads = nullptr;
  GradDType grad_dtype = GradDType::kFloat32;
  float grad_scale = 0.0f;  // <= 0: none. Gradients are divided by it (adamw_math.h).
  // The caller already checked every gradient for non-finite values (as grads arrived); the
  // backend then uses grads_finite instead of reading them again.
  bool grads_checked = false;
  bool grads_finite = true;
  // Read the gradients from the accumulator (Accumulate's sums: fp32, laid out as the params)
  // instead of grads; grads, grad_offsets and grad_dtype are then ignored, and grad_scale is
  // the number of pushes summed, so that the step uses their mean (table_rows, the caller's
  // sums of the same pushes' rows, are divided by it too). grads_checked must be set.
  bool from_accumulator = false;
  // The step uses lr / lr_divisor of each tensor's group, computed in float64 (bounded
  // staleness scales the lr of a stale push's step by 1 / (1 + tau)). >= 1.
  double lr_divisor = 1.0;
  // Embedding tables stepped with the tensors above, in the same step: all or nothing, and a
  // non-finite value anywhere (dense or rows, after summing duplicates and dividing by
  // grad_scale) skips all of it. grad_scale and lr_divisor apply to them too.
  absl::Span<const TableRows> table_rows = {};
};

// A point in the backend's stream order: Wait(marker) returns once everything queued before it
// is done. 0 is the null marker (nothing to wait for). Each non-null marker must be waited for
// exactly once (a backend may hold resources, such as CUDA events, until then).
using Marker = uint64_t;

struct StepOutcome {
  bool skipped = false;  // A non-finite gradient: nothing queued, nothing changes, no step.
  uint32_t tensors_updated = 0;
  Marker marker = 0;  // Done once the step has run; 0 when nothing was queued.
};

// What Wait reports about the work before a marker.
struct WorkDone {
  // For a step's marker: the device time of its kernels (the CPU backend: the step's wall
  // time), and how long the device waited for the step's gradient copies once it reached the
  // step. 0 for other markers.
  double device_seconds = 0;
  double copy_wait_seconds = 0;
};

// A write of host values into one field of one tensor, for a restore from a checkpoint or a
// state load (Write).
struct WriteRequest {
  TensorField field = TensorField::kParam;
  // Write the 16-bit param copy (bf16 or fp16 bits, as param_copy_dtype()) instead of the
  // params: field must be kParam, the tensor's params fp32, and the backend must keep a copy.
  // Elements are then 2 bytes.
  bool param_copy = false;
  uint32_t tensor = 0;
  uint64_t offset = 0;  // The first element written.
  uint64_t count = 0;   // Elements.
  // count elements of host memory (on a GPU backend best page-locked: AllocateHostBuffer),
  // unchanged until a marker taken after the Write is done.
  const void* src = nullptr;
  // The values are the field's stored form (StoredElementBytes each: a checkpoint's bytes,
  // written bit for bit); else fp32, which the backend rounds or quantizes into the stored form
  // (an int8 field then takes whole blocks: offset a multiple of kQuantBlock, and count one too
  // or reaching the tensor's end). The scales (k*Absmax) are written stored only.
  bool stored = false;
};

// A read of one field of some tensors, for pulls and checkpoints.
struct ReadRequest {
  TensorField field = TensorField::kParam;
  // Read the 16-bit param copy instead of the params (field must be kParam, every tensor's
  // params fp32, and the backend must keep a copy: param_copy_dtype() != kNone). Elements are
  // then 2 bytes.
  bool param_copy = false;
  // Read the field's stored form (StoredElementBytes each, bit for bit: what checkpoints hold);
  // else fp32: bf16 widened, int8 dequantized (4 bytes each). The scales (k*Absmax) are read
  // stored only.
  bool stored = false;
  absl::Span<const uint32_t> tensors;
  // Tensor tensors[i]'s elements go to dst + dst_offsets[i] (bytes).
  absl::Span<const uint64_t> dst_offsets;
  // Host memory (on a GPU backend best page-locked, e.g. the staging arena), or a snapshot
  // buffer (AllocateSnapshot; then the offsets are into it).
  void* dst = nullptr;
  bool dst_is_snapshot = false;
  // dst is device memory of this backend's device that the caller holds (a device workspace,
  // SharedDeviceMemory): the copies are device to device, and the offsets are into dst.
  bool dst_on_device = false;
};

// Device memory that another process on this host maps (a device workspace,
// server/workspace/): `data` on this backend's device, its CUDA IPC handle (the 64 bytes of a
// cudaIpcMemHandle_t) and the device's UUID ("GPU-" and 36 characters, as nvidia-smi -L).
struct SharedDeviceMemory {
  void* data = nullptr;
  std::string ipc_handle;
  std::string device_uuid;
};

// A range of device memory (a device workspace) copied into the staging arena's device mirror
// at `offset` (bytes): CopyDeviceToStaging.
struct DeviceStagingCopy {
  const void* src = nullptr;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

// What CopyDeviceToStaging saw of the gradients it copied: whether every element was finite,
// and the largest magnitude among them, so that the caller decides for any grad_scale
// (a finite g / grad_scale overflows exactly when max_abs / grad_scale does).
struct GradCheck {
  bool finite = true;
  float max_abs = 0.0f;
};

// A staging arena (OptimizerBackend::AllocateStagingArena): page-locked host memory, and on a
// GPU backend its device mirror at the same offsets.
struct StagingArena {
  char* host = nullptr;
  void* device = nullptr;  // The mirror; null on the CPU backend.
  uint64_t bytes = 0;
};

class OptimizerBackend {
 public:
  virtual ~OptimizerBackend() = default;

  virtual std::string name() const = 0;    // "cpu" or "cuda". Thread-safe.
  virtual std::string device() const = 0;  // Human-readable device description. Thread-safe.
  virtual ParamCopyDType param_copy_dtype() const = 0;  // Thread-safe.

  // Creates (group == group count) or replaces the hyperparameters of group `group`. In stream
  // order: steps queued after this call use the new values, steps queued before the old ones.
  // Errors: INVALID_ARGUMENT when `group` would leave a gap; RESOURCE_EXHAUSTED when a group
  // with amsgrad needs the max_exp_avg_sq arena and memory runs out.
  virtual absl::Status SetParamGroup(uint32_t group, const AdamWHyperparameters& hyper) = 0;

  // Appends tensors, all or nothing, and returns the index of the first (the new tensors are
  // first .. first + tensors.size() - 1). Their params, states and steps start at zero.
  // Errors: RESOURCE_EXHAUSTED when memory runs out; INVALID_ARGUMENT for an unknown group.
  virtual absl::StatusOr<uint32_t> AddTensors(absl::Span<const NewTensor> tensors) = 0;

  // Removes tensors [count, tensor_count()): undoes AddTensors for a registration that failed.
  // REQUIRES: count <= tensor_count(), and no step or read queued since they were added names
  // them. Arena memory may stay allocated for later tensors.
  virtual absl::Status TruncateTensors(uint32_t count) = 0;

  // Writes fp32 params [offset, offset + values.size()) of a tensor (and its low-precision
  // copy), in stream order; bf16 params get them rounded to nearest even. Returns once
  // `values` may be reused.
  // REQUIRES: the range lies inside the tensor.
  virtual absl::Status WriteParams(uint32_t tensor, uint64_t offset,
                                   absl::Span<const float> values) = 0;

  // Queues a copy of host values into [offset, offset + count) of one field of a tensor (see
  // WriteRequest), for a restore or a state load, in stream order (steps queued before it read
  // the old values). Params written this way leave the param copy as it was: write the copy too
  // (param_copy), or use WriteParams.
  // Returns once `src` may be reused when the backend converted it (fp32 into a stored form of
  // another dtype), else once the copy is queued (src stays valid until a later marker).
  // Errors: INVALID_ARGUMENT for an unknown tensor, a range outside it, or an fp32 write into
  // int8 state that does not cover whole blocks; FAILED_PRECONDITION for max_exp_avg_sq of a
  // tensor whose group has no amsgrad, scales of a tensor without int8 state or not stored,
  // or param_copy without a copy or for bf16 params.
  virtual absl::Status Write(const WriteRequest& request) = 0;

  // Sets a tensor's step, for a restore or a state load, in stream order (later steps count on
  // from it).
  // Errors: INVALID_ARGUMENT for an unknown tensor or a negative step.
  virtual absl::Status SetStep(uint32_t tensor, int64_t step) = 0;

  // Queues one AdamW step (kernels/adamw_math.h) of every tensor of the request, and one
  // row-sparse step of each of its tables (TableRows), all or nothing: if any gradient is
  // non-finite (after conversion to fp32 and division by grad_scale), nothing is queued,
  // nothing changes and the outcome says skipped. Each updated tensor's and table's step
  // advances by one (step() reports it at once); tensors_updated counts both.
  // Errors (nothing queued, nothing changed): for table rows, INVALID_ARGUMENT naming the
  // field and the limit (table_rows[i].tensor unknown, named twice or also in tensors; a dim
  // that does not divide its numel; keys[j] outside [0, rows); grads not keys.size() * dim; a
  // group the row step refuses, row_sparse.h), and UNIMPLEMENTED
  // on a backend without embedding tables (both of ours have them: backend_tables.h). The CUDA
  // backend updates a step's rows in a launch of their own after the dense one
  // (kernels/cuda/table_rows_kernel.cuh): a step with tables and dense tensors is two launches.
  virtual absl::StatusOr<StepOutcome> Step(const StepRequest& request) = 0;

  // Copies some rows of one field of an embedding table into host memory (ReadRowsRequest), in
  // stream order: the data is there once a marker taken after this call is done. Errors
  // (nothing queued): INVALID_ARGUMENT naming the field and the limit (an unknown tensor, a dim
  // that does not divide its numel, a key outside [0, rows), a field other than param,
  // exp_avg and exp_avg_sq, a table not stored in fp32); UNIMPLEMENTED on a backend without
  // embedding tables (this default).
  virtual absl::Status ReadRows(const ReadRowsRequest& request) {
    (void)request;
    return absl::UnimplementedError("embedding tables on the " + name() +
                                    " backend (issue 38: the CPU backend has them)");
  }

  // Queues a sum of gradients into the accumulator, for a synchronous round: an fp32 arena laid
  // out as the params (allocated on first use, reported as "grad_accumulator"). For each tensor
  // of the request, acc = (first ? 0 : acc) + grad / grad_scale (grad_scale <= 0: none), in
  // fp32, the division as AdamWUpdate's. The grads are read as Step reads them (the staging
  // arena's mirror, or other host memory) and may be reused once the returned marker is done;
  // grads_checked/grads_finite are ignored (non-finite values are summed as they are: the
  // caller knows them and decides whether the round's step runs). A later Step with
  // from_accumulator reads the sums. One launch ("fusedps_grad_accumulate" on CUDA,
  // "cpu_grad_accumulate" on the CPU backend).
  // Errors: RESOURCE_EXHAUSTED for the accumulator's memory; INVALID_ARGUMENT for grads past
  // the staging arena. Nothing is queued on an error. REQUIRES: !request.from_accumulator.
  virtual absl::StatusOr<Marker> Accumulate(const StepRequest& request, bool first) = 0;

  // Queues a copy of one field of whole tensors (see ReadRequest), as fp32, as the param copy's
  // 16-bit values, or in the stored form. The data is there once a marker taken after this call
  // is done. A read of fp32 from a field stored in bf16 or int8 converts on the device (one
  // launch, "fusedps_state_read", on CUDA).
  // Errors: FAILED_PRECONDITION for max_exp_avg_sq of a tensor whose group has no amsgrad,
  // scales of a tensor without int8 state or not stored, or param_copy without a copy or of
  // bf16 params. Nothing is queued on an error.
  virtual absl::Status Read(const ReadRequest& request) = 0;

  // Memory for consistent reads of large pulls, in the device's own memory (host memory on the
  // CPU backend): Read into it at one point of the stream order, then copy it out piece by
  // piece with CopyFromSnapshot while later steps run. Errors: RESOURCE_EXHAUSTED.
  virtual absl::StatusOr<void*> AllocateSnapshot(uint64_t bytes) = 0;
  // Frees a snapshot after the work queued so far (in stream order).
  virtual absl::Status FreeSnapshot(void* snapshot) = 0;
  // Thread-safe. Copies [offset, offset + bytes) of a snapshot into host memory `dst` and
  // returns once copied. Never waits for queued steps. REQUIRES: the Read into the snapshot is
  // done (a marker after it was waited for), and FreeSnapshot was not called yet.
  virtual absl::Status CopyFromSnapshot(const void* snapshot, uint64_t offset, uint64_t bytes,
                                        void* dst) = 0;

  // Thread-safe. Host memory for checkpoint snapshots (a Read's dst): page-locked on a GPU
  // backend, so that the device copies into it at full speed; plain memory on the CPU backend.
  // Errors: RESOURCE_EXHAUSTED. FreeHostBuffer frees one; REQUIRES: no queued work uses it.
  virtual absl::StatusOr<void*> AllocateHostBuffer(uint64_t bytes) = 0;
  virtual void FreeHostBuffer(void* buffer) = 0;

  // Thread-safe. Makes host memory the caller allocated (a same-host workspace, a shared
  // mapping) page-locked, so that reads into it and copies out of it run at full speed;
  // nothing on the CPU backend. Errors: RESOURCE_EXHAUSTED when it cannot be locked.
  // UnregisterHostMemory undoes it; REQUIRES: no queued work uses the memory.
  virtual absl::Status RegisterHostMemory(void* data, uint64_t bytes) const {
    (void)data;
    (void)bytes;
    return absl::OkStatus();
  }
  virtual void UnregisterHostMemory(void* data) const { (void)data; }

  // Thread-safe. `bytes` bytes of zeroed device memory that another process on this host can
  // map through CUDA IPC (a device workspace). Errors: FAILED_PRECONDITION on a backend
  // without a device (the CPU backend's default); RESOURCE_EXHAUSTED when the device has no
  // room. FreeSharedDeviceMemory frees it; REQUIRES: no queued work uses it.
  virtual absl::StatusOr<SharedDeviceMemory> AllocateSharedDeviceMemory(uint64_t bytes) const {
    (void)bytes;
    return absl::FailedPreconditionError(
        absl::StrCat("the ", name(), " backend has no device memory to share"));
  }
  virtual void FreeSharedDeviceMemory(void* data) const { (void)data; }

  // Thread-safe. Copies each range of device memory (a device workspace's) into the staging
  // arena's device mirror at its offset, reading every element as `dtype` on the way, and
  // returns once the copies are done with what it saw (GradCheck). The next Step reads
  // them from the mirror as CopyStagingToDevice's. Errors: INVALID_ARGUMENT for a range outside
  // the arena, of bytes not a multiple of the dtype's size, or from an address not aligned to
  // it; FAILED_PRECONDITION on a backend
  // without a device (the default); INTERNAL when the device failed.
  virtual absl::StatusOr<GradCheck> CopyDeviceToStaging(absl::Span<const DeviceStagingCopy> copies,
                                                        GradDType dtype) {
    (void)copies;
    (void)dtype;
    return absl::FailedPreconditionError(
        absl::StrCat("the ", name(), " backend has no device to copy gradients on"));
  }

  // A marker after all the work queued so far (see Marker).
  virtual absl::StatusOr<Marker> Mark() = 0;

  // Thread-safe. Blocks until the work queued before `marker` is done (0: returns at once).
  // Errors: INTERNAL when the device failed.
  virtual absl::StatusOr<WorkDone> Wait(Marker marker) = 0;

  virtual int64_t step(uint32_t tensor) const = 0;  // Counting steps queued.
  virtual uint32_t tensor_count() const = 0;
  virtual uint64_t numel(uint32_t tensor) const = 0;
  virtual TensorLayout layout(uint32_t tensor) const = 0;

  // Copies `count` gradients of one dtype from host memory into the backend's staging at
  // byte_offset (growing it as needed), for a later Step with grads == nullptr, and checks them
  // for non-finite values (after division by grad_scale, <= 0: none): the next such Step is
  // skipped if any staged since the previous one was not finite. Stage payloads only, never
  // the padding between tensors. (Used by the kernel benchmark, which times steps alone.)
  virtual absl::Status StageGrads(uint64_t byte_offset, const void* data, uint64_t count,
                                  GradDType dtype, float grad_scale) = 0;

  // Host memory for staging pushes, `bytes` long, allocated once and owned by the backend:
  // page-locked on a GPU backend, with a device mirror at the same offsets, so that a range can
  // move to the device as soon as it is written (CopyStagingToDevice). A Step whose grads lie
  // in the arena reads them from the mirror. Errors: RESOURCE_EXHAUSTED.
  virtual absl::StatusOr<char*> AllocateStagingArena(uint64_t bytes) = 0;

  // The staging arena this backend reads from (its own, AllocateStagingArena's, or one it
  // shares), as ShareStagingArena takes it; all zero before there is one. Thread-safe.
  virtual StagingArena staging_arena() const = 0;
  // Uses `arena`, the staging arena of another backend of the same device (its
  // staging_arena()), as its own: CopyStagingToDevice copies into the arena's device mirror on
  // this backend's copy stream, and this backend's steps read their grads from there. Several
  // backends (one per model of a server) then share one pool of staging. Nothing is allocated.
  // REQUIRES: the owner outlives this backend, and the callers keep the backends' ranges
  // disjoint (the staging pool does). Errors: FAILED_PRECONDITION when this backend has an
  // arena already; INVALID_ARGUMENT for an empty arena, or one without a device mirror on a
  // GPU backend.
  virtual absl::Status ShareStagingArena(const StagingArena& arena) = 0;

  // Thread-safe. Starts copying [offset, offset + bytes) of the staging arena to its device
  // mirror: on a GPU backend asynchronously, on a copy stream that the next Step waits for;
  // elsewhere nothing.
  virtual absl::Status CopyStagingToDevice(uint64_t offset, uint64_t bytes) = 0;

  // Thread-safe. Kernel launches (CUDA) or parallel passes (CPU) so far, by kernel name,
  // counted where each is launched (the CUDA backend's launch wrapper; the CPU backend's
  // parallel pass "cpu_adamw_apply").
  virtual std::map<std::string, uint64_t> launch_counts() const = 0;
  // The sum of launch_counts(). Thread-safe.
  virtual uint64_t launches_total() const = 0;

  // Bytes allocated for each kind of memory, for metrics: "params", "exp_avg", "exp_avg_sq"
  // (each the sum of its arenas of every dtype), "max_exp_avg_sq", "state_scales" (the int8
  // state's, both), "param_copy", "grad_staging", "grad_accumulator", and on the CUDA backend
  // "tables" and "pull_snapshots" (device memory on a GPU backend, host memory on the CPU
  // backend; 0 for an arena not in use).
  virtual std::map<std::string, uint64_t> memory_bytes() const = 0;
};

// Queues `request` and waits for it: a synchronous read, for tests and tools.
absl::Status ReadNow(OptimizerBackend& backend, const ReadRequest& request);

// Queues a step and waits for it (a skipped step has nothing to wait for): for tests and tools.
absl::StatusOr<StepOutcome> StepNow(OptimizerBackend& backend, const StepRequest& request);

// Reads one field of one tensor as fp32 into `out` (numel floats) and waits for it.
absl::Status ReadTensor(OptimizerBackend& backend, TensorField field, uint32_t tensor, float* out);
// Reads one field of one tensor in its stored form into `out` (StoredCount elements of
// StoredElementBytes) and waits for it.
absl::Status ReadStored(OptimizerBackend& backend, TensorField field, uint32_t tensor, void* out);
// Reads one tensor's 16-bit param copy into `out` (numel values) and waits for it.
// FAILED_PRECONDITION when the backend keeps no copy (as Read).
absl::Status ReadParamCopy(OptimizerBackend& backend, uint32_t tensor, uint16_t* out);

// Rounds an element count up so that the next tensor starts on a 16-byte boundary in every
// arena of any element size (2 or 4 bytes).
inline uint64_t AlignedNumel(uint64_t numel) { return (numel + 7) & ~uint64_t{7}; }

std::unique_ptr<OptimizerBackend> MakeCpuBackend(const BackendOptions& options);

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_BACKEND_H_
