// accumulate_read_kernels.cu: the CUDA backend's passes over a chunk list that are not a step
// (adamw_kernel.cuh): a synchronous round's gradient sum (GradAccumulate) and the read of one
// field as fp32 (StateRead). The step itself is adamw_kernel.cu's.
#include "kernels/cuda/adamw_kernel.cuh"
#include "kernels/cuda/adamw_portion.cuh"

namespace fusedps {
namespace gpu {

namespace {

__device__ __forceinline__ void Load8(const float* p, float (&v)[kVec]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

__device__ __forceinline__ void Store8(float* p, const float (&v)[kVec]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// Loads 8 gradients starting at element i (a multiple of 8) with 16-byte loads.
__device__ __forceinline__ void LoadGrads8(const void* grads, GradDType dtype, uint64_t i,
                                           float (&g)[kVec]) {
  if (dtype == GradDType::kFloat32) {
    Load8(static_cast<const float*>(grads) + i, g);
    return;
  }
  const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(grads) + i);
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    g[2 * k] = Widen(dtype, static_cast<uint16_t>(words[k] & 0xffffu));
    g[2 * k + 1] = Widen(dtype, static_cast<uint16_t>(words[k] >> 16));
  }
}

// A synchronous round's sum: each warp takes every W-th 256-element portion of the chunks' full
// 8 and adds 8 gradients per lane (converted to fp32 and divided by grad_scale, as AdamWUpdate
// divides) into the accumulator, or writes them for the round's first push.
template <GradDType kGrad>
__global__ void __launch_bounds__(kThreads)
    GradAccumulate(float* accumulator, const void* grads, const Chunk* chunks, uint32_t chunk_count,
                   float grad_scale, bool first) {
  const uint32_t lane = threadIdx.x % 32;
  const uint64_t warps = static_cast<uint64_t>(gridDim.x) * kWarpsPerBlock;
  const uint64_t portions = static_cast<uint64_t>(chunk_count) * kPortions;
  const bool divide = grad_scale > 0.0f;
  for (uint64_t q = static_cast<uint64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
       q < portions; q += warps) {
    const Chunk& chunk = chunks[q / kPortions];
    const uint32_t count = chunk.count;
    const uint32_t first_element =
        static_cast<uint32_t>(q % kPortions) * kPortionNumel + lane * kVec;
    if (first_element >= count) continue;
    float* acc = accumulator + chunk.element;
    const uint64_t g = chunk.grad;
    if (first_element + kVec <= count) {
      float values[kVec], sum[kVec];
      LoadGrads8(grads, kGrad, g + first_element, values);
      if (!first) Load8(acc + first_element, sum);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float v = divide ? values[k] / grad_scale : values[k];
        sum[k] = first ? v : sum[k] + v;
      }
      Store8(acc + first_element, sum);
      continue;
    }
    for (uint32_t i = first_element; i < count && i < first_element + kVec; ++i) {
      const float grad = LoadGrad(grads, kGrad, g + i);
      const float v = divide ? grad / grad_scale : grad;
      acc[i] = first ? v : acc[i] + v;
    }
  }
}

// A read of one field as fp32 (bf16 widened, int8 dequantized): each warp takes every W-th
// portion, 8 elements per lane, into out at the chunk's grad offset.
__global__ void __launch_bounds__(kThreads)
    StateRead(TensorField field, DeviceArenas a, const Chunk* chunks, uint32_t chunk_count,
              float* out) {
  const uint32_t lane = threadIdx.x % 32;
  const uint64_t warps = static_cast<uint64_t>(gridDim.x) * kWarpsPerBlock;
  const uint64_t portions = static_cast<uint64_t>(chunk_count) * kPortions;
  for (uint64_t q = static_cast<uint64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
       q < portions; q += warps) {
    const Chunk& chunk = chunks[q / kPortions];
    const uint32_t portion = static_cast<uint32_t>(q % kPortions);
    const uint32_t first_element = portion * kPortionNumel + lane * kVec;
    const uint32_t count = chunk.count;
    if (first_element >= count) continue;
    const StateDType state = StateOf(chunk.layout);
    const uint64_t s = chunk.state, p = chunk.param;
    for (uint32_t i = first_element; i < count && i < first_element + kVec; ++i) {
      float value;
      if (field == TensorField::kParam) {
        value = (chunk.layout & kLayoutParamsBf16) ? BFloat16ToFloat(a.params16[p + i])
                                                   : a.params32[p + i];
      } else {
        const bool is_m = field == TensorField::kExpAvg;
        if (state == StateDType::kBFloat16) {
          value = BFloat16ToFloat(is_m ? a.exp_avg16[s + i] : a.exp_avg_sq16[s + i]);
        } else if (state == StateDType::kInt8) {
          const uint64_t block = s / kQuantBlock + portion;
          value =
              is_m ? Dequantize(a.codebooks->exp_avg.values, a.exp_avg8[s + i], a.absmax_m[block])
                   : Dequantize(a.codebooks->exp_avg_sq.values, a.exp_avg_sq8[s + i],
                                a.absmax_v[block]);
        } else {
          value = is_m ? a.exp_avg32[s + i] : a.exp_avg_sq32[s + i];
        }
      }
      out[chunk.grad + i] = value;
    }
  }
}

}  // namespace

absl::Status LaunchGradAccumulate(LaunchCounter& launches, int grid, cudaStream_t stream,
                                  GradDType grad_dtype, float* accumulator, const void* grads,
                                  const Chunk* chunks, uint32_t chunk_count, float grad_scale,
                                  bool first) {
  void (*kernel)(float*, const void*, const Chunk*, uint32_t, float, bool) =
      grad_dtype == GradDType::kBFloat16  ? GradAccumulate<GradDType::kBFloat16>
      : grad_dtype == GradDType::kFloat16 ? GradAccumulate<GradDType::kFloat16>
                                          : GradAccumulate<GradDType::kFloat32>;
  return launches.Launch("fusedps_grad_accumulate", kernel,
                         static_cast<int>(std::min<uint32_t>(grid, chunk_count)), 0, stream,
                         accumulator, grads, chunks, chunk_count, grad_scale, first);
}

absl::Status LaunchStateRead(LaunchCounter& launches, int grid, cudaStream_t stream,
                             TensorField field, const DeviceArenas& arenas, const Chunk* chunks,
                             uint32_t chunk_count, float* out) {
  return launches.Launch("fusedps_state_read", StateRead,
                         static_cast<int>(std::min<uint32_t>(grid, chunk_count)), 0, stream, field,
                         arenas, chunks, chunk_count, out);
}

}  // namespace gpu
}  // namespace fusedps
