// Tests of the CUDA backend's embedding tables (kernels/cuda/table_rows_kernel.cuh; the rows are
// prepared on the host by backend_tables.h): the same steps of table rows, alone or with dense
// tensors, give the CUDA backend the CPU backend's bits (which cpu_table_rows_test.cc holds to
// row_sparse.h and a float64 SparseAdam); a refused step changes nothing and names the field,
// a non-finite row skips the whole step; rows that start over (init_rows) do so as on the CPU;
// ReadRows returns the CPU backend's rows in key order;
// a step of tables alone is one launch, and so is one with dense tensors; many tables in the
// dense kernel's pipeline and tables with int8 state match the CPU backend too. Skipped without a
// GPU.
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "kernels/cuda_backend_test_util.h"
#include "kernels/row_table_test_util.h"

namespace fusedps {
namespace {

using cuda_test::NeedsCuda;
using cuda_test::ReadAll;
using row_table_test::DecayedSparseAdam;
using row_table_test::NormalFloats;
using row_table_test::SameBytes;

constexpr uint64_t kDense = 300;
// Tensor 1: a table wider than a warp, not a multiple of 32; tensor 2: a narrow one.
constexpr uint64_t kRows1 = 64, kDim1 = 40, kRows2 = 7, kDim2 = 3;

std::vector<int64_t> Keys(std::mt19937& rng, uint64_t rows, size_t n) {
  std::uniform_int_distribution<int64_t> key(0, static_cast<int64_t>(rows) - 1);
  std::vector<int64_t> keys(n);
  for (int64_t& k : keys) k = key(rng);
  return keys;
}

// The same tensors and params on a CPU and a CUDA backend, in one group.
struct Pair {
  std::unique_ptr<OptimizerBackend> cpu, cuda;

  Pair(const AdamWHyperparameters& hyper, std::mt19937& rng) : cpu(MakeCpuBackend({})) {
    auto made = MakeBackend("cuda:0", {});
    EXPECT_TRUE(made.ok()) << made.status();
    cuda = *std::move(made);
    const std::vector<float> params[] = {NormalFloats(rng, kDense),
                                         NormalFloats(rng, kRows1 * kDim1),
                                         NormalFloats(rng, kRows2 * kDim2)};
    for (OptimizerBackend* b : {cpu.get(), cuda.get()}) {
      EXPECT_TRUE(b->SetParamGroup(0, hyper).ok());
      EXPECT_TRUE(b->AddTensors({{kDense, 0}, {kRows1 * kDim1, 0}, {kRows2 * kDim2, 0}}).ok());
      for (uint32_t t = 0; t < 3; ++t) EXPECT_TRUE(b->WriteParams(t, 0, params[t]).ok());
    }
  }

  // Every field of every tensor, of one backend.
  static std::vector<std::vector<float>> State(OptimizerBackend& b) {
    std::vector<std::vector<float>> all;
    for (uint32_t t = 0; t < 3; ++t) {
      for (TensorField f : {TensorField::kParam, TensorField::kExpAvg, TensorField::kExpAvgSq}) {
        all.push_back(ReadAll(b, f, t));
      }
    }
    return all;
  }

