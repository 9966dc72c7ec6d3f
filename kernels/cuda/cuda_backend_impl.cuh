// cuda_backend_impl.cuh (CUDA backend only): the class of the CUDA backend (kernels/backend.h),
// CudaBackend, for the three files that define its methods: cuda_backend.cu (construction,
// registration, allocation), cuda_backend_step.cu (steps, accumulation, grad staging, markers)
// and cuda_backend_io.cu (writes, reads, snapshots). Callers get one from MakeBackend
// (backend_factory.h, through MakeCudaBackend in cuda_backend.cu) and see only OptimizerBackend.
//
// Streams. Everything that reads or changes the shard (steps, param writes, reads, table
// uploads, snapshot allocation) is queued on one apply stream, in call order: that is the
// backend's stream order. CopyStagingToDevice queues on a copy stream that the next Step waits
// for on the device (cudaStreamWaitEvent), and CopyFromSnapshot copies on a snapshot stream of
// its own, so it never waits for queued steps.
//
// No host round trip on a step's path: Step queues its chunk list upload (a partial push), its
// gradient copy or the wait for the copy stream, its kernel and three events, and returns;
// Wait(marker) blocks on the event after the kernel. The host waits for the device only on
// rare paths: a buffer that must grow (registration, a larger push than any before:
// GrowBuffers), WriteParams and StageGrads (which return once their source may be reused),
// and an upload ring that wraps onto a copy still queued.
//
// Storage: typed arenas (device_arenas.cuh; tensor_table.h says where each tensor lies). A
// read of fp32 from bf16 or int8 storage converts on the device (StateRead, one launch per
// Read); a write of fp32 into them converts on the host (stored_values.h) and uploads the
// stored form.
//
// What queued work reads stays valid until it is done:
// - device buffers are freed only once the apply stream has drained (GrowBuffers), and a buffer
//   that a queued kernel reads is rewritten only by work queued after it on the same stream;
// - a partial push's chunk list and the group table are uploaded from page-locked ring slots
//   (PinnedRing), each refilled only once the event after its copy has completed; their device
//   copies are single buffers, rewritten in stream order, so a queued step keeps reading its
//   own chunk list and hyperparameters while the next ones wait behind it;
// - AddTensors uploads its host tables from pageable memory, which cudaMemcpyAsync has read
//   before it returns (CUDA's API synchronization behavior: pageable host-to-device copies are
//   staged at once);
// - the caller keeps a step's grads and a read's destination valid until their marker is done
//   (backend.h).
//
// Threads. The CUDA runtime's current device is per thread, so every method that calls CUDA
// starts with UseDevice(device_ordinal) (cuda_check.h): registration, steps, waits and staging
// copies each act on this backend's GPU whichever thread calls them. The thread-safe methods
// share only the marker table and the snapshot store (markers.cuh, snapshots.cuh), the launch
// counter, each with its own mutex, and buffer sizes (atomics).
#ifndef FUSEDPS_KERNELS_CUDA_CUDA_BACKEND_IMPL_CUH_
#define FUSEDPS_KERNELS_CUDA_CUDA_BACKEND_IMPL_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/backend_tables.h"
#include "kernels/cuda/adamw_kernel.cuh"
#include "kernels/cuda/device_arenas.cuh"
#include "kernels/cuda/device_memory.cuh"
#include "kernels/cuda/device_staging.cuh"
#include "kernels/cuda/full_push_list.cuh"
#include "kernels/cuda/markers.cuh"
#include "kernels/cuda/snapshots.cuh"
#include "kernels/cuda/table_rows_kernel.cuh"
#include "kernels/tensor_table.h"

namespace fusedps {
namespace gpu {

class CudaBackend final : public OptimizerBackend {
 public:
  explicit CudaBackend(const BackendOptions& options) : options_(options) {}
  ~CudaBackend() override;

  std::string name() const override { return "cuda"; }
  std::string device() const override { return device_name_; }
  ParamCopyDType param_copy_dtype() const override { return options_.param_copy_dtype; }
  int64_t step(uint32_t tensor) const override { return table_.step(tensor); }
  uint32_t tensor_count() const override { return table_.size(); }
  uint64_t numel(uint32_t tensor) const override { return table_.numel(tensor); }
  TensorLayout layout(uint32_t tensor) const override { return table_.layout(tensor); }
  uint64_t launches_total() const override { return launches_.total(); }
  std::map<std::string, uint64_t> launch_counts() const override { return launches_.counts(); }
  StagingArena staging_arena() const override { return {arena_, arena_device_, arena_bytes_}; }

