// quant_math.h: low-precision AdamW state and params, the math shared by the CPU and CUDA
// backends, as adamw_math.h is for fp32. Plain C++ and CUDA (host and device), except the
// codebook construction (host). Nothing here allocates.
//
// State dtypes (a param group's state_dtype, fixed at registration):
//   fp32  exp_avg and exp_avg_sq in fp32 (adamw_math.h)
//   bf16  both stored in bf16 (round to nearest even); the update reads them as fp32, runs
//         AdamWUpdate in fp32 and rounds the new values
//   int8  both stored as one byte per element plus one fp32 scale per block of kQuantBlock
//         elements (block-wise dynamic quantization: Dettmers et al., "8-bit Optimizers via
//         Block-wise Quantization", arXiv 2110.02861; bitsandbytes and torchao's AdamW8bit):
//           1. dequantize: m = signed_map[code] * absmax_m, v = unsigned_map[code] * absmax_v
//           2. AdamWUpdate in fp32 with those m, v, in the folded order (kInt8StateOrder,
//              adamw_math.h): the param update uses the new fp32 m and v
//           3. per block, absmax = max |new m| and max new v
//           4. code = the map value nearest to |value| x (1 / absmax) (Quantize below; the
//              reciprocal once per block, as a multiplication is far cheaper than a division
//              on the GPU); a block of zeros has absmax 0 and the codes of 0
//         Tensors under kMinQuantNumel elements keep fp32 state, as bitsandbytes does (biases,
//         norms: little memory, the most sensitive to quantization).
// Choices, on evidence (bitsandbytes 0.44+ and torchao both): blocks of 256 (bitsandbytes'
// changelog: 2048 -> 256 "improves accuracy"; torchao's default; 256 is also one warp pass of
// our kernel, 32 lanes x 8, so a block's absmax is one warp reduction); the signed dynamic map
// for exp_avg and the unsigned one for exp_avg_sq (torchao's choice: the latter is never
// negative, so its 256 codes all go to the magnitudes); nearest rounding, no stochastic
// rounding of state (neither library rounds optimizer state stochastically).
//
// Nearest, exactly: a map's decision thresholds are the fp32 midpoints of neighbouring
// magnitudes, (a + b) * 0.5f, and a magnitude's code counts the thresholds at or below it
// (ties go away from zero). Both backends count with a bucket table (CountAtOrBelow): one
// lookup by the float's exponent and top 7 mantissa bits, then one comparison, which the table's
// construction proves is enough. A binary search over the thresholds gives the same counts
// (quant_math_test checks both against each other and against brute force).
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

