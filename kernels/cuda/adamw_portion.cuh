// adamw_portion.cuh (adamw_kernel.cu and adamw_chunk_blocks.cu): how AdamWApply's warps compute
// their portions: the per-warp tensor bookkeeping (steps, countdowns), and one portion's update
// for each storage layout, which AdamWApplyChunks shares. How the warps move their portions (the
// shared-memory pipeline, the lanes' share of a portion) is in adamw_pipeline.cuh, included here.
// See adamw_kernel.cu's header for the design; everything here is inlined into the kernels.
#ifndef FUSEDPS_KERNELS_CUDA_ADAMW_PORTION_CUH_
#define FUSEDPS_KERNELS_CUDA_ADAMW_PORTION_CUH_

#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "kernels/adamw_math.h"
#include "kernels/cuda/adamw_kernel.cuh"
#include "kernels/cuda/adamw_pipeline.cuh"
#include "kernels/quant_math.h"

namespace fusedps {
namespace gpu {

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