  // cuda_backend.cu: construction, registration, host memory, the staging arena, metrics.
  absl::Status Init();
  absl::Status SetParamGroup(uint32_t group, const AdamWHyperparameters& hyper) override;
  absl::StatusOr<uint32_t> AddTensors(absl::Span<const NewTensor> tensors) override;
  absl::Status TruncateTensors(uint32_t count) override;
  absl::StatusOr<void*> AllocateHostBuffer(uint64_t bytes) override;
  void FreeHostBuffer(void* buffer) override;
  absl::Status RegisterHostMemory(void* data, uint64_t bytes) const override;
  void UnregisterHostMemory(void* data) const override;
  absl::StatusOr<SharedDeviceMemory> AllocateSharedDeviceMemory(uint64_t bytes) const override;
  void FreeSharedDeviceMemory(void* data) const override;
  absl::StatusOr<char*> AllocateStagingArena(uint64_t bytes) override;
  absl::Status ShareStagingArena(const StagingArena& arena) override;
  // Reads only atomics (DeviceBuffer::bytes) and the snapshot store (its own mutex): safe while
  // the engine thread grows buffers.
  std::map<std::string, uint64_t> memory_bytes() const override;

  // cuda_backend_step.cu: steps, accumulation, grad staging, markers.
  absl::StatusOr<StepOutcome> Step(const StepRequest& request) override;
  absl::StatusOr<Marker> Accumulate(const StepRequest& request, bool first) override;
  absl::Status CopyStagingToDevice(uint64_t offset, uint64_t bytes) override;
  absl::StatusOr<GradCheck> CopyDeviceToStaging(absl::Span<const DeviceStagingCopy> copies,
                                                GradDType dtype) override;
  absl::Status StageGrads(uint64_t byte_offset, const void* data, uint64_t count, GradDType dtype,
                          float grad_scale) override;
  absl::StatusOr<Marker> Mark() override;
  absl::StatusOr<WorkDone> Wait(Marker marker) override;

  // cuda_backend_io.cu: writes, reads, snapshots.
  absl::Status WriteParams(uint32_t tensor, uint64_t offset,
                           absl::Span<const float> values) override;
  absl::Status Write(const WriteRequest& request) override;
  absl::Status SetStep(uint32_t tensor, int64_t step) override;
  absl::Status Read(const ReadRequest& request) override;
  absl::StatusOr<void*> AllocateSnapshot(uint64_t bytes) override;
  absl::Status FreeSnapshot(void* snapshot) override;
  absl::Status CopyFromSnapshot(const void* snapshot, uint64_t offset, uint64_t bytes,
                                void* dst) override;
  // A lookup: the rows gathered on the device (LaunchTableRowsGather), then copied into dst.
  absl::Status ReadRows(const ReadRowsRequest& request) override;

 private:
  // Where a step's (or an accumulation's) grads come from, once checked (CheckGrads).
  struct GradSource {
    bool in_arena = false;    // The staging arena (its mirror on the device).
    uint64_t grad_bytes = 0;  // The bytes the kernel reads: never past a tensor's last element.
  };
  // The chunk list a launch walks, with its units of work: the resident full list, or a
  // partial one (push_chunks_host_, push_units_host_) to upload from `slot` (PrepareChunks;
  // QueueChunks).
  struct ChunkList {
    bool full = true;
    uint32_t count = 0;
    uint32_t blocks = 0;
    UnitPlan plan;  // Its portions: the list's.
    LaunchStorage storage;
    PinnedRing::Slot* slot = nullptr;
  };
  // Where a launch's chunk list and units are on the device.
  struct DeviceList {
    const Chunk* chunks = nullptr;
    const UnitStart* units = nullptr;
  };

  // Checks where the grads lie and makes room for a copy from other host memory.
  absl::StatusOr<GradSource> CheckGrads(const StepRequest& request);

  // The resident list for a full push, else a partial list built in push_chunks_host_ (with
  // its units), with a slot to upload it from. From the accumulator, each tensor's
  // grads are at its canonical offset.
  absl::StatusOr<ChunkList> PrepareChunks(const StepRequest& request);

  // Queues the upload of a partial list; returns the device list the launch walks.
  absl::StatusOr<DeviceList> QueueChunks(const ChunkList& list);

  bool HasCopy() const { return options_.param_copy_dtype != ParamCopyDType::kNone; }

  TensorRows Rows() { return {&step_dev_, &remaining_, &portions_of_dev_}; }

  // A Read of fp32 from bf16 or int8 storage (every tensor of it through StateRead): into the
  // snapshot directly, or into the scratch buffer and then, in one copy, into host memory.
  absl::Status ReadConverted(const ReadRequest& request, uint64_t end, cudaMemcpyKind kind);
  // The 256 fp32 values of an int8 map in the device's codebooks: exp_avg's (signed) or
  // exp_avg_sq's.
  const float* CodebookValues(bool signed_map) const;

  // Queues the wait for (or the copy of) the grads; returns where the kernel reads them.
  absl::StatusOr<const void*> QueueGrads(const StepRequest& request, const GradSource& source);

