#include "kernels/grad_check.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/parallel.h"

namespace fusedps {
namespace {

constexpr uint64_t kPieceNumel = 64 * 1024;

template <GradDType kDType>
bool RangeFinite(const void* grads, uint64_t begin, uint64_t end, float grad_scale) {
  bool finite = true;
  for (uint64_t i = begin; i < end; ++i) {
    finite &= std::isfinite(LoadGrad(grads, kDType, i) / grad_scale);
  }
  return finite;
}

// True when no element of [begin, end) has every exponent bit set (inf or NaN), for an
// IEEE-style format whose exponent bits are `mask`. A branch-free OR over the raw bits, which
// the compiler vectorizes; the float path above is scalar.
template <typename Bits>
bool BitsFinite(const void* grads, uint64_t begin, uint64_t end, Bits mask) {
  const Bits* bits = static_cast<const Bits*>(grads);
  Bits all_ones = 0;
  for (uint64_t i = begin; i < end; ++i) all_ones |= static_cast<Bits>((bits[i] & mask) == mask);
  return all_ones == 0;
}

bool RangeFinite(const void* grads, GradDType dtype, uint64_t begin, uint64_t end,
                 float grad_scale) {
  // Dividing by a grad_scale >= 1 cannot turn a finite value into inf, so the check is then
  // one of the stored bits alone. (Every fp16 and bf16 value is exactly a float.)
  if (grad_scale >= 1.0f) {
    switch (dtype) {
      case GradDType::kBFloat16:
        return BitsFinite<uint16_t>(grads, begin, end, 0x7F80);
      case GradDType::kFloat16:
        return BitsFinite<uint16_t>(grads, begin, end, 0x7C00);
      case GradDType::kFloat32:
      default:
        return BitsFinite<uint32_t>(grads, begin, end, 0x7F800000u);
    }
  }
  switch (dtype) {
    case GradDType::kBFloat16:
      return RangeFinite<GradDType::kBFloat16>(grads, begin, end, grad_scale);
    case GradDType::kFloat16:
      return RangeFinite<GradDType::kFloat16>(grads, begin, end, grad_scale);
    case GradDType::kFloat32:
    default:
      return RangeFinite<GradDType::kFloat32>(grads, begin, end, grad_scale);
  }
}

struct Range {
  uint64_t begin, end;
};

bool RangesFinite(const void* grads, GradDType dtype, const std::vector<Range>& ranges,
                  float grad_scale, bool parallel) {
  const float scale = grad_scale > 0 ? grad_scale : 1.0f;
  const int64_t n = static_cast<int64_t>(ranges.size());
  bool finite = true;
  const int threads = OmpThreads();
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(&& : finite) \
    if (parallel && n > 1)
  for (int64_t k = 0; k < n; ++k) {
    finite = finite && RangeFinite(grads, dtype, ranges[k].begin, ranges[k].end, scale);
  }
  return finite;
}

void AddPieces(uint64_t begin, uint64_t end, std::vector<Range>& out) {
  for (uint64_t b = begin; b < end; b += kPieceNumel)
    out.push_back({b, std::min(end, b + kPieceNumel)});
}

}  // namespace

bool GradsAllFinite(const void* grads, GradDType dtype, uint64_t count, float grad_scale,
                    bool parallel) {
  std::vector<Range> ranges;
  AddPieces(0, count, ranges);
  return RangesFinite(grads, dtype, ranges, grad_scale, parallel);
}

GradCheck SeeGrads(const void* grads, GradDType dtype, uint64_t count) {
  GradCheck check;
  for (uint64_t i = 0; i < count; ++i) {
    const float g = LoadGrad(grads, dtype, i);
    if (!std::isfinite(g)) {
      check.finite = false;
    } else {
      check.max_abs = std::max(check.max_abs, std::fabs(g));
    }
  }
  return check;
}

void MergeGradChecks(GradCheck* into, const GradCheck& more) {
  into->finite = into->finite && more.finite;
  into->max_abs = std::max(into->max_abs, more.max_abs);
}

bool GradCheckFinite(const GradCheck& check, float grad_scale) {
  if (!check.finite) return false;
  return grad_scale <= 0.0f || std::isfinite(check.max_abs / grad_scale);
}

bool PushGradsAllFinite(const StepRequest& request,
                        const std::function<uint64_t(uint32_t tensor)>& numel) {
  std::vector<Range> ranges;
  for (size_t r = 0; r < request.tensors.size(); ++r) {
    const uint64_t begin = request.grad_offsets[r];
    AddPieces(begin, begin + numel(request.tensors[r]), ranges);
  }
  return RangesFinite(request.grads, request.grad_dtype, ranges, request.grad_scale, true);
}

bool StepGradsFinite(const StepRequest& request, bool* staged_non_finite,
                     const std::function<uint64_t(uint32_t tensor)>& numel) {
  if (request.from_accumulator) return request.grads_finite;  // The pushes' checks.
  if (request.grads == nullptr) {
    const bool finite = !*staged_non_finite;
    *staged_non_finite = false;
    return finite;
  }
  if (request.grads_checked) return request.grads_finite;
  return PushGradsAllFinite(request, numel);
}

}  // namespace fusedps
