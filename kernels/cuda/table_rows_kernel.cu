#include <algorithm>

#include "kernels/cuda/table_rows_kernel.cuh"
#include "kernels/sparse_adam_math.h"

namespace fusedps {
namespace gpu {
namespace {

// The warps of the whole grid, each over rows first, r, r + warps, ...
__device__ uint64_t FirstRow() { return uint64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32; }
__device__ uint64_t RowStride() { return uint64_t{gridDim.x} * kWarpsPerBlock; }

__global__ void __launch_bounds__(kThreads)
    TableRowsUpdate(const RowTable* tables, uint32_t table_count, const int64_t* keys,
                    const float* grads, uint64_t rows) {
  if (blockIdx.x == 0) {
    for (uint32_t t = threadIdx.x; t < table_count; t += blockDim.x) *tables[t].step += 1;
  }
  const uint32_t lane = threadIdx.x % 32;
  uint32_t t = 0;  // Rows ascend per warp, so the table index only moves forward.
  for (uint64_t r = FirstRow(); r < rows; r += RowStride()) {
    while (t + 1 < table_count && tables[t + 1].first_row <= r) ++t;
    const RowTable& table = tables[t];
    const uint64_t at = static_cast<uint64_t>(keys[r]) * table.dim;
    const float* g = grads + table.grad_offset + (r - table.first_row) * table.dim;
    for (uint64_t j = lane; j < table.dim; j += 32) {
      float param = table.params[at + j];
      float exp_avg = table.exp_avg[at + j];
      float exp_avg_sq = table.exp_avg_sq[at + j];
      SparseAdamUpdate(table.s, g[j], param, exp_avg, exp_avg_sq);
      table.params[at + j] = param;
      table.exp_avg[at + j] = exp_avg;
      table.exp_avg_sq[at + j] = exp_avg_sq;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    TableRowsGather(const float* field, uint64_t dim, const int64_t* keys, uint64_t count,
                    float* out) {
  const uint32_t lane = threadIdx.x % 32;
  for (uint64_t i = FirstRow(); i < count; i += RowStride()) {
    const float* row = field + static_cast<uint64_t>(keys[i]) * dim;
    for (uint64_t j = lane; j < dim; j += 32) out[i * dim + j] = row[j];
  }
}

// Enough blocks for a warp per row, at most `grid`, at least one.
int Blocks(int grid, uint64_t rows) {
  const uint64_t wanted = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return static_cast<int>(std::max<uint64_t>(1, std::min<uint64_t>(grid, wanted)));
}

}  // namespace

absl::Status LaunchTableRowsUpdate(LaunchCounter& launches, int grid, cudaStream_t stream,
                                   const RowTable* tables, uint32_t table_count,
                                   const int64_t* keys, const float* grads, uint64_t rows) {
  return launches.Launch("fusedps_table_rows_update", TableRowsUpdate, Blocks(grid, rows), 0,
                         stream, tables, table_count, keys, grads, rows);
}

absl::Status LaunchTableRowsGather(LaunchCounter& launches, int grid, cudaStream_t stream,
                                   const float* field, uint64_t dim, const int64_t* keys,
                                   uint64_t count, float* out) {
  return launches.Launch("fusedps_table_rows_gather", TableRowsGather, Blocks(grid, count), 0,
                         stream, field, dim, keys, count, out);
}

}  // namespace gpu
}  // namespace fusedps
