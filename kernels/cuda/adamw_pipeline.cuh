// adamw_pipeline.cuh (adamw_kernel.cu and adamw_chunk_blocks.cu, through adamw_portion.cuh): how
// AdamWApply's warps move their portions: each warp's shared-memory pipeline (asynchronous copies
// of a portion's gradients, params, state, chunk entry, step and scales, or bulk copies counted
// by a transaction barrier), the lanes' share of a portion and its vector loads and stores, and
// the issue of one portion's copies into a stage. adamw_portion.cuh computes the portions. See
// adamw_kernel.cu's header for the design; everything here is inlined into the kernels.
#ifndef FUSEDPS_KERNELS_CUDA_ADAMW_PIPELINE_CUH_
#define FUSEDPS_KERNELS_CUDA_ADAMW_PIPELINE_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/adamw_math.h"
#include "kernels/cuda/adamw_kernel.cuh"
#include "kernels/quant_math.h"

namespace fusedps {
namespace gpu {

// Portions a warp has in its pipeline: 2 or 3 gave the same bandwidth, 1 (no overlap) too on
// large tensors (docs/benchmarks.md); 3 keeps the most bytes in flight for small ones.
constexpr int kStages = 3;

// A stage of a warp's pipeline in shared memory: a header, then four regions of 1 KB, for the
// portion's gradients, params, exp_avg and exp_avg_sq. In a region of elements of b bytes, lane
// l's run r (4 elements, 4b bytes) lies at (32 r + l) x 4b, so a warp's reads are contiguous.
constexpr int kHeaderBytes = 128;
constexpr int kRegionBytes = 1024;
constexpr int kStageBytes = kHeaderBytes + 4 * kRegionBytes;
// Header: [0, 64) the chunk; [64, 72) its tensor's step as read; [72, 80) the block's int8
// scales (exp_avg, exp_avg_sq); [80, 84) the portion's index within the chunk; [84, 88) its
// tensor's portions; [96, 104) the stage's transaction barrier (kernels with bulk copies).
constexpr int kStepAt = 64, kAbsmaxAt = 72, kPortionAt = 80, kTensorPortionsAt = 84;
constexpr int kBarrierAt = 96;

// --- Asynchronous copies into shared memory (sm_80+). ---

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void CopyAsync16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(SharedAddress(dst)), "l"(src)
               : "memory");
}
__device__ __forceinline__ void CopyAsync8(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(SharedAddress(dst)), "l"(src)
               : "memory");
}
__device__ __forceinline__ void CopyAsync4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(SharedAddress(dst)), "l"(src)
               : "memory");
}
__device__ __forceinline__ void CommitAsync() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void WaitAsync() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// --- Bulk copies (sm_90): one lane copies each of a portion's arrays as one span, and the
// stage's transaction barrier counts the bytes in. ---

// Whether a kernel's warps stage their portions with bulk copies: the int8-state kernel's do. Its
// step is bound by instructions, and one lane's four bulk copies replace eight cp.async per lane:
// on GPT-2 small it ran 2.5% faster with fp32 grads and within 0.3% with bf16 grads. The
// fp32-only and any-storage kernels, bound by memory, ran 0.1-0.9% slower with them
// (docs/benchmarks.md, runs D1 and D2).
template <ApplyKinds kKinds>
constexpr bool kBulkCopies = kKinds == ApplyKinds::kInt8State;
static_assert(kRegionBytes % 16 == 0 && kHeaderBytes % 16 == 0, "bulk copies land 16-aligned");

