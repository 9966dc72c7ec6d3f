// fusedps-table-bench (CUDA builds only): the embedding tables' row update
// (kernels/cuda/table_rows_kernel.cuh) against the device's copy roof, measured in the same run.
//
// For each (touched rows N, dim): a [2N, dim] fp32 table with its moments, N unique keys drawn at
// random and sorted (as the host's coalescing hands them over), N gradient rows; the update is
// timed alone (CUDA events, median of --iters launches after --warmup, each launch a step of the
// same rows), then checked: every 997th updated row against sparse_adam_math.h on the host, bit
// for bit. Bytes moved per row: the key (8), param, exp_avg, exp_avg_sq read and written and the
// gradient read (7 * dim * 4). The roof: a device-to-device cudaMemcpyAsync of half those bytes
// (it reads and writes each byte: the same traffic), timed the same way (bench/device_copy.h).
// The host's part of a step (summing duplicates, the upload) is not in these numbers.
//
//   fusedps-table-bench [--touched=1000000,10000000] [--dims=64,128] [--warmup=3] [--iters=20]
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

using gpu::LaunchCounter;
using gpu::LaunchTableRowsUpdate;
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
int RunCase(uint64_t n, uint64_t dim, int warmup, int iters) {
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
  CHECK_CUDA(cudaMalloc(&d_params, numel * 4));
  CHECK_CUDA(cudaMalloc(&d_m, numel * 4));
  CHECK_CUDA(cudaMalloc(&d_v, numel * 4));
  CHECK_CUDA(cudaMalloc(&d_grads, n * dim * 4));
  CHECK_CUDA(cudaMalloc(&d_keys, n * 8));
  CHECK_CUDA(cudaMalloc(&d_step, 8));
  CHECK_CUDA(cudaMalloc(&d_table, sizeof(RowTable)));
  CHECK_CUDA(cudaMemcpy(d_params, params.data(), numel * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(d_m, 0, numel * 4));
  CHECK_CUDA(cudaMemset(d_v, 0, numel * 4));
  CHECK_CUDA(cudaMemset(d_step, 0, 8));
  CHECK_CUDA(cudaMemcpy(d_grads, grads.data(), n * dim * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_keys, keys.data(), n * 8, cudaMemcpyHostToDevice));
  AdamWHyperparameters hyper;
  hyper.lr = 0.01;
  hyper.weight_decay = 0.0;
  RowTable table;
  table.params = d_params;
  table.exp_avg = d_m;
  table.exp_avg_sq = d_v;
  table.step = d_step;
  table.dim = dim;
  table.s = MakeStepScalars(hyper, 1, 0.0f);  // The same scalars each launch: timing only.
  table.width = gpu::RowUnitWidth(table, d_grads);
  const uint64_t units = n * dim / table.width;
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
    absl::Status s = LaunchTableRowsUpdate(counter, stream, d_table, 1, d_keys, d_grads, units);
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
  for (uint64_t r = 0; r < n; r += 997, ++checked) {
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
  const double bytes = static_cast<double>(n) * (8.0 + 7.0 * dim * 4.0);
  absl::StatusOr<double> copy_ms =
      DeviceCopyMs(0, static_cast<uint64_t>(bytes / 2), warmup, iters, /*queued=*/true);
  if (!copy_ms.ok()) {
    std::fprintf(stderr, "copy: %s\n", std::string(copy_ms.status().message()).c_str());
    return 1;
  }
  std::printf(
      "| %llu | %llu | %.1f | %.3f | %.0f | %.3f | %.0f | %.1f%% | width %llu; %llu rows, %s |\n",
      static_cast<unsigned long long>(n), static_cast<unsigned long long>(dim), bytes / 1e6,
      update_ms, bytes / update_ms / 1e6, *copy_ms, bytes / *copy_ms / 1e6,
      100.0 * *copy_ms / update_ms, static_cast<unsigned long long>(table.width),
      static_cast<unsigned long long>(checked), wrong == 0 ? "bit for bit" : "WRONG");
  for (cudaEvent_t e : events) cudaEventDestroy(e);
  cudaStreamDestroy(stream);
  for (void* p : {static_cast<void*>(d_params), static_cast<void*>(d_m), static_cast<void*>(d_v),
                  static_cast<void*>(d_grads), static_cast<void*>(d_keys),
                  static_cast<void*>(d_step), static_cast<void*>(d_table)}) {
    cudaFree(p);
  }
  return wrong == 0 ? 0 : 1;
}

}  // namespace
}  // namespace fusedps

int main(int argc, char** argv) {
  std::vector<uint64_t> touched = {1000000, 10000000}, dims = {64, 128};
  int warmup = 3, iters = 20;
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
    } else {
      std::fprintf(stderr,
                   "usage: fusedps-table-bench [--touched=N,...] [--dims=D,...] [--warmup=W] "
                   "[--iters=I]\n");
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
  int status = 0;
  for (uint64_t n : touched) {
    for (uint64_t dim : dims) status |= fusedps::RunCase(n, dim, warmup, iters);
  }
  return status;
}
