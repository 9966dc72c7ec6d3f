// adamw_portion.cuh (adamw_kernel.cu and adamw_chunk_blocks.cu): how AdamWApply's warps move and
// compute their portions: each warp's shared-memory pipeline (asynchronous copies of a portion's
// gradients, params, state, chunk entry, step and scales), the lanes' share of a portion, the
// per-warp tensor bookkeeping (steps, countdowns), and one portion's update for each storage
// layout, which AdamWApplyChunks shares. See adamw_kernel.cu's header for the design; everything
// here is inlined into the kernels.
#ifndef FUSEDPS_KERNELS_CUDA_ADAMW_PORTION_CUH_
#define FUSEDPS_KERNELS_CUDA_ADAMW_PORTION_CUH_

#include <cuda_runtime.h>

#include <cfloat>
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

// What a warp carries from portion to portion (every lane holds the same values).
struct WarpState {
  uint32_t tensor = 0xffffffffu;  // The tensor of the portions computed last.
  uint32_t portions = 0;          // Its portions computed here...
  uint32_t tensor_portions = 0;   // ...and in all.
  int64_t step = 0;               // Its step after this update.
  uint64_t key = 0;               // Its stochastic rounding key at that step.
  uint32_t scalars_group = 0xffffffffu;
  int64_t scalars_step = -1;
  uint64_t seed = 0;
  AdamWStepScalars s{};
  // Countdowns left to look at, one per lane below kPendingLanes (each lane's own values: the
  // tensor, the count's old value, what was subtracted, the tensor's portions, the step), and
  // the lane of the next.
  uint32_t pending_tensor = 0xffffffffu, pending_old = 0, pending_portions = 0, pending_total = 0;
  int64_t pending_step = 0;
  uint32_t countdown_lane = 0;  // Uniform.
};

// Lanes that take a warp's countdowns in turn: a lane looks at the old count its atomic
// returned only kPendingLanes tensors later, so the atomic's round trip (long where many warps
// count one tensor down at once) stays off the warp's path.
constexpr uint32_t kPendingLanes = 4;

// This lane's countdown left, if any; if it took the count to zero, the step advances and the
// count re-arms for the next launch. Stores only: the tensor's portions came with its stage
// header, so no load waits here (a load of portions_of here, once per tensor on the path of the
// warp that ends it, cost 10,000 x 1K 1% of its step: docs/benchmarks.md, run E1).
__device__ __forceinline__ void Settle(const DeviceArenas& a, WarpState& w) {
  if (w.pending_tensor == 0xffffffffu) return;
  if (w.pending_old == w.pending_portions) {
    a.step[w.pending_tensor] = w.pending_step;
    a.remaining[w.pending_tensor] = w.pending_total;
  }
  w.pending_tensor = 0xffffffffu;
}

// The warp leaves its current tensor: it advances a tensor it computed every portion of, else
// counts its portions down (looked at later, by Settle). A warp never comes back to a tensor it
// left (its units are in increasing order), so every portion is counted once.
__device__ __forceinline__ void Leave(const DeviceArenas& a, WarpState& w, uint32_t lane) {
  if (w.tensor == 0xffffffffu) return;
  if (w.portions == w.tensor_portions) {
    if (lane == 0) a.step[w.tensor] = w.step;
    return;
  }
  if (lane == w.countdown_lane) {
    Settle(a, w);
    w.pending_old = atomicSub(&a.remaining[w.tensor], w.portions);
    w.pending_tensor = w.tensor;
    w.pending_portions = w.portions;
    w.pending_total = w.tensor_portions;
    w.pending_step = w.step;
  }
  w.countdown_lane = w.countdown_lane + 1 == kPendingLanes ? 0 : w.countdown_lane + 1;
}

// A portion's inputs, as fp32: this lane's 8 gradients, params, exp_avg and exp_avg_sq (int8
// dequantized with the block's scales, which absmax_m and absmax_v hold).
struct PortionValues {
  float g[kVec], p[kVec], m[kVec], v[kVec];
  float absmax_m = 0.0f, absmax_v = 0.0f;
};

