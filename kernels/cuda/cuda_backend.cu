// cuda_backend.cu: the CUDA backend (kernels/backend.h): the device arenas and resident tables
// of one shard, the streams and events that order its work, the staging mirror and the pull
// snapshots. The step's kernels and their launcher are in adamw_kernel.cu and
// adamw_chunk_blocks.cu; the full push's chunk list and its packs of small tensors in
// full_push_list.cuh.
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
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/cuda/adamw_kernel.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_arenas.cuh"
#include "kernels/cuda/device_memory.cuh"
#include "kernels/cuda/full_push_list.cuh"
#include "kernels/cuda/markers.cuh"
#include "kernels/cuda/snapshots.cuh"
#include "kernels/grad_check.h"
#include "kernels/stored_values.h"
#include "kernels/tensor_table.h"

namespace fusedps {
namespace gpu {
namespace {

// Slots of each upload ring: uploads that may be queued before the host waits for the oldest.
constexpr int kUploadSlots = 4;

// cudaHostAlloc: RESOURCE_EXHAUSTED ("<what> of N bytes") when memory runs out, else INTERNAL.
absl::StatusOr<void*> HostAlloc(uint64_t bytes, const char* what) {
  void* memory = nullptr;
  if (const cudaError_t err = cudaHostAlloc(&memory, bytes, cudaHostAllocDefault);
      err != cudaSuccess) {
    cudaGetLastError();
    if (err != cudaErrorMemoryAllocation) {
      return absl::InternalError(absl::StrCat("cudaHostAlloc: ", cudaGetErrorString(err)));
    }
    return absl::ResourceExhaustedError(absl::StrCat(what, " of ", bytes, " bytes"));
  }
  return memory;
}

class CudaBackend final : public OptimizerBackend {
 public:
  explicit CudaBackend(const BackendOptions& options) : options_(options) {}

  ~CudaBackend() override {
    // Free with this backend's device current, whatever thread destroys it.
    if (UseDevice(options_.device_ordinal) != cudaSuccess) return;
    for (cudaStream_t s : {stream_, copy_stream_}) {
      if (s != nullptr) cudaStreamSynchronize(s);
    }
    snapshots_.Free(stream_);
    markers_.Free();
    if (copies_done_ != nullptr) cudaEventDestroy(copies_done_);
    for (DeviceBuffer* b : AllBuffers()) b->Free();
    for (DeviceBuffer* b : arenas_.Buffers()) b->Free();
    chunk_ring_.Free();
    hyper_ring_.Free();
    if (owns_arena_) cudaFreeHost(arena_);
    for (cudaStream_t s : {stream_, copy_stream_}) {
      if (s != nullptr) cudaStreamDestroy(s);
    }
  }