__device__ __forceinline__ void BarrierInit(void* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(SharedAddress(bar)) : "memory");
}
__device__ __forceinline__ void BarrierInitFence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void ProxyFence() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void BarrierExpect(void* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
               :
               : "r"(SharedAddress(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void CopyBulk(void* dst, const void* src, uint32_t bytes, void* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
      :
      : "r"(SharedAddress(dst)), "l"(src), "r"(bytes), "r"(SharedAddress(bar))
      : "memory");
}
// Spins until the barrier's phase of the given parity has completed.
__device__ __forceinline__ void BarrierWait(void* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n"
        " mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(SharedAddress(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ uint32_t Bytes16(uint32_t elements, uint32_t size) {
  return (elements * size + 15) & ~15u;
}

// Lane l's 8 elements of a portion are two runs of 4: [4l, 4l + 4) and [128 + 4l, 128 + 4l + 4)
// (register k holds run k / 4's element k % 4). A warp-wide access of one run then covers one
// contiguous span of 512, 256 or 128 bytes (4-, 2- or 1-byte elements): every sector it touches
// is used whole.
struct LaneElements {
  uint32_t at[2];     // Each run's first element, within the chunk.
  uint32_t valid[2];  // Elements of each run below the chunk's count: 0 to 4.
  bool full;          // Every element of the portion is (uniform across the warp).
};

__device__ __forceinline__ LaneElements ElementsOf(uint32_t count, uint32_t portion,
                                                   uint32_t lane) {
  LaneElements e;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    e.at[r] = portion * kPortionNumel + 128 * r + 4 * lane;
    e.valid[r] = e.at[r] < count ? min(4u, count - e.at[r]) : 0;
  }
  e.full = (portion + 1) * kPortionNumel <= count;
  return e;
}

__device__ __forceinline__ bool IsValid(const LaneElements& e, int k) {
  return static_cast<uint32_t>(k % 4) < e.valid[k / 4];
}

// Calls f(std::true_type{}) or f(std::false_type{}) as `flag` (uniform across the warp) says,
// so that f's body is compiled once with the flag as a constant and once without.
template <typename F>
__device__ __forceinline__ void Specialized(bool flag, F&& f) {
  if (flag) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// Four elements as one vector access (float4, uint2 or uint32), aligned.
template <typename T>
__device__ __forceinline__ void Load4(const T* src, T* out) {
  if constexpr (sizeof(T) == 4) {
    const float4 v = *reinterpret_cast<const float4*>(src);
    const float f[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) memcpy(&out[j], &f[j], 4);
  } else if constexpr (sizeof(T) == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    out[0] = static_cast<T>(v.x & 0xffffu), out[1] = static_cast<T>(v.x >> 16);
    out[2] = static_cast<T>(v.y & 0xffffu), out[3] = static_cast<T>(v.y >> 16);
  } else {
    const uint32_t v = *reinterpret_cast<const uint32_t*>(src);
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = static_cast<T>(v >> (8 * j));
  }
}

// Four elements stored as one vector access. In is T, except for int8 codes: 32-bit values in
// [0, 255], packed with byte permutes (no masking).
template <typename T, typename In>
__device__ __forceinline__ void Store4(T* dst, const In* in) {
  if constexpr (sizeof(T) == 4) {
    float f[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) memcpy(&f[j], &in[j], 4);
    *reinterpret_cast<float4*>(dst) = make_float4(f[0], f[1], f[2], f[3]);
  } else if constexpr (sizeof(T) == 2) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(in[0] | (static_cast<uint32_t>(in[1]) << 16),
                                                in[2] | (static_cast<uint32_t>(in[3]) << 16));
  } else {
    static_assert(sizeof(In) == 4, "int8 codes are stored from 32-bit registers");
    *reinterpret_cast<uint32_t*>(dst) =
        __byte_perm(__byte_perm(in[0], in[1], 0x0040), __byte_perm(in[2], in[3], 0x0040), 0x5410);
  }
}

// Where run r of lane `lane` lies in a stage's region of elements of type T.
template <typename T>
__device__ __forceinline__ char* RunInRegion(char* region, uint32_t lane, int r) {
  return region + (32 * r + lane) * 4 * sizeof(T);
}

// Starts copying this lane's runs of a chunk's array (`chunk_base`: the chunk's element 0)
// into a stage region: each run that holds a valid element, whole. kFull: the portion is full
// (e.full), so every run is copied without a test.
template <bool kFull, typename T>
__device__ __forceinline__ void StageRuns(char* region, uint32_t lane, const T* chunk_base,
                                          const LaneElements& e) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!kFull && e.valid[r] == 0) continue;
    char* dst = RunInRegion<T>(region, lane, r);
    if constexpr (sizeof(T) == 4) {
      CopyAsync16(dst, chunk_base + e.at[r]);
    } else if constexpr (sizeof(T) == 2) {
      CopyAsync8(dst, chunk_base + e.at[r]);
    } else {
      CopyAsync4(dst, chunk_base + e.at[r]);
    }
  }
}