  void ExpectSame() {
    const auto a = State(*cuda), b = State(*cpu);
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(SameBytes(a[i], b[i])) << "tensor " << i / 3 << " field " << i % 3;
    }
    for (uint32_t t = 0; t < 3; ++t) EXPECT_EQ(cuda->step(t), cpu->step(t)) << "tensor " << t;
  }
};

class CudaTablesTest : public NeedsCuda<> {};

TEST_F(CudaTablesTest, RowsAloneAndWithDenseTensorsMatchTheCpuBackendBitForBit) {
  AdamWHyperparameters maximize = DecayedSparseAdam();
  maximize.maximize = true;
  AdamWHyperparameters plain;  // SparseAdam's own: no weight decay.
  plain.weight_decay = 0.0;
  AdamWHyperparameters bf16 = DecayedSparseAdam();  // Moments stored as bf16.
  bf16.state_dtype = StateDType::kBFloat16;
  for (const AdamWHyperparameters& h : {DecayedSparseAdam(), maximize, plain, bf16}) {
    std::mt19937 rng(5);
    Pair pair(h, rng);
    for (int step = 1; step <= 8; ++step) {
      const bool with_dense = step % 3 != 0;
      const std::vector<float> dense = NormalFloats(rng, kDense);
      // Table 1: many rows with duplicates (keys from a narrow range); table 2: some steps none.
      std::vector<int64_t> keys1 = Keys(rng, kRows1 / 4, 30);
      keys1.push_back(kRows1 - 1);
      const std::vector<float> grads1 = NormalFloats(rng, keys1.size() * kDim1);
      const std::vector<int64_t> keys2 = step % 2 ? Keys(rng, kRows2, 4) : std::vector<int64_t>{};
      const std::vector<float> grads2 = NormalFloats(rng, keys2.size() * kDim2);
      const uint32_t tensors[] = {0};
      const uint64_t offsets[] = {0};
      const TableRows rows[] = {{1, kDim1, keys1, grads1}, {2, kDim2, keys2, grads2}};
      StepRequest request;
      if (with_dense) {
        request.tensors = tensors;
        request.grad_offsets = offsets;
        request.grads = dense.data();
      }
      request.table_rows = rows;
      request.grad_scale = step % 2 ? 0.0f : 8.0f;
      request.lr_divisor = step == 4 ? 2.0 : 1.0;
      absl::StatusOr<StepOutcome> a = StepNow(*pair.cuda, request);
      absl::StatusOr<StepOutcome> b = StepNow(*pair.cpu, request);
      ASSERT_TRUE(a.ok()) << a.status();
      ASSERT_TRUE(b.ok()) << b.status();
      EXPECT_FALSE(a->skipped);
      EXPECT_EQ(a->tensors_updated, b->tensors_updated);
      EXPECT_EQ(a->tensors_updated, with_dense ? 3u : 2u);
      pair.ExpectSame();
    }
    EXPECT_EQ(pair.cuda->step(1), 8);
  }
}

// Rows that start over (a hashed table's new rows: TableRows::init_rows) read their init params
// and zero moments in the update launch, in both unit widths (dim 40: 16-byte units; dim 3: one
// element), as the CPU backend writes them before its update; a skipped step leaves them as
// they were.
TEST_F(CudaTablesTest, RowsThatStartOverMatchTheCpuBackendBitForBit) {
  std::mt19937 rng(13);
  Pair pair(DecayedSparseAdam(), rng);
  for (int step = 1; step <= 6; ++step) {
    std::vector<int64_t> keys1 = Keys(rng, kRows1, 20);
    keys1.push_back(keys1[0]);
    const std::vector<int64_t> init1 = {keys1[0], keys1[3], keys1[7]};
    const std::vector<int64_t> keys2 = {static_cast<int64_t>(step % kRows2), 0, 0};
    const std::vector<int64_t> init2 = {0};
    const std::vector<float> grads1 = NormalFloats(rng, keys1.size() * kDim1);
    const std::vector<float> grads2 = NormalFloats(rng, keys2.size() * kDim2);
    const std::vector<float> params1 = NormalFloats(rng, init1.size() * kDim1);
    const std::vector<float> params2 = NormalFloats(rng, init2.size() * kDim2);
    // init1 may name a key twice when the draw repeats: the backends must refuse it alike.
    const TableRows rows[] = {{1, kDim1, keys1, grads1, init1, params1},
                              {2, kDim2, keys2, grads2, init2, params2}};
    StepRequest request;
    request.table_rows = rows;
    request.grad_scale = step % 2 ? 0.0f : 4.0f;
    absl::StatusOr<StepOutcome> a = StepNow(*pair.cuda, request);
    absl::StatusOr<StepOutcome> b = StepNow(*pair.cpu, request);
    ASSERT_EQ(a.status(), b.status());
    if (a.ok()) {
      EXPECT_FALSE(a->skipped);
    }
    pair.ExpectSame();
  }
  EXPECT_GT(pair.cuda->step(1), 0);
  // A skipped step (a non-finite gradient) starts no row over.
  const auto before = Pair::State(*pair.cuda);
  const std::vector<int64_t> keys = {2, 9};
  std::vector<float> grads = NormalFloats(rng, 2 * kDim1);
  grads[5] = INFINITY;
  const std::vector<int64_t> init = {9};
  const std::vector<float> params = NormalFloats(rng, kDim1);
  const TableRows rows[] = {{1, kDim1, keys, grads, init, params}};
  StepRequest request;
  request.table_rows = rows;
  absl::StatusOr<StepOutcome> skipped = StepNow(*pair.cuda, request);
  ASSERT_TRUE(skipped.ok()) << skipped.status();
  EXPECT_TRUE(skipped->skipped);
  const auto after = Pair::State(*pair.cuda);
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(SameBytes(before[i], after[i])) << i;
}

TEST_F(CudaTablesTest, RefusedAndSkippedStepsChangeNothing) {
  std::mt19937 rng(9);
  Pair pair(DecayedSparseAdam(), rng);
  const std::vector<int64_t> keys = {1, 5, 5};
  const std::vector<float> grads = NormalFloats(rng, keys.size() * kDim1);
  const TableRows good[] = {{1, kDim1, keys, grads}};
  StepRequest request;
  request.table_rows = good;
  ASSERT_TRUE(StepNow(*pair.cuda, request).ok());
  ASSERT_TRUE(StepNow(*pair.cpu, request).ok());
  const auto before = Pair::State(*pair.cuda);

  const std::vector<int64_t> bad_keys = {2, static_cast<int64_t>(kRows1)};
  const std::vector<float> bad_grads = NormalFloats(rng, 2 * kDim1);
  const TableRows bad[] = {{1, kDim1, bad_keys, bad_grads}};
  request.table_rows = bad;
  absl::StatusOr<StepOutcome> refused = StepNow(*pair.cuda, request);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(refused.status().message(), StepNow(*pair.cpu, request).status().message());
  EXPECT_NE(refused.status().message().find("table_rows[0].keys[1] = 64"), std::string::npos)
      << refused.status();

  std::vector<float> nan_grads = NormalFloats(rng, 2 * kDim1);
  nan_grads[kDim1 + 3] = std::nanf("");
  const std::vector<int64_t> nan_keys = {3, 4};
  const std::vector<float> dense = NormalFloats(rng, kDense);
  const uint32_t tensors[] = {0};
  const uint64_t offsets[] = {0};
  const TableRows nan_rows[] = {{1, kDim1, nan_keys, nan_grads}};
  request.tensors = tensors;
  request.grad_offsets = offsets;
  request.grads = dense.data();
  request.table_rows = nan_rows;
  absl::StatusOr<StepOutcome> skipped = StepNow(*pair.cuda, request);
  ASSERT_TRUE(skipped.ok()) << skipped.status();
  EXPECT_TRUE(skipped->skipped);
  const auto after = Pair::State(*pair.cuda);
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(SameBytes(before[i], after[i])) << i;
  EXPECT_EQ(pair.cuda->step(0), 0);
  EXPECT_EQ(pair.cuda->step(1), 1);
}

TEST_F(CudaTablesTest, ReadRowsInKeyOrderAsTheCpuBackend) {
  std::mt19937 rng(13);
  Pair pair(DecayedSparseAdam(), rng);
  const std::vector<int64_t> keys = Keys(rng, kRows1, 50);
  const std::vector<float> grads = NormalFloats(rng, keys.size() * kDim1);
  const TableRows rows[] = {{1, kDim1, keys, grads}};
  StepRequest request;
  request.table_rows = rows;
  ASSERT_TRUE(StepNow(*pair.cuda, request).ok());
  ASSERT_TRUE(StepNow(*pair.cpu, request).ok());
  const std::vector<int64_t> read = {5, 0, 5, kRows1 - 1, 17};
  for (TensorField f : {TensorField::kParam, TensorField::kExpAvg, TensorField::kExpAvgSq}) {
    std::vector<float> a(read.size() * kDim1, -1.0f), b(read.size() * kDim1, -2.0f);
    ReadRowsRequest r{f, 1, kDim1, read, a.data()};
    ASSERT_TRUE(pair.cuda->ReadRows(r).ok());
    r.dst = b.data();
    ASSERT_TRUE(pair.cpu->ReadRows(r).ok());
    absl::StatusOr<Marker> marker = pair.cuda->Mark();
    ASSERT_TRUE(marker.ok());
    ASSERT_TRUE(pair.cuda->Wait(*marker).ok());
    EXPECT_TRUE(SameBytes(a, b)) << TensorFieldName(f);
  }
  const std::vector<int64_t> outside = {3, -1};
  std::vector<float> dst(2 * kDim1);
  absl::Status s = pair.cuda->ReadRows({TensorField::kParam, 1, kDim1, outside, dst.data()});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("keys[1] = -1"), std::string::npos) << s;
}

