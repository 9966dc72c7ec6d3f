// fusedps-table-bench (CUDA builds only): the embedding tables' row update against the device's
// copy roof, measured in the same run: by default as a step of tables alone runs it
// (LaunchTableRowsUpdate, kernels/cuda/table_rows_kernel.cuh); with --launch=apply as a step with
// dense tensors runs it, in the row phase of AdamWApply (table_rows_update.cuh; here with no
// dense tensor).
//
// For each (touched rows N, dim): a [2N, dim] fp32 table with its moments, N unique keys drawn at
// random and sorted (as the host's coalescing hands them over), N gradient rows; the update is
// timed alone (CUDA events, median of --iters launches after --warmup, each launch a step of the
// same rows), then checked: every 997th updated row against sparse_adam_math.h on the host, bit
// for bit. Bytes moved per row: the key (8), param, exp_avg, exp_avg_sq read and written and the
// gradient read (7 * dim * 4). The roof: a device-to-device cudaMemcpyAsync of half those bytes
// (it reads and writes each byte: the same traffic), timed the same way (bench/device_copy.h).
// The host's part of a step (summing duplicates, the upload) is not in these numbers.
// --state=int8: the table's moments as int8 codes with a scale per row (a warp per row); bytes
// per row: the key, param read and written, two codes read and written, the
// gradient read and four scales (8 + 16 * dim + 16); checked against SparseAdamUpdateInt8Row.
//
//   fusedps-table-bench [--touched=1000000,10000000] [--dims=64,128] [--warmup=3] [--iters=20]
//                       [--state=fp32|int8] [--launch=alone|apply]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench/device_copy.h"
#include "kernels/adamw_math.h"
#include "kernels/cuda/table_rows_kernel.cuh"
#include "kernels/sparse_adam_math.h"

