#include <algorithm>
#include <cstdint>

#include "kernels/cuda/table_rows_kernel.cuh"
#include "kernels/sparse_adam_math.h"

namespace fusedps {
namespace gpu {
namespace {

// The warps of the whole grid, each over rows first, r, r + warps, ...
__device__ uint64_t FirstRow() { return uint64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32; }
__device__ uint64_t RowStride() { return uint64_t{gridDim.x} * kWarpsPerBlock; }

// Element j (0..3) of a float4.
__device__ float& Lane(float4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

__global__ void __launch_bounds__(kThreads)
    TableRowsUpdate(const RowTable* tables, uint32_t table_count, const int64_t* keys,
                    const float* grads, uint64_t units) {
  if (blockIdx.x == 0) {
    for (uint32_t t = threadIdx.x; t < table_count; t += blockDim.x) *tables[t].step += 1;
  }
  uint32_t t = 0;  // Units ascend per thread, so the table index only moves forward.
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t u = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; u < units; u += stride) {
    while (t + 1 < table_count && tables[t + 1].first_unit <= u) ++t;
    const RowTable& table = tables[t];
    const uint64_t per_row = table.dim / table.width;
    const uint64_t local = u - table.first_unit;
    const uint64_t r = local / per_row;
    const uint64_t col = (local - r * per_row) * table.width;
    const uint64_t at = static_cast<uint64_t>(keys[table.first_row + r]) * table.dim + col;
    const float* g = grads + table.grad_offset + r * table.dim + col;
    // A row that starts over reads its init params and zero moments instead of its slot's.
    const int32_t init = table.init_of_row == nullptr ? -1 : table.init_of_row[r];
    const float* init_param = init < 0 ? nullptr : table.init_params + init * table.dim + col;
    if (table.exp_avg16 != nullptr) {  // bf16 state.
      for (uint64_t j = 0; j < table.width; ++j) {
        float param = init_param == nullptr ? table.params[at + j] : init_param[j];
        uint16_t exp_avg = init_param == nullptr ? table.exp_avg16[at + j] : uint16_t{0};
        uint16_t exp_avg_sq = init_param == nullptr ? table.exp_avg_sq16[at + j] : uint16_t{0};
        SparseAdamUpdateBFloat16State(table.s, g[j], param, exp_avg, exp_avg_sq);
        table.params[at + j] = param;
        table.exp_avg16[at + j] = exp_avg;
        table.exp_avg_sq16[at + j] = exp_avg_sq;
      }
    } else if (table.width == 4) {
      float4 param, exp_avg, exp_avg_sq;
      if (init_param == nullptr) {
        param = *reinterpret_cast<const float4*>(table.params + at);
        exp_avg = *reinterpret_cast<const float4*>(table.exp_avg + at);
        exp_avg_sq = *reinterpret_cast<const float4*>(table.exp_avg_sq + at);
      } else {
        param = *reinterpret_cast<const float4*>(init_param);
        exp_avg = exp_avg_sq = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
      float4 grad = *reinterpret_cast<const float4*>(g);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        SparseAdamUpdate(table.s, Lane(grad, j), Lane(param, j), Lane(exp_avg, j),
                         Lane(exp_avg_sq, j));
      }
      *reinterpret_cast<float4*>(table.params + at) = param;
      *reinterpret_cast<float4*>(table.exp_avg + at) = exp_avg;
      *reinterpret_cast<float4*>(table.exp_avg_sq + at) = exp_avg_sq;
    } else {
      float param = init_param == nullptr ? table.params[at] : *init_param;
      float exp_avg = init_param == nullptr ? table.exp_avg[at] : 0.0f;
      float exp_avg_sq = init_param == nullptr ? table.exp_avg_sq[at] : 0.0f;
      SparseAdamUpdate(table.s, *g, param, exp_avg, exp_avg_sq);
      table.params[at] = param;
      table.exp_avg[at] = exp_avg;
      table.exp_avg_sq[at] = exp_avg_sq;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    TableRowsGather(const float* field32, const uint16_t* field16, uint64_t dim,
                    const int64_t* keys, uint64_t count, float* out) {
  const uint32_t lane = threadIdx.x % 32;
  for (uint64_t i = FirstRow(); i < count; i += RowStride()) {
    const uint64_t row = static_cast<uint64_t>(keys[i]) * dim;
    for (uint64_t j = lane; j < dim; j += 32) {
      out[i * dim + j] = field32 != nullptr ? field32[row + j] : BFloat16ToFloat(field16[row + j]);
    }
  }
}

// Enough blocks for `per_block` items each, at most `grid`, at least one.
int Blocks(int grid, uint64_t items, uint64_t per_block) {
  const uint64_t wanted = (items + per_block - 1) / per_block;
  return static_cast<int>(std::max<uint64_t>(1, std::min<uint64_t>(grid, wanted)));
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

uint64_t RowUnitWidth(const RowTable& table, const float* grads) {
  const bool four = table.dim % 4 == 0 && table.grad_offset % 4 == 0 && Aligned16(grads) &&
                    Aligned16(table.params) && Aligned16(table.exp_avg) &&
                    Aligned16(table.exp_avg_sq) &&
                    (table.init_params == nullptr || Aligned16(table.init_params));
  return four ? 4 : 1;
}

absl::Status LaunchTableRowsUpdate(LaunchCounter& launches, int grid, cudaStream_t stream,
                                   const RowTable* tables, uint32_t table_count,
                                   const int64_t* keys, const float* grads, uint64_t units) {
  return launches.Launch("fusedps_table_rows_update", TableRowsUpdate,
                         Blocks(grid, units, kThreads), 0, stream, tables, table_count, keys, grads,
                         units);
}

absl::Status LaunchTableRowsGather(LaunchCounter& launches, int grid, cudaStream_t stream,
                                   const float* field32, const uint16_t* field16, uint64_t dim,
                                   const int64_t* keys, uint64_t count, float* out) {
  return launches.Launch("fusedps_table_rows_gather", TableRowsGather,
                         Blocks(grid, count, kWarpsPerBlock), 0, stream, field32, field16, dim,
                         keys, count, out);
}

}  // namespace gpu
}  // namespace fusedps