// The portion's inputs from its pipeline stage.
template <GradDType kGrad, ParamsDType kParams, StateDType kState>
__device__ __forceinline__ void LoadFromStage(const char* stage, uint32_t lane,
                                              const Int8Codebooks* books, PortionValues& x) {
  const char* data = stage + kHeaderBytes;
  if constexpr (kGrad == GradDType::kFloat32) {
    ReadRuns(data, lane, x.g);
  } else {
    uint16_t h[kVec];
    ReadRuns(data, lane, h);
#pragma unroll
    for (int k = 0; k < kVec; ++k) x.g[k] = Widen(kGrad, h[k]);
  }
  if constexpr (kParams == ParamsDType::kFloat32) {
    ReadRuns(data + kRegionBytes, lane, x.p);
  } else {
    uint16_t h[kVec];
    ReadRuns(data + kRegionBytes, lane, h);
#pragma unroll
    for (int k = 0; k < kVec; ++k) x.p[k] = BFloat16ToFloat(h[k]);
  }
  if constexpr (kState == StateDType::kFloat32) {
    ReadRuns(data + 2 * kRegionBytes, lane, x.m);
    ReadRuns(data + 3 * kRegionBytes, lane, x.v);
  } else if constexpr (kState == StateDType::kBFloat16) {
    uint16_t hm[kVec], hv[kVec];
    ReadRuns(data + 2 * kRegionBytes, lane, hm);
    ReadRuns(data + 3 * kRegionBytes, lane, hv);
#pragma unroll
    for (int k = 0; k < kVec; ++k) x.m[k] = BFloat16ToFloat(hm[k]), x.v[k] = BFloat16ToFloat(hv[k]);
  } else {
    uint8_t cm[kVec], cv[kVec];
    ReadRuns(data + 2 * kRegionBytes, lane, cm);
    ReadRuns(data + 3 * kRegionBytes, lane, cv);
    x.absmax_m = *reinterpret_cast<const float*>(stage + kAbsmaxAt);
    x.absmax_v = *reinterpret_cast<const float*>(stage + kAbsmaxAt + 4);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      x.m[k] = Dequantize(books->exp_avg.values, cm[k], x.absmax_m);
      x.v[k] = Dequantize(books->exp_avg_sq.values, cv[k], x.absmax_v);
    }
  }
}

