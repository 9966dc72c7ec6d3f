// Tests of kernels/adamw_math.h against an independent float64 AdamW reference.
#include "kernels/adamw_math.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/adamw_reference.h"

namespace fusedps {
namespace {

struct Config {
  const char* name;
  AdamWHyperparameters hyper;
  float grad_scale;
};

std::vector<Config> Configs() {
  std::vector<Config> configs;
  AdamWHyperparameters h;
  configs.push_back({"defaults", h, 0});
  h.lr = 0.01;
  configs.push_back({"lr_0.01", h, 0});
  h = {};
  h.weight_decay = 0.1;
  configs.push_back({"weight_decay_0.1", h, 0});
  h.maximize = true;
  configs.push_back({"weight_decay_maximize", h, 0});
  h.maximize = false;
  h.amsgrad = true;
  configs.push_back({"weight_decay_amsgrad", h, 0});
  h.amsgrad = false;
  h.decoupled_weight_decay = false;
  configs.push_back({"l2", h, 0});
  h = {};
  configs.push_back({"grad_scale_1024", h, 1024.0f});
  h.beta1 = 0.0;
  h.beta2 = 0.5;
  h.eps = 1e-3;
  configs.push_back({"odd_betas_eps", h, 0});
  return configs;
}

// Ten steps of AdamWUpdate in `kOrder` against the float64 reference (torch's order: both
// orders are the same value in exact arithmetic), within torch's tolerance.
template <UpdateOrder kOrder>
void ExpectMatchesFloat64ReferenceOverTenSteps() {
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const Config& c : Configs()) {
    SCOPED_TRACE(c.name);
    constexpr int kElements = 257;
    std::vector<ReferenceAdamW> ref(kElements);
    std::vector<float> param(kElements), exp_avg(kElements, 0), exp_avg_sq(kElements, 0),
        max_sq(kElements, 0);
    for (int i = 0; i < kElements; ++i) ref[i].param = param[i] = normal(rng);
    for (int step = 1; step <= 10; ++step) {
      const AdamWStepScalars s = MakeStepScalars(c.hyper, step, c.grad_scale);
      for (int i = 0; i < kElements; ++i) {
        const float grad = normal(rng) * (c.grad_scale > 0 ? c.grad_scale : 1.0f);
        AdamWUpdate<kOrder>(s, grad, param[i], exp_avg[i], exp_avg_sq[i], &max_sq[i]);
        ref[i].Step(c.hyper, grad, step, c.grad_scale);
      }
    }
    for (int i = 0; i < kElements; ++i) {
      ASSERT_NEAR(param[i], ref[i].param, 1e-5 + 1.3e-6 * std::abs(ref[i].param)) << i;
      ASSERT_NEAR(exp_avg[i], ref[i].exp_avg, 1e-6 + 1e-5 * std::abs(ref[i].exp_avg)) << i;
      ASSERT_NEAR(exp_avg_sq[i], ref[i].exp_avg_sq, 1e-6 + 1e-5 * std::abs(ref[i].exp_avg_sq));
      if (c.hyper.amsgrad) {
        ASSERT_NEAR(max_sq[i], ref[i].max_exp_avg_sq, 1e-6 + 1e-5 * ref[i].max_exp_avg_sq);
      }
    }
  }
}

TEST(AdamWMathTest, MatchesFloat64ReferenceOverTenSteps) {
  ExpectMatchesFloat64ReferenceOverTenSteps<UpdateOrder::kTorch>();
}

TEST(AdamWMathTest, FoldedOrderMatchesFloat64ReferenceOverTenSteps) {
  ExpectMatchesFloat64ReferenceOverTenSteps<UpdateOrder::kFolded>();
}

// The folded order is another computation, not torch's under another name: it rounds some
// params differently (else int8 state would match torch's order bit for bit, and the order
// would change nothing).
TEST(AdamWMathTest, FoldedOrderRoundsDifferentlyFromTorchs) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const AdamWStepScalars s = MakeStepScalars(AdamWHyperparameters{}, 3, 0.0f);
  int differ = 0;
  for (int i = 0; i < 1000; ++i) {
    const float grad = normal(rng), param = normal(rng), m = 0.1f * normal(rng);
    const float v = 0.01f * std::abs(normal(rng));
    float p1 = param, m1 = m, v1 = v, p2 = param, m2 = m, v2 = v;
    AdamWUpdate<UpdateOrder::kTorch>(s, grad, p1, m1, v1, nullptr);
    AdamWUpdate<UpdateOrder::kFolded>(s, grad, p2, m2, v2, nullptr);
    ASSERT_EQ(m1, m2);  // The moments are computed alike.
    ASSERT_EQ(v1, v2);
    ASSERT_NEAR(p1, p2, 4e-7 * std::abs(param) + 1e-9) << i;
    differ += p1 != p2;
  }
  EXPECT_GT(differ, 0);
}