  // Queues a checked step, one launch for all of it: its chunk list, events.reached, the wait
  // for (or the copy of) its grads, the upload of its tables' rows (QueueTableRows),
  // events.begin, the launch, and events.done. The launch is AdamWApply with the rows, or, for
  // tables alone that RunsAlone, the tables' own kernel. list.count may be 0 (a step of tables
  // only), and so may rows.
  absl::Status Queue(const StepRequest& request, const ChunkList& list, const GradSource& source,
                     const StepEvents& events, const std::vector<PreparedTableRows>& rows);

  // Grows the buffers a step's table rows are uploaded into (before anything of the step is
  // queued: growing waits for the apply stream).
  absl::Status ReserveTableRows(const std::vector<PreparedTableRows>& rows);
  // Queues the upload of prepared table rows (from pageable memory, read before this returns)
  // and of their tables' lists; returns the RowStep the step's launch updates them with.
  absl::StatusOr<RowStep> QueueTableRows(const std::vector<PreparedTableRows>& rows);

  // Grows a buffer of a step's path to hold n elements, by half again at least, so that a
  // series of growing pushes (or a push staged tensor by tensor) makes few host waits.
  template <typename T>
  absl::Status Reserve(DeviceArray<T>& array, uint64_t n) {
    if (array.capacity() >= n) return absl::OkStatus();
    return GrowBuffers({array.ToHold(std::max(n, array.capacity() + array.capacity() / 2))},
                       stream_);
  }

  // Every tensor in order, with its grads at its arena offset (always so from the accumulator).
  bool IsFullPush(const StepRequest& request) const;

  std::vector<DeviceBuffer*> AllBuffers();

  const BackendOptions options_;
  std::string device_name_;
  int apply_grid_ = 0;
  int sm_count_ = 0;  // The device's SMs (Init).
  LaunchCounter launches_;
  cudaStream_t stream_ = nullptr;       // The apply stream: the backend's stream order.
  cudaStream_t copy_stream_ = nullptr;  // CopyStagingToDevice's copies.

  // The staging arena (page-locked) and its device mirror, filled by CopyStagingToDevice on
  // copy_stream_; a step waits for the copies queued before it through copies_done_.
  // Set once, before the backend is shared between threads: by AllocateStagingArena (owned:
  // arena_mirror_ holds the mirror) or ShareStagingArena (another backend's; arena_mirror_
  // stays empty).
  char* arena_ = nullptr;
  uint64_t arena_bytes_ = 0;
  char* arena_device_ = nullptr;  // The mirror.
  bool owns_arena_ = false;
  DeviceArray<uint4> arena_mirror_;
  cudaEvent_t copies_done_ = nullptr;
  // CopyDeviceToStaging's pass (on copy_stream_, into the mirror).
  DeviceStagingCopier device_copier_;

  // StageGrads' staging (also where a step's grads from other host memory land).
  DeviceArray<uint4> grads_;
  uint64_t staged_bytes_ = 0;
  bool staged_non_finite_ = false;

  // Host tables (the engine thread's).
  TensorTable table_;
  // The lists of every tensor without packs: their chunks and portions (registration grows
  // the buffers for them).
  uint64_t unpacked_chunks_ = 0, unpacked_portions_ = 0;
  FullPushList full_;  // Its device buffers too.
  std::vector<Chunk> push_chunks_host_;
  std::vector<UnitStart> push_units_host_;
  PinnedRing chunk_ring_, hyper_ring_;  // Upload sources of partial chunk lists and groups.

  // Device memory.
  DeviceArenaSet arenas_;
  DeviceArray<float> accumulator_;  // Accumulate's sums, laid out canonically.
  DeviceArray<int64_t> step_dev_;
  DeviceArray<AdamWHyperparameters> hyper_;
  DeviceArray<uint32_t> remaining_, portions_of_dev_;
  DeviceArray<Chunk> push_chunks_, read_chunks_;
  DeviceArray<UnitStart> push_units_;
  DeviceArray<float> read_scratch_;  // fp32 reads of converted storage into host memory.
  DeviceArray<Int8Codebooks> codebooks_;
  DeviceArray<uint32_t> work_;  // DeviceArenas::work.
  // The last step's (or lookup's) table rows: the tables, the keys, the gradient rows. Rewritten
  // only by work queued after the launch that reads them.
  DeviceArray<RowTable> row_tables_;
  DeviceArray<int64_t> row_keys_;
  DeviceArray<float> row_grads_;
  // Rows that start over (a hashed table's new rows): per pushed row, its init row or -1, and
  // the init rows' params; only for tables that have some.
  DeviceArray<int32_t> row_init_of_row_;
  DeviceArray<float> row_init_params_;

  // Thread-safe, each with its own mutex.
  MarkerTable markers_;
  SnapshotStore snapshots_;
};

}  // namespace gpu
}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_CUDA_CUDA_BACKEND_IMPL_CUH_