namespace fusedps {

constexpr int kQuantBlock = 256;           // Elements per scale.
constexpr uint64_t kMinQuantNumel = 4096;  // Smaller tensors keep fp32 state.
constexpr int kQuantMapSize = 256;

// The order of int8 state's update (adamw_math.h): folded, bitsandbytes' 8-bit order. The same
// value as torch's in exact arithmetic, one IEEE division less per element: the CUDA kernel's
// int8 step was bound by instructions (with this order and units of 3, adamw_kernel.cuh, GPT-2
// small's int8 step ran 4% faster on an H100: 1.55x to 1.61x fp32's), and no torch optimizer
// has this state to match bit for bit. fp32 and bf16 state keep torch's order.
constexpr UpdateOrder kInt8StateOrder = UpdateOrder::kFolded;

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
// values from -0.99296875, 0 at index 127, 128 positive ones up to 1 at index 255 (so the
// negative side mirrors the positive one but for 1). Unsigned: 0 at index 0, then 254 positive
// values from 3.25e-7, and 1. Host only.
QuantMap MakeDynamicMap(bool is_signed);

// The bucket of a magnitude a in [0, 1] (what Normalized returns): 0 below 2^-23, else 1 +
// (its exponent and top 7 mantissa bits, counted from 2^-23); 1.0 is the last bucket.
constexpr uint32_t kQuantBucketBase = 0x34000000u;  // The bits of 2^-23.
constexpr int kQuantBuckets = 2946;                 // 1 + 23 octaves x 128 + 1 (for 1.0).
constexpr int kQuantBucketsPadded = 2960;           // A multiple of 16 bytes.

FUSEDPS_HOST_DEVICE int QuantBucket(float a) {
  // Counted from one bucket below 2^-23, so that everything below lands in bucket 0 by a max,
  // without a test; and no clamp above 1.0: the kernel's quantizers are instruction-bound.
  constexpr uint32_t kBelow = kQuantBucketBase - (1u << 16);
  const uint32_t bits = FloatToBits(a);
  return static_cast<int>(((bits > kBelow ? bits : kBelow) - kBelow) >> 16);
}

// One map ready for quantizing. `thresholds` lists the midpoints between neighbouring
// magnitudes, ascending: the unsigned map's 255 (between values i and i+1); the signed map's
// 128, between its positive magnitudes 0, values[128..255]; the entries after them are +inf.
// buckets[b] counts the thresholds at or below the start of bucket b; each bucket holds at
// most one more (MakeCodebook checks it), so a magnitude's count is one lookup and one
// comparison.
struct QuantCodebook {
  float values[kQuantMapSize];
  float thresholds[kQuantMapSize];  // [0, threshold_count); the rest +inf.
  uint8_t buckets[kQuantBucketsPadded];
};
static_assert(sizeof(QuantCodebook) % 16 == 0, "copied in 16-byte pieces");
constexpr int kSignedThresholds = 128;
constexpr int kUnsignedThresholds = 255;

// The codebook of MakeDynamicMap(is_signed). Host only; aborts if a bucket would hold two
// thresholds (a broken invariant of the table, not an input error).
QuantCodebook MakeCodebook(bool is_signed);

// The number of a codebook's thresholds at or below a (a in [0, 1]), with the bucket table.
// The thresholds after the map's count are +inf, so the count needs no bound.
FUSEDPS_HOST_DEVICE int CountAtOrBelow(const float* thresholds, const uint8_t* buckets, float a) {
  const int lo = buckets[QuantBucket(a)];
  return lo + (thresholds[lo] <= a ? 1 : 0);
}

// A block's scale as the quantizers take it: 1 / absmax (0 for a block of zeros), computed once
// per block, so that each value costs a multiplication, not a division.
FUSEDPS_HOST_DEVICE float InverseScale(float absmax) {
  return absmax > 0.0f ? 1.0f / absmax : 0.0f;
}

// A value's magnitude relative to its block's scale, in [0, 1]: |x| * inverse_scale, clamped
// (it may round 1 ulp above 1; and an absmax so small that its inverse overflows gives 1 for
// any non-zero x). kFiniteInverse: the caller has checked that inverse_scale is finite (once per
// block, in the CUDA kernel), so a magnitude of 0 gives 0 without the test: the same result.
template <bool kFiniteInverse = false>
FUSEDPS_HOST_DEVICE float Normalized(float magnitude, float inverse_scale) {
  if (!kFiniteInverse && magnitude == 0.0f) return 0.0f;
  return fminf(magnitude * inverse_scale, 1.0f);
}

// The code of exp_avg value m in a block whose scale absmax is >= every |m| of the block
// (inverse_scale = InverseScale(absmax); 0 for a block of zeros), in the signed map: 127 + the
// count for m >= 0, 127 - the count (at most 127) for m < 0. kFiniteInverse as Normalized's.
// The code is returned in [0, 255] but as a 32-bit value: the kernel packs four with byte
// permutes, which need no masking.
template <bool kFiniteInverse = false>
FUSEDPS_HOST_DEVICE uint32_t QuantizeSigned(const float* thresholds, const uint8_t* buckets,
                                            float m, float inverse_scale) {
  const int count =
      CountAtOrBelow(thresholds, buckets, Normalized<kFiniteInverse>(fabsf(m), inverse_scale));
  return static_cast<uint32_t>(m < 0.0f ? 127 - (count < 127 ? count : 127) : 127 + count);
}

// The code of exp_avg_sq value v in a block of inverse scale inverse_scale, in the unsigned map.
// A v that is not positive (an exp_avg_sq the step never makes, but a state load could send)
// gets code 0. kFiniteInverse as Normalized's.
template <bool kFiniteInverse = false>
FUSEDPS_HOST_DEVICE uint32_t QuantizeUnsigned(const float* thresholds, const uint8_t* buckets,
                                              float v, float inverse_scale) {
  // A select, not an early return: the CUDA kernel's 8 quantizations per lane then need no
  // branch. 0 has code 0: every threshold is above it.
  const float a = v > 0.0f ? Normalized<kFiniteInverse>(v, inverse_scale) : 0.0f;
  return static_cast<uint32_t>(CountAtOrBelow(thresholds, buckets, a));
}

FUSEDPS_HOST_DEVICE float Dequantize(const float* values, uint8_t code, float absmax) {
  return values[code] * absmax;
}

// The signed and unsigned codebooks of int8 state, as the CUDA kernel keeps them in shared
// memory and the CPU backend in its own memory.
struct Int8Codebooks {
  QuantCodebook exp_avg;     // signed
  QuantCodebook exp_avg_sq;  // unsigned
};
// Built once (a function-local static), host only.
const Int8Codebooks& DynamicCodebooks();

// --- Stochastic rounding of bf16 params. ---

// splitmix64's output function (Steele, Lea, Flood, "Fast splittable pseudorandom number
// generators", OOPSLA 2014; the finalizer of java.util.SplittableRandom): a bijection of 64-bit
// integers whose output bits each depend on every input bit.
FUSEDPS_HOST_DEVICE uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A tensor's rounding key: a hash of its name (FNV-1a, 64-bit, then Mix64), so that its bits
// depend on what the tensor is, not on where it is stored: a restore into another layout, or
// another shard, rounds the same. Host only.
uint64_t TensorRoundingKey(const char* name, uint64_t length);

// The key of one tensor's step: computed once per (tensor, step), not per element.
FUSEDPS_HOST_DEVICE uint64_t RoundingKey(uint64_t seed, uint64_t tensor_key, int64_t step) {
  return Mix64(Mix64(Mix64(seed) ^ tensor_key) ^ static_cast<uint64_t>(step));
}

// A 32-bit bijection whose output bits each depend on every input bit (Chris Wellons'
// "lowbias32", from his hash-prospector search), for the per-element bits: two 32-bit
// multiplications, where Mix64's 64-bit ones cost several instructions each on a GPU.
FUSEDPS_HOST_DEVICE uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}