TEST(AdamWMathTest, FirstStepMovesEachParamByAboutLr) {
  // With bias correction, step 1 moves each param by lr * sign(grad) (for |grad| >> eps).
  AdamWHyperparameters h;
  h.weight_decay = 0;
  h.lr = 0.5;
  const AdamWStepScalars s = MakeStepScalars(h, 1, 0);
  float p = 2.0f, m = 0, v = 0;
  AdamWUpdate(s, -3.0f, p, m, v, nullptr);
  EXPECT_NEAR(p, 2.5f, 1e-6);
  EXPECT_FLOAT_EQ(m, -0.3f);
}

// A positive, finite grad_scale below 1 / FLT_MAX (1e-39 is a subnormal float): its inverse
// overflows, so gradients must be divided by it, as torch's fused kernel does. Zero gradients
// then stay zero, and small ones stay finite and match the float64 reference.
TEST(AdamWMathTest, TinyGradScaleDividesInsteadOfOverflowing) {
  const float grad_scale = 1e-39f;
  ASSERT_TRUE(std::isinf(1.0f / grad_scale));
  AdamWHyperparameters h;
  const AdamWStepScalars s = MakeStepScalars(h, 1, grad_scale);
  for (const float grad : {0.0f, 3e-40f, -5e-40f}) {
    float p = 1.0f, m = 0, v = 0;
    ReferenceAdamW ref;
    ref.param = p;
    AdamWUpdate(s, grad, p, m, v, nullptr);
    ref.Step(h, grad, 1, grad_scale);
    ASSERT_TRUE(std::isfinite(p) && std::isfinite(m) && std::isfinite(v)) << grad;
    EXPECT_NEAR(p, ref.param, 1e-5 + 1.3e-6 * std::abs(ref.param)) << grad;
  }
}

TEST(ConversionTest, Float16KnownValues) {
  EXPECT_EQ(FloatToFloat16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToFloat16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToFloat16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToFloat16(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToFloat16(65520.0f), 0x7c00);  // Ties to even: overflows to inf.
  EXPECT_EQ(FloatToFloat16(0.1f), 0x2e66);
  EXPECT_EQ(FloatToFloat16(5.9604644775390625e-8f), 0x0001);   // Smallest subnormal.
  EXPECT_EQ(FloatToFloat16(2.98023223876953125e-8f), 0x0000);  // Half of it: ties to even.
  EXPECT_EQ(FloatToFloat16(1e-10f), 0x0000);
  EXPECT_EQ(FloatToFloat16(INFINITY), 0x7c00);
  EXPECT_TRUE(std::isnan(Float16ToFloat(FloatToFloat16(NAN))));
  EXPECT_EQ(Float16ToFloat(0x3555), 0.333251953125f);
  EXPECT_EQ(Float16ToFloat(0x8001), -5.9604644775390625e-8f);
}

TEST(ConversionTest, Float16RoundTripsEveryNonNanValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = Float16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToFloat16(f), h) << std::hex << h;
  }
}

TEST(ConversionTest, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(BitsToFloat(0x3f808000u)), 0x3f80);  // Tie, even stays.
  EXPECT_EQ(FloatToBFloat16(BitsToFloat(0x3f818000u)), 0x3f82);  // Tie, odd rounds up.
  EXPECT_EQ(FloatToBFloat16(BitsToFloat(0x3f808001u)), 0x3f81);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(NAN))));
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = BFloat16ToFloat(static_cast<uint16_t>(b));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBFloat16(f), b) << std::hex << b;
  }
}

TEST(ConversionTest, LoadGradReadsEachDType) {
  const float f32[] = {1.5f, -2.0f};
  const uint16_t bf16[] = {0x3fc0, 0xc000};
  const uint16_t f16[] = {0x3e00, 0xc000};
  EXPECT_EQ(LoadGrad(f32, GradDType::kFloat32, 1), -2.0f);
  EXPECT_EQ(LoadGrad(bf16, GradDType::kBFloat16, 0), 1.5f);
  EXPECT_EQ(LoadGrad(f16, GradDType::kFloat16, 0), 1.5f);
  EXPECT_EQ(LoadGrad(f16, GradDType::kFloat16, 1), -2.0f);
}

}  // namespace
}  // namespace fusedps