namespace fusedps {
namespace {

using gpu::LaunchAdamWApply;
using gpu::LaunchCounter;
using gpu::RowStep;
using gpu::RowTable;

std::vector<uint64_t> List(const char* text) {
  std::vector<uint64_t> out;
  for (const char* p = text; *p != '\0';) {
    char* end = nullptr;
    out.push_back(std::strtoull(p, &end, 10));
    p = *end == ',' ? end + 1 : end;
    if (end == p && *p != '\0') break;
  }
  return out;
}

#define CHECK_CUDA(call)                                                 \
  do {                                                                   \
    cudaError_t err_ = (call);                                           \
    if (err_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(err_)); \
      return 1;                                                          \
    }                                                                    \
  } while (0)

// One (n, dim) case; prints its row. Returns 0, or 1 on a CUDA error or a wrong row.
int RunCase(uint64_t n, uint64_t dim, int warmup, int iters, bool int8, bool apply, int grid,
            int sms) {
  const uint64_t rows = 2 * n, numel = rows * dim;
  std::mt19937_64 rng(n * 131 + dim);
  std::vector<int64_t> keys(n);
  {  // n unique keys of [0, rows), sorted: every second row, shifted at random.
    for (uint64_t i = 0; i < n; ++i) keys[i] = static_cast<int64_t>(2 * i + (rng() & 1));
  }
  // Uniform in [-1, 1) from 24 random bits each (the host fills gigabytes: no normal here).
  const auto uniform = [&rng] { return static_cast<float>(rng() >> 40) * 0x1p-23f - 1.0f; };
  std::vector<float> params(numel), grads(n * dim);
  for (float& x : params) x = uniform();
  for (float& x : grads) x = uniform();
  float *d_params, *d_m, *d_v, *d_grads;
  int64_t *d_keys, *d_step;
  RowTable* d_table;
  Int8Codebooks* d_books = nullptr;
  // int8: d_m and d_v hold the codes (numel bytes) and then the row scales (rows floats).
  const uint64_t state_bytes = int8 ? numel + rows * 4 : numel * 4;
  CHECK_CUDA(cudaMalloc(&d_params, numel * 4));
  CHECK_CUDA(cudaMalloc(&d_m, state_bytes));
  CHECK_CUDA(cudaMalloc(&d_v, state_bytes));
  CHECK_CUDA(cudaMalloc(&d_books, sizeof(Int8Codebooks)));
  CHECK_CUDA(
      cudaMemcpy(d_books, &DynamicCodebooks(), sizeof(Int8Codebooks), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&d_grads, n * dim * 4));
  CHECK_CUDA(cudaMalloc(&d_keys, n * 8));
  CHECK_CUDA(cudaMalloc(&d_step, 8));
  CHECK_CUDA(cudaMalloc(&d_table, sizeof(RowTable)));
  CHECK_CUDA(cudaMemcpy(d_params, params.data(), numel * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(d_m, 0, state_bytes));
  CHECK_CUDA(cudaMemset(d_v, 0, state_bytes));
  CHECK_CUDA(cudaMemset(d_step, 0, 8));
  CHECK_CUDA(cudaMemcpy(d_grads, grads.data(), n * dim * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_keys, keys.data(), n * 8, cudaMemcpyHostToDevice));
  AdamWHyperparameters hyper;
  hyper.lr = 0.01;
  hyper.weight_decay = 0.0;
  RowTable table;
  table.params = d_params;
  table.step = d_step;
  table.dim = dim;
  table.rows = n;
  table.s = MakeStepScalars(hyper, 1, 0.0f);  // The same scalars each launch: timing only.
  RowStep step;
  step.tables = d_table;
  step.keys = d_keys;
  step.grads = d_grads;
  gpu::ApplyConfig config;
  if (int8) {
    table.exp_avg8 = reinterpret_cast<uint8_t*>(d_m);
    table.exp_avg_sq8 = reinterpret_cast<uint8_t*>(d_v);
    table.absmax_m = reinterpret_cast<float*>(reinterpret_cast<char*>(d_m) + numel);
    table.absmax_v = reinterpret_cast<float*>(reinterpret_cast<char*>(d_v) + numel);
    table.books = d_books;
    step.int8 = 1;
    step.int8_units = n * gpu::kInt8RowUnits;
    config.kinds = gpu::ApplyKinds::kInt8State;
  } else {
    table.exp_avg = d_m;
    table.exp_avg_sq = d_v;
    table.width = gpu::RowUnitWidth(table, d_grads);
    if (table.width == 4) {
      step.pipelined = 1;
      step.portions = (n * dim + gpu::kPortionNumel - 1) / gpu::kPortionNumel;
    } else {
      step.elementwise = 1;
      step.element_units = n * dim / table.width;
    }
  }
  gpu::DeviceArenas arenas{};  // No dense tensor: only the codebooks are read.
  arenas.codebooks = d_books;
  const uint32_t blocks = gpu::ApplyBlocks(grid, step.PortionsWorth());
  CHECK_CUDA(cudaMemcpy(d_table, &table, sizeof(RowTable), cudaMemcpyHostToDevice));
  // The rows to check, before any update: param, exp_avg, exp_avg_sq after `launches` steps.
  const int launches = warmup + iters;
  LaunchCounter counter;
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  std::vector<cudaEvent_t> events(launches + 1);
  for (cudaEvent_t& e : events) CHECK_CUDA(cudaEventCreate(&e));
  CHECK_CUDA(cudaEventRecord(events[0], stream));
  for (int i = 0; i < launches; ++i) {
    absl::Status s = apply ? LaunchAdamWApply(counter, blocks, stream, config, arenas, nullptr, 0,
                                              nullptr, gpu::UnitPlan{}, 0.0f, 1.0, step)
                           : gpu::LaunchTableRowsUpdate(counter, stream, step, sms);
    if (!s.ok()) {
      std::fprintf(stderr, "launch: %s\n", std::string(s.message()).c_str());
      return 1;
    }
    CHECK_CUDA(cudaEventRecord(events[i + 1], stream));
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<double> ms;
  for (int i = warmup; i < launches; ++i) {
    float elapsed = 0;
    CHECK_CUDA(cudaEventElapsedTime(&elapsed, events[i], events[i + 1]));
    ms.push_back(elapsed);
  }
  std::sort(ms.begin(), ms.end());
  const double update_ms = ms[ms.size() / 2];
  // Check: every 997th row, `launches` steps with the same scalars on the host.
  std::vector<float> got(dim), got_m(dim), got_v(dim);
  uint64_t checked = 0, wrong = 0;
  for (uint64_t r = 0; r < n && int8; r += 997, ++checked) {
    const auto key = static_cast<uint64_t>(keys[r]);
    const uint64_t at = key * dim;
    std::vector<uint8_t> codes(2 * dim), want_codes(2 * dim, 0);
    float scales[4], want_m = 0.0f, want_v = 0.0f;
    std::vector<float> p(params.begin() + at, params.begin() + at + dim);
    for (int i = 0; i < launches; ++i) {
      SparseAdamUpdateInt8Row(table.s, DynamicCodebooks(), dim, grads.data() + r * dim, p.data(),
                              want_codes.data(), want_codes.data() + dim, want_m, want_v);
    }
    CHECK_CUDA(cudaMemcpy(got.data(), d_params + at, dim * 4, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(codes.data(), table.exp_avg8 + at, dim, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(codes.data() + dim, table.exp_avg_sq8 + at, dim, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(&scales[0], table.absmax_m + key, 4, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(&scales[1], table.absmax_v + key, 4, cudaMemcpyDeviceToHost));
    if (std::memcmp(p.data(), got.data(), dim * 4) != 0 || codes != want_codes ||
        std::memcmp(&scales[0], &want_m, 4) != 0 || std::memcmp(&scales[1], &want_v, 4) != 0) {
      ++wrong;
    }
  }
  for (uint64_t r = 0; r < n && !int8; r += 997, ++checked) {
    const uint64_t at = static_cast<uint64_t>(keys[r]) * dim;
    CHECK_CUDA(cudaMemcpy(got.data(), d_params + at, dim * 4, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(got_m.data(), d_m + at, dim * 4, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(got_v.data(), d_v + at, dim * 4, cudaMemcpyDeviceToHost));
    for (uint64_t j = 0; j < dim; ++j) {
      float p = params[at + j], m = 0.0f, v = 0.0f;
      for (int i = 0; i < launches; ++i) SparseAdamUpdate(table.s, grads[r * dim + j], p, m, v);
      if (std::memcmp(&p, &got[j], 4) != 0 || std::memcmp(&m, &got_m[j], 4) != 0 ||
          std::memcmp(&v, &got_v[j], 4) != 0) {
        ++wrong;
      }
    }
  }
  const double bytes =
      static_cast<double>(n) * (int8 ? 8.0 + 16.0 * dim + 16.0 : 8.0 + 7.0 * dim * 4.0);
  absl::StatusOr<double> copy_ms =
      DeviceCopyMs(0, static_cast<uint64_t>(bytes / 2), warmup, iters, /*queued=*/true);
  if (!copy_ms.ok()) {
    std::fprintf(stderr, "copy: %s\n", std::string(copy_ms.status().message()).c_str());
    return 1;
  }
  std::printf("| %llu | %llu | %.1f | %.3f | %.0f | %.3f | %.0f | %.1f%% | %s; %llu rows, %s |\n",
              static_cast<unsigned long long>(n), static_cast<unsigned long long>(dim), bytes / 1e6,
              update_ms, bytes / update_ms / 1e6, *copy_ms, bytes / *copy_ms / 1e6,
              100.0 * *copy_ms / update_ms,
              int8 ? (apply ? "int8 state, apply" : "int8 state")
                   : (table.width == 4 ? (apply ? "width 4, apply" : "width 4") : "width 1"),
              static_cast<unsigned long long>(checked), wrong == 0 ? "bit for bit" : "WRONG");
  for (cudaEvent_t e : events) cudaEventDestroy(e);
  cudaStreamDestroy(stream);
  for (void* p :
       {static_cast<void*>(d_params), static_cast<void*>(d_m), static_cast<void*>(d_v),
        static_cast<void*>(d_grads), static_cast<void*>(d_keys), static_cast<void*>(d_step),
        static_cast<void*>(d_table), static_cast<void*>(d_books)}) {
    cudaFree(p);
  }
  return wrong == 0 ? 0 : 1;
}

}  // namespace
}  // namespace fusedps

int main(int argc, char** argv) {
  std::vector<uint64_t> touched = {1000000, 10000000}, dims = {64, 128};
  int warmup = 3, iters = 20;
  bool int8 = false, apply = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&](const char* name) -> const char* {
      const std::string prefix = std::string("--") + name + "=";
      return arg.rfind(prefix, 0) == 0 ? argv[i] + prefix.size() : nullptr;
    };
    if (const char* v = value("touched")) {
      touched = fusedps::List(v);
    } else if (const char* v = value("dims")) {
      dims = fusedps::List(v);
    } else if (const char* v = value("warmup")) {
      warmup = std::atoi(v);
    } else if (const char* v = value("iters")) {
      iters = std::atoi(v);
    } else if (const char* v = value("state")) {
      if (std::strcmp(v, "int8") != 0 && std::strcmp(v, "fp32") != 0) return 2;
      int8 = std::strcmp(v, "int8") == 0;
    } else if (const char* v = value("launch")) {
      if (std::strcmp(v, "alone") != 0 && std::strcmp(v, "apply") != 0) return 2;
      apply = std::strcmp(v, "apply") == 0;
    } else {
      std::fprintf(stderr,
                   "usage: fusedps-table-bench [--touched=N,...] [--dims=D,...] [--warmup=W] "
                   "[--iters=I] [--state=fp32|int8] [--launch=alone|apply]\n");
      return 2;
    }
  }
  if (iters < 1 || warmup < 0 || touched.empty() || dims.empty()) return 2;
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  std::printf("device: %s (%d SMs); update: median of %d launches after %d\n", prop.name,
              prop.multiProcessorCount, iters, warmup);
  std::printf(
      "| touched rows | dim | MB moved | update ms | update GB/s | copy ms | copy GB/s | "
      "update / copy roof | checked |\n|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
  absl::StatusOr<int> grid = fusedps::gpu::AdamWApplyGrid();
  if (!grid.ok()) {
    std::fprintf(stderr, "grid: %s\n", std::string(grid.status().message()).c_str());
    return 1;
  }
  int status = 0;
  for (uint64_t n : touched) {
    for (uint64_t dim : dims) {
      status |=
          fusedps::RunCase(n, dim, warmup, iters, int8, apply, *grid, prop.multiProcessorCount);
    }
  }
  return status;
}
