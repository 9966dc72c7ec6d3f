// GradsAllFinite against the definition it implements: every element, widened to float and
// divided by grad_scale, is finite (std::isfinite).
#include "kernels/grad_check.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace fusedps {
namespace {

bool Reference(float value, float grad_scale) {
  return std::isfinite(grad_scale > 0 ? value / grad_scale : value);
}

// 1e-39 is subnormal: 1 / 1e-39 overflows to inf, which a multiplication by the inverse would
// turn into NaN for a zero gradient.
const float kScales[] = {0.0f, 1.0f, 256.0f, 0.5f, 1e-30f, 1e-39f};

// Every bf16 and fp16 bit pattern, alone and in the middle of a large finite array.
TEST(GradCheckTest, EveryHalfPatternAgreesWithTheDefinition) {
  for (GradDType dtype : {GradDType::kBFloat16, GradDType::kFloat16}) {
    for (float scale : kScales) {
      for (uint32_t p = 0; p <= 0xFFFF; ++p) {
        const uint16_t bits = static_cast<uint16_t>(p);
        const float value =
            dtype == GradDType::kBFloat16 ? BFloat16ToFloat(bits) : Float16ToFloat(bits);
        ASSERT_EQ(GradsAllFinite(&bits, dtype, 1, scale), Reference(value, scale))
            << "dtype " << static_cast<int>(dtype) << " bits 0x" << std::hex << p << " grad_scale "
            << scale;
      }
    }
  }
}

TEST(GradCheckTest, Float32SpecialsAndRandomPatterns) {
  std::vector<float> values = {0.0f,
                               -0.0f,
                               std::numeric_limits<float>::max(),
                               -std::numeric_limits<float>::max(),
                               std::numeric_limits<float>::denorm_min(),
                               std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::quiet_NaN(),
                               -std::numeric_limits<float>::quiet_NaN()};
  std::mt19937 rng(3);
  for (int i = 0; i < 100000; ++i) {
    const uint32_t bits = static_cast<uint32_t>(rng());
    float v;
    std::memcpy(&v, &bits, 4);
    values.push_back(v);
  }
  for (float scale : kScales) {
    for (float v : values) {
      ASSERT_EQ(GradsAllFinite(&v, GradDType::kFloat32, 1, scale), Reference(v, scale))
          << v << " grad_scale " << scale;
    }
  }
}

// One bad element anywhere in a long array (several 64K-element pieces), serial or parallel.
TEST(GradCheckTest, OneBadElementAnywhereInALongArray) {
  constexpr uint64_t kCount = 300001;
  for (bool parallel : {false, true}) {
    for (uint64_t at :
         {uint64_t{0}, uint64_t{65535}, uint64_t{65536}, uint64_t{150000}, kCount - 1}) {
      std::vector<uint16_t> bf16(kCount, 0x3F80);  // 1.0
      EXPECT_TRUE(GradsAllFinite(bf16.data(), GradDType::kBFloat16, kCount, 0.0f, parallel));
      bf16[at] = 0xFFC0;  // NaN
      EXPECT_FALSE(GradsAllFinite(bf16.data(), GradDType::kBFloat16, kCount, 0.0f, parallel)) << at;
      std::vector<float> fp32(kCount, 1.0f);
      fp32[at] = 3e38f;  // Finite, but inf once divided by 0.5.
      EXPECT_TRUE(GradsAllFinite(fp32.data(), GradDType::kFloat32, kCount, 2.0f, parallel));
      EXPECT_FALSE(GradsAllFinite(fp32.data(), GradDType::kFloat32, kCount, 0.5f, parallel)) << at;
    }
  }
}

// SeeGrads, then GradCheckFinite at any scale, agrees with GradsAllFinite (which the tests above
// hold to the definition) on arrays with specials in them, in every dtype; and the check of two
// halves merged is the check of the whole.
TEST(GradCheckTest, ACheckSeenOnceDecidesForEveryScaleAsTheHostCheckDoes) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> uniform(-4.0f, 4.0f);
  const float specials[] = {std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::max(),
                            3e38f,
                            65504.0f,
                            1e-39f};
  for (GradDType dtype : {GradDType::kFloat32, GradDType::kBFloat16, GradDType::kFloat16}) {
    for (int trial = 0; trial < 40; ++trial) {
      std::vector<float> values(257);
      for (float& v : values) v = uniform(rng);
      if (trial % 2 == 1) values[rng() % values.size()] = specials[trial / 2 % 7];
      std::vector<char> grads(values.size() * DTypeSize(dtype));
      for (size_t i = 0; i < values.size(); ++i) {
        if (dtype == GradDType::kFloat32) {
          std::memcpy(grads.data() + 4 * i, &values[i], 4);
        } else {
          const uint16_t h = dtype == GradDType::kBFloat16 ? FloatToBFloat16(values[i])
                                                           : FloatToFloat16(values[i]);
          std::memcpy(grads.data() + 2 * i, &h, 2);
        }
      }
      const GradCheck whole = SeeGrads(grads.data(), dtype, values.size());
      GradCheck halves = SeeGrads(grads.data(), dtype, 100);
      MergeGradChecks(&halves,
                      SeeGrads(grads.data() + 100 * DTypeSize(dtype), dtype, values.size() - 100));
      EXPECT_EQ(halves.finite, whole.finite);
      EXPECT_EQ(halves.max_abs, whole.max_abs);
      for (float scale : kScales) {
        ASSERT_EQ(GradCheckFinite(whole, scale),
                  GradsAllFinite(grads.data(), dtype, values.size(), scale))
            << "dtype " << static_cast<int>(dtype) << " trial " << trial << " scale " << scale;
      }
    }
  }
}

}  // namespace
}  // namespace fusedps