// One portion's update from its inputs, stored (register k is element ElementsOf's run k / 4,
// element k % 4). A whole portion (the usual case, uniform across the warp) updates all 8
// without a test; a partial one only its valid elements.
template <GradDType kGrad, ParamCopyDType kCopy, ParamsDType kParams, StateDType kState>
__device__ __forceinline__ void UpdateAndStore(const DeviceArenas& a, const Chunk& c,
                                               uint32_t portion, const LaneElements& e,
                                               const WarpState& w, const Int8Codebooks* books,
                                               uint32_t lane, PortionValues& x) {
  float(&p)[kVec] = x.p;
  float(&m)[kVec] = x.m;
  float(&v)[kVec] = x.v;
  float vmax[kVec];
  const bool amsgrad = kState == StateDType::kFloat32 && w.s.amsgrad;
  if (amsgrad) LoadRuns(a.max_exp_avg_sq + c.state, e, vmax);
  // All 8, valid or not (a partial portion's others hold stale stage bytes, never stored).
  constexpr UpdateOrder kOrder =
      kState == StateDType::kInt8 ? kInt8StateOrder : UpdateOrder::kTorch;
  AdamWUpdateN<kVec, kOrder>(w.s, x.g, p, m, v, vmax);

  uint32_t codes_m[kVec], codes_v[kVec];  // Each in [0, 255].
  if constexpr (kState == StateDType::kInt8) {
    // The block's new scales: a max over the warp, then every code against them.
    float lane_m = 0.0f, lane_v = 0.0f;
    Specialized(e.full, [&](auto full) {  // No per-element test in the usual, full case.
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if (decltype(full)::value || IsValid(e, k)) {
          lane_m = fmaxf(lane_m, fabsf(m[k]));
          lane_v = fmaxf(lane_v, v[k]);
        }
      }
    });
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      lane_m = fmaxf(lane_m, __shfl_xor_sync(0xffffffffu, lane_m, offset));
      lane_v = fmaxf(lane_v, __shfl_xor_sync(0xffffffffu, lane_v, offset));
    }
    const float inverse_m = InverseScale(lane_m), inverse_v = InverseScale(lane_v);
    const auto quantize = [&](auto finite) {
      constexpr bool kFinite = decltype(finite)::value;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        codes_m[k] = QuantizeSigned<kFinite>(books->exp_avg.thresholds, books->exp_avg.buckets,
                                             m[k], inverse_m);
        codes_v[k] = QuantizeUnsigned<kFinite>(books->exp_avg_sq.thresholds,
                                               books->exp_avg_sq.buckets, v[k], inverse_v);
      }
    };
    // Finite unless a scale is below about 3e-39 (a reciprocal that overflows): uniform.
    Specialized(inverse_m <= FLT_MAX && inverse_v <= FLT_MAX, quantize);
    if (lane == 0) {
      a.absmax_m[c.state / kQuantBlock + portion] = lane_m;
      a.absmax_v[c.state / kQuantBlock + portion] = lane_v;
    }
  }
  uint16_t params16[kVec], copy16[kVec], m16[kVec], v16[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    if constexpr (kParams == ParamsDType::kBFloat16) {
      const uint64_t index = c.first + e.at[k / 4] + k % 4;  // Within the tensor.
      params16[k] = FloatToBFloat16Stochastic(p[k], RoundingBits(w.key, index));
    } else if constexpr (kCopy == ParamCopyDType::kBFloat16) {
      copy16[k] = FloatToBFloat16(p[k]);
    } else if constexpr (kCopy == ParamCopyDType::kFloat16) {
      copy16[k] = FloatToFloat16(p[k]);
    }
    if constexpr (kState == StateDType::kBFloat16) {
      m16[k] = FloatToBFloat16(m[k]);
      v16[k] = FloatToBFloat16(v[k]);
    }
  }
  // A full portion (the usual case, uniform across the warp) stores every run without a test.
  const auto store_arrays = [&](auto full) {
    constexpr bool kFull = decltype(full)::value;
    if constexpr (kParams == ParamsDType::kFloat32) {
      StoreRuns<kFull>(a.params32 + c.param, e, p);
      if constexpr (kCopy != ParamCopyDType::kNone) StoreRuns<kFull>(a.copy + c.param, e, copy16);
    } else {
      StoreRuns<kFull>(a.params16 + c.param, e, params16);
    }
    if constexpr (kState == StateDType::kFloat32) {
      StoreRuns<kFull>(a.exp_avg32 + c.state, e, m);
      StoreRuns<kFull>(a.exp_avg_sq32 + c.state, e, v);
      if (amsgrad) StoreRuns<kFull>(a.max_exp_avg_sq + c.state, e, vmax);
    } else if constexpr (kState == StateDType::kBFloat16) {
      StoreRuns<kFull>(a.exp_avg16 + c.state, e, m16);
      StoreRuns<kFull>(a.exp_avg_sq16 + c.state, e, v16);
    } else {
      StoreRuns<kFull>(a.exp_avg8 + c.state, e, codes_m);
      StoreRuns<kFull>(a.exp_avg_sq8 + c.state, e, codes_v);
    }
  };
  Specialized(e.full, store_arrays);
}

// One portion from its pipeline stage.
template <GradDType kGrad, ParamCopyDType kCopy, ParamsDType kParams, StateDType kState>
__device__ __forceinline__ void ComputePortion(const DeviceArenas& a, const char* stage,
                                               const Chunk& c, uint32_t portion, const WarpState& w,
                                               const Int8Codebooks* books, uint32_t lane) {
  const LaneElements e = ElementsOf(c.count, portion, lane);
  PortionValues x;
  LoadFromStage<kGrad, kParams, kState>(stage, lane, books, x);
  UpdateAndStore<kGrad, kCopy, kParams, kState>(a, c, portion, e, w, books, lane, x);
}

