// row_init.h: the initial values of a hashed embedding table's rows, for the CPU and, later,
// CUDA backends alike (plain C++ and CUDA, host and device; nothing here allocates).
//
// A hashed table (hashed_rows.h) creates a key's row the first time a push names it, and again
// after an eviction. Its value depends only on (seed, key, column): no generator state exists,
// so any shard, any slot, any order of creation, a replay or a restore gives the same bits.
// Element `column` of the row of `key` is normal(0, std), by this recipe (uint64 arithmetic
// wraps; every other operation is an IEEE-754 float64 +, -, *, / or sqrt):
//   1. row_key = Mix64(Mix64(seed) ^ uint64(key))                 (quant_math.h's Mix64)
//   2. bits = Mix64(row_key + (column + 1) * 0x9e3779b97f4a7c15)  (splitmix64's output number
//      column + 1 from the state row_key); hi = bits >> 32, lo = bits & 0xffffffff
//   3. log_u = RowInitLog(hi) ~ ln(u), u = (hi + 0.5) / 2^32 in (0, 1), never 0 or 1
//   4. cos_t = RowInitCos(lo) ~ cos(2 pi t), t = lo / 2^32 in [0, 1)
//   5. value = float(sqrt(-2 * log_u) * cos_t * double(std))      (Box-Muller, cosine half),
//      the products left to right, one rounding to fp32 at the end.
// |value| <= 6.8 * std (the smallest u is 2^-33); std 0 gives zeros (of either sign).
//
// Why not logf / cosf (or log / cos): libm and CUDA's math library round them differently in
// the last bit (neither is correctly rounded), so the two backends would disagree on some rows.
// RowInitLog and RowInitCos instead use exact integer range reduction and fixed polynomials in
// float64 +, -, *, / only, which IEEE-754 rounds identically everywhere; sqrt is correctly
// rounded on both (IEEE-754 requires it; CUDA's double sqrt is). So the recipe is bit for bit
// the same on any IEEE-754 machine, provided no fused multiply-add is contracted from the source
// (-ffp-contract=off here, --fmad=false in nvcc, as for the rest of kernels/). Accuracy: both
// helpers are within about 1e-15 (relative for the log, absolute for the cosine) of the exact
// functions (hashed_rows_test checks them against long double references), far below fp32's 6e-8.
//
// Usage:
//   InitRow(seed, key, init_std, dim, params + slot * dim);  // moments: zero
#ifndef FUSEDPS_KERNELS_ROW_INIT_H_
#define FUSEDPS_KERNELS_ROW_INIT_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/half_float.h"   // FUSEDPS_HOST_DEVICE.
#include "kernels/quant_math.h"  // Mix64.

