// The CUDA backend: fused multi-tensor AdamW over flat device arenas, one update launch per
// optimizer step whatever the tensor count.
//
// Storage (per shard, device memory): fp32 params, exp_avg, exp_avg_sq, max_exp_avg_sq (once a
// group has amsgrad), an optional bf16/fp16 param copy, and gradient staging in the wire dtype.
// Tensor t occupies elements [offset[t], offset[t] + numel[t]) of every arena; offsets are
// multiples of 8 elements, so 8-element (16- or 32-byte) vector accesses are always aligned.
//
// Resident tables (device memory, rebuilt only when tensors are registered): the chunk list of
// a full push, which cuts every tensor into chunks of at most kChunkNumel elements, each entry
// carrying its arena offset, staging offset, tensor and group; per tensor its step and the
// countdown below; per group its hyperparameters. A push that names only some tensors uploads
// a compact chunk list of its own in the same stream.
//
// A step is one launch, AdamWApply, on the backend's stream, over a grid that fills the GPU
// (SMs x resident blocks). Work is split among warps: warp w of W takes a contiguous run of the
// chunks' 256-element portions, so warps never wait for each other and small tensors still
// fill every warp. A warp reads a tensor's step once, when it reaches the tensor, computes the
// step's scalars (bias corrections in float64, as torch does) only when the (group, step) pair
// changes, and updates 8 elements per lane with kernels/adamw_math.h, 16-byte loads and stores,
// writing the low-precision copy in the same pass. lr, betas and the step are read on the
// device, so a schedule change relaunches nothing and a step could be captured in a CUDA graph.
//
// Step counters advance inside the same launch without a race: each warp counts its portions of
// a tensor down from remaining[t] after it read the step, and the warp that takes the count to
// zero (the last reader) advances step[t] and re-arms the count.
//
// Non-finite gradients are caught on the host where they are staged (kernels/grad_check.h):
// a skipped step launches nothing and writes nothing.
//
// Tuning history (NVIDIA H200, docs/benchmarks.md): one block per chunk with a barrier per chunk
// reached ~55% of copy bandwidth; contiguous chunk ranges per block with scalars cached ~90% on
// large tensors; independent warps lifted 10,000 x 1K from ~53% to ~75%; dtype template
// parameters lifted the bf16 path by 2-5 points.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/grad_check.h"
#include "kernels/tensor_table.h"

