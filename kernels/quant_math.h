// quant_math.h: low-precision AdamW state and params (issue 16), the math shared by the CPU and
// CUDA backends, as adamw_math.h is for fp32. Plain C++ and CUDA (host and device), except the
// map construction (host). Nothing here allocates.
//
// State dtypes (a param group's `state_dtype`, fixed at registration):
//   fp32  exp_avg and exp_avg_sq in fp32 (adamw_math.h)
//   bf16  both stored in bf16 (round to nearest even); the update reads them as fp32, runs
//         AdamWUpdate in fp32 and rounds the new values
//   int8  both stored as one byte per element plus one fp32 scale per block of kQuantBlock
//         elements (block-wise dynamic quantization: Dettmers et al., "8-bit Optimizers via
//         Block-wise Quantization", arXiv 2110.02861; bitsandbytes and torchao's AdamW8bit):
//           1. dequantize: m = signed_map[code] * absmax_m, v = unsigned_map[code] * absmax_v
//           2. AdamWUpdate in fp32 with those m, v: the param update uses the new fp32 m and v
//           3. per block, absmax = max |new value| (exp_avg) or max new value (exp_avg_sq)
//           4. code = the nearest map entry to value / absmax (ties to the lower code); a block
//              of zeros has absmax 0 and the codes of 0
//         Tensors under kMinQuantNumel elements keep fp32 state, as bitsandbytes does (biases,
//         norms: little memory, the most sensitive to quantization).
// Choices, on evidence (bitsandbytes 0.44+ and torchao both): blocks of 256 (bitsandbytes'
// changelog: 2048 -> 256 "improves accuracy"; 256 is also one warp pass of our kernel, 32 lanes
// x 8, so a block's absmax is one warp reduction); the signed dynamic map for exp_avg and the
// unsigned one for exp_avg_sq (the latter is never negative, so its 256 codes all go to the
// magnitudes); nearest rounding, no stochastic rounding of state (neither library rounds
// optimizer state stochastically).
//
// Device bytes per parameter of a large tensor (staging of the step's gradients not counted):
//   fp32 state: 4 (param) + 4 + 4 = 12;  bf16 state: 4 + 2 + 2 = 8;
//   int8 state: 4 + 1 + 1 + 2 x 4 / 256 = 6.03;  int8 state with bf16 params: 4.03.
//
// bf16 params with stochastic rounding: the fp32 update result is rounded to bf16 up or down
// with probability proportional to its distance, using 16 random bits from a counter-based hash
// of (seed, tensor key, step, element index). So a replay, or a restore from a checkpoint,
// gives the same bits: no generator state exists to save.
#ifndef FUSEDPS_KERNELS_QUANT_MATH_H_
#define FUSEDPS_KERNELS_QUANT_MATH_H_

#include <cstdint>

#include "kernels/adamw_math.h"

#ifdef __CUDACC__
#define FUSEDPS_UNROLL _Pragma("unroll")
#else
#define FUSEDPS_UNROLL
#endif