// 16 random bits for element `index` of the tensor whose step key is `key` (the index's low 32
// bits, spread by the golden ratio, offset by the key's halves).
FUSEDPS_HOST_DEVICE uint32_t RoundingBits(uint64_t key, uint64_t index) {
  const uint32_t x = static_cast<uint32_t>(index) * 0x9e3779b9u + static_cast<uint32_t>(key);
  return Mix32(x ^ static_cast<uint32_t>(key >> 32)) >> 16;
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

// One element with bf16 state (bf16 bit patterns), fp32 math.
FUSEDPS_HOST_DEVICE void AdamWUpdateBFloat16State(const AdamWStepScalars& s, float grad,
                                                  float& param, uint16_t& exp_avg,
                                                  uint16_t& exp_avg_sq) {
  float m = BFloat16ToFloat(exp_avg), v = BFloat16ToFloat(exp_avg_sq);
  AdamWUpdate(s, grad, param, m, v, nullptr);
  exp_avg = FloatToBFloat16(m);
  exp_avg_sq = FloatToBFloat16(v);
}

// One block of n <= kQuantBlock elements with int8 state, on the host (the CUDA kernel does the
// same with a warp per block and a shuffle reduction for the absmax). `update(i, m, v)` runs
// element i's AdamW (AdamWUpdate<kInt8StateOrder>) on its dequantized m and v (fp32, in place)
// and writes its param; then the
// block's scales become the new absmax values and its codes are requantized against them.
template <typename Update>
inline void Int8BlockStep(const Int8Codebooks& books, uint8_t* m_codes, uint8_t* v_codes,
                          float& absmax_m, float& absmax_v, int n, Update update) {
  float m[kQuantBlock], v[kQuantBlock];
  float new_absmax_m = 0.0f, new_absmax_v = 0.0f;
  for (int i = 0; i < n; ++i) {
    m[i] = Dequantize(books.exp_avg.values, m_codes[i], absmax_m);
    v[i] = Dequantize(books.exp_avg_sq.values, v_codes[i], absmax_v);
    update(i, m[i], v[i]);
    new_absmax_m = fmaxf(new_absmax_m, fabsf(m[i]));
    new_absmax_v = fmaxf(new_absmax_v, v[i]);
  }
  const float inverse_m = InverseScale(new_absmax_m), inverse_v = InverseScale(new_absmax_v);
  for (int i = 0; i < n; ++i) {
    m_codes[i] = static_cast<uint8_t>(
        QuantizeSigned(books.exp_avg.thresholds, books.exp_avg.buckets, m[i], inverse_m));
    v_codes[i] = static_cast<uint8_t>(
        QuantizeUnsigned(books.exp_avg_sq.thresholds, books.exp_avg_sq.buckets, v[i], inverse_v));
  }
  absmax_m = new_absmax_m;
  absmax_v = new_absmax_v;
}

// One block of fp32 values quantized (a state load, or a test): scale = max |x| (signed) or
// max x (unsigned), then each code. n <= kQuantBlock.
void QuantizeBlock(const QuantCodebook& book, bool is_signed, const float* x, int n, uint8_t* codes,
                   float* absmax);

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_QUANT_MATH_H_