namespace fusedps {

// Step 1: the key of one row's stream, computed once per row.
FUSEDPS_HOST_DEVICE uint64_t RowInitKey(uint64_t seed, int64_t key) {
  return Mix64(Mix64(seed) ^ static_cast<uint64_t>(key));
}

// Step 2: the 64 random bits of element `column` (>= 0) of the row whose key is row_key.
FUSEDPS_HOST_DEVICE uint64_t RowInitBits(uint64_t row_key, int64_t column) {
  return Mix64(row_key + (static_cast<uint64_t>(column) + 1) * 0x9e3779b97f4a7c15ull);
}

// Step 3: ln((hi + 0.5) / 2^32), in float64 from +, -, *, / only. u = m / 2^33 with m = 2 hi + 1
// odd; m = x * 2^e with x in [sqrt(1/2), sqrt(2)) (e and x from m's float64 bits, exactly);
// ln(x) = 2 atanh(s), s = (x - 1) / (x + 1), |s| <= 0.1716, by its series to s^23 (the next
// term is below 1e-18 of the sum); ln(u) = ln(x) + (e - 33) * ln(2).
FUSEDPS_HOST_DEVICE double RowInitLog(uint32_t hi) {
  const double m = static_cast<double>(2 * static_cast<uint64_t>(hi) + 1);  // Exact: < 2^33.
  uint64_t bits;
  memcpy(&bits, &m, sizeof(bits));
  int64_t e = static_cast<int64_t>((bits >> 52) & 0x7ff) - 1023;
  bits = (bits & 0x000fffffffffffffull) | (uint64_t{1023} << 52);
  double x;
  memcpy(&x, &bits, sizeof(x));   // m / 2^e, in [1, 2).
  if (x >= 1.4142135623730951) {  // The float64 nearest sqrt(2).
    x *= 0.5;                     // Exact.
    ++e;
  }
  const double s = (x - 1.0) / (x + 1.0);  // x - 1 is exact (Sterbenz).
  const double s2 = s * s;
  double series = 1.0 / 23.0;
  constexpr double kOddReciprocals[] = {1.0 / 21.0, 1.0 / 19.0, 1.0 / 17.0, 1.0 / 15.0,
                                        1.0 / 13.0, 1.0 / 11.0, 1.0 / 9.0,  1.0 / 7.0,
                                        1.0 / 5.0,  1.0 / 3.0,  1.0};
  for (const double c : kOddReciprocals) series = c + s2 * series;
  constexpr double kLn2 = 0.6931471805599453;  // The float64 nearest ln(2).
  return 2.0 * s * series + static_cast<double>(e - 33) * kLn2;
}

// Step 4: cos(2 pi lo / 2^32), in float64 from +, -, *, / only. The turn lo / 2^32 is reduced
// exactly in integers to k quarter turns (k = the nearest, mod 4) plus r / 2^32, |r| <= 2^29,
// so theta = r * (2 pi / 2^32) is in [-pi/4, pi/4]; cos and sin of theta by their Taylor series
// (to theta^16 and theta^17: the next terms are below 3e-18), then the quadrant's identity:
// cos(theta + k pi/2) = cos theta, -sin theta, -cos theta, sin theta for k = 0, 1, 2, 3.
FUSEDPS_HOST_DEVICE double RowInitCos(uint32_t lo) {
  const uint64_t quarters = (static_cast<uint64_t>(lo) + (uint64_t{1} << 29)) >> 30;  // 0..4
  const int64_t r = static_cast<int64_t>(lo) - static_cast<int64_t>(quarters << 30);
  constexpr double kTwoPiOver2To32 = 6.283185307179586 / 4294967296.0;  // Exact scaling.
  const double theta = static_cast<double>(r) * kTwoPiOver2To32;
  const double t2 = theta * theta;
  // 1/n! for n = 16, 14, ..., 2 (cos) and 17, 15, ..., 3 (sin); every n! is exact in float64.
  constexpr double kCos[] = {
      1.0 / 20922789888000.0, -1.0 / 87178291200.0, 1.0 / 479001600.0, -1.0 / 3628800.0,
      1.0 / 40320.0,          -1.0 / 720.0,         1.0 / 24.0,        -1.0 / 2.0};
  constexpr double kSin[] = {
      1.0 / 355687428096000.0, -1.0 / 1307674368000.0, 1.0 / 6227020800.0, -1.0 / 39916800.0,
      1.0 / 362880.0,          -1.0 / 5040.0,          1.0 / 120.0,        -1.0 / 6.0};
  double cos_series = 0.0, sin_series = 0.0;
  for (const double c : kCos) cos_series = (cos_series + c) * t2;
  for (const double c : kSin) sin_series = (sin_series + c) * t2;
  const double cos_theta = 1.0 + cos_series;
  const double sin_theta = theta + theta * sin_series;
  switch (quarters & 3) {
    case 0:
      return cos_theta;
    case 1:
      return -sin_theta;
    case 2:
      return -cos_theta;
    default:
      return sin_theta;
  }
}

// Steps 2 to 5 for element `column` of the row whose key is row_key (RowInitKey).
FUSEDPS_HOST_DEVICE float RowInitValueOfRow(uint64_t row_key, int64_t column, float std) {
  const uint64_t bits = RowInitBits(row_key, column);
  const double log_u = RowInitLog(static_cast<uint32_t>(bits >> 32));
  const double cos_t = RowInitCos(static_cast<uint32_t>(bits));
  return static_cast<float>(sqrt(-2.0 * log_u) * cos_t * static_cast<double>(std));
}

// The initial value of element `column` (>= 0) of the row of `key` in a table with `seed`:
// normal(0, std), the recipe above.
FUSEDPS_HOST_DEVICE float RowInitValue(uint64_t seed, int64_t key, int64_t column, float std) {
  return RowInitValueOfRow(RowInitKey(seed, key), column, std);
}

// Writes the initial row of `key` to row[0, dim): row[j] = RowInitValue(seed, key, j, std).
// REQUIRES: dim >= 0; row has dim floats.
FUSEDPS_HOST_DEVICE void InitRow(uint64_t seed, int64_t key, float std, int64_t dim, float* row) {
  const uint64_t row_key = RowInitKey(seed, key);
  for (int64_t j = 0; j < dim; ++j) row[j] = RowInitValueOfRow(row_key, j, std);
}

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_ROW_INIT_H_
