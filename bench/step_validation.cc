// step_validation.cc: the kernel bench's check of a backend's steps (step_validation.h).
#include "bench/step_validation.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/adamw_math.h"

namespace fusedps {
namespace {

// Elements per sampled range; each tensor gets its head, its tail and one random range.
constexpr uint64_t kSampleNumel = 8;
// AdamWUpdate here and in a backend may differ by a few fp32 ulps (FMA contraction on a GPU).
constexpr double kRelativeTolerance = 1e-6;
constexpr double kAbsoluteTolerance = 1e-7;

// One field of every tensor, laid out as the arenas are: fp32, or the 16-bit param copy.
struct FieldValues {
  std::vector<float> f32;
  std::vector<uint16_t> copy;
};

// Reads `field` of every tensor whole, as a pull does, with one request into a host buffer laid
// out as the arenas are (the CUDA backend then makes one copy of it), and waits for it.
absl::StatusOr<FieldValues> ReadField(OptimizerBackend& optimizer, const StagedGrads& layout,
                                      TensorField field, bool param_copy) {
  FieldValues values;
  const uint64_t element = param_copy ? 2 : 4;
  std::vector<uint64_t> byte_offsets;
  for (uint64_t offset : layout.offsets) byte_offsets.push_back(offset * element);
  ReadRequest read;
  read.field = field;
  read.param_copy = param_copy;
  read.tensors = layout.tensors;
  read.dst_offsets = byte_offsets;
  if (param_copy) {
    values.copy.resize(layout.arena_numel);
    read.dst = values.copy.data();
  } else {
    values.f32.resize(layout.arena_numel);
    read.dst = values.f32.data();
  }
  if (absl::Status status = ReadNow(optimizer, read); !status.ok()) return status;
  return values;
}

// The sampled elements of one field, sample by sample.
std::vector<std::vector<float>> Sampled(const FieldValues& values, const StagedGrads& layout,
                                        const std::vector<SampleRange>& samples) {
  std::vector<std::vector<float>> sampled;
  for (const SampleRange& r : samples) {
    const float* begin = values.f32.data() + layout.offsets[r.tensor] + r.begin;
    sampled.emplace_back(begin, begin + r.count);
  }
  return sampled;
}

struct StateValues {  // Per sample.
  std::vector<std::vector<float>> param, exp_avg, exp_avg_sq;
};

absl::StatusOr<StateValues> ReadState(OptimizerBackend& optimizer, const StagedGrads& layout,
                                      const std::vector<SampleRange>& samples) {
  StateValues v;
  const std::pair<TensorField, std::vector<std::vector<float>>*> reads[] = {
      {TensorField::kParam, &v.param},
      {TensorField::kExpAvg, &v.exp_avg},
      {TensorField::kExpAvgSq, &v.exp_avg_sq}};
  for (const auto& [field, out] : reads) {
    absl::StatusOr<FieldValues> values = ReadField(optimizer, layout, field, false);
    if (!values.ok()) return values.status();
    *out = Sampled(*values, layout, samples);
  }
  return v;
}

absl::Status CheckClose(const char* field, const SampleRange& r, uint64_t j, float actual,
                        float expected) {
  const double diff = std::fabs(static_cast<double>(actual) - expected);
  if (diff <= kAbsoluteTolerance + kRelativeTolerance * std::fabs(expected)) {
    return absl::OkStatus();
  }
  return absl::InternalError(absl::StrFormat("tensor %d element %d %s: got %.9g, expected %.9g",
                                             r.tensor, r.begin + j, field, actual, expected));
}

}  // namespace

std::vector<SampleRange> PickSamples(const std::vector<uint64_t>& numels, uint64_t seed) {
  std::mt19937_64 rng(SplitMix64(seed ^ 0x5a5a5a5aull));
  std::vector<SampleRange> samples;
  for (uint32_t t = 0; t < numels.size(); ++t) {
    const uint64_t n = numels[t];
    const uint64_t count = std::min(n, kSampleNumel);
    samples.push_back({t, 0, count});
    if (n > count) samples.push_back({t, n - count, count});
    if (n > 2 * count) {
      std::uniform_int_distribution<uint64_t> begin(0, n - count);
      samples.push_back({t, begin(rng), count});
    }
  }
  return samples;
}

absl::StatusOr<uint64_t> ValidateOneStep(OptimizerBackend& optimizer, const StagedGrads& grads,
                                         const std::vector<SampleRange>& samples) {
  std::vector<int64_t> steps_before(optimizer.tensor_count());
  for (uint32_t t = 0; t < optimizer.tensor_count(); ++t) steps_before[t] = optimizer.step(t);
  absl::StatusOr<StateValues> before = ReadState(optimizer, grads, samples);
  if (!before.ok()) return before.status();

  const StepRequest request = grads.Request();
  absl::StatusOr<StepOutcome> outcome = StepNow(optimizer, request);
  if (!outcome.ok()) return outcome.status();
  if (outcome->skipped || outcome->tensors_updated != optimizer.tensor_count()) {
    return absl::InternalError(absl::StrCat("step of finite gradients skipped or partial: ",
                                            outcome->tensors_updated, " tensors updated"));
  }
  for (uint32_t t = 0; t < optimizer.tensor_count(); ++t) {
    if (optimizer.step(t) != steps_before[t] + 1) {
      return absl::InternalError(absl::StrCat("tensor ", t, " step is ", optimizer.step(t),
                                              ", expected ", steps_before[t] + 1));
    }
  }

  const AdamWHyperparameters hyper;  // Group 0, as Populate registered it.
  absl::StatusOr<StateValues> after = ReadState(optimizer, grads, samples);
  if (!after.ok()) return after.status();
  FieldValues copy;
  if (optimizer.param_copy_dtype() == ParamCopyDType::kBFloat16) {
    absl::StatusOr<FieldValues> values = ReadField(optimizer, grads, TensorField::kParam, true);
    if (!values.ok()) return values.status();
    copy = *std::move(values);
  }
  uint64_t checked = 0;
  for (size_t k = 0; k < samples.size(); ++k) {
    const SampleRange& r = samples[k];
    const AdamWStepScalars s =
        MakeStepScalars(hyper, steps_before[r.tensor] + 1, request.grad_scale);
    for (uint64_t j = 0; j < r.count; ++j) {
      float param = before->param[k][j];
      float exp_avg = before->exp_avg[k][j];
      float exp_avg_sq = before->exp_avg_sq[k][j];
      const uint64_t g = grads.offsets[r.tensor] + r.begin + j;
      AdamWUpdate(s, LoadGrad(grads.host.data(), grads.dtype, g), param, exp_avg, exp_avg_sq,
                  nullptr);
      const float got = after->param[k][j];
      for (absl::Status status :
           {CheckClose("param", r, j, got, param),
            CheckClose("exp_avg", r, j, after->exp_avg[k][j], exp_avg),
            CheckClose("exp_avg_sq", r, j, after->exp_avg_sq[k][j], exp_avg_sq)}) {
        if (!status.ok()) return status;
      }
      if (!copy.copy.empty() && copy.copy[g] != FloatToBFloat16(got)) {
        return absl::InternalError(absl::StrFormat(
            "tensor %d element %d bf16 copy: got 0x%04x, expected 0x%04x of param %.9g", r.tensor,
            r.begin + j, copy.copy[g], FloatToBFloat16(got), got));
      }
      ++checked;
    }
  }
  return checked;
}

namespace {

// One field of every tensor in its stored form, each tensor at a 16-byte aligned offset.
absl::StatusOr<std::vector<char>> ReadStoredField(OptimizerBackend& b, TensorField field,
                                                  std::vector<uint64_t>* offsets) {
  std::vector<uint32_t> tensors;
  offsets->clear();
  uint64_t end = 0;
  for (uint32_t t = 0; t < b.tensor_count(); ++t) {
    const uint64_t bytes =
        StoredCount(b.layout(t), field, b.numel(t)) * StoredElementBytes(b.layout(t), field);
    if (bytes == 0) continue;
    tensors.push_back(t);
    offsets->push_back(end);
    end += (bytes + 15) / 16 * 16;
  }
  std::vector<char> data(end);
  if (tensors.empty()) return data;
  ReadRequest read;
  read.field = field;
  read.stored = true;
  read.tensors = tensors;
  read.dst_offsets = *offsets;
  read.dst = data.data();
  if (absl::Status status = ReadNow(b, read); !status.ok()) return status;
  return data;
}

}  // namespace

absl::StatusOr<uint64_t> ValidateAgainstTwin(OptimizerBackend& optimizer, OptimizerBackend& twin,
                                             const StagedGrads& grads) {
  absl::StatusOr<StepOutcome> outcome = StepNow(optimizer, grads.Request());
  if (!outcome.ok()) return outcome.status();
  StepRequest on_host = grads.Request();
  on_host.grads = grads.host.data();
  absl::StatusOr<StepOutcome> twin_outcome = StepNow(twin, on_host);
  if (!twin_outcome.ok()) return twin_outcome.status();
  if (outcome->skipped || twin_outcome->skipped) {
    return absl::InternalError("a step of finite gradients was skipped");
  }
  uint64_t compared = 0;
  for (TensorField field : {TensorField::kParam, TensorField::kExpAvg, TensorField::kExpAvgSq,
                            TensorField::kExpAvgAbsmax, TensorField::kExpAvgSqAbsmax}) {
    std::vector<uint64_t> offsets, twin_offsets;
    absl::StatusOr<std::vector<char>> a = ReadStoredField(optimizer, field, &offsets);
    if (!a.ok()) return a.status();
    absl::StatusOr<std::vector<char>> b = ReadStoredField(twin, field, &twin_offsets);
    if (!b.ok()) return b.status();
    if (*a == *b) {
      for (uint32_t t = 0; t < optimizer.tensor_count(); ++t) {
        compared += StoredCount(optimizer.layout(t), field, optimizer.numel(t));
      }
      continue;
    }
    const auto mismatch = std::mismatch(a->begin(), a->end(), b->begin()).first - a->begin();
    size_t i = 0;
    while (i + 1 < offsets.size() && offsets[i + 1] <= static_cast<uint64_t>(mismatch)) ++i;
    return absl::InternalError(absl::StrFormat(
        "%s differs from the CPU backend's: byte %d of the stored field (the %dth tensor that "
        "has it, from byte %d)",
        TensorFieldName(field), mismatch, i, offsets.empty() ? 0 : offsets[i]));
  }
  for (uint32_t t = 0; t < optimizer.tensor_count(); ++t) {
    if (optimizer.step(t) != twin.step(t)) {
      return absl::InternalError(absl::StrCat("tensor ", t, " step ", optimizer.step(t),
                                              ", the CPU backend's ", twin.step(t)));
    }
  }
  return compared;
}

}  // namespace fusedps
