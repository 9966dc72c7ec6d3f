// Tests of the CPU backend's low-precision storage (issue 16): each state dtype and bf16 params
// against a float64 reference of the same algorithm, written from its definition in
// quant_math.h's header (dequantize, AdamW, new absmax per 256-element block, the nearest map
// value, stochastic rounding), one step at a time from the state the backend stored; fp32
// writes into low-precision storage; and what the fields read back as.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/adamw_reference.h"
#include "kernels/backend.h"
#include "kernels/quant_math.h"
#include "kernels/stored_values.h"

namespace fusedps {
namespace {

// The index of the map value nearest to x, in float64, by trying all 256.
int Nearest(const QuantMap& map, double x) {
  int best = 0;
  for (int i = 1; i < kQuantMapSize; ++i) {
    if (std::abs(map.values[i] - x) < std::abs(map.values[best] - x)) best = i;
  }
  return best;
}

// One tensor's stored fields, read back.
struct Stored {
  std::vector<float> params32;
  std::vector<uint16_t> params16;
  std::vector<float> m32, v32;
  std::vector<uint16_t> m16, v16;
  std::vector<uint8_t> m8, v8;
  std::vector<float> absmax_m, absmax_v;
};

Stored ReadStoredFields(OptimizerBackend& b, uint32_t t) {
  const TensorLayout l = b.layout(t);
  const uint64_t n = b.numel(t);
  Stored s;
  const auto read = [&](TensorField f, auto& v) {
    v.resize(StoredCount(l, f, n));
    if (!v.empty()) {
      EXPECT_TRUE(ReadStored(b, f, t, v.data()).ok());
    }
  };
  if (l.params == ParamsDType::kFloat32) read(TensorField::kParam, s.params32);
  if (l.params == ParamsDType::kBFloat16) read(TensorField::kParam, s.params16);
  switch (l.state) {
    case StateDType::kFloat32:
      read(TensorField::kExpAvg, s.m32);
      read(TensorField::kExpAvgSq, s.v32);
      break;
    case StateDType::kBFloat16:
      read(TensorField::kExpAvg, s.m16);
      read(TensorField::kExpAvgSq, s.v16);
      break;
    case StateDType::kInt8:
      read(TensorField::kExpAvg, s.m8);
      read(TensorField::kExpAvgSq, s.v8);
      read(TensorField::kExpAvgAbsmax, s.absmax_m);
      read(TensorField::kExpAvgSqAbsmax, s.absmax_v);
      break;
  }
  return s;
}

double Bf16Ulp(double x) {  // The spacing of bf16 values at |x|.
  if (x == 0) return std::ldexp(1.0, -133);
  int e = 0;
  std::frexp(std::abs(x), &e);
  return std::ldexp(1.0, e - 8);
}

struct Counts {
  int compared = 0, off_by_one = 0;
  double sr_error_sum = 0;  // Of bf16 params: (stored - exact) / ulp.
  int sr_count = 0;
};

// One step of tensor t from `before`, in float64, checked against what the backend stored.
void CheckStep(const AdamWHyperparameters& h, const TensorLayout& l, int64_t step,
               const std::vector<float>& grads, const Stored& before, const Stored& after,
               Counts& counts) {
  const QuantMap signed_map = MakeDynamicMap(true), unsigned_map = MakeDynamicMap(false);
  const size_t n = grads.size();
  std::vector<ReferenceAdamW> ref(n);
  // The size of the terms the fp32 update adds, for the bound on its rounding error (which is
  // relative to them, not to a result that cancels).
  std::vector<double> terms_m(n), terms_v(n);
  for (size_t i = 0; i < n; ++i) {
    ref[i].param = l.params == ParamsDType::kFloat32 ? before.params32[i]
                                                     : BFloat16ToFloat(before.params16[i]);
    if (l.state == StateDType::kFloat32) {
      ref[i].exp_avg = before.m32[i];
      ref[i].exp_avg_sq = before.v32[i];
    } else if (l.state == StateDType::kBFloat16) {
      ref[i].exp_avg = BFloat16ToFloat(before.m16[i]);
      ref[i].exp_avg_sq = BFloat16ToFloat(before.v16[i]);
    } else {
      ref[i].exp_avg = signed_map.values[before.m8[i]] * double{before.absmax_m[i / kQuantBlock]};
      ref[i].exp_avg_sq =
          unsigned_map.values[before.v8[i]] * double{before.absmax_v[i / kQuantBlock]};
    }
    const double g = std::abs(grads[i]) + h.weight_decay * std::abs(ref[i].param);
    terms_m[i] = std::abs(ref[i].exp_avg) + g;
    terms_v[i] = ref[i].exp_avg_sq + g * g;
    ref[i].Step(h, grads[i], step, 0);
  }
  for (size_t i = 0; i < n; ++i) {
    if (l.params == ParamsDType::kFloat32) {
      ASSERT_TRUE(NearTorch(after.params32[i], ref[i].param)) << i;
    } else {
      // Rounded stochastically: the bf16 value just below or just above the exact result.
      const double got = BFloat16ToFloat(after.params16[i]);
      const double ulp = Bf16Ulp(ref[i].param);
      ASSERT_LE(std::abs(got - ref[i].param), ulp * (1 + 1e-3) + 1e-5) << i;
      counts.sr_error_sum += (got - ref[i].param) / ulp;
      ++counts.sr_count;
    }
    if (l.state == StateDType::kFloat32) {
      ASSERT_TRUE(NearTorch(after.m32[i], ref[i].exp_avg)) << i;
      ASSERT_TRUE(NearTorch(after.v32[i], ref[i].exp_avg_sq)) << i;
    } else if (l.state == StateDType::kBFloat16) {
      // Rounded to nearest from an fp32 result within fp32 rounding (of its terms) of the
      // exact one.
      for (auto [got, want, terms] : {std::tuple{after.m16[i], ref[i].exp_avg, terms_m[i]},
                                      std::tuple{after.v16[i], ref[i].exp_avg_sq, terms_v[i]}}) {
        ASSERT_LE(std::abs(BFloat16ToFloat(got) - want), 0.5 * Bf16Ulp(want) + 4e-7 * terms) << i;
      }
    }
  }
  if (l.state != StateDType::kInt8) return;
  for (size_t b = 0; b * kQuantBlock < n; ++b) {
    const size_t end = std::min(n, (b + 1) * kQuantBlock);
    double absmax_m = 0, absmax_v = 0;
    for (size_t i = b * kQuantBlock; i < end; ++i) {
      absmax_m = std::max(absmax_m, std::abs(ref[i].exp_avg));
      absmax_v = std::max(absmax_v, ref[i].exp_avg_sq);
    }
    ASSERT_NEAR(after.absmax_m[b], absmax_m, 1e-6 * absmax_m) << "block " << b;
    ASSERT_NEAR(after.absmax_v[b], absmax_v, 1e-6 * absmax_v) << "block " << b;
    for (size_t i = b * kQuantBlock; i < end; ++i) {
      const int want_m = absmax_m > 0 ? Nearest(signed_map, ref[i].exp_avg / absmax_m) : 127;
      const int want_v = absmax_v > 0 ? Nearest(unsigned_map, ref[i].exp_avg_sq / absmax_v) : 0;
      for (auto [got, want] :
           {std::pair<int, int>{after.m8[i], want_m}, std::pair<int, int>{after.v8[i], want_v}}) {
        ++counts.compared;
        // Off by one only where the fp32 value lies within rounding of a decision boundary.
        ASSERT_LE(std::abs(got - want), 1) << "element " << i;
        counts.off_by_one += got != want;
      }
    }
  }
}

struct LayoutCase {
  const char* name;
  StateDType state;
  ParamsDType params;
};

class CpuBackendStateTest : public ::testing::TestWithParam<LayoutCase> {};

// The group of the stepping tests: lr and weight decay large enough that every step moves the
// state, in the given storage.
AdamWHyperparameters SteppingHyper(StateDType state, ParamsDType params) {
  AdamWHyperparameters h;
  h.lr = 0.01;
  h.weight_decay = 0.1;
  h.state_dtype = state;
  h.params_dtype = params;
  h.rounding_seed = 5;
  return h;
}

TEST_P(CpuBackendStateTest, EachStepMatchesTheFloat64AlgorithmFromItsStoredState) {
  const LayoutCase lc = GetParam();
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto backend = MakeCpuBackend({.threads = 2});
  const AdamWHyperparameters h = SteppingHyper(lc.state, lc.params);
  ASSERT_TRUE(backend->SetParamGroup(0, h).ok());
  // Under and over the int8 threshold, partial blocks, several 32K-element pieces.
  const std::vector<uint64_t> sizes = {100, 4095, 4096, 5000, 70001};
  std::vector<NewTensor> specs;
  for (size_t t = 0; t < sizes.size(); ++t) specs.push_back({sizes[t], 0, 1000 + t});
  ASSERT_TRUE(backend->AddTensors(specs).ok());
  for (uint32_t t = 0; t < sizes.size(); ++t) {
    std::vector<float> values(sizes[t]);
    for (float& v : values) v = normal(rng);
    ASSERT_TRUE(backend->WriteParams(t, 0, values).ok());
    const TensorLayout l = backend->layout(t);
    EXPECT_EQ(l.params, lc.params);
    EXPECT_EQ(l.state, lc.state == StateDType::kInt8 && sizes[t] < kMinQuantNumel
                           ? StateDType::kFloat32
                           : lc.state);
  }
  Counts counts;
  for (int step = 1; step <= 6; ++step) {
    std::vector<uint32_t> tensors;
    std::vector<uint64_t> offsets;
    std::vector<float> grads;
    for (uint32_t t = 0; t < sizes.size(); ++t) {
      tensors.push_back(t);
      offsets.push_back(grads.size());
      for (uint64_t i = 0; i < AlignedNumel(sizes[t]); ++i) grads.push_back(normal(rng) * 0.1f);
    }
    std::vector<Stored> before;
    for (uint32_t t : tensors) before.push_back(ReadStoredFields(*backend, t));
    ASSERT_TRUE(StepNow(*backend, {tensors, offsets, grads.data(), GradDType::kFloat32, 0}).ok());
    for (uint32_t t : tensors) {
      SCOPED_TRACE(testing::Message() << lc.name << " step " << step << " tensor " << t);
      const std::vector<float> g(grads.begin() + offsets[t], grads.begin() + offsets[t] + sizes[t]);
      CheckStep(h, backend->layout(t), step, g, before[t], ReadStoredFields(*backend, t), counts);
      if (HasFatalFailure()) return;
    }
  }
  if (counts.compared > 0) {
    EXPECT_LT(counts.off_by_one, counts.compared / 1000)
        << counts.off_by_one << " of " << counts.compared << " codes off by one";
  }
  if (counts.sr_count > 0) {
    // Unbiased: the mean error is a small fraction of an ulp (about 0.3 / sqrt(n) by chance).
    EXPECT_LT(std::abs(counts.sr_error_sum / counts.sr_count), 0.02)
        << counts.sr_error_sum / counts.sr_count;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, CpuBackendStateTest,
    ::testing::Values(LayoutCase{"fp32", StateDType::kFloat32, ParamsDType::kFloat32},
                      LayoutCase{"bf16_state", StateDType::kBFloat16, ParamsDType::kFloat32},
                      LayoutCase{"int8_state", StateDType::kInt8, ParamsDType::kFloat32},
                      LayoutCase{"bf16_params", StateDType::kFloat32, ParamsDType::kBFloat16},
                      LayoutCase{"int8_state_bf16_params", StateDType::kInt8,
                                 ParamsDType::kBFloat16}),
    [](const testing::TestParamInfo<LayoutCase>& info) { return info.param.name; });

// The CPU backend's int8 step is quant_math.h's, bit for bit: Int8BlockStep with
// AdamWUpdate<kInt8StateOrder> on each block of the stored state gives the stored params, codes
// and scales. (cuda_backend_test holds the CUDA kernel to the CPU backend, bit for bit; this
// holds the CPU backend to the header, where the float64 test above cannot tell one order of
// the update from the other.)
TEST(CpuBackendStateTest, Int8StepIsTheHeadersStepBitForBit) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto backend = MakeCpuBackend({.threads = 2});
  const AdamWHyperparameters h = SteppingHyper(StateDType::kInt8, ParamsDType::kFloat32);
  ASSERT_TRUE(backend->SetParamGroup(0, h).ok());
  constexpr uint64_t kN = 5000;  // 19 whole blocks and a partial one.
  ASSERT_TRUE(backend->AddTensors({{kN, 0, 1000}}).ok());
  ASSERT_EQ(backend->layout(0).state, StateDType::kInt8);
  std::vector<float> values(kN);
  for (float& v : values) v = normal(rng);
  ASSERT_TRUE(backend->WriteParams(0, 0, values).ok());
  for (int step = 1; step <= 3; ++step) {
    std::vector<float> grads(AlignedNumel(kN));
    for (float& g : grads) g = normal(rng) * 0.1f;
    Stored want = ReadStoredFields(*backend, 0);
    const AdamWStepScalars s = MakeStepScalars(h, step, 0.0f);
    for (uint64_t first = 0; first < kN; first += kQuantBlock) {
      const uint64_t b = first / kQuantBlock;
      const int n = static_cast<int>(std::min<uint64_t>(kQuantBlock, kN - first));
      Int8BlockStep(DynamicCodebooks(), want.m8.data() + first, want.v8.data() + first,
                    want.absmax_m[b], want.absmax_v[b], n, [&](int j, float& m, float& v) {
                      AdamWUpdate<kInt8StateOrder>(s, grads[first + j], want.params32[first + j], m,
                                                   v, nullptr);
                    });
    }
    ASSERT_TRUE(StepNow(*backend, {{0}, {0}, grads.data(), GradDType::kFloat32, 0}).ok());
    const Stored got = ReadStoredFields(*backend, 0);
    SCOPED_TRACE(testing::Message() << "step " << step);
    EXPECT_EQ(got.params32, want.params32);
    EXPECT_EQ(got.m8, want.m8);
    EXPECT_EQ(got.v8, want.v8);
    EXPECT_EQ(got.absmax_m, want.absmax_m);
    EXPECT_EQ(got.absmax_v, want.absmax_v);
  }
}

// fp32 writes into int8 state quantize block by block (as QuantizeBlock), reads dequantize, and
// a write that is not whole blocks is refused with the state unchanged.
TEST(CpuBackendStateTest, Fp32WritesIntoInt8StateQuantizeWholeBlocks) {
  auto backend = MakeCpuBackend({.threads = 1});
  AdamWHyperparameters h;
  h.state_dtype = StateDType::kInt8;
  ASSERT_TRUE(backend->SetParamGroup(0, h).ok());
  constexpr uint64_t kN = 5000;
  ASSERT_TRUE(backend->AddTensors({{kN, 0}}).ok());
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1e-3f);
  std::vector<float> values(kN);
  for (float& v : values) v = normal(rng);
  WriteRequest w;
  w.field = TensorField::kExpAvg;
  w.count = kN;
  w.src = values.data();
  ASSERT_TRUE(backend->Write(w).ok());
  std::vector<float> read(kN);
  ASSERT_TRUE(ReadTensor(*backend, TensorField::kExpAvg, 0, read.data()).ok());
  const QuantCodebook& book = DynamicCodebooks().exp_avg;
  for (uint64_t b = 0; b * kQuantBlock < kN; ++b) {
    const int n = static_cast<int>(std::min<uint64_t>(kQuantBlock, kN - b * kQuantBlock));
    std::vector<uint8_t> codes(n);
    float absmax = 0;
    QuantizeBlock(book, true, values.data() + b * kQuantBlock, n, codes.data(), &absmax);
    for (int i = 0; i < n; ++i) {
      ASSERT_EQ(read[b * kQuantBlock + i], book.values[codes[i]] * absmax) << b << " " << i;
      // Within the map's resolution of the value written (the top decade: 1/64 of absmax).
      ASSERT_NEAR(read[b * kQuantBlock + i], values[b * kQuantBlock + i], absmax / 64);
    }
  }
  // Not whole blocks: refused, nothing changes.
  std::vector<uint8_t> codes_before(kN);
  ASSERT_TRUE(ReadStored(*backend, TensorField::kExpAvg, 0, codes_before.data()).ok());
  w.offset = 100;
  w.count = 256;
  EXPECT_EQ(backend->Write(w).code(), absl::StatusCode::kInvalidArgument);
  w.offset = 256;
  w.count = 300;
  EXPECT_EQ(backend->Write(w).code(), absl::StatusCode::kInvalidArgument);
  std::vector<uint8_t> codes_after(kN);
  ASSERT_TRUE(ReadStored(*backend, TensorField::kExpAvg, 0, codes_after.data()).ok());
  EXPECT_EQ(codes_before, codes_after);
  // The tail block may end at the tensor's end.
  w.offset = 4864;
  w.count = kN - 4864;
  EXPECT_TRUE(backend->Write(w).ok());
}

// Stored writes land bit for bit; scales only stored; bad fields refused.
TEST(CpuBackendStateTest, StoredFormsRoundTripAndScalesAreStoredOnly) {
  auto backend = MakeCpuBackend({.param_copy_dtype = ParamCopyDType::kBFloat16, .threads = 1});
  AdamWHyperparameters h;
  h.state_dtype = StateDType::kInt8;
  h.params_dtype = ParamsDType::kBFloat16;
  ASSERT_TRUE(backend->SetParamGroup(0, h).ok());
  ASSERT_TRUE(backend->AddTensors({{4100, 0}, {10, 0}}).ok());
  std::vector<uint8_t> codes(4100);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>(i * 7);
  std::vector<float> scales(QuantBlocks(4100));
  for (size_t b = 0; b < scales.size(); ++b) scales[b] = 0.5f + b;
  WriteRequest w;
  w.field = TensorField::kExpAvgSq;
  w.count = codes.size();
  w.src = codes.data();
  w.stored = true;
  ASSERT_TRUE(backend->Write(w).ok());
  w.field = TensorField::kExpAvgSqAbsmax;
  w.count = scales.size();
  w.src = scales.data();
  ASSERT_TRUE(backend->Write(w).ok());
  std::vector<uint8_t> codes_read(codes.size());
  std::vector<float> scales_read(scales.size());
  ASSERT_TRUE(ReadStored(*backend, TensorField::kExpAvgSq, 0, codes_read.data()).ok());
  ASSERT_TRUE(ReadStored(*backend, TensorField::kExpAvgSqAbsmax, 0, scales_read.data()).ok());
  EXPECT_EQ(codes, codes_read);
  EXPECT_EQ(scales, scales_read);
  // Scales as fp32, or of a tensor without int8 state (the small one): FAILED_PRECONDITION.
  w.stored = false;
  EXPECT_EQ(backend->Write(w).code(), absl::StatusCode::kFailedPrecondition);
  std::vector<float> out(100);
  EXPECT_EQ(ReadTensor(*backend, TensorField::kExpAvgAbsmax, 0, out.data()).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ReadStored(*backend, TensorField::kExpAvgAbsmax, 1, out.data()).code(),
            absl::StatusCode::kFailedPrecondition);
  // bf16 params have no copy.
  std::vector<uint16_t> copy(4100);
  EXPECT_EQ(ReadParamCopy(*backend, 0, copy.data()).code(), absl::StatusCode::kFailedPrecondition);
  // Params written as fp32 are rounded to nearest even.
  const std::vector<float> params = {1.0f + 1.0f / 512, 3.14159f, -2.0f};
  ASSERT_TRUE(backend->WriteParams(0, 0, params).ok());
  std::vector<uint16_t> stored(4100);
  ASSERT_TRUE(ReadStored(*backend, TensorField::kParam, 0, stored.data()).ok());
  for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(stored[i], FloatToBFloat16(params[i]));
}

// A write of no elements (a state load of an empty tensor) is a no-op, its source null, for
// every field and form (state_loader_fuzz found the null source reaching memcpy).
TEST(CpuBackendStateTest, WritesOfNoElementsAreNoOps) {
  for (StateDType state : {StateDType::kFloat32, StateDType::kBFloat16, StateDType::kInt8}) {
    auto backend = MakeCpuBackend({.threads = 1});
    AdamWHyperparameters h;
    h.state_dtype = state;
    h.params_dtype = state == StateDType::kInt8 ? ParamsDType::kBFloat16 : ParamsDType::kFloat32;
    ASSERT_TRUE(backend->SetParamGroup(0, h).ok());
    ASSERT_TRUE(backend->AddTensors({{0, 0}, {5000, 0}}).ok());
    for (uint32_t tensor : {0u, 1u}) {
      for (TensorField field :
           {TensorField::kParam, TensorField::kExpAvg, TensorField::kExpAvgSq}) {
        for (bool stored : {false, true}) {
          WriteRequest w;
          w.field = field;
          w.tensor = tensor;
          w.src = nullptr;
          w.stored = stored;
          EXPECT_TRUE(backend->Write(w).ok()) << tensor << " " << TensorFieldName(field);
        }
      }
    }
  }
}

// amsgrad needs fp32 state; a group's storage cannot change once it has tensors.
TEST(CpuBackendStateTest, GroupStorageRules) {
  auto backend = MakeCpuBackend({.threads = 1});
  AdamWHyperparameters h;
  h.state_dtype = StateDType::kInt8;
  h.amsgrad = true;
  EXPECT_EQ(backend->SetParamGroup(0, h).code(), absl::StatusCode::kInvalidArgument);
  h.amsgrad = false;
  ASSERT_TRUE(backend->SetParamGroup(0, h).ok());
  h.state_dtype = StateDType::kBFloat16;
  EXPECT_TRUE(backend->SetParamGroup(0, h).ok());  // No tensors yet: may change.
  ASSERT_TRUE(backend->AddTensors({{5000, 0}}).ok());
  h.state_dtype = StateDType::kInt8;
  EXPECT_EQ(backend->SetParamGroup(0, h).code(), absl::StatusCode::kInvalidArgument);
  h.state_dtype = StateDType::kBFloat16;
  h.lr = 0.5;  // Other hyperparameters may change.
  EXPECT_TRUE(backend->SetParamGroup(0, h).ok());
  EXPECT_EQ(backend->layout(0).state, StateDType::kBFloat16);
}

}  // namespace
}  // namespace fusedps
