#include "kernels/stored_values.h"

#include <algorithm>
#include <cstring>

#include "kernels/quant_math.h"

namespace fusedps {
namespace {

bool IsInt8State(TensorLayout layout, TensorField field) {
  return layout.state == StateDType::kInt8 &&
         (field == TensorField::kExpAvg || field == TensorField::kExpAvgSq);
}

}  // namespace

void StoredToFloat(TensorLayout layout, TensorField field, const void* stored, const float* scales,
                   uint64_t count, float* out) {
  if (count == 0) return;  // out may be null then.
  const int bytes = StoredElementBytes(layout, field);
  if (bytes == 4) {
    std::memcpy(out, stored, count * sizeof(float));
  } else if (bytes == 2) {
    const auto* half = static_cast<const uint16_t*>(stored);
    for (uint64_t i = 0; i < count; ++i) out[i] = BFloat16ToFloat(half[i]);
  } else if (IsInt8State(layout, field)) {
    const Int8Codebooks& books = DynamicCodebooks();
    const float* values =
        field == TensorField::kExpAvg ? books.exp_avg.values : books.exp_avg_sq.values;
    const auto* codes = static_cast<const uint8_t*>(stored);
    for (uint64_t i = 0; i < count; ++i) {
      out[i] = Dequantize(values, codes[i], scales[i / layout.scale_block]);
    }
  }
}

void FloatToStored(TensorLayout layout, TensorField field, const float* values, uint64_t offset,
                   uint64_t count, void* stored, float* scales) {
  if (count == 0) return;  // values may be null then (a load of an empty tensor).
  const int bytes = StoredElementBytes(layout, field);
  if (bytes == 4) {
    std::memcpy(static_cast<float*>(stored) + offset, values, count * sizeof(float));
  } else if (bytes == 2) {
    auto* half = static_cast<uint16_t*>(stored) + offset;
    for (uint64_t i = 0; i < count; ++i) half[i] = FloatToBFloat16(values[i]);
  } else if (IsInt8State(layout, field)) {
    const Int8Codebooks& books = DynamicCodebooks();
    const bool is_signed = field == TensorField::kExpAvg;
    auto* codes = static_cast<uint8_t*>(stored);
    const uint64_t block = layout.scale_block;
    for (uint64_t done = 0; done < count; done += block) {
      const int n = static_cast<int>(std::min<uint64_t>(block, count - done));
      QuantizeBlock(is_signed ? books.exp_avg : books.exp_avg_sq, is_signed, values + done, n,
                    codes + offset + done, &scales[(offset + done) / block]);
    }
  }
}

}  // namespace fusedps