// Tables with int8 state (a scale per row, a warp per row on the device) match the CPU backend
// bit for bit: their codes and row scales as stored, every field as fp32 (the read of a whole
// field dequantizes row by row) and their looked-up rows; with rows that start over, a dense
// int8 tensor in the same step, and an fp32 table before them in the launch (whose units are
// then padded to a whole warp).
TEST_F(CudaTablesTest, Int8StateMatchesTheCpuBackendBitForBit) {
  // Tensor 0: dense, int8; 1: a [150, 40] int8 table (40: not a multiple of 32); 2: a [70, 64]
  // int8 table; 3: a [33, 3] fp32 table (group 1).
  constexpr uint64_t kDenseInt8 = 5000, kDims[] = {0, 40, 64, 3}, kRowsOf[] = {0, 150, 70, 33};
  AdamWHyperparameters int8 = DecayedSparseAdam();
  int8.state_dtype = StateDType::kInt8;
  std::mt19937 rng(31);
  std::unique_ptr<OptimizerBackend> cpu = MakeCpuBackend({});
  auto made = MakeBackend("cuda:0", {});
  ASSERT_TRUE(made.ok()) << made.status();
  std::unique_ptr<OptimizerBackend> cuda = *std::move(made);
  const std::vector<float> params[] = {
      NormalFloats(rng, kDenseInt8), NormalFloats(rng, kRowsOf[1] * kDims[1]),
      NormalFloats(rng, kRowsOf[2] * kDims[2]), NormalFloats(rng, kRowsOf[3] * kDims[3])};
  for (OptimizerBackend* b : {cpu.get(), cuda.get()}) {
    ASSERT_TRUE(b->SetParamGroup(0, int8).ok());
    ASSERT_TRUE(b->SetParamGroup(1, DecayedSparseAdam()).ok());
    ASSERT_TRUE(b->AddTensors({{kDenseInt8, 0},
                               {kRowsOf[1] * kDims[1], 0, 0, kDims[1]},
                               {kRowsOf[2] * kDims[2], 0, 0, kDims[2]},
                               {kRowsOf[3] * kDims[3], 1, 0, kDims[3]}})
                    .ok());
    for (uint32_t t = 0; t < 4; ++t) ASSERT_TRUE(b->WriteParams(t, 0, params[t]).ok());
  }
  ASSERT_EQ(cuda->layout(1).state, StateDType::kInt8);
  const auto expect_same = [&](int step) {
    for (uint32_t t = 0; t < 4; ++t) {
      for (TensorField f : {TensorField::kParam, TensorField::kExpAvg, TensorField::kExpAvgSq,
                            TensorField::kExpAvgAbsmax, TensorField::kExpAvgSqAbsmax}) {
        EXPECT_EQ(cuda_test::ReadStoredBytes(*cuda, f, t), cuda_test::ReadStoredBytes(*cpu, f, t))
            << "step " << step << " tensor " << t << " " << TensorFieldName(f);
        if (f == TensorField::kExpAvgAbsmax || f == TensorField::kExpAvgSqAbsmax) continue;
        EXPECT_TRUE(SameBytes(ReadAll(*cuda, f, t), ReadAll(*cpu, f, t)))
            << "step " << step << " tensor " << t << " fp32 " << TensorFieldName(f);
      }
      EXPECT_EQ(cuda->step(t), cpu->step(t));
    }
  };
  for (int step = 1; step <= 6; ++step) {
    std::vector<TableRows> rows;
    std::vector<std::vector<int64_t>> keys(4), init(4);
    std::vector<std::vector<float>> grads(4), init_params(4);
    for (uint32_t t : {3u, 1u, 2u}) {  // The fp32 table first: padding before the int8 ones.
      keys[t] = Keys(rng, kRowsOf[t] / 2, 41);
      keys[t].push_back(static_cast<int64_t>(kRowsOf[t]) - 1);
      grads[t] = NormalFloats(rng, keys[t].size() * kDims[t]);
      if (step % 2 == 0 && t != 3) {  // Rows that start over: codes and scales from zero.
        init[t] = {static_cast<int64_t>(kRowsOf[t]) - 1};
        init_params[t] = NormalFloats(rng, kDims[t]);
      }
      rows.push_back({t, kDims[t], keys[t], grads[t], init[t], init_params[t]});
    }
    const std::vector<float> dense = NormalFloats(rng, kDenseInt8);
    const uint32_t tensors[] = {0};
    const uint64_t offsets[] = {0};
    StepRequest request;
    if (step != 3) {
      request.tensors = tensors;
      request.grad_offsets = offsets;
      request.grads = dense.data();
    }
    request.table_rows = rows;
    request.grad_scale = step % 2 ? 0.0f : 4.0f;
    const uint64_t before = cuda->launches_total();
    absl::StatusOr<StepOutcome> a = StepNow(*cuda, request);
    absl::StatusOr<StepOutcome> b = StepNow(*cpu, request);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    // One launch, with the dense tensor or without (int8 and fp32 tables alone: the row phase).
    EXPECT_EQ(cuda->launches_total() - before, 1u) << "step " << step;
    expect_same(step);
  }
  const std::vector<int64_t> read = {5, 0, 5, 149, 17};
  for (TensorField f : {TensorField::kParam, TensorField::kExpAvg, TensorField::kExpAvgSq}) {
    std::vector<float> a(read.size() * kDims[1], -1.0f), b(read.size() * kDims[1], -2.0f);
    ReadRowsRequest r{f, 1, kDims[1], read, a.data()};
    ASSERT_TRUE(cuda->ReadRows(r).ok());
    r.dst = b.data();
    ASSERT_TRUE(cpu->ReadRows(r).ok());
    absl::StatusOr<Marker> marker = cuda->Mark();
    ASSERT_TRUE(marker.ok());
    ASSERT_TRUE(cuda->Wait(*marker).ok());
    EXPECT_TRUE(SameBytes(a, b)) << TensorFieldName(f);
  }
}

