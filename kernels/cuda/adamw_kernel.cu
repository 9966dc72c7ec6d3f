// adamw_kernel.cu: the kernel of an optimizer step, fused multi-tensor AdamW over flat device
// arenas, one launch per step whatever the tensor count; and its launcher.
//
// Storage (per shard, device memory, cuda_backend.cu): fp32 params, exp_avg, exp_avg_sq,
// max_exp_avg_sq (once a group has amsgrad), an optional bf16/fp16 param copy, and the step's
// gradients in the wire dtype. Tensor t occupies elements [offset[t], offset[t] + numel[t]) of
// every arena; offsets are multiples of 8 elements, so 8-element (16- or 32-byte) vector
// accesses are always aligned.
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
#include "kernels/cuda/adamw_kernel.cuh"

#include <algorithm>

namespace fusedps {
namespace gpu {
namespace {

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
    const uint4 raw =
        __ldcs(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(grads) + i));
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
    AdamWApply(DeviceArenas a, const Chunk* chunks, uint32_t chunk_count, float grad_scale,
               double lr_divisor) {
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
        s = MakeStepScalars(a.hyper[chunk.group], step, grad_scale, lr_divisor);
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

using ApplyKernelFn = void (*)(DeviceArenas, const Chunk*, uint32_t, float, double);

// A synchronous round's sum: each warp takes every W-th 256-element portion of the chunks and
// adds 8 gradients per lane (converted to fp32 and divided by grad_scale, as AdamWUpdate
// divides) into the accumulator, or writes them for the round's first push.
template <GradDType dtype>
__global__ void __launch_bounds__(kThreads)
    GradAccumulate(float* accumulator, const void* grads, const Chunk* chunks,
                   uint32_t chunk_count, float grad_scale, bool first) {
  const uint32_t lane = threadIdx.x % 32;
  const uint64_t warps = static_cast<uint64_t>(gridDim.x) * kWarpsPerBlock;
  const uint64_t portions = static_cast<uint64_t>(chunk_count) * kPortions;
  const bool divide = grad_scale > 0.0f;
  for (uint64_t q = static_cast<uint64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
       q < portions; q += warps) {
    const Chunk chunk = chunks[q / kPortions];
    const uint32_t first_element =
        static_cast<uint32_t>(q % kPortions) * kPortionNumel + lane * kVec;
    if (first_element >= chunk.count) continue;
    float* acc = accumulator + chunk.arena_offset;
    if (first_element + kVec <= chunk.count) {
      float g[kVec], sum[kVec];
      LoadGrads8(grads, dtype, chunk.grad_offset + first_element, g);
      if (!first) Load8(acc + first_element, sum);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float v = divide ? g[k] / grad_scale : g[k];
        sum[k] = first ? v : sum[k] + v;
      }
      Store8(acc + first_element, sum);
    } else {
      for (uint32_t i = first_element; i < chunk.count && i < first_element + kVec; ++i) {
        const float g = GradAt(grads, dtype, chunk.grad_offset + i);
        const float v = divide ? g / grad_scale : g;
        acc[i] = first ? v : acc[i] + v;
      }
    }
  }
}

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

}  // namespace

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

absl::StatusOr<int> AdamWApplyGrid() {
  int device = 0;
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  int sms = 0;
  FUSEDPS_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
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
  return sms * std::max(apply_blocks, 1);
}

absl::Status LaunchAdamWApply(LaunchCounter& launches, int grid, cudaStream_t stream,
                              GradDType grad_dtype, ParamCopyDType copy_dtype,
                              const DeviceArenas& arenas, const Chunk* chunks,
                              uint32_t chunk_count, float grad_scale, double lr_divisor) {
  return launches.Launch("fusedps_adamw_apply", ApplyKernel(grad_dtype, copy_dtype),
                         static_cast<int>(std::min<uint32_t>(grid, chunk_count)), stream, arenas,
                         chunks, chunk_count, grad_scale, lr_divisor);
}

absl::Status LaunchGradAccumulate(LaunchCounter& launches, int grid, cudaStream_t stream,
                                  GradDType grad_dtype, float* accumulator, const void* grads,
                                  const Chunk* chunks, uint32_t chunk_count, float grad_scale,
                                  bool first) {
  void (*kernel)(float*, const void*, const Chunk*, uint32_t, float, bool) =
      grad_dtype == GradDType::kBFloat16 ? GradAccumulate<GradDType::kBFloat16>
      : grad_dtype == GradDType::kFloat16 ? GradAccumulate<GradDType::kFloat16>
                                          : GradAccumulate<GradDType::kFloat32>;
  return launches.Launch("fusedps_grad_accumulate", kernel,
                         static_cast<int>(std::min<uint32_t>(grid, chunk_count)), stream,
                         accumulator, grads, chunks, chunk_count, grad_scale, first);
}

}  // namespace gpu
}  // namespace fusedps
