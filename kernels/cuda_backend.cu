// The CUDA backend: fused multi-tensor AdamW over flat device arenas, one update launch per
// optimizer step whatever the tensor count.
//
// Storage (per shard, device memory): fp32 params, exp_avg, exp_avg_sq, max_exp_avg_sq (once a
// group has amsgrad), an optional bf16/fp16 param copy, and gradient staging in the wire dtype.
// Tensor t occupies elements [offset[t], offset[t] + numel[t]) of every arena; offsets are
// multiples of 8 elements, so 8-element (16- or 32-byte) vector accesses are always aligned.
//
// Resident tables (device memory, rebuilt only when tensors are registered): per tensor its
// offset, numel, group and step; per group its hyperparameters; and the chunk list of a full
// push, which cuts every tensor into chunks of at most kChunkNumel elements. A push that names
// only some tensors uploads a compact chunk list of its own in the same stream.
//
// A step is two launches on one stream, with no host synchronization between them:
//   1. CheckAndAdvance: scans the gradients for non-finite values (sets found_inf for this
//      step's epoch), advances each pushed tensor's step, and computes its AdamWStepScalars.
//   2. AdamWApply: if found_inf was set for this epoch, restores the steps and returns (the step
//      is skipped, nothing else was written); else applies kernels/adamw_math.h to every element.
// lr, betas, the step and its bias corrections are read on the device, so a schedule change
// relaunches nothing and a step could be captured in a CUDA graph.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"