TEST_F(CudaTablesTest, OneLaunchForTablesAloneAndWithDenseTensors) {
  std::mt19937 rng(17);
  Pair pair(DecayedSparseAdam(), rng);
  const std::vector<int64_t> keys = {1, 2, 2};
  const std::vector<float> grads = NormalFloats(rng, keys.size() * kDim1);
  const std::vector<float> dense = NormalFloats(rng, kDense);
  const TableRows rows[] = {{1, kDim1, keys, grads}, {2, kDim2, {}, {}}};
  const uint32_t tensors[] = {0};
  const uint64_t offsets[] = {0};
  StepRequest request;
  request.table_rows = rows;
  uint64_t before = pair.cuda->launches_total();
  ASSERT_TRUE(StepNow(*pair.cuda, request).ok());
  EXPECT_EQ(pair.cuda->launches_total() - before, 1u);
  EXPECT_EQ(pair.cuda->step(2), 1);  // Named without rows: stepped all the same.
  request.tensors = tensors;
  request.grad_offsets = offsets;
  request.grads = dense.data();
  before = pair.cuda->launches_total();
  ASSERT_TRUE(StepNow(*pair.cuda, request).ok());
  EXPECT_EQ(pair.cuda->launches_total() - before, 1u);
  // Tables alone: their own kernel; with a dense tensor: the rows in AdamWApply's launch.
  EXPECT_EQ(pair.cuda->launch_counts().at("fusedps_table_rows_update"), 1u);
  EXPECT_EQ(pair.cuda->launch_counts().at("fusedps_adamw_apply"), 1u);
  EXPECT_EQ(pair.cuda->step(0), 1);
  EXPECT_EQ(pair.cuda->step(1), 2);
}

