// Tests of the CPU backend's embedding tables (backend.h: TableRows in a Step, ReadRows;
// backend_tables.h): a step of a dense tensor and table rows together gives the dense tensor a
// dense-only step's bits and the table row_sparse.h's bits, and matches the float64 SparseAdam
// of row_table_test_util.h; a non-finite row skips the whole step; bad rows are refused naming
// the field and change nothing; ReadRows returns rows in key order; a table with int8 state has
// a scale per row.
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/row_sparse.h"
#include "kernels/row_table_test_util.h"
#include "kernels/sparse_adam_math.h"
#include "kernels/stored_values.h"

namespace fusedps {
namespace {

using row_table_test::DecayedSparseAdam;
using row_table_test::NormalFloats;
using row_table_test::ReferenceRowUpdate;
using row_table_test::ReferenceStepSize;
using row_table_test::SameBytes;
using row_table_test::SumRows;

constexpr uint64_t kRows = 16;
constexpr uint64_t kDim = 5;
constexpr uint64_t kDense = 40;

std::vector<float> Field(OptimizerBackend& b, TensorField field, uint32_t t) {
  std::vector<float> out(b.numel(t));
  EXPECT_TRUE(ReadTensor(b, field, t, out.data()).ok());
  return out;
}

// A backend with tensor 0 dense (kDense elements) and tensor 1 a [kRows, kDim] table, both in
// group 0 (`hyper`), params from `rng`.
struct Shard {
  Shard(const AdamWHyperparameters& hyper, std::mt19937& rng) : backend(MakeCpuBackend({})) {
    EXPECT_TRUE(backend->SetParamGroup(0, hyper).ok());
    EXPECT_TRUE(backend->AddTensors({{kDense, 0}, {kRows * kDim, 0}}).ok());
    dense0 = NormalFloats(rng, kDense);
    table0 = NormalFloats(rng, kRows * kDim);
    EXPECT_TRUE(backend->WriteParams(0, 0, dense0).ok());
    EXPECT_TRUE(backend->WriteParams(1, 0, table0).ok());
  }
  // Everything a step may change.
  std::vector<std::vector<float>> State() {
    std::vector<std::vector<float>> all;
    for (uint32_t t : {0u, 1u}) {
      for (TensorField f : {TensorField::kParam, TensorField::kExpAvg, TensorField::kExpAvgSq}) {
        all.push_back(Field(*backend, f, t));
      }
    }
    return all;
  }
  std::unique_ptr<OptimizerBackend> backend;
  std::vector<float> dense0, table0;
};

// A step of dense tensors (their grads at `grads`, fp32) and table rows.
StepRequest Request(absl::Span<const uint32_t> tensors, absl::Span<const uint64_t> offsets,
                    const float* grads, absl::Span<const TableRows> rows, float grad_scale = 0.0f) {
  StepRequest request;
  request.tensors = tensors;
  request.grad_offsets = offsets;
  request.grads = grads;
  request.grad_scale = grad_scale;
  request.table_rows = rows;
  return request;
}

TEST(CpuTableRowsTest, DenseAndTableRowsStepTogetherAsEachAlone) {
  std::mt19937 rng(3);
  const AdamWHyperparameters h = DecayedSparseAdam();
  Shard shard(h, rng);
  std::mt19937 same(3);
  Shard dense_only(h, same);  // The same params: the dense tensor's reference.
  // The table's references: row_sparse.h's step on copies (bits), and float64 SparseAdam.
  std::vector<float> params = shard.table0, exp_avg(kRows * kDim), exp_avg_sq(kRows * kDim);
  RowSparseTable table{
      absl::MakeSpan(params), absl::MakeSpan(exp_avg), absl::MakeSpan(exp_avg_sq), kRows, kDim, 0};
  std::vector<double> p64(params.begin(), params.end()), m64(kRows * kDim), v64(kRows * kDim);
  const float grad_scale = 4.0f;
  for (int step = 1; step <= 6; ++step) {
    const std::vector<float> dense_grads = NormalFloats(rng, kDense);
    // Duplicates (3 and 7 twice); rows 0, 1 and 15 never pushed.
    const std::vector<int64_t> keys = {7, 3, 12, 3, 7, 2 + step};
    const std::vector<float> grads = NormalFloats(rng, keys.size() * kDim);
    const uint32_t dense_tensor[] = {0};
    const uint64_t offsets[] = {0};
    const TableRows rows[] = {{1, kDim, keys, grads}};
    const StepRequest request =
        Request(dense_tensor, offsets, dense_grads.data(), rows, grad_scale);
    const StepRequest dense_request =
        Request(dense_tensor, offsets, dense_grads.data(), {}, grad_scale);
    absl::StatusOr<StepOutcome> outcome = StepNow(*shard.backend, request);
    ASSERT_TRUE(outcome.ok()) << outcome.status();
    EXPECT_FALSE(outcome->skipped);
    EXPECT_EQ(outcome->tensors_updated, 2u);
    ASSERT_TRUE(StepNow(*dense_only.backend, dense_request).ok());
    ASSERT_TRUE(*ApplyRowSparseStep(table, h, keys, grads, grad_scale));
    const double step_size = ReferenceStepSize(h, step);
    for (const auto& [key, sum] : SumRows(keys, grads, kDim)) {
      std::vector<double> g(sum);
      for (double& x : g) x /= grad_scale;
      const size_t at = static_cast<size_t>(key) * kDim;
      ReferenceRowUpdate(h, step_size, g, &p64[at], &m64[at], &v64[at]);
    }
    EXPECT_EQ(shard.backend->step(0), step);
    EXPECT_EQ(shard.backend->step(1), step);  // One count for the table.
  }
  for (TensorField f : {TensorField::kParam, TensorField::kExpAvg, TensorField::kExpAvgSq}) {
    EXPECT_TRUE(SameBytes(Field(*shard.backend, f, 0), Field(*dense_only.backend, f, 0)));
  }
  EXPECT_TRUE(SameBytes(Field(*shard.backend, TensorField::kParam, 1), params));
  EXPECT_TRUE(SameBytes(Field(*shard.backend, TensorField::kExpAvg, 1), exp_avg));
  EXPECT_TRUE(SameBytes(Field(*shard.backend, TensorField::kExpAvgSq, 1), exp_avg_sq));
  const std::vector<float> got = Field(*shard.backend, TensorField::kParam, 1);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], p64[i], 1e-5 + 1e-5 * std::fabs(p64[i])) << "element " << i;
  }
  for (int64_t row : {0, 1, 15}) {  // Never pushed: every byte as registered.
    EXPECT_EQ(std::memcmp(&got[row * kDim], &shard.table0[row * kDim], kDim * sizeof(float)), 0);
  }
}

