// cuda_backend.cu: the CUDA backend (kernels/backend.h): the device arenas and resident tables
// of one shard, the streams and events that order its work, the staging mirror and the pull
// snapshots. The step's kernels and their launcher are in adamw_kernel.cu and
// adamw_chunk_blocks.cu; the full push's chunk list and its packs of small tensors in
// full_push_list.cuh.
//
// This file: the backend's construction, its registration of groups and tensors, its host
// memory, its staging arena and MakeCudaBackend. The class and how it orders its work are in
// cuda_backend_impl.cuh; steps in cuda_backend_step.cu, writes, reads and snapshots in
// cuda_backend_io.cu.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_backend_impl.cuh"
#include "kernels/cuda/cuda_check.h"

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

}  // namespace

CudaBackend::~CudaBackend() {
  // Free with this backend's device current, whatever thread destroys it.
  if (UseDevice(options_.device_ordinal) != cudaSuccess) return;
  for (cudaStream_t s : {stream_, copy_stream_}) {
    if (s != nullptr) cudaStreamSynchronize(s);
  }
  snapshots_.Free(stream_);
  markers_.Free();
  if (copies_done_ != nullptr) cudaEventDestroy(copies_done_);
  device_copier_.Free();
  for (DeviceBuffer* b : AllBuffers()) b->Free();
  for (DeviceBuffer* b : arenas_.Buffers()) b->Free();
  chunk_ring_.Free();
  hyper_ring_.Free();
  if (owns_arena_) cudaFreeHost(arena_);
  for (cudaStream_t s : {stream_, copy_stream_}) {
    if (s != nullptr) cudaStreamDestroy(s);
  }
}

absl::Status CudaBackend::Init() {
  FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
  cudaDeviceProp prop;
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, options_.device_ordinal));
  device_name_ = absl::StrCat("cuda:", options_.device_ordinal, " ", prop.name, " (",
                              prop.multiProcessorCount, " SMs)");
  absl::StatusOr<int> grid = AdamWApplyGrid();
  if (!grid.ok()) return grid.status();
  apply_grid_ = *grid;
  sm_count_ = prop.multiProcessorCount;
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
  if (absl::Status s = snapshots_.Init(); !s.ok()) return s;
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&copies_done_, cudaEventDisableTiming));
  if (absl::Status s = device_copier_.Init(); !s.ok()) return s;
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

absl::Status CudaBackend::SetParamGroup(uint32_t group, const AdamWHyperparameters& hyper) {
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

absl::StatusOr<uint32_t> CudaBackend::AddTensors(absl::Span<const NewTensor> tensors) {
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

absl::Status CudaBackend::TruncateTensors(uint32_t count) {
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

absl::StatusOr<void*> CudaBackend::AllocateHostBuffer(uint64_t bytes) {
  FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
  return HostAlloc(std::max<uint64_t>(bytes, 1), "page-locked host buffer");
}

void CudaBackend::FreeHostBuffer(void* buffer) {
  if (UseDevice(options_.device_ordinal) == cudaSuccess) cudaFreeHost(buffer);
}

absl::Status CudaBackend::RegisterHostMemory(void* data, uint64_t bytes) const {
  FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
  if (cudaError_t e = cudaHostRegister(data, bytes, cudaHostRegisterPortable); e != cudaSuccess) {
    cudaGetLastError();  // Not sticky: clear it.
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot page-lock ", bytes, " bytes of host memory: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

void CudaBackend::UnregisterHostMemory(void* data) const {
  if (UseDevice(options_.device_ordinal) == cudaSuccess) cudaHostUnregister(data);
}

absl::StatusOr<SharedDeviceMemory> CudaBackend::AllocateSharedDeviceMemory(uint64_t bytes) const {
  return AllocateShared(options_.device_ordinal, bytes);
}

void CudaBackend::FreeSharedDeviceMemory(void* data) const {
  if (UseDevice(options_.device_ordinal) == cudaSuccess) cudaFree(data);
}

std::map<std::string, uint64_t> CudaBackend::memory_bytes() const {
  std::map<std::string, uint64_t> bytes = arenas_.Bytes();
  bytes["grad_staging"] = grads_.bytes() + arena_mirror_.bytes() + row_grads_.bytes();
  bytes["grad_accumulator"] = accumulator_.bytes();
  bytes["tables"] = full_.bytes() + push_chunks_.bytes() + push_units_.bytes() +
                    read_chunks_.bytes() + step_dev_.bytes() + hyper_.bytes() + remaining_.bytes() +
                    portions_of_dev_.bytes() + codebooks_.bytes() + work_.bytes() +
                    row_tables_.bytes() + row_keys_.bytes();
  bytes["pull_snapshots"] = snapshots_.bytes() + read_scratch_.bytes();
  return bytes;
}

absl::StatusOr<char*> CudaBackend::AllocateStagingArena(uint64_t bytes) {
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

absl::Status CudaBackend::ShareStagingArena(const StagingArena& arena) {
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

std::vector<DeviceBuffer*> CudaBackend::AllBuffers() {
  std::vector<DeviceBuffer*> buffers = {
      &grads_,       &arena_mirror_,    &step_dev_,    &hyper_,
      &remaining_,   &portions_of_dev_, &push_chunks_, &push_units_,
      &read_chunks_, &read_scratch_,    &accumulator_, &codebooks_,
      &work_,        &row_tables_,      &row_keys_,    &row_grads_};
  for (DeviceBuffer* b : full_.Buffers()) buffers.push_back(b);
  return buffers;
}

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