namespace fusedps {
namespace {

constexpr int kVec = 8;                   // Elements per lane per portion: 16-byte accesses.
constexpr uint32_t kPortionNumel = 32 * kVec;  // Elements per portion: one warp pass.
constexpr uint32_t kPortions = 8;         // Portions per chunk.
constexpr uint32_t kChunkNumel = kPortions * kPortionNumel;  // 2048 elements per chunk.
constexpr int kThreads = 256;             // Threads per block.
constexpr int kWarpsPerBlock = kThreads / 32;

#define FUSEDPS_CUDA_RETURN_IF_ERROR(expr)                                               \
  do {                                                                                   \
    const cudaError_t fusedps_err = (expr);                                              \
    if (fusedps_err != cudaSuccess) {                                                    \
      return absl::InternalError(absl::StrCat(#expr, ": ", cudaGetErrorString(fusedps_err))); \
    }                                                                                    \
  } while (0)

// One unit of work: up to kChunkNumel elements of one tensor. 32 bytes, everything a block
// needs to start its loads at once.
struct Chunk {
  uint64_t arena_offset;  // Element of the arenas that holds the chunk's first element.
  uint64_t grad_offset;   // Element of the staging buffer that holds its first gradient.
  uint32_t tensor;
  uint32_t count;         // Elements; 0 only for a tensor of no elements.
  uint32_t group;
  uint32_t unused;
};

struct DeviceArenas {
  float* params;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // Null until a group has amsgrad.
  uint16_t* copy;         // Null without a param copy.
  const void* grads;      // Staging.
  int64_t* step;
  const AdamWHyperparameters* hyper;
  uint32_t* remaining;          // Per tensor: portions of this step still to read its step.
  const uint32_t* portions_of;  // Per tensor: kPortions x its number of chunks.
};

// Every launch goes through here: one place checks it and counts it by kernel name.
class LaunchCounter {
 public:
  template <typename... KernelArgs, typename... Args>
  absl::Status Launch(const char* name, void (*kernel)(KernelArgs...), int grid,
                      cudaStream_t stream, Args&&... args) {
    kernel<<<grid, kThreads, 0, stream>>>(std::forward<Args>(args)...);
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_[name];
    ++total_;
    return absl::OkStatus();
  }
  uint64_t total() const {
    std::lock_guard<std::mutex> lock(mu_);
    return total_;
  }
  std::map<std::string, uint64_t> counts() const {
    std::lock_guard<std::mutex> lock(mu_);
    return counts_;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::string, uint64_t> counts_;
  uint64_t total_ = 0;
};

__device__ __forceinline__ float GradAt(const void* grads, GradDType dtype, uint64_t i) {
  return LoadGrad(grads, dtype, i);
}

// Loads 8 gradients starting at element i (a multiple of 8) with 16-byte loads.
__device__ __forceinline__ void LoadGrads8(const void* grads, GradDType dtype, uint64_t i,
                                           float (&g)[kVec]) {
  if (dtype == GradDType::kFloat32) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(grads) + i);
    const float4 a = __ldcs(p), b = __ldcs(p + 1);
    g[0] = a.x, g[1] = a.y, g[2] = a.z, g[3] = a.w, g[4] = b.x, g[5] = b.y, g[6] = b.z,
    g[7] = b.w;
  } else {
    const uint4 raw = __ldcs(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(grads) + i));
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint16_t lo = static_cast<uint16_t>(words[k] & 0xffffu);
      const uint16_t hi = static_cast<uint16_t>(words[k] >> 16);
      g[2 * k] = dtype == GradDType::kBFloat16 ? BFloat16ToFloat(lo) : Float16ToFloat(lo);
      g[2 * k + 1] = dtype == GradDType::kBFloat16 ? BFloat16ToFloat(hi) : Float16ToFloat(hi);
    }
  }
}

__device__ __forceinline__ void Load8(const float* p, float (&v)[kVec]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

__device__ __forceinline__ void Store8(float* p, const float (&v)[kVec]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// Marks `portions` portions of tensor t done reading its step; the last marker advances it.
// REQUIRES: the calling thread is the one that read step[t] for these portions, and it used the
// value before calling (so the read completed before the atomic issues; no fence is needed).
__device__ __forceinline__ void FinishPortions(const DeviceArenas& a, uint32_t t,
                                               uint32_t portions) {
  if (atomicSub(&a.remaining[t], portions) == portions) {
    a.step[t] += 1;
    a.remaining[t] = a.portions_of[t];
  }
}

// The one launch of a step. See the file comment.
//
// Work is split among warps, not blocks: each chunk has kPortions portions of 256 elements (32
// lanes x 8), and warp w of W takes the contiguous portions [w * P / W, (w + 1) * P / W) of all
// P = kPortions * chunk_count. Warps never wait for each other. A warp's portions mostly share a
// tensor, a group and a step, so it computes the step's scalars (float64 bias corrections, as
// torch does) only when the (group, step) pair changes. Lane 0 reads a tensor's step once, when
// the warp reaches the tensor, and counts the warp's portions of it done when it leaves.
// The dtypes are template parameters, so that each pair gets a loop with no dtype branches.
template <GradDType dtype, ParamCopyDType copy_dtype>
__global__ void __launch_bounds__(kThreads)
    AdamWApply(DeviceArenas a, const Chunk* chunks, uint32_t chunk_count, float grad_scale) {
  const uint32_t lane = threadIdx.x % 32;
  const uint64_t warps = static_cast<uint64_t>(gridDim.x) * kWarpsPerBlock;
  const uint64_t warp = static_cast<uint64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const uint64_t portions = static_cast<uint64_t>(chunk_count) * kPortions;
  const uint64_t q_end = portions * (warp + 1) / warps;
  uint32_t tensor = 0xffffffffu, pending = 0;  // The current tensor, and its portions done here.
  uint32_t scalars_group = 0xffffffffu;
  int64_t scalars_step = -1;
  AdamWStepScalars s{};
  uint32_t chunk_index = 0xffffffffu;
  Chunk chunk{};
  for (uint64_t q = portions * warp / warps; q < q_end; ++q) {
    if (q / kPortions != chunk_index) {
      chunk_index = static_cast<uint32_t>(q / kPortions);
      chunk = chunks[chunk_index];  // The same address for the whole warp: one broadcast.
    }
    const uint32_t first = static_cast<uint32_t>(q % kPortions) * kPortionNumel + lane * kVec;
    const bool full_vector = first + kVec <= chunk.count;
    const uint64_t e = chunk.arena_offset + first;
    // Issue this lane's loads first, so they fly while the rest is decided.
    float g[kVec], p[kVec], m[kVec], v[kVec], vmax[kVec];
    if (full_vector) {
      LoadGrads8(a.grads, dtype, chunk.grad_offset + first, g);
      Load8(a.params + e, p);
      Load8(a.exp_avg + e, m);
      Load8(a.exp_avg_sq + e, v);
    }
    if (chunk.tensor != tensor) {  // Uniform across the warp.
      if (pending > 0 && lane == 0) FinishPortions(a, tensor, pending);
      tensor = chunk.tensor;
      pending = 0;
      int64_t step = 0;
      if (lane == 0) step = a.step[tensor] + 1;
      step = __shfl_sync(0xffffffffu, step, 0);
      if (step != scalars_step || chunk.group != scalars_group) {
        s = MakeStepScalars(a.hyper[chunk.group], step, grad_scale);
        scalars_step = step;
        scalars_group = chunk.group;
      }
    }
    ++pending;
    if (full_vector) {
      if (s.amsgrad) Load8(a.max_exp_avg_sq + e, vmax);
#pragma unroll
      for (int k = 0; k < kVec; ++k) AdamWUpdate(s, g[k], p[k], m[k], v[k], &vmax[k]);
      Store8(a.params + e, p);
      Store8(a.exp_avg + e, m);
      Store8(a.exp_avg_sq + e, v);
      if (s.amsgrad) Store8(a.max_exp_avg_sq + e, vmax);
      if constexpr (copy_dtype != ParamCopyDType::kNone) {
        uint16_t h[kVec];
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          h[k] = copy_dtype == ParamCopyDType::kBFloat16 ? FloatToBFloat16(p[k])
                                                         : FloatToFloat16(p[k]);
        }
        uint4 packed;
        packed.x = h[0] | (static_cast<uint32_t>(h[1]) << 16);
        packed.y = h[2] | (static_cast<uint32_t>(h[3]) << 16);
        packed.z = h[4] | (static_cast<uint32_t>(h[5]) << 16);
        packed.w = h[6] | (static_cast<uint32_t>(h[7]) << 16);
        *reinterpret_cast<uint4*>(a.copy + e) = packed;
      }
    } else {
      for (uint32_t i = first; i < chunk.count && i < first + kVec; ++i) {
        const uint64_t x = chunk.arena_offset + i;
        float unused = 0.0f;
        AdamWUpdate(s, GradAt(a.grads, dtype, chunk.grad_offset + i), a.params[x], a.exp_avg[x],
                    a.exp_avg_sq[x], s.amsgrad ? &a.max_exp_avg_sq[x] : &unused);
        if (copy_dtype == ParamCopyDType::kBFloat16) a.copy[x] = FloatToBFloat16(a.params[x]);
        if (copy_dtype == ParamCopyDType::kFloat16) a.copy[x] = FloatToFloat16(a.params[x]);
      }
    }
  }
  if (pending > 0 && lane == 0) FinishPortions(a, tensor, pending);
}

using ApplyKernelFn = void (*)(DeviceArenas, const Chunk*, uint32_t, float);

template <GradDType dtype>
ApplyKernelFn ApplyKernelFor(ParamCopyDType copy) {
  switch (copy) {
    case ParamCopyDType::kBFloat16:
      return AdamWApply<dtype, ParamCopyDType::kBFloat16>;
    case ParamCopyDType::kFloat16:
      return AdamWApply<dtype, ParamCopyDType::kFloat16>;
    case ParamCopyDType::kNone:
    default:
      return AdamWApply<dtype, ParamCopyDType::kNone>;
  }
}

// The instantiation of AdamWApply for a gradient dtype and a param copy dtype.
ApplyKernelFn ApplyKernel(GradDType grad, ParamCopyDType copy) {
  switch (grad) {
    case GradDType::kBFloat16:
      return ApplyKernelFor<GradDType::kBFloat16>(copy);
    case GradDType::kFloat16:
      return ApplyKernelFor<GradDType::kFloat16>(copy);
    case GradDType::kFloat32:
    default:
      return ApplyKernelFor<GradDType::kFloat32>(copy);
  }
}

// A device buffer that grows by reallocation, keeping its contents.
template <typename T>
class DeviceVector {
 public:
  ~DeviceVector() { cudaFree(data_); }
  T* data() const { return data_; }
  size_t size() const { return size_; }
  uint64_t bytes_allocated() const { return capacity_ * sizeof(T); }
  // Grows to n elements (new ones zero), keeping the contents when `keep`. Every operation runs
  // on `stream`, the one that writes the buffer, so copies already queued there land first.
  absl::Status Resize(size_t n, cudaStream_t stream, bool keep = true) {
    if (n <= capacity_) {
      size_ = n;
      return absl::OkStatus();
    }
    T* fresh = nullptr;
    if (cudaMalloc(&fresh, n * sizeof(T)) != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(
          absl::StrCat("device memory: cannot allocate ", n * sizeof(T), " bytes"));
    }
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(fresh, 0, n * sizeof(T), stream));
    if (keep && size_ > 0) {
      FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(fresh, data_, size_ * sizeof(T),
                                                   cudaMemcpyDeviceToDevice, stream));
    }
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));  // Before freeing data_.
    cudaFree(data_);
    data_ = fresh;
    size_ = capacity_ = n;
    return absl::OkStatus();
  }
  absl::Status Upload(const T* host, size_t n, cudaStream_t stream, size_t at = 0) {
    FUSEDPS_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(data_ + at, host, n * sizeof(T), cudaMemcpyHostToDevice, stream));
    return absl::OkStatus();
  }

 private:
  T* data_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