TEST(CpuTableRowsTest, ANonFiniteRowSkipsTheWholeStep) {
  std::mt19937 rng(4);
  Shard shard(DecayedSparseAdam(), rng);
  const std::vector<float> dense_grads = NormalFloats(rng, kDense);
  const std::vector<int64_t> keys = {1, 1};
  // Finite rows whose sum overflows: the check is of the summed, unscaled gradient.
  std::vector<float> grads(2 * kDim, 3e38f);
  const uint32_t dense_tensor[] = {0};
  const uint64_t offsets[] = {0};
  const TableRows rows[] = {{1, kDim, keys, grads}};
  const auto before = shard.State();
  absl::StatusOr<StepOutcome> outcome =
      StepNow(*shard.backend, Request(dense_tensor, offsets, dense_grads.data(), rows));
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  EXPECT_TRUE(outcome->skipped);
  EXPECT_EQ(shard.State(), before);
  EXPECT_EQ(shard.backend->step(0), 0);
  EXPECT_EQ(shard.backend->step(1), 0);
}

TEST(CpuTableRowsTest, BadRowsAreRefusedNamingTheFieldAndChangeNothing) {
  std::mt19937 rng(5);
  Shard shard(DecayedSparseAdam(), rng);
  AdamWHyperparameters bf16_params = DecayedSparseAdam();
  bf16_params.params_dtype = ParamsDType::kBFloat16;
  ASSERT_TRUE(shard.backend->SetParamGroup(1, bf16_params).ok());
  AdamWHyperparameters amsgrad = DecayedSparseAdam();
  amsgrad.amsgrad = true;
  ASSERT_TRUE(shard.backend->SetParamGroup(2, amsgrad).ok());
  ASSERT_TRUE(shard.backend->AddTensors({{kRows * kDim, 1}, {kRows * kDim, 2}}).ok());
  const std::vector<float> dense_grads = NormalFloats(rng, kDense);
  const std::vector<float> grads = NormalFloats(rng, 2 * kDim);
  const std::vector<int64_t> good = {0, 4}, outside = {0, 16}, negative = {-1, 2};
  const std::vector<int64_t> init_other = {5}, init_twice = {4, 4}, init_one = {4};
  const std::vector<float> init_params = NormalFloats(rng, 2 * kDim);
  const uint32_t dense_tensor[] = {0};
  const uint32_t table_tensor[] = {1};
  const uint64_t offsets[] = {0};
  struct Case {
    TableRows rows;
    absl::Span<const uint32_t> tensors;
    const char* message;
  };
  const Case cases[] = {
      {{1, kDim, outside, grads},
       dense_tensor,
       "table_rows[0].keys[1] = 16 is outside [0, 16) (the table's rows)"},
      {{1, kDim, negative, grads}, dense_tensor, "table_rows[0].keys[0] = -1 is outside"},
      {{1, kDim, good, absl::MakeConstSpan(grads).subspan(1)},
       dense_tensor,
       "table_rows[0].grads has 9 floats, not keys.size() * dim = 2 * 5"},
      {{1, 3, good, grads},
       dense_tensor,
       "table_rows[0].dim = 3 does not divide tensor 1's 80 elements"},
      {{9, kDim, good, grads},
       dense_tensor,
       "table_rows[0].tensor = 9 is not a registered tensor (4 registered)"},
      {{1, kDim, good, grads}, table_tensor, "table_rows[0].tensor = 1 is named twice"},
      {{2, kDim, good, grads},
       dense_tensor,
       "table_rows[0].tensor = 2: an embedding table needs fp32 params"},
      {{3, kDim, good, grads}, dense_tensor, "table_rows[0]: hyper.amsgrad"},
      {{1, kDim, good, grads, init_other, absl::MakeConstSpan(init_params).subspan(0, kDim)},
       dense_tensor,
       "table_rows[0].init_rows[0] = 5 is not one of the step's keys"},
      {{1, kDim, good, grads, init_twice, init_params},
       dense_tensor,
       "table_rows[0].init_rows[1] = 4 is not one of the step's keys, or is named twice"},
      {{1, kDim, good, grads, init_one, init_params},
       dense_tensor,
       "table_rows[0].init_params has 10 floats, not init_rows x dim = 1 x 5"},
  };
  const auto before = shard.State();
  for (const Case& c : cases) {
    const TableRows rows[] = {c.rows};
    StepRequest request = Request(c.tensors, offsets, dense_grads.data(), rows);
    absl::StatusOr<StepOutcome> outcome = shard.backend->Step(request);
    ASSERT_FALSE(outcome.ok()) << c.message;
    EXPECT_EQ(outcome.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(outcome.status().message().find(c.message), absl::string_view::npos)
        << outcome.status();
    EXPECT_EQ(shard.State(), before) << c.message;
    EXPECT_EQ(shard.backend->step(0), 0);
    EXPECT_EQ(shard.backend->step(1), 0);
  }
}

TEST(CpuTableRowsTest, ReadRowsReturnsRowsInKeyOrder) {
  std::mt19937 rng(6);
  Shard shard(DecayedSparseAdam(), rng);
  const std::vector<int64_t> pushed = {2, 9};
  const std::vector<float> grads = NormalFloats(rng, 2 * kDim);
  const TableRows rows[] = {{1, kDim, pushed, grads}};
  ASSERT_TRUE(StepNow(*shard.backend, Request({}, {}, nullptr, rows)).ok());
  const std::vector<int64_t> keys = {9, 0, 9, 15};
  for (TensorField f : {TensorField::kParam, TensorField::kExpAvg, TensorField::kExpAvgSq}) {
    const std::vector<float> whole = Field(*shard.backend, f, 1);
    std::vector<float> got(keys.size() * kDim, -1.0f);
    ASSERT_TRUE(shard.backend->ReadRows({f, 1, kDim, keys, got.data()}).ok());
    for (size_t i = 0; i < keys.size(); ++i) {
      EXPECT_EQ(std::memcmp(&got[i * kDim], &whole[keys[i] * kDim], kDim * sizeof(float)), 0)
          << TensorFieldName(f) << " row " << i;
    }
  }
  std::vector<float> out(kDim);
  const std::vector<int64_t> bad = {16};
  absl::Status s = shard.backend->ReadRows({TensorField::kParam, 1, kDim, bad, out.data()});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("keys[0] = 16 is outside [0, 16)"), absl::string_view::npos) << s;
  s = shard.backend->ReadRows({TensorField::kMaxExpAvgSq, 1, kDim, pushed, out.data()});
  EXPECT_NE(s.message().find("request.field = max_exp_avg_sq"), absl::string_view::npos) << s;
}

