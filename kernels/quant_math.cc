// quant_math.cc: the dynamic quantization maps and codebooks of kernels/quant_math.h.
#include "kernels/quant_math.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <vector>

namespace fusedps {

QuantMap MakeDynamicMap(bool is_signed) {
  constexpr int kExponentBits = 7;  // Decades 1e-6 .. 1.
  std::vector<double> values;
  for (int i = 0; i < kExponentBits; ++i) {
    const double scale = std::pow(10.0, i - (kExponentBits - 1));
    const int points = (is_signed ? (1 << i) : (2 << i)) + 1;  // Evenly spaced on [0.1, 1].
    const double spacing = 0.9 / (points - 1);
    for (int k = 0; k + 1 < points; ++k) {
      const double midpoint = 0.1 + spacing * (k + 0.5);
      values.push_back(scale * midpoint);
      if (is_signed) values.push_back(-scale * midpoint);
    }
  }
  values.push_back(0.0);
  values.push_back(1.0);
  std::sort(values.begin(), values.end());
  QuantMap map{};
  for (int i = 0; i < kQuantMapSize; ++i) map.values[i] = static_cast<float>(values[i]);
  return map;
}

QuantCodebook MakeCodebook(bool is_signed) {
  const QuantMap map = MakeDynamicMap(is_signed);
  QuantCodebook book{};
  std::copy(std::begin(map.values), std::end(map.values), std::begin(book.values));
  // The magnitudes a code can stand for, ascending from 0.
  const int first = is_signed ? 127 : 0;
  const int n = is_signed ? kSignedThresholds : kUnsignedThresholds;
  for (int k = 0; k < kQuantMapSize; ++k) {
    book.thresholds[k] = k < n ? (map.values[first + k] + map.values[first + k + 1]) * 0.5f
                               : std::numeric_limits<float>::infinity();
  }
  // buckets[b]: the thresholds at or below the bucket's first value; then check that no bucket
  // holds two thresholds above its start (CountAtOrBelow compares one).
  int count = 0;
  for (int b = 0; b < kQuantBuckets; ++b) {
    const float start =
        b == 0 ? 0.0f : BitsToFloat(kQuantBucketBase + (static_cast<uint32_t>(b - 1) << 16));
    while (count < n && book.thresholds[count] <= start) ++count;
    book.buckets[b] = static_cast<uint8_t>(count);
    const float end = b + 1 < kQuantBuckets
                          ? BitsToFloat(kQuantBucketBase + (static_cast<uint32_t>(b) << 16))
                          : 2.0f;
    int inside = 0;
    for (int k = count; k < n && book.thresholds[k] < end; ++k) ++inside;
    if (inside > 1) {
      std::fprintf(stderr, "MakeCodebook: bucket %d holds %d thresholds\n", b, inside);
      std::abort();
    }
  }
  return book;
}

const Int8Codebooks& DynamicCodebooks() {
  static const Int8Codebooks books{MakeCodebook(true), MakeCodebook(false)};
  return books;
}

uint64_t TensorRoundingKey(const char* name, uint64_t length) {
  uint64_t hash = 0xcbf29ce484222325ull;  // FNV-1a's offset basis and prime.
  for (uint64_t i = 0; i < length; ++i) {
    hash ^= static_cast<unsigned char>(name[i]);
    hash *= 0x100000001b3ull;
  }
  return Mix64(hash);
}

void QuantizeBlock(const QuantCodebook& book, bool is_signed, const float* x, int n, uint8_t* codes,
                   float* absmax) {
  float scale = 0.0f;
  for (int i = 0; i < n; ++i) scale = std::fmax(scale, is_signed ? std::fabs(x[i]) : x[i]);
  const float inverse = InverseScale(scale);
  for (int i = 0; i < n; ++i) {
    codes[i] = static_cast<uint8_t>(
        is_signed ? QuantizeSigned(book.thresholds, book.buckets, x[i], inverse)
                  : QuantizeUnsigned(book.thresholds, book.buckets, x[i], inverse));
  }
  *absmax = scale;
}

}  // namespace fusedps