namespace fusedps {

// How a param group stores exp_avg and exp_avg_sq. Values are the wire enum's.
enum class StateDType : uint8_t { kFloat32 = 0, kBFloat16 = 1, kInt8 = 2 };

constexpr int kQuantBlock = 256;           // Elements per scale.
constexpr uint64_t kMinQuantNumel = 4096;  // Smaller tensors keep fp32 state.
constexpr int kQuantMapSize = 256;

// Whether a tensor of `numel` elements in a group of `dtype` has int8 state.
FUSEDPS_HOST_DEVICE bool QuantizesState(StateDType dtype, uint64_t numel) {
  return dtype == StateDType::kInt8 && numel >= kMinQuantNumel;
}

// Blocks (and so scales per state) of a tensor of `numel` elements.
FUSEDPS_HOST_DEVICE uint64_t QuantBlocks(uint64_t numel) {
  return (numel + kQuantBlock - 1) / kQuantBlock;
}

// A quantization map: 256 fp32 values in ascending order, within [-1, 1].
struct QuantMap {
  float values[kQuantMapSize];
};

// The dynamic map of bitsandbytes' create_dynamic_map (8 bits, 7 exponent bits), built from its
// definition: for decade i = 0..6 (scale 10^(i-6)), the midpoints of n evenly spaced points on
// [0.1, 1] (n = 2^i + 1 signed, 2^(i+1) + 1 unsigned), times the scale; signed adds their
// negatives; then 0 and 1. Computed in float64, rounded once to fp32. Signed: 127 negative
// values from -0.99296875, 0 at index 127, 128 positive ones up to 1 at index 255. Unsigned: 0
// at index 0, then 254 positive values from 3.25e-7, and 1. Host only.
QuantMap MakeDynamicMap(bool is_signed);

// The index of the map value nearest to x (ties to the lower index), by an 8-step binary
// search. x is a normalized value, within [-1, 1] (signed map) or [0, 1] (unsigned).
FUSEDPS_HOST_DEVICE uint8_t QuantizeNearest(const float* map, float x) {
  int index = 0;
  FUSEDPS_UNROLL
  for (int step = kQuantMapSize / 2; step > 0; step /= 2) {
    if (map[index + step] <= x) index += step;
  }
  // map[index] <= x < map[index + 1], or x is below map[0].
  if (index < kQuantMapSize - 1 && map[index + 1] - x < x - map[index]) ++index;
  return static_cast<uint8_t>(index);
}

// The code of value v in a block of scale absmax (> 0, or 0 for a block of zeros).
FUSEDPS_HOST_DEVICE uint8_t QuantizeScaled(const float* map, float v, float absmax) {
  return QuantizeNearest(map, absmax > 0.0f ? v / absmax : 0.0f);
}

FUSEDPS_HOST_DEVICE float Dequantize(const float* map, uint8_t code, float absmax) {
  return map[code] * absmax;
}

// --- Stochastic rounding of bf16 params. ---

// splitmix64's output function (Steele, Lea, Flood, "Fast splittable pseudorandom number
// generators", OOPSLA 2014; the finalizer of java.util.SplittableRandom): a bijection of 64-bit
// integers whose output bits each depend on every input bit.
FUSEDPS_HOST_DEVICE uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The key of one tensor's step: computed once per (tensor, step), not per element.
// tensor_key identifies the tensor independently of where it is stored (a hash of its name), so
// that the bits survive a restore into another layout.
FUSEDPS_HOST_DEVICE uint64_t RoundingKey(uint64_t seed, uint64_t tensor_key, int64_t step) {
  return Mix64(Mix64(Mix64(seed) ^ tensor_key) ^ static_cast<uint64_t>(step));
}

// 16 random bits for element `index` of the tensor whose step key is `key`.
FUSEDPS_HOST_DEVICE uint32_t RoundingBits(uint64_t key, uint64_t index) {
  return static_cast<uint32_t>(Mix64(key + index * 0x9e3779b97f4a7c15ull) >> 48);
}

// f rounded to bf16 up or down (in magnitude) with probabilities 1 - d and d, where d is the
// fraction of a bf16 ulp by which |f| exceeds the bf16 value below it: random16 (uniform in
// [0, 2^16)) is added to the 16 bits that bf16 drops, and the carry decides. Values exact in
// bf16 are unchanged; NaN and infinities round as FloatToBFloat16 does. A finite f within one
// bf16 ulp of the largest bf16 value can round to infinity, with that probability.
FUSEDPS_HOST_DEVICE uint16_t FloatToBFloat16Stochastic(float f, uint32_t random16) {
  const uint32_t bits = FloatToBits(f);
  if ((bits & 0x7f800000u) == 0x7f800000u) return FloatToBFloat16(f);  // inf, NaN
  return static_cast<uint16_t>((bits + (random16 & 0xffffu)) >> 16);
}

// --- One AdamW step with low-precision state (the reference of both backends' loops). ---

// One element with bf16 state (codes are bf16 bit patterns), fp32 param.
FUSEDPS_HOST_DEVICE void AdamWUpdateBFloat16State(const AdamWStepScalars& s, float grad,
                                                  float& param, uint16_t& exp_avg,
                                                  uint16_t& exp_avg_sq) {
  float m = BFloat16ToFloat(exp_avg), v = BFloat16ToFloat(exp_avg_sq);
  AdamWUpdate(s, grad, param, m, v, nullptr);
  exp_avg = FloatToBFloat16(m);
  exp_avg_sq = FloatToBFloat16(v);
}

// One block of n <= kQuantBlock elements with int8 state, on the host (the CUDA kernel does the
// same with a warp per block and a shuffle reduction for the absmax). params are fp32; m_codes
// and v_codes the block's codes; absmax_m and absmax_v its scales, read and rewritten.
inline void AdamWUpdateInt8Block(const AdamWStepScalars& s, const float* grads, float* params,
                                 uint8_t* m_codes, uint8_t* v_codes, float& absmax_m,
                                 float& absmax_v, int n, const QuantMap& signed_map,
                                 const QuantMap& unsigned_map) {
  float m[kQuantBlock], v[kQuantBlock];
  float new_absmax_m = 0.0f, new_absmax_v = 0.0f;
  for (int i = 0; i < n; ++i) {
    m[i] = Dequantize(signed_map.values, m_codes[i], absmax_m);
    v[i] = Dequantize(unsigned_map.values, v_codes[i], absmax_v);
    AdamWUpdate(s, grads[i], params[i], m[i], v[i], nullptr);
    new_absmax_m = fmaxf(new_absmax_m, fabsf(m[i]));
    new_absmax_v = fmaxf(new_absmax_v, v[i]);
  }
  for (int i = 0; i < n; ++i) {
    m_codes[i] = QuantizeScaled(signed_map.values, m[i], new_absmax_m);
    v_codes[i] = QuantizeScaled(unsigned_map.values, v[i], new_absmax_v);
  }
  absmax_m = new_absmax_m;
  absmax_v = new_absmax_v;
}

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_QUANT_MATH_H_
