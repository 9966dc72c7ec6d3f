// table_rows_kernel.cu: the embedding tables' row update and row gather (table_rows_kernel.cuh).
//
// How the update is organised, and why. Per 16-byte unit (4 elements of a row) it reads param,
// exp_avg, exp_avg_sq and the gradient and writes the first three back, with a few dozen fp32
// operations between: a copy with arithmetic, so its speed is how many loads the device keeps in
// flight. A thread takes one unit: it loads the unit's gradient and its row's key together (the
// gradient does not wait on the key), then the three fields of the row the key names, then does
// the math and the stores. Each load of a warp is 32 consecutive units: 512 contiguous bytes of
// the gradients and whole rows of the table.
//
// What keeps loads in flight is resident threads: the launch has a block per kThreads units, not
// a grid of a few blocks per SM walked grid-stride, so each SM holds as many blocks as the
// kernel's registers allow (40 registers: 6 blocks of 256 threads) and refills them as blocks
// finish. On an H200 (docs/benchmarks.md, run T4) this reached 85-88% of the copy roof, against
// 73-75% for the kernel before it (the same thread per 16-byte unit, on the backend's apply grid:
// 2 blocks per SM). Held to 4 or 2 blocks per SM (by shared memory), this kernel ran at 70-74%
// and 61-62%. Tried and dropped: 2, 4 or 8 units per thread with all their loads issued before
// the math (73-79%, 50-52% for 8): the registers cost resident warps, and a warp's math, while
// none of its own loads are in flight, is hidden only by other warps; streaming cache hints
// (ld/st .cs), 1-3 points slower with a unit per thread. The kernel before this one's load order
// (key, row, then gradient) with this launch ran at 96% in the T4 harness but at 83.8-86.9% in
// the bench (run T5; its data is made differently, not examined), under this one's 85.1-88.1%.
//
// Units of tables with bf16 state or 1-element units (a dim not a multiple of 4, or unaligned
// fields) take UpdateElements, one element at a time, with the same math (sparse_adam_math.h).
// Tables with int8 state take UpdateRowInt8 in a launch of their own, a warp per row (a row's
// scales need the whole row).
#include <algorithm>
#include <cstdint>
#include <limits>

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