// Many pipelined tables (fp32 state, dims multiples of 4: a run never straddles rows, a portion
// often does) with more portions than the launch has warps, so that each warp's pipeline cycles
// through its stages, beside a dense tensor, with rows that start over: one launch, and the CPU
// backend's bits.
TEST_F(CudaTablesTest, ManyPipelinedTablesWithADenseTensorMatchTheCpuBackendBitForBit) {
  constexpr uint64_t kDims[] = {4, 8, 44, 64, 132}, kTableRows = 20000, kDenseNumel = 70000;
  std::mt19937 rng(41);
  std::unique_ptr<OptimizerBackend> cpu = MakeCpuBackend({});
  auto made = MakeBackend("cuda:0", {});
  ASSERT_TRUE(made.ok()) << made.status();
  std::unique_ptr<OptimizerBackend> cuda = *std::move(made);
  std::vector<NewTensor> tensors = {{kDenseNumel, 0}};
  for (uint64_t dim : kDims) tensors.push_back({kTableRows * dim, 0, 0, dim});
  for (OptimizerBackend* b : {cpu.get(), cuda.get()}) {
    ASSERT_TRUE(b->SetParamGroup(0, DecayedSparseAdam()).ok());
    ASSERT_TRUE(b->AddTensors(tensors).ok());
  }
  for (uint32_t t = 0; t < tensors.size(); ++t) {
    const std::vector<float> params = NormalFloats(rng, tensors[t].numel);
    ASSERT_TRUE(cpu->WriteParams(t, 0, params).ok());
    ASSERT_TRUE(cuda->WriteParams(t, 0, params).ok());
  }
  for (int step = 1; step <= 3; ++step) {
    const std::vector<float> dense = NormalFloats(rng, kDenseNumel);
    std::vector<std::vector<int64_t>> keys(std::size(kDims)), init(std::size(kDims));
    std::vector<std::vector<float>> grads(std::size(kDims)), init_params(std::size(kDims));
    std::vector<TableRows> rows;
    for (size_t i = 0; i < std::size(kDims); ++i) {
      // 3,000 to 15,000 draws of 20,000 rows: duplicates, and rows left out. About 15,000
      // portions in all: several per warp on an H100 or H200 (2,112 to 2,304 warps).
      keys[i] = Keys(rng, kTableRows, 3000 * (i + 1));
      grads[i] = NormalFloats(rng, keys[i].size() * kDims[i]);
      if (step != 2) {
        init[i] = {keys[i][keys[i].size() / 2]};  // A pushed key, once.
        init_params[i] = NormalFloats(rng, kDims[i]);
      }
      rows.push_back(
          {static_cast<uint32_t>(i + 1), kDims[i], keys[i], grads[i], init[i], init_params[i]});
    }
    const uint32_t dense_tensors[] = {0};
    const uint64_t offsets[] = {0};
    StepRequest request;
    request.tensors = dense_tensors;
    request.grad_offsets = offsets;
    request.grads = dense.data();
    request.table_rows = rows;
    request.grad_scale = step == 3 ? 2.0f : 0.0f;
    const uint64_t before = cuda->launches_total();
    absl::StatusOr<StepOutcome> a = StepNow(*cuda, request);
    absl::StatusOr<StepOutcome> b = StepNow(*cpu, request);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(cuda->launches_total() - before, 1u);
    for (uint32_t t = 0; t < tensors.size(); ++t) {
      for (TensorField f : {TensorField::kParam, TensorField::kExpAvg, TensorField::kExpAvgSq}) {
        EXPECT_TRUE(SameBytes(ReadAll(*cuda, f, t), ReadAll(*cpu, f, t)))
            << "step " << step << " tensor " << t << " " << TensorFieldName(f);
      }
      EXPECT_EQ(cuda->step(t), cpu->step(t)) << "tensor " << t;
    }
  }
}

}  // namespace
}  // namespace fusedps