namespace fusedps {
namespace {

constexpr uint32_t kChunkNumel = 2048;    // Elements per chunk: one block pass.
constexpr int kThreads = 256;             // Threads per block.
constexpr int kVec = 8;                   // Elements per thread per chunk.
static_assert(kThreads * kVec == kChunkNumel, "a block covers one chunk per pass");

#define FUSEDPS_CUDA_RETURN_IF_ERROR(expr)                                               \
  do {                                                                                   \
    const cudaError_t fusedps_err = (expr);                                              \
    if (fusedps_err != cudaSuccess) {                                                    \
      return absl::InternalError(absl::StrCat(#expr, ": ", cudaGetErrorString(fusedps_err))); \
    }                                                                                    \
  } while (0)

struct Chunk {
  uint64_t begin;        // First element, within the tensor.
  uint64_t grad_offset;  // Element of the staging buffer that holds grad[begin].
  uint32_t tensor;
  uint32_t count;        // Elements; 0 only for a tensor of no elements.
};

struct DeviceArenas {
  float* params;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // Null until a group has amsgrad.
  uint16_t* copy;         // Null without a param copy.
  const void* grads;      // Staging.
  const uint64_t* offset;
  const uint32_t* group;
  int64_t* step;
  const AdamWHyperparameters* hyper;
  AdamWStepScalars* scalars;
  int* found_inf_epoch;
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

// Launch 1 of a step. See the file comment.
__global__ void CheckAndAdvance(DeviceArenas a, const Chunk* chunks, uint32_t chunk_count,
                                GradDType dtype, float grad_scale, int epoch) {
  for (uint32_t c = blockIdx.x; c < chunk_count; c += gridDim.x) {
    const Chunk chunk = chunks[c];
    if (chunk.begin == 0 && threadIdx.x == 0) {
      const uint32_t t = chunk.tensor;
      const int64_t step = a.step[t] + 1;
      a.step[t] = step;
      a.scalars[t] = MakeStepScalars(a.hyper[a.group[t]], step, grad_scale);
    }
    const uint32_t first = threadIdx.x * kVec;
    bool finite = true;
    if (first + kVec <= chunk.count) {
      float g[kVec];
      LoadGrads8(a.grads, dtype, chunk.grad_offset + first, g);
#pragma unroll
      for (int k = 0; k < kVec; ++k) finite &= isfinite(g[k]);
    } else {
      for (uint32_t i = first; i < chunk.count; ++i) {
        finite &= isfinite(GradAt(a.grads, dtype, chunk.grad_offset + i));
      }
    }
    if (__any_sync(0xffffffffu, !finite) && (threadIdx.x % 32) == 0) *a.found_inf_epoch = epoch;
  }
}

// Launch 2 of a step. See the file comment.
__global__ void __launch_bounds__(kThreads) AdamWApply(DeviceArenas a, const Chunk* chunks,
                                                       uint32_t chunk_count, GradDType dtype,
                                                       ParamCopyDType copy_dtype, int epoch) {
  const bool skipped = *a.found_inf_epoch == epoch;
  for (uint32_t c = blockIdx.x; c < chunk_count; c += gridDim.x) {
    const Chunk chunk = chunks[c];
    if (skipped) {
      if (chunk.begin == 0 && threadIdx.x == 0) --a.step[chunk.tensor];
      continue;
    }
    const AdamWStepScalars s = a.scalars[chunk.tensor];
    const uint64_t base = a.offset[chunk.tensor] + chunk.begin;
    const uint32_t first = threadIdx.x * kVec;
    if (first + kVec <= chunk.count) {
      const uint64_t e = base + first;
      float g[kVec], p[kVec], m[kVec], v[kVec], vmax[kVec];
      LoadGrads8(a.grads, dtype, chunk.grad_offset + first, g);
      Load8(a.params + e, p);
      Load8(a.exp_avg + e, m);
      Load8(a.exp_avg_sq + e, v);
      if (s.amsgrad) Load8(a.max_exp_avg_sq + e, vmax);
#pragma unroll
      for (int k = 0; k < kVec; ++k) AdamWUpdate(s, g[k], p[k], m[k], v[k], &vmax[k]);
      Store8(a.params + e, p);
      Store8(a.exp_avg + e, m);
      Store8(a.exp_avg_sq + e, v);
      if (s.amsgrad) Store8(a.max_exp_avg_sq + e, vmax);
      if (copy_dtype != ParamCopyDType::kNone) {
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
      for (uint32_t i = first; i < chunk.count; ++i) {
        const uint64_t e = base + i;
        float unused = 0.0f;
        AdamWUpdate(s, GradAt(a.grads, dtype, chunk.grad_offset + i), a.params[e], a.exp_avg[e],
                    a.exp_avg_sq[e], s.amsgrad ? &a.max_exp_avg_sq[e] : &unused);
        if (copy_dtype == ParamCopyDType::kBFloat16) a.copy[e] = FloatToBFloat16(a.params[e]);
        if (copy_dtype == ParamCopyDType::kFloat16) a.copy[e] = FloatToFloat16(a.params[e]);
      }
    }
  }
}

// A device buffer that grows by reallocation, keeping its contents.
template <typename T>
class DeviceVector {
 public:
  ~DeviceVector() { cudaFree(data_); }
  T* data() const { return data_; }
  size_t size() const { return size_; }
  absl::Status Resize(size_t n, bool keep = true) {
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
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemset(fresh, 0, n * sizeof(T)));
    if (keep && size_ > 0) {
      FUSEDPS_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(fresh, data_, size_ * sizeof(T), cudaMemcpyDeviceToDevice));
    }
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

void AppendChunks(uint32_t tensor, uint64_t numel, uint64_t grad_offset, std::vector<Chunk>& out) {
  if (numel == 0) {
    out.push_back({0, grad_offset, tensor, 0});  // Still one entry: its step advances.
    return;
  }
  for (uint64_t begin = 0; begin < numel; begin += kChunkNumel) {
    const uint32_t count = static_cast<uint32_t>(std::min<uint64_t>(kChunkNumel, numel - begin));
    out.push_back({begin, grad_offset + begin, tensor, count});
  }
}

class CudaBackend final : public OptimizerBackend {
 public:
  CudaBackend(const BackendOptions& options) : options_(options) {}
  ~CudaBackend() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (step_begin_ != nullptr) cudaEventDestroy(step_begin_);
    if (step_end_ != nullptr) cudaEventDestroy(step_end_);
    cudaFreeHost(found_inf_host_);
  }

  absl::Status Init() {
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device_ordinal));
    cudaDeviceProp prop;
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, options_.device_ordinal));
    device_name_ = absl::StrCat("cuda:", options_.device_ordinal, " ", prop.name, " (",
                                prop.multiProcessorCount, " SMs)");
    int apply_blocks = 0, check_blocks = 0;
    FUSEDPS_CUDA_RETURN_IF_ERROR(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&apply_blocks, AdamWApply, kThreads, 0));
    FUSEDPS_CUDA_RETURN_IF_ERROR(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&check_blocks, CheckAndAdvance, kThreads, 0));
    apply_grid_ = prop.multiProcessorCount * std::max(apply_blocks, 1);
    check_grid_ = prop.multiProcessorCount * std::max(check_blocks, 1);
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMallocHost(&found_inf_host_, sizeof(int)));
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&step_begin_));
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&step_end_));
    absl::Status s = found_inf_epoch_.Resize(1);
    if (!s.ok()) return s;
    return absl::OkStatus();
  }

  std::string name() const override { return "cuda"; }
  std::string device() const override { return device_name_; }
  ParamCopyDType param_copy_dtype() const override { return options_.param_copy_dtype; }

  absl::Status SetParamGroup(uint32_t group, const AdamWHyperparameters& hyper) override {
    if (group > groups_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("param group index ", group, " skips ",
                                                     groups_.size()));
    }
    if (group == groups_.size()) groups_.push_back(hyper);
    groups_[group] = hyper;
    if (hyper.amsgrad && max_exp_avg_sq_.size() < params_.size()) {
      if (absl::Status s = max_exp_avg_sq_.Resize(params_.size()); !s.ok()) return s;
    }
    if (absl::Status s = hyper_.Resize(groups_.size()); !s.ok()) return s;
    if (absl::Status s = hyper_.Upload(groups_.data(), groups_.size(), stream_); !s.ok()) return s;
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  absl::Status AddTensors(absl::Span<const NewTensor> tensors) override {
    uint64_t total = arena_numel_;
    for (const NewTensor& t : tensors) {
      if (t.param_group >= groups_.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("param group index ", t.param_group, " is not registered"));
      }
      total += AlignedNumel(t.numel);
    }
    if (absl::Status s = GrowArenas(total); !s.ok()) return s;
    for (const NewTensor& t : tensors) {
      const uint32_t index = static_cast<uint32_t>(offsets_.size());
      AppendChunks(index, t.numel, arena_numel_, full_chunks_host_);
      offsets_.push_back(arena_numel_);
      numels_.push_back(t.numel);
      groups_of_.push_back(t.param_group);
      steps_.push_back(0);
      arena_numel_ += AlignedNumel(t.numel);
    }
    return UploadTables();
  }

  absl::Status WriteParams(uint32_t tensor, uint64_t offset,
                           absl::Span<const float> values) override {
    const uint64_t at = offsets_[tensor] + offset;
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
    const uint64_t start = offsets_[tensor] + offset;
    if (field == TensorField::kParam && dtype != GradDType::kFloat32 &&
        static_cast<int>(dtype) == static_cast<int>(options_.param_copy_dtype)) {
      FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out, copy_.data() + start, count * 2,
                                                   cudaMemcpyDeviceToHost, stream_));
      FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
      return absl::OkStatus();
    }
    const float* src = nullptr;
    switch (field) {
      case TensorField::kParam:
        src = params_.data();
        break;
      case TensorField::kExpAvg:
        src = exp_avg_.data();
        break;
      case TensorField::kExpAvgSq:
        src = exp_avg_sq_.data();
        break;
      case TensorField::kMaxExpAvgSq:
        if (!groups_[groups_of_[tensor]].amsgrad) {
          return absl::FailedPreconditionError("max_exp_avg_sq exists only with amsgrad");
        }
        src = max_exp_avg_sq_.data();
        break;
    }
    std::vector<float> staged;
    float* dst = static_cast<float*>(out);
    if (dtype != GradDType::kFloat32) {
      staged.resize(count);
      dst = staged.data();
    }
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src + start, count * sizeof(float),
                                                 cudaMemcpyDeviceToHost, stream_));
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    if (dtype != GradDType::kFloat32) {
      auto* half = static_cast<uint16_t*>(out);
      for (uint64_t i = 0; i < count; ++i) {
        half[i] = dtype == GradDType::kBFloat16 ? FloatToBFloat16(staged[i])
                                                : FloatToFloat16(staged[i]);
      }
    }
    return absl::OkStatus();
  }

  int64_t step(uint32_t tensor) const override { return steps_[tensor]; }
  uint32_t tensor_count() const override { return static_cast<uint32_t>(offsets_.size()); }
  uint64_t numel(uint32_t tensor) const override { return numels_[tensor]; }
  uint64_t launches_total() const override { return launches_.total(); }
  double last_step_device_seconds() const override { return last_step_seconds_; }

  absl::Status StageGrads(uint64_t byte_offset, const void* data, uint64_t bytes) override {
    const uint64_t words = (byte_offset + bytes + 15) / 16;
    if (grads_.size() < words) {
      if (absl::Status s = grads_.Resize(words); !s.ok()) return s;
    }
    FUSEDPS_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(reinterpret_cast<char*>(grads_.data()) + byte_offset, data, bytes,
                        cudaMemcpyHostToDevice, stream_));
    return absl::OkStatus();
  }

  absl::StatusOr<StepOutcome> Step(const StepRequest& request) override {
    // Stage the gradients on the device, and pick the chunk list.
    uint64_t grad_numel = 0;
    for (size_t r = 0; r < request.tensors.size(); ++r) {
      grad_numel = std::max(grad_numel, request.grad_offsets[r] +
                                            AlignedNumel(numels_[request.tensors[r]]));
    }
    const size_t grad_bytes = grad_numel * DTypeSize(request.grad_dtype);
    if (request.grads != nullptr) {
      if (absl::Status s = StageGrads(0, request.grads, grad_bytes); !s.ok()) return s;
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
        AppendChunks(request.tensors[r], numels_[request.tensors[r]], request.grad_offsets[r],
                     push_chunks_host_);
      }
      chunk_count = static_cast<uint32_t>(push_chunks_host_.size());
      if (absl::Status s = push_chunks_.Resize(chunk_count, false); !s.ok()) return s;
      if (absl::Status s = push_chunks_.Upload(push_chunks_host_.data(), chunk_count, stream_);
          !s.ok()) {
        return s;
      }
      chunks = push_chunks_.data();
    }
    if (chunk_count == 0) return StepOutcome{false, 0};
    const int epoch = ++epoch_;
    DeviceArenas arenas = Arenas();
    arenas.grads = grads_.data();
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventRecord(step_begin_, stream_));
    if (absl::Status s = launches_.Launch("fusedps_adamw_check", CheckAndAdvance,
                                          std::min<uint32_t>(check_grid_, chunk_count), stream_,
                                          arenas, chunks, chunk_count, request.grad_dtype,
                                          request.grad_scale, epoch);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = launches_.Launch("fusedps_adamw_apply", AdamWApply,
                                          std::min<uint32_t>(apply_grid_, chunk_count), stream_,
                                          arenas, chunks, chunk_count, request.grad_dtype,
                                          options_.param_copy_dtype, epoch);
        !s.ok()) {
      return s;
    }
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventRecord(step_end_, stream_));
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(found_inf_host_, found_inf_epoch_.data(),
                                                 sizeof(int), cudaMemcpyDeviceToHost, stream_));
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    float ms = 0;
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, step_begin_, step_end_));
    last_step_seconds_ = ms * 1e-3;
    if (*found_inf_host_ == epoch) return StepOutcome{true, 0};
    for (uint32_t t : request.tensors) ++steps_[t];
    return StepOutcome{false, static_cast<uint32_t>(request.tensors.size())};
  }

 private:
  bool IsFullPush(const StepRequest& request) const {
    if (request.tensors.size() != offsets_.size()) return false;
    for (size_t r = 0; r < request.tensors.size(); ++r) {
      if (request.tensors[r] != r || request.grad_offsets[r] != offsets_[r]) return false;
    }
    return true;
  }

  DeviceArenas Arenas() {
    return DeviceArenas{params_.data(),   exp_avg_.data(),         exp_avg_sq_.data(),
                        max_exp_avg_sq_.size() ? max_exp_avg_sq_.data() : nullptr,
                        copy_.size() ? copy_.data() : nullptr,
                        nullptr,          offset_dev_.data(),      group_dev_.data(),
                        step_dev_.data(), hyper_.data(),           scalars_.data(),
                        found_inf_epoch_.data()};
  }

  absl::Status GrowArenas(uint64_t numel) {
    for (DeviceVector<float>* arena : {&params_, &exp_avg_, &exp_avg_sq_}) {
      if (absl::Status s = arena->Resize(numel); !s.ok()) return s;
    }
    const bool amsgrad = std::any_of(groups_.begin(), groups_.end(),
                                     [](const AdamWHyperparameters& h) { return h.amsgrad; });
    if (amsgrad) {
      if (absl::Status s = max_exp_avg_sq_.Resize(numel); !s.ok()) return s;
    }
    if (options_.param_copy_dtype != ParamCopyDType::kNone) {
      if (absl::Status s = copy_.Resize(numel); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  absl::Status UploadTables() {
    const size_t n = offsets_.size();
    if (absl::Status s = offset_dev_.Resize(n); !s.ok()) return s;
    if (absl::Status s = group_dev_.Resize(n); !s.ok()) return s;
    if (absl::Status s = step_dev_.Resize(n); !s.ok()) return s;
    if (absl::Status s = scalars_.Resize(n); !s.ok()) return s;
    if (absl::Status s = full_chunks_.Resize(full_chunks_host_.size(), false); !s.ok()) return s;
    if (absl::Status s = offset_dev_.Upload(offsets_.data(), n, stream_); !s.ok()) return s;
    if (absl::Status s = group_dev_.Upload(groups_of_.data(), n, stream_); !s.ok()) return s;
    if (absl::Status s = step_dev_.Upload(steps_.data(), n, stream_); !s.ok()) return s;
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
  int apply_grid_ = 0, check_grid_ = 0;
  int epoch_ = 0;
  int* found_inf_host_ = nullptr;
  cudaEvent_t step_begin_ = nullptr, step_end_ = nullptr;
  double last_step_seconds_ = 0;
  LaunchCounter launches_;

  // Host mirrors.
  std::vector<AdamWHyperparameters> groups_;
  std::vector<uint64_t> offsets_, numels_;
  std::vector<uint32_t> groups_of_;
  std::vector<int64_t> steps_;
  std::vector<Chunk> full_chunks_host_, push_chunks_host_;
  uint64_t arena_numel_ = 0;

  // Device memory.
  DeviceVector<float> params_, exp_avg_, exp_avg_sq_, max_exp_avg_sq_;
  DeviceVector<uint16_t> copy_;
  DeviceVector<uint4> grads_;
  DeviceVector<uint64_t> offset_dev_;
  DeviceVector<uint32_t> group_dev_;
  DeviceVector<int64_t> step_dev_;
  DeviceVector<AdamWHyperparameters> hyper_;
  DeviceVector<AdamWStepScalars> scalars_;
  DeviceVector<Chunk> full_chunks_, push_chunks_;
  DeviceVector<int> found_inf_epoch_;
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