__device__ float4 Load16(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ void Store16(float* p, const float4& v) { *reinterpret_cast<float4*>(p) = v; }

// The table of unit u: the last with first_unit <= u (tables in order of first_unit; a table of
// no units shares its first_unit with the next). REQUIRES: u < the launch's units.
__device__ uint32_t TableOf(const RowTable* tables, uint32_t table_count, uint64_t u) {
  uint32_t lo = 0, hi = table_count - 1;
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo + 1) / 2;
    if (tables[mid].first_unit <= u) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Updates unit u of a table with fp32 state and 16-byte units (width 4).
__device__ void UpdateUnit4(const RowTable& table, const int64_t* keys, const float* grads,
                            uint64_t u) {
  const uint64_t dim = table.dim, per_row = dim / 4;
  const uint64_t local = u - table.first_unit;
  const uint64_t r = local / per_row;
  const uint64_t col = (local - r * per_row) * 4;
  // The gradient and the key first (neither waits on the other), then the row the key names.
  float4 grad = Load16(grads + table.grad_offset + r * dim + col);
  const int64_t key = __ldg(keys + table.first_row + r);
  // A row that starts over reads its init params and zero moments instead of its slot's.
  const int32_t init = table.init_of_row == nullptr ? -1 : __ldg(table.init_of_row + r);
  const uint64_t at = static_cast<uint64_t>(key) * dim + col;
  float4 param, exp_avg, exp_avg_sq;
  if (init < 0) {
    param = Load16(table.params + at);
    exp_avg = Load16(table.exp_avg + at);
    exp_avg_sq = Load16(table.exp_avg_sq + at);
  } else {
    param = Load16(table.init_params + static_cast<uint64_t>(init) * dim + col);
    exp_avg = exp_avg_sq = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    SparseAdamUpdate(table.s, Lane(grad, j), Lane(param, j), Lane(exp_avg, j), Lane(exp_avg_sq, j));
  }
  Store16(table.params + at, param);
  Store16(table.exp_avg + at, exp_avg);
  Store16(table.exp_avg_sq + at, exp_avg_sq);
}

// Updates unit u of any table, one element at a time (bf16 state, or 1-element units).
__device__ void UpdateElements(const RowTable& table, const int64_t* keys, const float* grads,
                               uint64_t u) {
  const uint64_t per_row = table.dim / table.width;
  const uint64_t local = u - table.first_unit;
  const uint64_t r = local / per_row;
  const uint64_t col = (local - r * per_row) * table.width;
  const uint64_t at = static_cast<uint64_t>(keys[table.first_row + r]) * table.dim + col;
  const float* g = grads + table.grad_offset + r * table.dim + col;
  // A row that starts over reads its init params and zero moments instead of its slot's.
  const int32_t init = table.init_of_row == nullptr ? -1 : table.init_of_row[r];
  const float* init_param =
      init < 0 ? nullptr : table.init_params + static_cast<uint64_t>(init) * table.dim + col;
  for (uint64_t j = 0; j < table.width; ++j) {
    float param = init_param == nullptr ? table.params[at + j] : init_param[j];
    if (table.exp_avg16 != nullptr) {  // bf16 state.
      uint16_t exp_avg = init_param == nullptr ? table.exp_avg16[at + j] : uint16_t{0};
      uint16_t exp_avg_sq = init_param == nullptr ? table.exp_avg_sq16[at + j] : uint16_t{0};
      SparseAdamUpdateBFloat16State(table.s, g[j], param, exp_avg, exp_avg_sq);
      table.exp_avg16[at + j] = exp_avg;
      table.exp_avg_sq16[at + j] = exp_avg_sq;
    } else {
      float exp_avg = init_param == nullptr ? table.exp_avg[at + j] : 0.0f;
      float exp_avg_sq = init_param == nullptr ? table.exp_avg_sq[at + j] : 0.0f;
      SparseAdamUpdate(table.s, g[j], param, exp_avg, exp_avg_sq);
      table.exp_avg[at + j] = exp_avg;
      table.exp_avg_sq[at + j] = exp_avg_sq;
    }
    table.params[at + j] = param;
  }
}

// Updates row r of a table with int8 state on one warp, lane l taking elements l, l + 32, ...:
// SparseAdamUpdateInt8Row's two passes. The lanes' new moments give the row's new scales (a
// warp max), then each lane recomputes its elements and stores them quantized; the scales are
// written last, once every lane has read the old ones. `books` is the block's copy in shared
// memory. The table's fields are read once into registers: the stores through them would
// otherwise make the compiler read them again after each one.
__device__ void UpdateRowInt8(const RowTable& table, const Int8Codebooks& books,
                              const int64_t* keys, const float* grads, uint64_t r, uint32_t lane) {
  const uint64_t dim = table.dim;
  const AdamWStepScalars s = table.s;
  const auto key = static_cast<uint64_t>(keys[table.first_row + r]);
  float* __restrict__ params = table.params + key * dim;
  uint8_t* __restrict__ codes_m = table.exp_avg8 + key * dim;
  uint8_t* __restrict__ codes_v = table.exp_avg_sq8 + key * dim;
  float* absmax_m = table.absmax_m + key;
  float* absmax_v = table.absmax_v + key;
  const float* __restrict__ g = grads + table.grad_offset + r * dim;
  // A row that starts over: its init params, and zero moments (codes 0 and scales 0, as
  // ZeroRowMoments leaves them).
  const int32_t init = table.init_of_row == nullptr ? -1 : table.init_of_row[r];
  const float* init_param =
      init < 0 ? nullptr : table.init_params + static_cast<uint64_t>(init) * dim;
  const float old_m = init < 0 ? *absmax_m : 0.0f;
  const float old_v = init < 0 ? *absmax_v : 0.0f;
  const auto element = [&](uint64_t j, float& param, float& m, float& v) {
    param = init_param == nullptr ? params[j] : init_param[j];
    const uint8_t code_m = init < 0 ? codes_m[j] : uint8_t{0};
    const uint8_t code_v = init < 0 ? codes_v[j] : uint8_t{0};
    SparseAdamUpdateInt8(s, books, g[j], param, code_m, code_v, old_m, old_v, m, v);
  };
  float new_m = 0.0f, new_v = 0.0f;
#pragma unroll 2
  for (uint64_t j = lane; j < dim; j += kInt8RowUnits) {
    float param, m, v;
    element(j, param, m, v);
    new_m = fmaxf(new_m, fabsf(m));
    new_v = fmaxf(new_v, v);
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    new_m = fmaxf(new_m, __shfl_xor_sync(0xffffffffu, new_m, offset));
    new_v = fmaxf(new_v, __shfl_xor_sync(0xffffffffu, new_v, offset));
  }
  const float inverse_m = InverseScale(new_m), inverse_v = InverseScale(new_v);
#pragma unroll 2
  for (uint64_t j = lane; j < dim; j += kInt8RowUnits) {
    float param, m, v;
    element(j, param, m, v);
    params[j] = param;
    codes_m[j] = static_cast<uint8_t>(
        QuantizeSigned(books.exp_avg.thresholds, books.exp_avg.buckets, m, inverse_m));
    codes_v[j] = static_cast<uint8_t>(
        QuantizeUnsigned(books.exp_avg_sq.thresholds, books.exp_avg_sq.buckets, v, inverse_v));
  }
  __syncwarp();
  if (lane == 0) {
    *absmax_m = new_m;
    *absmax_v = new_v;
  }
}

__global__ void __launch_bounds__(kThreads)
    TableRowsUpdate(const RowTable* tables, uint32_t table_count, const int64_t* keys,
                    const float* grads, uint64_t units) {
  if (blockIdx.x == 0) {
    for (uint32_t t = threadIdx.x; t < table_count; t += blockDim.x) *tables[t].step += 1;
  }
  // A unit per thread; the loop only matters past the grid's limit of 2^31 - 1 blocks.
  for (uint64_t u = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; u < units;
       u += uint64_t{gridDim.x} * blockDim.x) {
    const RowTable& table = tables[TableOf(tables, table_count, u)];
    if (table.exp_avg16 == nullptr && table.width == 4) {
      UpdateUnit4(table, keys, grads, u);
    } else {
      UpdateElements(table, keys, grads, u);
    }
  }
}

// The tables with int8 state: a launch of their own, so that their registers (the row's two
// passes and the warp max) do not cost the kernel above its resident blocks. A grid of a few
// blocks per SM, each copying the codebooks into shared memory once (10 KB: the quantizers'
// lookups are on the row's critical path) and walking rows grid-stride, a warp per row.
__global__ void __launch_bounds__(kThreads)
    TableRowsUpdateInt8(const RowTable* tables, uint32_t table_count, const int64_t* keys,
                        const float* grads, uint64_t units) {
  __shared__ Int8Codebooks books;
  {
    const auto* src = reinterpret_cast<const uint4*>(tables[0].books);
    auto* dst = reinterpret_cast<uint4*>(&books);
    for (uint32_t i = threadIdx.x; i < sizeof(Int8Codebooks) / 16; i += blockDim.x) {
      dst[i] = src[i];
    }
  }
  if (blockIdx.x == 0) {
    for (uint32_t t = threadIdx.x; t < table_count; t += blockDim.x) *tables[t].step += 1;
  }
  __syncthreads();
  const uint32_t lane = threadIdx.x % 32;
  // Whole warps: units is a multiple of 32, and so is the stride.
  for (uint64_t u = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; u < units;
       u += uint64_t{gridDim.x} * blockDim.x) {
    const RowTable& table = tables[TableOf(tables, table_count, u)];
    UpdateRowInt8(table, books, keys, grads, (u - table.first_unit) / kInt8RowUnits, lane);
  }
}

__global__ void __launch_bounds__(kThreads)
    TableRowsGather(RowSource field, uint64_t dim, const int64_t* keys, uint64_t count,
                    float* out) {
  const uint32_t lane = threadIdx.x % 32;
  for (uint64_t i = FirstRow(); i < count; i += RowStride()) {
    const uint64_t key = keys == nullptr ? i : static_cast<uint64_t>(keys[i]);
    const uint64_t row = key * dim;
    const float scale = field.int8 != nullptr ? field.scales[key] : 0.0f;
    for (uint64_t j = lane; j < dim; j += 32) {
      out[i * dim + j] = field.f32 != nullptr ? field.f32[row + j]
                         : field.bf16 != nullptr
                             ? BFloat16ToFloat(field.bf16[row + j])
                             : Dequantize(field.values, field.int8[row + j], scale);
    }
  }
}

// Enough blocks for `per_block` items each, at most `grid`, at least one.
int Blocks(int grid, uint64_t items, uint64_t per_block) {
  const uint64_t wanted = (items + per_block - 1) / per_block;
  return static_cast<int>(std::max<uint64_t>(1, std::min<uint64_t>(grid, wanted)));
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Blocks per SM of the int8 launch: as many as its registers let stay resident.
constexpr int kInt8BlocksPerSm = 4;

}  // namespace

uint64_t RowUnitWidth(const RowTable& table, const float* grads) {
  const bool four = table.dim % 4 == 0 && table.grad_offset % 4 == 0 && Aligned16(grads) &&
                    Aligned16(table.params) && Aligned16(table.exp_avg) &&
                    Aligned16(table.exp_avg_sq) &&
                    (table.init_params == nullptr || Aligned16(table.init_params));
  return four ? 4 : 1;
}

absl::Status LaunchTableRowsUpdate(LaunchCounter& launches, cudaStream_t stream,
                                   const RowTable* tables, uint32_t table_count,
                                   const int64_t* keys, const float* grads, uint64_t units,
                                   bool int8, int sm_count) {
  if (int8) {  // kInt8BlocksPerSm blocks per SM, walked grid-stride.
    return launches.Launch("fusedps_table_rows_update_int8", TableRowsUpdateInt8,
                           Blocks(sm_count * kInt8BlocksPerSm, units, kThreads), 0, stream, tables,
                           table_count, keys, grads, units);
  }
  // A block per kThreads units (see the top), up to the grid's limit.
  return launches.Launch("fusedps_table_rows_update", TableRowsUpdate,
                         Blocks(std::numeric_limits<int>::max(), units, kThreads), 0, stream,
                         tables, table_count, keys, grads, units);
}

absl::Status LaunchTableRowsGather(LaunchCounter& launches, int grid, cudaStream_t stream,
                                   const RowSource& field, uint64_t dim, const int64_t* keys,
                                   uint64_t count, float* out) {
  return launches.Launch("fusedps_table_rows_gather", TableRowsGather,
                         Blocks(grid, count, kWarpsPerBlock), 0, stream, field, dim, keys, count,
                         out);
}

}  // namespace gpu
}  // namespace fusedps