  absl::Status Init() {
    FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
    cudaDeviceProp prop;
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, options_.device_ordinal));
    device_name_ = absl::StrCat("cuda:", options_.device_ordinal, " ", prop.name, " (",
                                prop.multiProcessorCount, " SMs)");
    absl::StatusOr<int> grid = AdamWApplyGrid();
    if (!grid.ok()) return grid.status();
    apply_grid_ = *grid;
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
    if (absl::Status s = snapshots_.Init(); !s.ok()) return s;
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&copies_done_, cudaEventDisableTiming));
    if (absl::Status s = chunk_ring_.Init(kUploadSlots); !s.ok()) return s;
    if (absl::Status s = hyper_ring_.Init(kUploadSlots); !s.ok()) return s;
    // The int8 codebooks, once (pageable: staged before cudaMemcpyAsync returns).
    // The launches' work counters start at zero (GrowBuffers' new bytes are).
    if (absl::Status s = GrowBuffers({codebooks_.ToHold(1), work_.ToHold(1)}, stream_); !s.ok()) {
      return s;
    }
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(codebooks_.data(), &DynamicCodebooks(),
                                                 sizeof(Int8Codebooks), cudaMemcpyHostToDevice,
                                                 stream_));
    return absl::OkStatus();
  }

  std::string name() const override { return "cuda"; }
  std::string device() const override { return device_name_; }
  ParamCopyDType param_copy_dtype() const override { return options_.param_copy_dtype; }

  absl::Status SetParamGroup(uint32_t group, const AdamWHyperparameters& hyper) override {
    FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
    if (absl::Status s = table_.CheckGroup(group, hyper); !s.ok()) return s;
    std::vector<AdamWHyperparameters> groups = table_.groups();
    if (group == groups.size()) {
      groups.push_back(hyper);
    } else {
      groups[group] = hyper;
    }
    // Everything that can fail comes before the host table changes.
    std::vector<BufferGrowth> growths = {hyper_.ToHold(groups.size())};
    if (hyper.amsgrad) {
      std::vector<BufferGrowth> arenas = arenas_.ToHold(table_.sizes(), true, HasCopy());
      growths.insert(growths.end(), arenas.begin(), arenas.end());
    }
    if (absl::Status s = GrowBuffers(growths, stream_); !s.ok()) return s;
    const uint64_t bytes = groups.size() * sizeof(AdamWHyperparameters);
    absl::StatusOr<PinnedRing::Slot*> slot = hyper_ring_.Acquire(bytes);
    if (!slot.ok()) return slot.status();
    std::memcpy((*slot)->host, groups.data(), bytes);
    // In stream order: steps queued before read the old table, steps queued after the new one.
    FUSEDPS_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(hyper_.data(), (*slot)->host, bytes, cudaMemcpyHostToDevice, stream_));
    if (absl::Status s = hyper_ring_.Release(*slot, stream_); !s.ok()) return s;
    return table_.SetGroup(group, hyper);
  }

  absl::StatusOr<uint32_t> AddTensors(absl::Span<const NewTensor> tensors) override {
    FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
    absl::StatusOr<ArenaSizes> sizes = table_.ArenaSizesWith(tensors);
    if (!sizes.ok()) return sizes.status();
    const uint32_t first = table_.size();
    if (tensors.empty()) return first;
    const uint64_t count = first + tensors.size();
    // The list without packs bounds any packed one (full_push_list.cuh).
    uint64_t chunk_count = unpacked_chunks_;
    uint64_t portion_count = unpacked_portions_;
    std::vector<uint32_t> portions;  // The new tensors'.
    for (const NewTensor& t : tensors) {
      portions.push_back(PortionsOfTensor(t.numel));
      chunk_count += ChunksOfTensor(t.numel);
      portion_count += portions.back();
    }
    if (chunk_count >= kMaxChunks) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the shard would have ", chunk_count, " chunks of ", kChunkNumel,
                       " elements; the kernel's tables hold fewer than ", kMaxChunks));
    }
    std::vector<BufferGrowth> growths = arenas_.ToHold(*sizes, table_.any_amsgrad(), HasCopy());
    for (BufferGrowth g : full_.ToHold(count, chunk_count, portion_count, apply_grid_, Rows())) {
      growths.push_back(g);
    }
    // RESOURCE_EXHAUSTED here leaves every buffer and table as it was.
    if (absl::Status s = GrowBuffers(growths, stream_); !s.ok()) return s;
    table_.Append(tensors);
    full_.MarkStale();  // Before anything below can fail: the list no longer matches the table.
    unpacked_chunks_ = chunk_count;
    unpacked_portions_ = portion_count;
    // The new tensors' rows of the device tables. Their arena ranges are zero already (fresh
    // memory, or zeroed by TruncateTensors), but a truncated tensor may have left a step.
    const std::vector<int64_t> zero_steps(tensors.size(), 0);
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(step_dev_.data() + first, zero_steps.data(),
                                                 tensors.size() * sizeof(int64_t),
                                                 cudaMemcpyHostToDevice, stream_));
    for (uint32_t* table : {remaining_.data(), portions_of_dev_.data()}) {
      FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(table + first, portions.data(),
                                                   portions.size() * sizeof(uint32_t),
                                                   cudaMemcpyHostToDevice, stream_));
    }
    return first;
  }

  absl::Status TruncateTensors(uint32_t count) override {
    if (count > table_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot truncate ", table_.size(), " tensors to ", count));
    }
    if (count == table_.size()) return absl::OkStatus();
    FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
    table_.Truncate(count);
    full_.MarkStale();  // Before anything below can fail: the list no longer matches the table.
    unpacked_chunks_ = unpacked_portions_ = 0;
    for (uint32_t t = 0; t < count; ++t) {
      unpacked_chunks_ += ChunksOfTensor(table_.numel(t));
      unpacked_portions_ += PortionsOfTensor(table_.numel(t));
    }
    // Zero what the removed tensors held, after the work queued so far, so that tensors added
    // later start from zero.
    return arenas_.ZeroFrom(table_.sizes(), stream_);
  }

  absl::Status WriteParams(uint32_t tensor, uint64_t offset,
                           absl::Span<const float> values) override {
    if (values.empty()) return absl::OkStatus();
    FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
    const uint64_t at = table_.param_offset(tensor) + offset;
    const DeviceArenas a = arenas_.KernelView();
    std::vector<uint16_t> half;
    if (table_.layout(tensor).params == ParamsDType::kBFloat16) {
      half.resize(values.size());
      for (size_t i = 0; i < values.size(); ++i) half[i] = FloatToBFloat16(values[i]);
      FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(a.params16 + at, half.data(),
                                                   half.size() * sizeof(uint16_t),
                                                   cudaMemcpyHostToDevice, stream_));
    } else {
      FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(a.params32 + at, values.data(),
                                                   values.size() * sizeof(float),
                                                   cudaMemcpyHostToDevice, stream_));
      if (HasCopy()) {
        half.resize(values.size());
        for (size_t i = 0; i < values.size(); ++i) {
          half[i] = options_.param_copy_dtype == ParamCopyDType::kBFloat16
                        ? FloatToBFloat16(values[i])
                        : FloatToFloat16(values[i]);
        }
        FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(a.copy + at, half.data(),
                                                     half.size() * sizeof(uint16_t),
                                                     cudaMemcpyHostToDevice, stream_));
      }
    }
    // Registration is rare: wait, so that `values` (page-locked or not) may be reused.
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  absl::Status Write(const WriteRequest& request) override {
    if (absl::Status s = table_.CheckWrite(request, options_.param_copy_dtype); !s.ok()) return s;
    if (request.count == 0) return absl::OkStatus();
    FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
    if (request.param_copy) {
      uint16_t* dst =
          arenas_.KernelView().copy + table_.param_offset(request.tensor) + request.offset;
      FUSEDPS_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(dst, request.src, request.count * 2, cudaMemcpyHostToDevice, stream_));
      return absl::OkStatus();
    }
    const StoredField field = table_.FieldOf(arenas_.Pointers(), request.field, request.tensor);
    char* dst = field.data + request.offset * field.element_bytes;
    if (request.stored || field.element_bytes == 4) {
      // The caller keeps src until a later marker (backend.h).
      FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
          dst, request.src, request.count * field.element_bytes, cudaMemcpyHostToDevice, stream_));
      return absl::OkStatus();
    }
    // fp32 into bf16 or int8: converted here (whole blocks for int8: CheckWrite), then uploaded
    // from pageable memory, which cudaMemcpyAsync has read before it returns.
    const TensorLayout layout = table_.layout(request.tensor);
    std::vector<char> stored(request.count * field.element_bytes);
    std::vector<float> scales(QuantBlocks(request.count));
    FloatToStored(layout, request.field, static_cast<const float*>(request.src), 0, request.count,
                  stored.data(), scales.data());
    FUSEDPS_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, stored.data(), stored.size(), cudaMemcpyHostToDevice, stream_));
    if (layout.state == StateDType::kInt8 && request.field != TensorField::kParam) {
      const TensorField scale_field = request.field == TensorField::kExpAvg
                                          ? TensorField::kExpAvgAbsmax
                                          : TensorField::kExpAvgSqAbsmax;
      char* scales_dst = table_.FieldOf(arenas_.Pointers(), scale_field, request.tensor).data +
                         request.offset / kQuantBlock * sizeof(float);
      FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(scales_dst, scales.data(),
                                                   scales.size() * sizeof(float),
                                                   cudaMemcpyHostToDevice, stream_));
    }
    return absl::OkStatus();
  }

  absl::Status SetStep(uint32_t tensor, int64_t step) override {
    if (absl::Status s = table_.CheckStep(tensor, step); !s.ok()) return s;
    FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
    // From pageable memory: staged before cudaMemcpyAsync returns (see the top of this file).
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(step_dev_.data() + tensor, &step, sizeof(int64_t),
                                                 cudaMemcpyHostToDevice, stream_));
    table_.SetStep(tensor, step);
    full_.MarkStale();  // Its pack's steps, or its neighbours', may differ or agree now.
    return absl::OkStatus();
  }

  absl::StatusOr<void*> AllocateHostBuffer(uint64_t bytes) override {
    FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
    return HostAlloc(std::max<uint64_t>(bytes, 1), "page-locked host buffer");
  }

  void FreeHostBuffer(void* buffer) override {
    if (UseDevice(options_.device_ordinal) == cudaSuccess) cudaFreeHost(buffer);
  }

  absl::Status RegisterHostMemory(void* data, uint64_t bytes) const override {
    FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
    if (cudaError_t e = cudaHostRegister(data, bytes, cudaHostRegisterPortable); e != cudaSuccess) {
      cudaGetLastError();  // Not sticky: clear it.
      return absl::ResourceExhaustedError(absl::StrCat(
          "cannot page-lock ", bytes, " bytes of host memory: ", cudaGetErrorString(e)));
    }
    return absl::OkStatus();
  }

  void UnregisterHostMemory(void* data) const override {
    if (UseDevice(options_.device_ordinal) == cudaSuccess) cudaHostUnregister(data);
  }

  absl::StatusOr<StepOutcome> Step(const StepRequest& request) override {
    FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
    // First everything that can fail with an expected error, so that such a failure changes
    // nothing; then the finiteness check; then the queueing.
    if (request.from_accumulator && accumulator_.capacity() < table_.arena_numel()) {
      return absl::FailedPreconditionError("a step from the accumulator before Accumulate");
    }
    absl::StatusOr<GradSource> source = CheckGrads(request);
    if (!source.ok()) return source.status();
    absl::StatusOr<ChunkList> chunks = PrepareChunks(request);
    if (!chunks.ok()) return chunks.status();
    const bool finite = StepGradsFinite(request, &staged_non_finite_,
                                        [this](uint32_t t) { return table_.numel(t); });
    if (!finite) return StepOutcome{true, 0, 0};  // Nothing queued.
    if (chunks->count == 0) return StepOutcome{false, 0, 0};

    // The kernel advances packs' steps, not their members': a partial launch reads members'.
    if (!chunks->full && std::any_of(request.tensors.begin(), request.tensors.end(),
                                     [&](uint32_t t) { return full_.Packed(t); })) {
      if (absl::Status s = full_.SyncMemberSteps(table_, step_dev_, stream_); !s.ok()) return s;
    }
    absl::StatusOr<StepEvents> events = markers_.TakeStepEvents();
    if (!events.ok()) return events.status();
    if (absl::Status s = Queue(request, *chunks, *source, *events); !s.ok()) {
      markers_.Return(*events);
      return s;
    }
    table_.AdvanceSteps(request.tensors);
    if (chunks->full) {
      full_.Launched();
    } else if (std::any_of(request.tensors.begin(), request.tensors.end(),
                           [&](uint32_t t) { return full_.Affects(table_, t); })) {
      full_.MarkStale();
    }
    return StepOutcome{false, static_cast<uint32_t>(request.tensors.size()), markers_.Add(*events)};
  }

  absl::StatusOr<Marker> Accumulate(const StepRequest& request, bool first) override {
    FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
    if (absl::Status s = Reserve(accumulator_, table_.arena_numel()); !s.ok()) return s;
    absl::StatusOr<GradSource> source = CheckGrads(request);
    if (!source.ok()) return source.status();
    absl::StatusOr<ChunkList> chunks = PrepareChunks(request);
    if (!chunks.ok()) return chunks.status();
    if (chunks->count > 0) {
      absl::StatusOr<DeviceList> device_chunks = QueueChunks(*chunks);
      if (!device_chunks.ok()) return device_chunks.status();
      absl::StatusOr<const void*> device_grads = QueueGrads(request, *source);
      if (!device_grads.ok()) return device_grads.status();
      if (absl::Status s = LaunchGradAccumulate(
              launches_, apply_grid_, stream_, request.grad_dtype, accumulator_.data(),
              *device_grads, device_chunks->chunks, chunks->count, request.grad_scale, first);
          !s.ok()) {
        return s;
      }
    }
    return markers_.Mark(stream_);
  }

  absl::Status Read(const ReadRequest& request) override {
    // Check every tensor before queuing any copy.
    bool convert = false;  // fp32 from bf16 or int8 storage: through StateRead.
    for (uint32_t t : request.tensors) {
      if (absl::Status s = table_.CheckRead(request, t, options_.param_copy_dtype); !s.ok()) {
        return s;
      }
      convert |= !request.stored && !request.param_copy &&
                 StoredElementBytes(table_.layout(t), request.field) != 4;
    }
    FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
    uint64_t end = 0;  // Of the destination's bytes.
    std::vector<const char*> sources(request.tensors.size());
    std::vector<uint64_t> bytes(request.tensors.size());
    for (size_t i = 0; i < request.tensors.size(); ++i) {
      const uint32_t t = request.tensors[i];
      if (request.param_copy) {
        sources[i] =
            reinterpret_cast<const char*>(arenas_.KernelView().copy + table_.param_offset(t));
        bytes[i] = table_.numel(t) * 2;
      } else {
        const StoredField field = table_.FieldOf(arenas_.Pointers(), request.field, t);
        sources[i] = field.data;
        bytes[i] = field.count * (convert ? 4 : field.element_bytes);
      }
      end = std::max(end, request.dst_offsets[i] + bytes[i]);
    }
    if (request.dst_is_snapshot) {
      if (absl::Status s = snapshots_.CheckRange(request.dst, end); !s.ok()) return s;
    }
    const cudaMemcpyKind kind =
        request.dst_is_snapshot ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost;
    char* dst = static_cast<char*>(request.dst);
    if (convert) return ReadConverted(request, end, kind);
    // One copy per run of tensors that are adjacent both in their arena and in dst, with the
    // same gap between them: the copy then also moves the arena's padding (zero, never
    // written) into a gap of dst that no tensor uses.
    for (size_t i = 0; i < request.tensors.size();) {
      size_t last = i;
      while (last + 1 < request.tensors.size()) {
        const uint64_t gap = request.dst_offsets[last + 1] - request.dst_offsets[last];
        if (request.dst_offsets[last + 1] < request.dst_offsets[last] + bytes[last] ||
            sources[last + 1] != sources[last] + gap) {
          break;
        }
        ++last;
      }
      const uint64_t run = request.dst_offsets[last] - request.dst_offsets[i] + bytes[last];
      if (run > 0) {
        FUSEDPS_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(dst + request.dst_offsets[i], sources[i], run, kind, stream_));
      }
      i = last + 1;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<void*> AllocateSnapshot(uint64_t bytes) override {
    FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
    // Stream-ordered: ready for the reads queued after it, freed after them (FreeSnapshot).
    return snapshots_.Allocate(bytes, stream_);
  }

  absl::Status FreeSnapshot(void* snapshot) override {
    FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
    return snapshots_.Release(snapshot, stream_);
  }

  absl::Status CopyFromSnapshot(const void* snapshot, uint64_t offset, uint64_t bytes,
                                void* dst) override {
    FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
    return snapshots_.CopyOut(snapshot, offset, bytes, dst);  // On its own stream.
  }

  absl::StatusOr<Marker> Mark() override {
    FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
    return markers_.Mark(stream_);
  }

  absl::StatusOr<WorkDone> Wait(Marker marker) override {
    if (marker == 0) return WorkDone{};
    FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
    return markers_.Wait(marker);
  }

  int64_t step(uint32_t tensor) const override { return table_.step(tensor); }
  uint32_t tensor_count() const override { return table_.size(); }
  uint64_t numel(uint32_t tensor) const override { return table_.numel(tensor); }
  TensorLayout layout(uint32_t tensor) const override { return table_.layout(tensor); }
  uint64_t launches_total() const override { return launches_.total(); }
  std::map<std::string, uint64_t> launch_counts() const override { return launches_.counts(); }

  // Reads only atomics (DeviceBuffer::bytes) and the snapshot store (its own mutex): safe while
  // the engine thread grows buffers.
  std::map<std::string, uint64_t> memory_bytes() const override {
    std::map<std::string, uint64_t> bytes = arenas_.Bytes();
    bytes["grad_staging"] = grads_.bytes() + arena_mirror_.bytes();
    bytes["grad_accumulator"] = accumulator_.bytes();
    bytes["tables"] = full_.bytes() + push_chunks_.bytes() + push_units_.bytes() +
                      read_chunks_.bytes() + step_dev_.bytes() + hyper_.bytes() +
                      remaining_.bytes() + portions_of_dev_.bytes() + codebooks_.bytes() +
                      work_.bytes();
    bytes["pull_snapshots"] = snapshots_.bytes() + read_scratch_.bytes();
    return bytes;
  }

  absl::StatusOr<char*> AllocateStagingArena(uint64_t bytes) override {
    if (arena_ != nullptr) return absl::FailedPreconditionError("the arena exists already");
    FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
    absl::StatusOr<void*> allocated = HostAlloc(bytes, "page-locked host staging arena");
    if (!allocated.ok()) return allocated.status();
    char* arena = static_cast<char*>(*allocated);
    // The mirror is new, so GrowBuffers' wait on the apply stream also orders its zeroing
    // before any copy on the copy stream.
    if (absl::Status s = GrowBuffers({arena_mirror_.ToHold((bytes + 15) / 16)}, stream_); !s.ok()) {
      cudaFreeHost(arena);
      return s;
    }
    arena_ = arena;
    arena_bytes_ = bytes;
    arena_device_ = reinterpret_cast<char*>(arena_mirror_.data());
    owns_arena_ = true;
    return arena_;
  }

  StagingArena staging_arena() const override { return {arena_, arena_device_, arena_bytes_}; }

  absl::Status ShareStagingArena(const StagingArena& arena) override {
    if (arena_ != nullptr) return absl::FailedPreconditionError("the arena exists already");
    if (arena.host == nullptr || arena.device == nullptr || arena.bytes == 0) {
      return absl::InvalidArgumentError(
          "the staging arena to share is empty or has no device mirror");
    }
    arena_ = arena.host;
    arena_bytes_ = arena.bytes;
    arena_device_ = static_cast<char*>(arena.device);
    return absl::OkStatus();
  }

  absl::Status CopyStagingToDevice(uint64_t offset, uint64_t bytes) override {
    if (arena_ == nullptr || offset + bytes > arena_bytes_) {
      return absl::InvalidArgumentError("the range is not in the staging arena");
    }
    FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(arena_device_ + offset, arena_ + offset, bytes,
                                                 cudaMemcpyHostToDevice, copy_stream_));
    return absl::OkStatus();
  }

  absl::Status StageGrads(uint64_t byte_offset, const void* data, uint64_t count, GradDType dtype,
                          float grad_scale) override {
    FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
    const uint64_t bytes = count * DTypeSize(dtype);
    const uint64_t words = (byte_offset + bytes + 15) / 16;
    if (absl::Status s = Reserve(grads_, words); !s.ok()) return s;
    staged_non_finite_ |= !GradsAllFinite(data, dtype, count, grad_scale);
    if (bytes == 0) return absl::OkStatus();
    // After the steps queued so far, which may still read the staging.
    FUSEDPS_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(reinterpret_cast<char*>(grads_.data()) + byte_offset, data, bytes,
                        cudaMemcpyHostToDevice, stream_));
    staged_bytes_ = std::max(staged_bytes_, byte_offset + bytes);
    // Returns once `data` may be reused, page-locked or not (a benchmark's setup, not a path).
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

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
  absl::StatusOr<GradSource> CheckGrads(const StepRequest& request) {
    GradSource source;
    if (request.from_accumulator) return source;
    const char* host = static_cast<const char*>(request.grads);
    source.in_arena = arena_ != nullptr && host >= arena_ && host < arena_ + arena_bytes_;
    for (size_t r = 0; r < request.tensors.size(); ++r) {
      source.grad_bytes =
          std::max(source.grad_bytes, (request.grad_offsets[r] + table_.numel(request.tensors[r])) *
                                          DTypeSize(request.grad_dtype));
    }
    if (source.in_arena &&
        source.grad_bytes > static_cast<uint64_t>(arena_ + arena_bytes_ - host)) {
      return absl::InvalidArgumentError("the step's grads run past the staging arena");
    }
    if (host == nullptr && source.grad_bytes > staged_bytes_) {
      return absl::FailedPreconditionError(absl::StrCat("the step reads ", source.grad_bytes,
                                                        " bytes of staged grads; ", staged_bytes_,
                                                        " are staged"));
    }
    if (host != nullptr && !source.in_arena) {
      if (absl::Status s = Reserve(grads_, (source.grad_bytes + 15) / 16); !s.ok()) return s;
    }
    return source;
  }

  // The resident list for a full push, else a partial list built in push_chunks_host_ (with
  // its units), with a slot to upload it from. From the accumulator, each tensor's
  // grads are at its canonical offset.
  absl::StatusOr<ChunkList> PrepareChunks(const StepRequest& request) {
    ChunkList list;
    list.full = IsFullPush(request);
    if (list.full) {
      if (absl::Status s = full_.Refresh(table_, apply_grid_, Rows(), stream_); !s.ok()) return s;
      list.count = full_.count();
      list.blocks = ApplyBlocks(apply_grid_, full_.portions());
      list.plan = full_.plan();
      list.storage = full_.storage();
      return list;
    }
    push_chunks_host_.clear();
    for (size_t r = 0; r < request.tensors.size(); ++r) {
      const uint32_t t = request.tensors[r];
      AppendChunks(SourceOf(table_, t,
                            request.from_accumulator ? table_.offset(t) : request.grad_offsets[r]),
                   push_chunks_host_);
      list.storage.Add(table_.layout(t));
    }
    list.count = static_cast<uint32_t>(push_chunks_host_.size());
    const uint64_t portions = PortionsIn(push_chunks_host_);
    list.blocks = ApplyBlocks(apply_grid_, portions);
    list.plan = PlanUnits(portions, list.blocks * kWarpsPerBlock, list.storage);
    push_units_host_ = WorkUnits(push_chunks_host_, list.plan);
    if (absl::Status s = GrowBuffers(
            {push_chunks_.ToHold(std::max<uint64_t>(list.count, push_chunks_.capacity())),
             push_units_.ToHold(push_units_host_.size())},
            stream_);
        !s.ok()) {
      return s;
    }
    absl::StatusOr<PinnedRing::Slot*> slot = chunk_ring_.Acquire(
        list.count * sizeof(Chunk) + push_units_host_.size() * sizeof(UnitStart));
    if (!slot.ok()) return slot.status();
    list.slot = *slot;
    return list;
  }

  // Queues the upload of a partial list; returns the device list the launch walks.
  absl::StatusOr<DeviceList> QueueChunks(const ChunkList& list) {
    if (list.full) return DeviceList{full_.chunks(), full_.units()};
    // From a page-locked slot that stays untouched until this copy is done; the device list
    // is rewritten only by the next partial launch's copy, queued after this one's kernel.
    const uint64_t chunk_bytes = list.count * sizeof(Chunk);
    const uint64_t unit_bytes = push_units_host_.size() * sizeof(UnitStart);
    char* host = static_cast<char*>(list.slot->host);
    std::memcpy(host, push_chunks_host_.data(), chunk_bytes);
    std::memcpy(host + chunk_bytes, push_units_host_.data(), unit_bytes);
    FUSEDPS_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(push_chunks_.data(), host, chunk_bytes, cudaMemcpyHostToDevice, stream_));
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(push_units_.data(), host + chunk_bytes, unit_bytes,
                                                 cudaMemcpyHostToDevice, stream_));
    if (absl::Status s = chunk_ring_.Release(list.slot, stream_); !s.ok()) return s;
    return DeviceList{push_chunks_.data(), push_units_.data()};
  }

  bool HasCopy() const { return options_.param_copy_dtype != ParamCopyDType::kNone; }

  TensorRows Rows() { return {&step_dev_, &remaining_, &portions_of_dev_}; }

  // A Read of fp32 from bf16 or int8 storage (every tensor of it through StateRead): into the
  // snapshot directly, or into the scratch buffer and then, in one copy, into host memory.
  absl::Status ReadConverted(const ReadRequest& request, uint64_t end, cudaMemcpyKind kind) {
    std::vector<Chunk> chunks;
    for (size_t i = 0; i < request.tensors.size(); ++i) {
      if (request.dst_offsets[i] % sizeof(float) != 0) {
        return absl::InvalidArgumentError("an fp32 read needs 4-byte aligned destinations");
      }
      AppendChunks(SourceOf(table_, request.tensors[i], request.dst_offsets[i] / sizeof(float)),
                   chunks);
    }
    float* out = static_cast<float*>(request.dst);
    if (kind == cudaMemcpyDeviceToHost) {
      if (absl::Status s = Reserve(read_scratch_, end / sizeof(float)); !s.ok()) return s;
      out = read_scratch_.data();
    }
    if (absl::Status s = GrowBuffers(
            {read_chunks_.ToHold(std::max<uint64_t>(chunks.size(), read_chunks_.capacity()))},
            stream_);
        !s.ok()) {
      return s;
    }
    absl::StatusOr<PinnedRing::Slot*> slot = chunk_ring_.Acquire(chunks.size() * sizeof(Chunk));
    if (!slot.ok()) return slot.status();
    std::memcpy((*slot)->host, chunks.data(), chunks.size() * sizeof(Chunk));
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(read_chunks_.data(), (*slot)->host,
                                                 chunks.size() * sizeof(Chunk),
                                                 cudaMemcpyHostToDevice, stream_));
    if (absl::Status s = chunk_ring_.Release(*slot, stream_); !s.ok()) return s;
    DeviceArenas arenas = arenas_.KernelView();
    arenas.codebooks = codebooks_.data();
    if (absl::Status s =
            LaunchStateRead(launches_, apply_grid_, stream_, request.field, arenas,
                            read_chunks_.data(), static_cast<uint32_t>(chunks.size()), out);
        !s.ok()) {
      return s;
    }
    if (kind == cudaMemcpyDeviceToHost) {
      uint64_t begin = end;
      for (uint64_t o : request.dst_offsets) begin = std::min(begin, o);
      FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<char*>(request.dst) + begin,
                                                   reinterpret_cast<const char*>(out) + begin,
                                                   end - begin, kind, stream_));
    }
    return absl::OkStatus();
  }

  // Queues the wait for (or the copy of) the grads; returns where the kernel reads them.
  absl::StatusOr<const void*> QueueGrads(const StepRequest& request, const GradSource& source) {
    if (request.from_accumulator) return accumulator_.data();
    const char* host = static_cast<const char*>(request.grads);
    if (source.in_arena) {
      // In the staging arena: its ranges are on their way on the copy stream; wait for them.
      FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventRecord(copies_done_, copy_stream_));
      FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, copies_done_, 0));
      return static_cast<const char*>(arena_device_ + (host - arena_));
    }
    if (host != nullptr) {
      // The caller keeps the grads valid until the marker (backend.h's StepRequest).
      FUSEDPS_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(grads_.data(), host, source.grad_bytes, cudaMemcpyHostToDevice, stream_));
    }
    return grads_.data();
  }

  // Queues a checked step: its chunk list, the wait for (or the copy of) its grads, the kernel,
  // and the events of its marker.
  absl::Status Queue(const StepRequest& request, const ChunkList& list, const GradSource& source,
                     const StepEvents& events) {
    absl::StatusOr<DeviceList> chunks = QueueChunks(list);
    if (!chunks.ok()) return chunks.status();
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventRecord(events.reached, stream_));
    absl::StatusOr<const void*> grads = QueueGrads(request, source);
    if (!grads.ok()) return grads.status();
    DeviceArenas arenas = arenas_.KernelView();
    arenas.grads = *grads;
    arenas.step = step_dev_.data();
    arenas.hyper = hyper_.data();
    arenas.remaining = remaining_.data();
    arenas.portions_of = portions_of_dev_.data();
    arenas.codebooks = codebooks_.data();
    arenas.work = work_.data();
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventRecord(events.begin, stream_));
    const ApplyConfig config{request.from_accumulator ? GradDType::kFloat32 : request.grad_dtype,
                             options_.param_copy_dtype, list.storage.kinds, table_.any_amsgrad(),
                             options_.step_kernel};
    if (absl::Status s = LaunchAdamWApply(launches_, list.blocks, stream_, config, arenas,
                                          chunks->chunks, list.count, chunks->units, list.plan,
                                          request.grad_scale, request.lr_divisor);
        !s.ok()) {
      return s;
    }
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventRecord(events.done, stream_));
    return absl::OkStatus();
  }

  // Grows a buffer of a step's path to hold n elements, by half again at least, so that a
  // series of growing pushes (or a push staged tensor by tensor) makes few host waits.
  template <typename T>
  absl::Status Reserve(DeviceArray<T>& array, uint64_t n) {
    if (array.capacity() >= n) return absl::OkStatus();
    return GrowBuffers({array.ToHold(std::max(n, array.capacity() + array.capacity() / 2))},
                       stream_);
  }

  // Every tensor in order, with its grads at its arena offset (always so from the accumulator).
  bool IsFullPush(const StepRequest& request) const {
    if (request.tensors.size() != table_.size()) return false;
    for (size_t r = 0; r < request.tensors.size(); ++r) {
      if (request.tensors[r] != r) return false;
      if (!request.from_accumulator && request.grad_offsets[r] != table_.offset(r)) return false;
    }
    return true;
  }

  std::vector<DeviceBuffer*> AllBuffers() {
    std::vector<DeviceBuffer*> buffers = {
        &grads_,           &arena_mirror_, &step_dev_,   &hyper_,       &remaining_,
        &portions_of_dev_, &push_chunks_,  &push_units_, &read_chunks_, &read_scratch_,
        &accumulator_,     &codebooks_,    &work_};
    for (DeviceBuffer* b : full_.Buffers()) buffers.push_back(b);
    return buffers;
  }

  const BackendOptions options_;
  std::string device_name_;
  int apply_grid_ = 0;
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

  // Thread-safe, each with its own mutex.
  MarkerTable markers_;
  SnapshotStore snapshots_;
};

}  // namespace
}  // namespace gpu

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

absl::StatusOr<std::unique_ptr<OptimizerBackend>> MakeCudaBackend(const BackendOptions& options) {
  if (options.device_ordinal < 0 || options.device_ordinal >= CudaDeviceCount()) {
    return absl::UnavailableError(absl::StrCat("no CUDA device cuda:", options.device_ordinal, " (",
                                               CudaDeviceCount(), " visible)"));
  }
  auto backend = std::make_unique<gpu::CudaBackend>(options);
  if (absl::Status s = backend->Init(); !s.ok()) return s;
  return std::unique_ptr<OptimizerBackend>(std::move(backend));
}

}  // namespace fusedps
