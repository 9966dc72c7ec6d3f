// half_float.h: bit-exact conversions between fp32 and the 16-bit floats on the wire (bf16 and
// IEEE fp16), for host and device code alike. Shared by the server's kernels (adamw_math.h
// reads and writes staged gradients with them) and the clients (wire.cc rounds what they send
// and read), so that both sides round the same way; header-only, no dependencies.
//
// Rounding is to nearest even (as torch's .to(torch.bfloat16) and .half() round); NaN stays a
// quiet NaN; fp16 overflows to inf.
#ifndef FUSEDPS_COMMON_HALF_FLOAT_H_
#define FUSEDPS_COMMON_HALF_FLOAT_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#ifndef FUSEDPS_HOST_DEVICE
#ifdef __CUDACC__
#define FUSEDPS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FUSEDPS_HOST_DEVICE inline
#endif
#endif

namespace fusedps {

FUSEDPS_HOST_DEVICE float BitsToFloat(uint32_t bits) {
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
}
FUSEDPS_HOST_DEVICE uint32_t FloatToBits(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof(bits));
  return bits;
}

FUSEDPS_HOST_DEVICE float BFloat16ToFloat(uint16_t b) {
  return BitsToFloat(static_cast<uint32_t>(b) << 16);
}

// Round to nearest even; NaN stays NaN (quiet).
FUSEDPS_HOST_DEVICE uint16_t FloatToBFloat16(float f) {
  const uint32_t bits = FloatToBits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

FUSEDPS_HOST_DEVICE float Float16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));  // inf/NaN
  if (exponent != 0) return BitsToFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // Zero or subnormal: mantissa * 2^-24, exact in fp32.
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
  return sign ? -magnitude : magnitude;
}

// Round to nearest even, overflow to inf, NaN stays NaN.
FUSEDPS_HOST_DEVICE uint16_t FloatToFloat16(float f) {
  const uint32_t bits = FloatToBits(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520
  if (abs < 0x38800000u) {  // Below the smallest normal half (2^-14): subnormal or zero.
    // Scale by 2^24 so that one half subnormal ulp is 1.0, then round to nearest even.
    const float scaled = BitsToFloat(abs) * 16777216.0f;
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(rintf(scaled)));
  }
  const uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

}  // namespace fusedps

#endif  // FUSEDPS_COMMON_HALF_FLOAT_H_
