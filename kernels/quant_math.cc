// quant_math.cc: the dynamic quantization maps of kernels/quant_math.h.
#include "kernels/quant_math.h"

#include <algorithm>
#include <cmath>
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

}  // namespace fusedps
