// backend_accumulate_test.h (tests only): a sync round's device work on any backend. Pushes in
// different dtypes and loss scales are summed into the accumulator (Accumulate), then one step
// reads the sums with grad_scale = the push count (their mean), for every tensor or some, and
// with lr / lr_divisor; checked against kernels/adamw_math.h applied element by element on the
// host to the same fp32 sums.
#ifndef FUSEDPS_KERNELS_BACKEND_ACCUMULATE_TEST_H_
#define FUSEDPS_KERNELS_BACKEND_ACCUMULATE_TEST_H_

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/adamw_math.h"
#include "kernels/backend.h"

namespace fusedps {

// REQUIRES: `backend` is new; `accumulate_kernel` is its accumulation's launch name.
inline void ExpectRoundsAverageIntoOneStep(OptimizerBackend& backend,
                                           const std::string& accumulate_kernel) {
  const std::vector<uint64_t> numels = {5, 3000, 1};
  const std::vector<uint32_t> tensors = {0, 1, 2};
  ASSERT_TRUE(backend.SetParamGroup(0, {}).ok());
  ASSERT_TRUE(backend.AddTensors({{5, 0}, {3000, 0}, {1, 0}}).ok());
  std::vector<uint64_t> offsets;
  uint64_t total = 0;
  for (uint64_t n : numels) {
    offsets.push_back(total);
    total += AlignedNumel(n);
  }
  std::vector<std::vector<float>> params(3);
  for (uint32_t t = 0; t < 3; ++t) {
    for (uint64_t i = 0; i < numels[t]; ++i) params[t].push_back(0.01f * (i % 97) - 0.3f * t);
    ASSERT_TRUE(backend.WriteParams(t, 0, params[t]).ok());
  }
  // Push a: bf16 grads with loss scale 8; push b: fp32 without.
  std::vector<uint16_t> a(total);
  std::vector<float> b(total), a_value(total);
  for (uint64_t i = 0; i < total; ++i) {
    a[i] = FloatToBFloat16(8.0f * (0.02f * static_cast<float>(i % 13) - 0.1f));
    a_value[i] = BFloat16ToFloat(a[i]);
    b[i] = 0.003f * static_cast<float>(i % 29) - 0.04f;
  }
  StepRequest push_a;
  push_a.tensors = tensors;
  push_a.grad_offsets = offsets;
  push_a.grads = a.data();
  push_a.grad_dtype = GradDType::kBFloat16;
  push_a.grad_scale = 8.0f;
  StepRequest push_b = push_a;
  push_b.grads = b.data();
  push_b.grad_dtype = GradDType::kFloat32;
  push_b.grad_scale = 0.0f;
  for (auto [push, first] : {std::pair{&push_a, true}, {&push_b, false}}) {
    absl::StatusOr<Marker> marker = backend.Accumulate(*push, first);
    ASSERT_TRUE(marker.ok()) << marker.status();
    ASSERT_TRUE(backend.Wait(*marker).ok());
  }
  StepRequest mean;
  mean.tensors = tensors;
  mean.from_accumulator = true;
  mean.grad_scale = 2.0f;
  mean.grads_checked = true;
  ASSERT_TRUE(StepNow(backend, mean).ok());

  // The same on the host: the fp32 sum in the same order, then the update of adamw_math.h.
  const AdamWHyperparameters h;
  std::vector<std::vector<float>> exp_avg(3), exp_avg_sq(3);
  for (uint32_t t = 0; t < 3; ++t) {
    exp_avg[t].assign(numels[t], 0.0f);
    exp_avg_sq[t].assign(numels[t], 0.0f);
    const AdamWStepScalars s = MakeStepScalars(h, 1, 2.0f);
    for (uint64_t i = 0; i < numels[t]; ++i) {
      const float sum = a_value[offsets[t] + i] / 8.0f + b[offsets[t] + i];
      AdamWUpdate(s, sum, params[t][i], exp_avg[t][i], exp_avg_sq[t][i], nullptr);
    }
  }
  // A second round of one push (b), stepping tensors 0 and 2 only, at lr / 3.
  StepRequest only_b = push_b;
  absl::StatusOr<Marker> marker = backend.Accumulate(only_b, /*first=*/true);
  ASSERT_TRUE(marker.ok() && backend.Wait(*marker).ok());
  const std::vector<uint32_t> some = {0, 2};
  mean.tensors = some;
  mean.grad_scale = 1.0f;
  mean.lr_divisor = 3.0;
  ASSERT_TRUE(StepNow(backend, mean).ok());
  for (uint32_t t : some) {
    const AdamWStepScalars s = MakeStepScalars(h, 2, 1.0f, 3.0);
    for (uint64_t i = 0; i < numels[t]; ++i) {
      AdamWUpdate(s, b[offsets[t] + i], params[t][i], exp_avg[t][i], exp_avg_sq[t][i], nullptr);
    }
  }
  for (uint32_t t = 0; t < 3; ++t) {
    std::vector<float> got(numels[t]);
    ASSERT_TRUE(ReadTensor(backend, TensorField::kParam, t, got.data()).ok());
    for (uint64_t i = 0; i < numels[t]; ++i) {
      ASSERT_NEAR(got[i], params[t][i], 1e-6f * (1.0f + std::fabs(params[t][i])))
          << "tensor " << t << " element " << i;
    }
  }
  EXPECT_EQ(backend.step(0), 2);
  EXPECT_EQ(backend.step(1), 1);
  EXPECT_EQ(backend.launch_counts().at(accumulate_kernel), 3u);
  EXPECT_GT(backend.memory_bytes().at("grad_accumulator"), 0u);
}

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_BACKEND_ACCUMULATE_TEST_H_