// This lane's 8 elements from a stage region.
template <typename T>
__device__ __forceinline__ void ReadRuns(const char* region, uint32_t lane, T (&out)[kVec]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    Load4(reinterpret_cast<const T*>(RunInRegion<T>(const_cast<char*>(region), lane, r)),
          out + 4 * r);
  }
}

// This lane's valid elements from global memory, whole runs with vector loads.
template <typename T>
__device__ __forceinline__ void LoadRuns(const T* chunk_base, const LaneElements& e,
                                         T (&out)[kVec]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (e.valid[r] == 4) {
      Load4(chunk_base + e.at[r], out + 4 * r);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (static_cast<uint32_t>(j) < e.valid[r]) out[4 * r + j] = chunk_base[e.at[r] + j];
      }
    }
  }
}

// This lane's valid elements stored, whole runs with vector stores (In as Store4's). kFull: the
// portion is full (e.full), so every run is stored whole without a test.
template <bool kFull, typename T, typename In>
__device__ __forceinline__ void StoreRuns(T* chunk_base, const LaneElements& e,
                                          const In (&in)[kVec]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (kFull || e.valid[r] == 4) {
      Store4(chunk_base + e.at[r], in + 4 * r);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (static_cast<uint32_t>(j) < e.valid[r]) chunk_base[e.at[r] + j] = in[4 * r + j];
      }
    }
  }
}

__device__ __forceinline__ float Widen(GradDType dtype, uint16_t h) {
  return dtype == GradDType::kBFloat16 ? BFloat16ToFloat(h) : Float16ToFloat(h);
}

// The half of a chunk that starts its copies.
struct IssueFields {
  uint64_t grad, param, state;
  uint32_t count, layout, tensor;
};

__device__ __forceinline__ IssueFields LoadIssue(const Chunk* chunk) {
  const uint4 a = reinterpret_cast<const uint4*>(chunk)[0];
  const uint4 b = reinterpret_cast<const uint4*>(chunk)[1];
  IssueFields f;
  f.grad = a.x | (static_cast<uint64_t>(a.y) << 32);
  f.param = a.z | (static_cast<uint64_t>(a.w) << 32);
  f.state = b.x | (static_cast<uint64_t>(b.y) << 32);
  f.count = b.z & 0xffffu;
  f.layout = b.z >> 16;
  f.tensor = b.w;
  return f;
}

// Lane 0's bulk copies of a portion of fp32 params with fp32 or int8 state (the int8-state
// kernel's storage; `int8_state` as the chunk's layout says) into `stage`: each array's valid
// elements as one span, rounded up to 16 bytes (offsets are multiples of 8 elements, and of 256
// for int8 state, so the span starts aligned and ends inside the tensor's aligned extent),
// counted in by the stage's barrier.
template <GradDType kGrad>
__device__ __forceinline__ void StageBulk(const DeviceArenas& a, const IssueFields& f,
                                          uint32_t portion, bool int8_state, char* stage) {
  void* bar = stage + kBarrierAt;
  const uint32_t first = portion * kPortionNumel;
  const uint32_t n = f.count > first ? min(kPortionNumel, f.count - first) : 0;
  const uint32_t grad_bytes = Bytes16(n, DTypeSize(kGrad));
  const uint32_t param_bytes = Bytes16(n, 4);
  const uint32_t state_bytes = Bytes16(n, int8_state ? 1 : 4);
  ProxyFence();  // The lanes' reads of the stage's last portion before the copies' writes.
  BarrierExpect(bar, grad_bytes + param_bytes + 2 * state_bytes);
  if (n == 0) return;
  char* data = stage + kHeaderBytes;
  CopyBulk(data, static_cast<const char*>(a.grads) + (f.grad + first) * DTypeSize(kGrad),
           grad_bytes, bar);
  CopyBulk(data + kRegionBytes, a.params32 + f.param + first, param_bytes, bar);
  if (int8_state) {
    CopyBulk(data + 2 * kRegionBytes, a.exp_avg8 + f.state + first, state_bytes, bar);
    CopyBulk(data + 3 * kRegionBytes, a.exp_avg_sq8 + f.state + first, state_bytes, bar);
  } else {
    CopyBulk(data + 2 * kRegionBytes, a.exp_avg32 + f.state + first, state_bytes, bar);
    CopyBulk(data + 3 * kRegionBytes, a.exp_avg_sq32 + f.state + first, state_bytes, bar);
  }
}