// Appends a tensor's chunks and returns how many (at least 1: an empty tensor still has an
// entry, so that its step advances).
uint32_t AppendChunks(uint32_t tensor, uint32_t group, uint64_t numel, uint64_t arena_offset,
                      uint64_t grad_offset, std::vector<Chunk>& out) {
  if (numel == 0) {
    out.push_back({arena_offset, grad_offset, tensor, 0, group, 0});
    return 1;
  }
  uint32_t chunks = 0;
  for (uint64_t begin = 0; begin < numel; begin += kChunkNumel, ++chunks) {
    const uint32_t count = static_cast<uint32_t>(std::min<uint64_t>(kChunkNumel, numel - begin));
    out.push_back({arena_offset + begin, grad_offset + begin, tensor, count, group, 0});
  }
  return chunks;
}

class CudaBackend final : public OptimizerBackend {
 public:
  CudaBackend(const BackendOptions& options) : options_(options) {}
  ~CudaBackend() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
    if (copies_done_ != nullptr) cudaEventDestroy(copies_done_);
    if (arena_ != nullptr) cudaFreeHost(arena_);
    if (step_begin_ != nullptr) cudaEventDestroy(step_begin_);
    if (step_end_ != nullptr) cudaEventDestroy(step_end_);
  }

  absl::Status Init() {
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device_ordinal));
    cudaDeviceProp prop;
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, options_.device_ordinal));
    device_name_ = absl::StrCat("cuda:", options_.device_ordinal, " ", prop.name, " (",
                                prop.multiProcessorCount, " SMs)");
    // The grid fills the GPU: the most blocks of the heaviest instantiation that fit per SM.
    int apply_blocks = 1 << 30;
    for (GradDType grad : {GradDType::kFloat32, GradDType::kBFloat16, GradDType::kFloat16}) {
      for (ParamCopyDType copy :
           {ParamCopyDType::kNone, ParamCopyDType::kBFloat16, ParamCopyDType::kFloat16}) {
        int blocks = 0;
        FUSEDPS_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &blocks, ApplyKernel(grad, copy), kThreads, 0));
        apply_blocks = std::min(apply_blocks, blocks);
      }
    }
    apply_grid_ = prop.multiProcessorCount * std::max(apply_blocks, 1);
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
    FUSEDPS_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&copies_done_, cudaEventDisableTiming));
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&step_begin_));
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&step_end_));
    return absl::OkStatus();
  }

  std::string name() const override { return "cuda"; }
  std::string device() const override { return device_name_; }
  ParamCopyDType param_copy_dtype() const override { return options_.param_copy_dtype; }

  absl::Status SetParamGroup(uint32_t group, const AdamWHyperparameters& hyper) override {
    if (absl::Status s = table_.SetGroup(group, hyper); !s.ok()) return s;
    if (hyper.amsgrad && max_exp_avg_sq_.size() < params_.size()) {
      if (absl::Status s = max_exp_avg_sq_.Resize(params_.size(), stream_); !s.ok()) return s;
    }
    const std::vector<AdamWHyperparameters>& groups = table_.groups();
    if (absl::Status s = hyper_.Resize(groups.size(), stream_); !s.ok()) return s;
    if (absl::Status s = hyper_.Upload(groups.data(), groups.size(), stream_); !s.ok()) return s;
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  absl::Status AddTensors(absl::Span<const NewTensor> tensors) override {
    absl::StatusOr<uint64_t> total = table_.ArenaNumelWith(tensors);
    if (!total.ok()) return total.status();
    if (absl::Status s = GrowArenas(*total); !s.ok()) return s;
    const uint32_t first = table_.size();
    table_.Append(tensors);
    for (uint32_t t = first; t < table_.size(); ++t) {
      portions_of_.push_back(kPortions * AppendChunks(t, table_.group_of(t), table_.numel(t),
                                                      table_.offset(t), table_.offset(t),
                                                      full_chunks_host_));
    }
    return UploadTables();
  }

  absl::Status WriteParams(uint32_t tensor, uint64_t offset,
                           absl::Span<const float> values) override {
    const uint64_t at = table_.offset(tensor) + offset;
    if (absl::Status s = params_.Upload(values.data(), values.size(), stream_, at); !s.ok()) {
      return s;
    }
    if (options_.param_copy_dtype != ParamCopyDType::kNone) {
      std::vector<uint16_t> copy(values.size());
      for (size_t i = 0; i < values.size(); ++i) {
        copy[i] = options_.param_copy_dtype == ParamCopyDType::kBFloat16
                      ? FloatToBFloat16(values[i])
                      : FloatToFloat16(values[i]);
      }
      if (absl::Status s = copy_.Upload(copy.data(), copy.size(), stream_, at); !s.ok()) return s;
    }
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  absl::Status Read(TensorField field, uint32_t tensor, uint64_t offset, uint64_t count,
                    GradDType dtype, void* out) const override {
    const uint64_t start = table_.offset(tensor) + offset;
    if (field == TensorField::kParam && dtype != GradDType::kFloat32 &&
        static_cast<int>(dtype) == static_cast<int>(options_.param_copy_dtype)) {
      FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out, copy_.data() + start, count * 2,
                                                   cudaMemcpyDeviceToHost, stream_));
      FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
      return absl::OkStatus();
    }
    absl::StatusOr<const float*> field_start = table_.FieldOf(
        {params_.data(), exp_avg_.data(), exp_avg_sq_.data(), max_exp_avg_sq_.data()}, field,
        tensor);
    if (!field_start.ok()) return field_start.status();
    // fp32 lands in `out` directly; a 16-bit read is rounded on the host from fp32 first.
    std::vector<float> staged(dtype == GradDType::kFloat32 ? 0 : count);
    float* dst = staged.empty() ? static_cast<float*>(out) : staged.data();
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, *field_start + offset, count * sizeof(float),
                                                 cudaMemcpyDeviceToHost, stream_));
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    if (!staged.empty()) StoreFloats(staged.data(), count, dtype, out);
    return absl::OkStatus();
  }

  int64_t step(uint32_t tensor) const override { return table_.step(tensor); }
  uint32_t tensor_count() const override { return table_.size(); }
  uint64_t numel(uint32_t tensor) const override { return table_.numel(tensor); }
  uint64_t launches_total() const override { return launches_.total(); }
  std::map<std::string, uint64_t> launch_counts() const override { return launches_.counts(); }
  std::map<std::string, uint64_t> memory_bytes() const override {
    return {{"params", params_.bytes_allocated()},
            {"exp_avg", exp_avg_.bytes_allocated()},
            {"exp_avg_sq", exp_avg_sq_.bytes_allocated()},
            {"max_exp_avg_sq", max_exp_avg_sq_.bytes_allocated()},
            {"param_copy", copy_.bytes_allocated()},
            {"grad_staging", grads_.bytes_allocated() + arena_mirror_.bytes_allocated()},
            {"tables", full_chunks_.bytes_allocated() + push_chunks_.bytes_allocated() +
                           step_dev_.bytes_allocated() + hyper_.bytes_allocated() +
                           remaining_.bytes_allocated() + portions_of_dev_.bytes_allocated()}};
  }
  double last_step_device_seconds() const override { return last_step_seconds_; }

  absl::StatusOr<char*> AllocateStagingArena(uint64_t bytes) override {
    if (arena_ != nullptr) return absl::FailedPreconditionError("the arena exists already");
    if (cudaHostAlloc(&arena_, bytes, cudaHostAllocDefault) != cudaSuccess) {
      cudaGetLastError();
      arena_ = nullptr;
      return absl::ResourceExhaustedError(
          absl::StrCat("page-locked host staging arena of ", bytes, " bytes"));
    }
    arena_bytes_ = bytes;
    if (absl::Status s = arena_mirror_.Resize((bytes + 15) / 16, stream_, false); !s.ok()) return s;
    return arena_;
  }

  absl::Status CopyStagingToDevice(uint64_t offset, uint64_t bytes) override {
    FUSEDPS_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(reinterpret_cast<char*>(arena_mirror_.data()) + offset, arena_ + offset,
                        bytes, cudaMemcpyHostToDevice, copy_stream_));
    return absl::OkStatus();
  }

  absl::Status StageGrads(uint64_t byte_offset, const void* data, uint64_t count,
                          GradDType dtype, float grad_scale) override {
    staged_non_finite_ |= !GradsAllFinite(data, dtype, count, grad_scale);
    return CopyToStaging(byte_offset, data, count * DTypeSize(dtype));
  }

  absl::StatusOr<StepOutcome> Step(const StepRequest& request) override {
    const bool finite = StepGradsFinite(request, &staged_non_finite_,
                                        [this](uint32_t t) { return table_.numel(t); });
    if (!finite) return StepOutcome{true, 0};  // Nothing launched, nothing written.
    return Apply(request);
  }

 private:
  absl::Status CopyToStaging(uint64_t byte_offset, const void* data, uint64_t bytes) {
    const uint64_t words = (byte_offset + bytes + 15) / 16;
    if (grads_.size() < words) {
      // Grow by half again at least: a push is staged tensor by tensor.
      const uint64_t grown = std::max<uint64_t>(words, grads_.size() + grads_.size() / 2);
      if (absl::Status s = grads_.Resize(grown, stream_); !s.ok()) return s;
    }
    FUSEDPS_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(reinterpret_cast<char*>(grads_.data()) + byte_offset, data, bytes,
                        cudaMemcpyHostToDevice, stream_));
    return absl::OkStatus();
  }

  absl::StatusOr<StepOutcome> Apply(const StepRequest& request) {
    // Stage the gradients on the device, and pick the chunk list.
    uint64_t grad_numel = 0;
    for (size_t r = 0; r < request.tensors.size(); ++r) {
      grad_numel = std::max(grad_numel, request.grad_offsets[r] +
                                            AlignedNumel(table_.numel(request.tensors[r])));
    }
    const size_t grad_bytes = grad_numel * DTypeSize(request.grad_dtype);
    const char* host = static_cast<const char*>(request.grads);
    const bool in_arena = arena_ != nullptr && host >= arena_ && host < arena_ + arena_bytes_;
    if (in_arena) {
      // In the staging arena: its chunks are on their way on the copy stream; wait for them.
      FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventRecord(copies_done_, copy_stream_));
      FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, copies_done_, 0));
    } else if (request.grads != nullptr) {
      if (absl::Status s = CopyToStaging(0, request.grads, grad_bytes); !s.ok()) return s;
    } else if (grads_.size() * 16 < grad_bytes) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the step reads ", grad_bytes, " bytes of staged grads; ", grads_.size() * 16,
          " are staged"));
    }
    const Chunk* chunks = full_chunks_.data();
    uint32_t chunk_count = static_cast<uint32_t>(full_chunks_host_.size());
    if (!IsFullPush(request)) {
      push_chunks_host_.clear();
      for (size_t r = 0; r < request.tensors.size(); ++r) {
        const uint32_t t = request.tensors[r];
        AppendChunks(t, table_.group_of(t), table_.numel(t), table_.offset(t), request.grad_offsets[r],
                     push_chunks_host_);
      }
      chunk_count = static_cast<uint32_t>(push_chunks_host_.size());
      if (absl::Status s = push_chunks_.Resize(chunk_count, stream_, false); !s.ok()) return s;
      if (absl::Status s = push_chunks_.Upload(push_chunks_host_.data(), chunk_count, stream_);
          !s.ok()) {
        return s;
      }
      chunks = push_chunks_.data();
    }
    if (chunk_count == 0) return StepOutcome{false, 0};
    DeviceArenas arenas = Arenas();
    // Read only now: CopyToStaging may have moved grads_.
    arenas.grads = in_arena ? reinterpret_cast<const char*>(arena_mirror_.data()) + (host - arena_)
                            : reinterpret_cast<const char*>(grads_.data());
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventRecord(step_begin_, stream_));
    if (absl::Status s = launches_.Launch(
            "fusedps_adamw_apply", ApplyKernel(request.grad_dtype, options_.param_copy_dtype),
            std::min<uint32_t>(apply_grid_, chunk_count), stream_, arenas, chunks, chunk_count,
            request.grad_scale);
        !s.ok()) {
      return s;
    }
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventRecord(step_end_, stream_));
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(step_end_));
    float ms = 0;
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, step_begin_, step_end_));
    last_step_seconds_ = ms * 1e-3;
    table_.AdvanceSteps(request.tensors);
    return StepOutcome{false, static_cast<uint32_t>(request.tensors.size())};
  }

  bool IsFullPush(const StepRequest& request) const {
    if (request.tensors.size() != table_.size()) return false;
    for (size_t r = 0; r < request.tensors.size(); ++r) {
      if (request.tensors[r] != r || request.grad_offsets[r] != table_.offset(r)) return false;
    }
    return true;
  }

  DeviceArenas Arenas() {
    return DeviceArenas{params_.data(),   exp_avg_.data(),         exp_avg_sq_.data(),
                        max_exp_avg_sq_.size() ? max_exp_avg_sq_.data() : nullptr,
                        copy_.size() ? copy_.data() : nullptr,
                        nullptr,          step_dev_.data(),        hyper_.data(),
                        remaining_.data(),                         portions_of_dev_.data()};
  }

  absl::Status GrowArenas(uint64_t numel) {
    for (DeviceVector<float>* arena : {&params_, &exp_avg_, &exp_avg_sq_}) {
      if (absl::Status s = arena->Resize(numel, stream_); !s.ok()) return s;
    }
    if (table_.any_amsgrad()) {
      if (absl::Status s = max_exp_avg_sq_.Resize(numel, stream_); !s.ok()) return s;
    }
    if (options_.param_copy_dtype != ParamCopyDType::kNone) {
      if (absl::Status s = copy_.Resize(numel, stream_); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  absl::Status UploadTables() {
    const size_t n = table_.size();
    if (absl::Status s = step_dev_.Resize(n, stream_); !s.ok()) return s;
    if (absl::Status s = remaining_.Resize(n, stream_); !s.ok()) return s;
    if (absl::Status s = portions_of_dev_.Resize(n, stream_); !s.ok()) return s;
    if (absl::Status s = remaining_.Upload(portions_of_.data(), n, stream_); !s.ok()) return s;
    if (absl::Status s = portions_of_dev_.Upload(portions_of_.data(), n, stream_); !s.ok()) {
      return s;
    }
    if (absl::Status s = full_chunks_.Resize(full_chunks_host_.size(), stream_, false); !s.ok()) {
      return s;
    }
    if (absl::Status s = step_dev_.Upload(table_.steps().data(), n, stream_); !s.ok()) return s;
    if (absl::Status s = full_chunks_.Upload(full_chunks_host_.data(), full_chunks_host_.size(),
                                             stream_);
        !s.ok()) {
      return s;
    }
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  const BackendOptions options_;
  std::string device_name_;
  cudaStream_t stream_ = nullptr;
  int apply_grid_ = 0;
  // The staging arena (page-locked) and its device mirror, filled by CopyStagingToDevice on
  // copy_stream_; a step waits for the copies queued before it through copies_done_.
  char* arena_ = nullptr;
  uint64_t arena_bytes_ = 0;
  DeviceVector<uint4> arena_mirror_;
  cudaStream_t copy_stream_ = nullptr;
  cudaEvent_t copies_done_ = nullptr;
  bool staged_non_finite_ = false;
  cudaEvent_t step_begin_ = nullptr, step_end_ = nullptr;
  double last_step_seconds_ = 0;
  LaunchCounter launches_;

  // Host mirrors.
  TensorTable table_;
  std::vector<uint32_t> portions_of_;
  std::vector<Chunk> full_chunks_host_, push_chunks_host_;

  // Device memory.
  DeviceVector<float> params_, exp_avg_, exp_avg_sq_, max_exp_avg_sq_;
  DeviceVector<uint16_t> copy_;
  DeviceVector<uint4> grads_;
  DeviceVector<int64_t> step_dev_;
  DeviceVector<AdamWHyperparameters> hyper_;
  DeviceVector<uint32_t> remaining_, portions_of_dev_;
  DeviceVector<Chunk> full_chunks_, push_chunks_;
};

}  // namespace

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

absl::StatusOr<std::unique_ptr<OptimizerBackend>> MakeCudaBackend(const BackendOptions& options) {
  if (options.device_ordinal >= CudaDeviceCount()) {
    return absl::UnavailableError(absl::StrCat("no CUDA device cuda:", options.device_ordinal,
                                               " (", CudaDeviceCount(), " visible)"));
  }
  auto backend = std::make_unique<CudaBackend>(options);
  if (absl::Status s = backend->Init(); !s.ok()) return s;
  return std::unique_ptr<OptimizerBackend>(std::move(backend));
}

}  // namespace fusedps