// A portion of tensor c.tensor starts (uniform across the warp): when it is another tensor
// than the last, the warp leaves that one and takes this one's step (`step_read`, as read
// before this launch advanced it) and scalars. Then it counts the portion.
__device__ __forceinline__ void Enter(const DeviceArenas& a, const Chunk& c, int64_t step_read,
                                      uint32_t tensor_portions, WarpState& w, uint32_t lane,
                                      float grad_scale, double lr_divisor) {
  if (c.tensor != w.tensor) {
    Leave(a, w, lane);
    w.tensor = c.tensor;
    w.portions = 0;
    w.tensor_portions = tensor_portions;
    w.step = step_read + 1;
    if (w.step != w.scalars_step || c.group != w.scalars_group) {
      const AdamWHyperparameters& h = a.hyper[c.group];
      w.s = MakeStepScalars(h, w.step, grad_scale, lr_divisor);
      w.seed = h.rounding_seed;
      w.scalars_step = w.step;
      w.scalars_group = c.group;
    }
    // Only bf16 params round stochastically: three 64-bit hashes saved per tensor otherwise.
    if (c.layout & kLayoutParamsBf16) w.key = RoundingKey(w.seed, c.rounding_key, w.step);
  }
  ++w.portions;
}

// Calls f.template Run<kParams, kState>() for the chunk's storage: one instantiation for
// fp32-only launches, two for int8-state ones, six otherwise.
template <ApplyKinds kKinds, typename F>
__device__ __forceinline__ void ForLayout(uint16_t layout, F&& f) {
  if constexpr (kKinds == ApplyKinds::kFloat32Only) {
    f.template Run<ParamsDType::kFloat32, StateDType::kFloat32>();
  } else if constexpr (kKinds == ApplyKinds::kInt8State) {
    if (StateOf(layout) == StateDType::kInt8) {
      f.template Run<ParamsDType::kFloat32, StateDType::kInt8>();
    } else {
      f.template Run<ParamsDType::kFloat32, StateDType::kFloat32>();
    }
  } else {
    const bool bf16_params = layout & kLayoutParamsBf16;
    switch (StateOf(layout)) {
      case StateDType::kFloat32:
        if (bf16_params) {
          f.template Run<ParamsDType::kBFloat16, StateDType::kFloat32>();
        } else {
          f.template Run<ParamsDType::kFloat32, StateDType::kFloat32>();
        }
        break;
      case StateDType::kBFloat16:
        if (bf16_params) {
          f.template Run<ParamsDType::kBFloat16, StateDType::kBFloat16>();
        } else {
          f.template Run<ParamsDType::kFloat32, StateDType::kBFloat16>();
        }
        break;
      case StateDType::kInt8:
        if (bf16_params) {
          f.template Run<ParamsDType::kBFloat16, StateDType::kInt8>();
        } else {
          f.template Run<ParamsDType::kFloat32, StateDType::kInt8>();
        }
        break;
    }
  }
}

// Computes the portion in a pipeline stage, for ForLayout.
template <GradDType kGrad, ParamCopyDType kCopy>
struct StagePortion {
  const DeviceArenas& a;
  const char* stage;
  const Chunk& c;
  uint32_t portion;
  const WarpState& w;
  const Int8Codebooks* books;
  uint32_t lane;
  template <ParamsDType kParams, StateDType kState>
  __device__ __forceinline__ void Run() const {
    ComputePortion<kGrad, kCopy, kParams, kState>(a, stage, c, portion, w, books, lane);
  }
};

// Computes the portion in `stage`.
template <GradDType kGrad, ParamCopyDType kCopy, ApplyKinds kKinds>
__device__ __forceinline__ void ComputeStage(const DeviceArenas& a, const char* stage, WarpState& w,
                                             const Int8Codebooks* books, uint32_t lane,
                                             float grad_scale, double lr_divisor) {
  const Chunk c = *reinterpret_cast<const Chunk*>(stage);
  const uint32_t portion = *reinterpret_cast<const uint32_t*>(stage + kPortionAt);
  Enter(a, c, *reinterpret_cast<const int64_t*>(stage + kStepAt),
        *reinterpret_cast<const uint32_t*>(stage + kTensorPortionsAt), w, lane, grad_scale,
        lr_divisor);
  ForLayout<kKinds>(c.layout, StagePortion<kGrad, kCopy>{a, stage, c, portion, w, books, lane});
}

}  // namespace gpu
}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_CUDA_ADAMW_PORTION_CUH_
