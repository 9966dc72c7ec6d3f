// backend_write_test.h (tests only): the restore writes (OptimizerBackend::Write and SetStep)
// checked on any backend: values written in pieces at offsets read back exactly, field by field
// and in the param copy, steps count on from SetStep, and bad writes are refused.
#ifndef FUSEDPS_KERNELS_BACKEND_WRITE_TEST_H_
#define FUSEDPS_KERNELS_BACKEND_WRITE_TEST_H_

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"

namespace fusedps {

// REQUIRES: `backend` is new, with param_copy_dtype() kBFloat16.
inline void ExpectRestoreWritesLandExactly(OptimizerBackend& backend) {
  AdamWHyperparameters amsgrad;
  amsgrad.amsgrad = true;
  ASSERT_TRUE(backend.SetParamGroup(0, {}).ok());
  ASSERT_TRUE(backend.SetParamGroup(1, amsgrad).ok());
  ASSERT_TRUE(backend.AddTensors({{5, 0}, {1001, 1}}).ok());
  const uint64_t n = 1001;
  std::vector<float> values(n);
  std::vector<uint16_t> copy(n);
  for (uint64_t i = 0; i < n; ++i) {
    values[i] = 0.25f * static_cast<float>(i) - 3.0f;
    copy[i] = static_cast<uint16_t>(0x3f00 + i);  // Not params' rounding: written, not derived.
  }
  // Each field of tensor 1 in three pieces, in a scrambled order; then its step.
  for (TensorField field : {TensorField::kParam, TensorField::kExpAvg, TensorField::kExpAvgSq,
                            TensorField::kMaxExpAvgSq}) {
    for (uint64_t begin : {uint64_t{700}, uint64_t{0}, uint64_t{300}}) {
      const uint64_t end = begin == 700 ? n : begin + 300 + (begin == 300 ? 100 : 0);
      WriteRequest w{field, false, 1, begin, end - begin, values.data() + begin};
      ASSERT_TRUE(backend.Write(w).ok());
    }
  }
  ASSERT_TRUE(backend.Write({TensorField::kParam, true, 1, 0, n, copy.data()}).ok());
  ASSERT_TRUE(backend.SetStep(1, 41).ok());
  absl::StatusOr<Marker> marker = backend.Mark();
  ASSERT_TRUE(marker.ok() && backend.Wait(*marker).ok());
  for (TensorField field : {TensorField::kParam, TensorField::kExpAvg, TensorField::kExpAvgSq,
                            TensorField::kMaxExpAvgSq}) {
    std::vector<float> out(n);
    ASSERT_TRUE(ReadTensor(backend, field, 1, out.data()).ok());
    EXPECT_EQ(out, values) << "field " << static_cast<int>(field);
  }
  std::vector<uint16_t> copy_out(n);
  ASSERT_TRUE(ReadParamCopy(backend, 1, copy_out.data()).ok());
  EXPECT_EQ(copy_out, copy);
  // Tensor 0 was not written: zero, like any new tensor.
  std::vector<float> zero(5, 1.0f);
  ASSERT_TRUE(ReadTensor(backend, TensorField::kExpAvg, 0, zero.data()).ok());
  EXPECT_EQ(zero, std::vector<float>(5, 0.0f));
  // The step goes on from the one set.
  std::vector<float> grads(AlignedNumel(n), 0.5f);
  const std::vector<uint32_t> tensors = {1};
  const std::vector<uint64_t> offsets = {0};
  absl::StatusOr<StepOutcome> step =
      StepNow(backend, {tensors, offsets, grads.data(), GradDType::kFloat32, 0});
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(backend.step(1), 42);

  // Refused, and nothing written: outside the tensor, an unknown tensor, max_exp_avg_sq
  // without amsgrad, a negative step.
  const float one = 1.0f;
  EXPECT_EQ(backend.Write({TensorField::kParam, false, 0, 5, 1, &one}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend.Write({TensorField::kParam, false, 0, 4, 2, &one}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend.Write({TensorField::kParam, false, 2, 0, 1, &one}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend.Write({TensorField::kMaxExpAvgSq, false, 0, 0, 1, &one}).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(backend.Write({TensorField::kExpAvg, true, 0, 0, 1, &one}).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(backend.SetStep(0, -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend.SetStep(2, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend.step(0), 0);
}

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_BACKEND_WRITE_TEST_H_