// A table with int8 state keeps one scale per row (tensor_layout.h): a step updates the pushed
// rows as sparse_adam_math.h's fp32 update of their dequantized moments, each row then quantized
// alone (stored_values.h's quantizer, QuantizeBlock, with the row as its block), and leaves
// every byte of the rows it does not name (codes, scales, params). The dense int8 tensor beside
// it keeps blocks of 256.
TEST(CpuTableRowsTest, Int8StateHasAScalePerRowAndLeavesOtherRowsAlone) {
  constexpr uint64_t kInt8Rows = 130, kInt8Dim = 40;  // 5,200 elements: over kMinQuantNumel.
  constexpr uint64_t kInt8Dense = 5000;
  std::mt19937 rng(21);
  AdamWHyperparameters h = DecayedSparseAdam();
  h.state_dtype = StateDType::kInt8;
  std::unique_ptr<OptimizerBackend> b = MakeCpuBackend({});
  ASSERT_TRUE(b->SetParamGroup(0, h).ok());
  ASSERT_TRUE(b->AddTensors({{kInt8Dense, 0}, {kInt8Rows * kInt8Dim, 0, 0, kInt8Dim}}).ok());
  ASSERT_TRUE(b->WriteParams(1, 0, NormalFloats(rng, kInt8Rows * kInt8Dim)).ok());
  const TensorLayout layout = b->layout(1);
  ASSERT_EQ(layout.state, StateDType::kInt8);
  EXPECT_EQ(StoredCount(layout, TensorField::kExpAvgAbsmax, kInt8Rows * kInt8Dim), kInt8Rows);
  EXPECT_EQ(StoredCount(b->layout(0), TensorField::kExpAvgAbsmax, kInt8Dense), 20u);
  const auto stored = [&](TensorField f) {
    std::vector<char> out(StoredCount(layout, f, kInt8Rows * kInt8Dim) *
                          StoredElementBytes(layout, f));
    EXPECT_TRUE(ReadStored(*b, f, 1, out.data()).ok());
    return out;
  };
  const TensorField fields[] = {TensorField::kParam, TensorField::kExpAvg, TensorField::kExpAvgSq,
                                TensorField::kExpAvgAbsmax, TensorField::kExpAvgSqAbsmax};
  for (int step = 1; step <= 6; ++step) {
    std::vector<int64_t> keys = {0, 7, 7, static_cast<int64_t>(kInt8Rows - 1)};
    std::uniform_int_distribution<int64_t> key(0, kInt8Rows / 3);
    for (int i = 0; i < 12; ++i) keys.push_back(key(rng));
    std::vector<float> grads = NormalFloats(rng, keys.size() * kInt8Dim);
    for (float& g : grads) g *= step == 3 ? 1e-3f : 1.0f;  // Scales move down and up.
    std::vector<std::vector<char>> before;
    for (TensorField f : fields) before.push_back(stored(f));
    const std::vector<float> params = Field(*b, TensorField::kParam, 1);
    const std::vector<float> exp_avg = Field(*b, TensorField::kExpAvg, 1);
    const std::vector<float> exp_avg_sq = Field(*b, TensorField::kExpAvgSq, 1);
    const TableRows rows[] = {{1, kInt8Dim, keys, grads}};
    ASSERT_TRUE(StepNow(*b, Request({}, {}, nullptr, rows, 2.0f)).ok());
    ASSERT_EQ(b->step(1), step);

    // The expected row: fp32 SparseAdam on the dequantized moments, then quantized alone.
    const CoalescedRows summed = CoalesceRows(keys, grads, kInt8Dim);
    const AdamWStepScalars s = MakeStepScalars(h, step, 2.0f);
    std::vector<std::vector<char>> after;
    for (TensorField f : fields) after.push_back(stored(f));
    std::vector<bool> pushed(kInt8Rows, false);
    for (size_t i = 0; i < summed.keys.size(); ++i) {
      const auto r = static_cast<size_t>(summed.keys[i]);
      pushed[r] = true;
      std::vector<float> p(kInt8Dim), m(kInt8Dim), v(kInt8Dim);
      for (size_t j = 0; j < kInt8Dim; ++j) {
        p[j] = params[r * kInt8Dim + j];
        m[j] = exp_avg[r * kInt8Dim + j];
        v[j] = exp_avg_sq[r * kInt8Dim + j];
        SparseAdamUpdate(s, SparseAdamGrad(s, summed.grads[i * kInt8Dim + j]), p[j], m[j], v[j]);
      }
      std::vector<uint8_t> codes_m(kInt8Dim), codes_v(kInt8Dim);
      float scale_m = -1.0f, scale_v = -1.0f;
      FloatToStored(layout, TensorField::kExpAvg, m.data(), 0, kInt8Dim, codes_m.data(), &scale_m);
      FloatToStored(layout, TensorField::kExpAvgSq, v.data(), 0, kInt8Dim, codes_v.data(),
                    &scale_v);
      EXPECT_EQ(0, std::memcmp(after[0].data() + r * kInt8Dim * 4, p.data(), kInt8Dim * 4)) << r;
      EXPECT_EQ(0, std::memcmp(after[1].data() + r * kInt8Dim, codes_m.data(), kInt8Dim)) << r;
      EXPECT_EQ(0, std::memcmp(after[2].data() + r * kInt8Dim, codes_v.data(), kInt8Dim)) << r;
      EXPECT_EQ(0, std::memcmp(after[3].data() + r * 4, &scale_m, 4)) << r;
      EXPECT_EQ(0, std::memcmp(after[4].data() + r * 4, &scale_v, 4)) << r;
    }
    for (size_t r = 0; r < kInt8Rows; ++r) {
      if (pushed[r]) continue;
      for (size_t f = 0; f < 5; ++f) {
        const size_t width = f == 0 ? kInt8Dim * 4 : f < 3 ? kInt8Dim : 4;
        EXPECT_EQ(0, std::memcmp(after[f].data() + r * width, before[f].data() + r * width, width))
            << "row " << r << " field " << f;
      }
    }
  }
  // A lookup dequantizes with the row's scale, as a read of the whole field does.
  const std::vector<int64_t> read = {7, 0, 7};
  std::vector<float> rows_read(read.size() * kInt8Dim);
  ASSERT_TRUE(b->ReadRows({TensorField::kExpAvg, 1, kInt8Dim, read, rows_read.data()}).ok());
  const std::vector<float> exp_avg = Field(*b, TensorField::kExpAvg, 1);
  EXPECT_EQ(0, std::memcmp(rows_read.data(), exp_avg.data() + 7 * kInt8Dim, kInt8Dim * 4));
  EXPECT_EQ(0, std::memcmp(rows_read.data() + kInt8Dim, exp_avg.data(), kInt8Dim * 4));
}

}  // namespace
}  // namespace fusedps