// Issues the copies of one portion into `stage`: the header (chunk entry, step, scales, portion
// index) and this lane's elements.
template <GradDType kGrad, ApplyKinds kKinds>
__device__ __forceinline__ void IssuePortion(const DeviceArenas& a, const Chunk* chunk,
                                             const IssueFields& f, uint32_t portion, char* stage,
                                             uint32_t lane) {
  const bool int8_state = kKinds != ApplyKinds::kFloat32Only &&
                          StateOf(static_cast<uint16_t>(f.layout)) == StateDType::kInt8;
  if (lane < 4) CopyAsync16(stage + 16 * lane, reinterpret_cast<const char*>(chunk) + 16 * lane);
  if (lane == 4) CopyAsync8(stage + kStepAt, a.step + f.tensor);
  if (lane == 7) CopyAsync4(stage + kTensorPortionsAt, a.portions_of + f.tensor);
  if (int8_state && lane == 5) {
    CopyAsync4(stage + kAbsmaxAt, a.absmax_m + f.state / kQuantBlock + portion);
  }
  if (int8_state && lane == 6) {
    CopyAsync4(stage + kAbsmaxAt + 4, a.absmax_v + f.state / kQuantBlock + portion);
  }
  if (lane == 0) *reinterpret_cast<uint32_t*>(stage + kPortionAt) = portion;
  if constexpr (kBulkCopies<kKinds>) {
    if (lane == 0) StageBulk<kGrad>(a, f, portion, int8_state, stage);
    return;
  }
  const LaneElements e = ElementsOf(f.count, portion, lane);
  if (e.valid[0] == 0) return;
  // A full portion (the usual case, uniform across the warp) copies every run without a test.
  const auto stage_arrays = [&](auto full) {
    constexpr bool kFull = decltype(full)::value;
    char* data = stage + kHeaderBytes;
    const char* grads = static_cast<const char*>(a.grads) + f.grad * DTypeSize(kGrad);
    if constexpr (kGrad == GradDType::kFloat32) {
      StageRuns<kFull>(data, lane, reinterpret_cast<const float*>(grads), e);
    } else {
      StageRuns<kFull>(data, lane, reinterpret_cast<const uint16_t*>(grads), e);
    }
    if (kKinds == ApplyKinds::kAny && (f.layout & kLayoutParamsBf16)) {
      StageRuns<kFull>(data + kRegionBytes, lane, a.params16 + f.param, e);
    } else {
      StageRuns<kFull>(data + kRegionBytes, lane, a.params32 + f.param, e);
    }
    const StateDType state = kKinds != ApplyKinds::kFloat32Only
                                 ? StateOf(static_cast<uint16_t>(f.layout))
                                 : StateDType::kFloat32;
    if (state == StateDType::kFloat32) {
      StageRuns<kFull>(data + 2 * kRegionBytes, lane, a.exp_avg32 + f.state, e);
      StageRuns<kFull>(data + 3 * kRegionBytes, lane, a.exp_avg_sq32 + f.state, e);
    } else if (kKinds == ApplyKinds::kAny && state == StateDType::kBFloat16) {
      StageRuns<kFull>(data + 2 * kRegionBytes, lane, a.exp_avg16 + f.state, e);
      StageRuns<kFull>(data + 3 * kRegionBytes, lane, a.exp_avg_sq16 + f.state, e);
    } else {
      StageRuns<kFull>(data + 2 * kRegionBytes, lane, a.exp_avg8 + f.state, e);
      StageRuns<kFull>(data + 3 * kRegionBytes, lane, a.exp_avg_sq8 + f.state, e);
    }
  };
  Specialized(e.full, stage_arrays);
}

}  // namespace gpu
}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_CUDA_ADAMW_PIPELINE_CUH_
