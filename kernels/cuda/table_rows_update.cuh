// table_rows_update.cuh (adamw_kernel.cu only): the embedding tables' row update, as the row
// phase of AdamWApply: the step's dense tensors and its tables' rows are one launch
// (docs/dev/embedding-tables.md, "The update"). Each warp runs the row phase once it has no
// dense portion left, with the same shared-memory pipeline the dense portions went through.
// The math is kernels/sparse_adam_math.h's, bit for bit the CPU backend's (this code is compiled
// with adamw_kernel.cu's --fmad=false). The host prepares a step's rows first
// (kernels/backend_tables.h: duplicate keys summed, gradients divided by grad_scale and negated
// for maximize, every value checked finite), so the update only reads them.
//
// A step's rows are laid out flat: the keys of every table one after another (each table's
// unique and ascending), and their fp32 gradient rows in the same order, each `dim` wide. A
// step's tables come in three lists (RowStep, adamw_kernel.cuh), each walked in units:
// - pipelined: fp32 state, dim a multiple of 4, 16-byte aligned fields and gradient rows (the
//   common case). A unit is a portion: 256 consecutive elements of the table's pushed rows
//   (rows * dim flat, as the gradients lie), lane l's the runs [4l, 4l + 4) and [128 + 4l,
//   128 + 4l + 4), as a dense portion's. A run never straddles two rows (dim % 4 == 0), so each
//   is one 16-byte asynchronous copy (cp.async) of each of the gradient, the param, exp_avg and
//   exp_avg_sq of the row its key names, into a stage of the warp's pipeline; the warp computes
//   a portion while the next kStages - 1 are on their way, and stores with 16-byte stores.
//   Warps take portions w, w + W, w + 2W, ... (W warps): every portion moves the same bytes.
// - elementwise: bf16 state, or a dim not a multiple of 4, or unaligned fields: a unit is one
//   element, a thread each, straight from global memory.
// - int8 state: a row per warp (a row's scales need the whole row): kInt8RowUnits units a row,
//   SparseAdamUpdateInt8Row's two passes spread over the lanes, the codebooks from the kernel's
//   shared memory.
// An element is read and written by its unit's thread alone, since keys are unique within a
// table; tables never share memory with the step's dense tensors.
//
// Why in the dense kernel's pipeline (tuning history, docs/benchmarks.md runs T4, T5 and T7):
// the row update is a copy with arithmetic, bound by the loads the device keeps in flight. The
// kernel before this one, a launch of its own with a thread per 16-byte unit, kept them in
// flight by resident threads: 6 blocks of 256 threads per SM (40 registers) reached 85-88% of
// the copy roof, but held to AdamWApply's 2 blocks per SM it ran at 61-62%. So a step with dense
// tensors and tables was two launches. Here the pipeline keeps two portions in flight per warp
// while it computes a third, as it does for dense tensors, whatever the blocks per SM.
#ifndef FUSEDPS_KERNELS_CUDA_TABLE_ROWS_UPDATE_CUH_
#define FUSEDPS_KERNELS_CUDA_TABLE_ROWS_UPDATE_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/adamw_kernel.cuh"
#include "kernels/cuda/adamw_pipeline.cuh"
#include "kernels/cuda/table_rows_kernel.cuh"
#include "kernels/sparse_adam_math.h"

namespace fusedps {
namespace gpu {
namespace row_phase {

// The table of unit u in a list of `count` tables: the last with first_unit <= u (tables in
// order of first_unit; a table of no units shares its first_unit with the next).
// REQUIRES: count >= 1; u < the list's units.
__device__ __forceinline__ uint32_t TableOf(const RowTable* tables, uint32_t count, uint64_t u) {
  uint32_t lo = 0, hi = count - 1;
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

// Element j (0..3) of a float4.
__device__ __forceinline__ float& Lane(float4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}
__device__ __forceinline__ float4 Load16(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}
__device__ __forceinline__ void Store16(float* p, const float4& v) {
  *reinterpret_cast<float4*>(p) = v;
}

// Brings the line at p into L2 without waiting for it: a later load of it is short.
__device__ __forceinline__ void PrefetchL2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Brings the keys (and rows-that-start-over entries) of pipelined portion `portion` into L2, a
// lane per 128-byte line, so that their loads (LoadPortionRows) are short.
__device__ __forceinline__ void PrefetchPortionKeys(const RowTable& t, const RowStep& step,
                                                    uint64_t portion, uint32_t lane) {
  // 32-bit arithmetic: a pipelined table has at most 2^32 - 256 elements in a step (RowStep).
  const auto first = static_cast<uint32_t>((portion - t.first_unit) * kPortionNumel);
  const auto dim = static_cast<uint32_t>(t.dim);
  const uint32_t row = first / dim;
  const uint32_t skip = first - row * dim;  // < dim: no sum below overflows.
  const uint32_t end =
      min(static_cast<uint32_t>(t.rows), row + (skip + kPortionNumel + dim - 1) / dim);
  const int64_t* keys = step.keys + t.first_row + row;
  const uint32_t n = end - row;                        // >= 1: the portion holds an element.
  const uint32_t at = lane == 31 ? n - 1 : 16 * lane;  // The last, whatever the start.
  if (at < n) {
    PrefetchL2(keys + at);
    if (t.init_of_row != nullptr) PrefetchL2(t.init_of_row + row + at);
  }
}

// Lane l's two runs of a pipelined portion: for each, whether it holds elements, its row (within
// the table's pushed rows) and its column.
struct PortionRuns {
  bool valid[2];
  uint32_t row[2];
  uint32_t col[2];
};

__device__ __forceinline__ PortionRuns RunsOf(const RowTable& t, uint64_t portion, uint32_t lane) {
  PortionRuns runs;
  // 32-bit arithmetic: a pipelined table has at most 2^32 - 256 elements in a step (RowStep).
  const auto dim = static_cast<uint32_t>(t.dim);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const auto element =
        static_cast<uint32_t>((portion - t.first_unit) * kPortionNumel) + 128 * r + 4 * lane;
    const uint32_t row = element / dim;
    runs.row[r] = row;
    runs.col[r] = element - row * dim;
    runs.valid[r] = row < t.rows;
  }
  return runs;
}

// Lane l's runs of a pipelined portion with their rows' keys and rows-that-start-over entries
// (-1: none), loaded one issue before the portion's: the copies need the rows' addresses, and a
// load of them at the issue would put a round trip to memory on the warp's path.
struct PortionRows {
  PortionRuns runs;
  uint64_t key[2];
  int32_t init[2];
};

// Starts loading lane l's keys of pipelined portion `portion` of table t (all loads first, so
// that their round trips overlap; nothing here waits for them).
__device__ __forceinline__ PortionRows LoadPortionRows(const RowTable& t, const RowStep& step,
                                                       uint64_t portion, uint32_t lane) {
  PortionRows p;
  p.runs = RunsOf(t, portion, lane);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    p.key[r] = p.runs.valid[r] ? __ldg(step.keys + t.first_row + p.runs.row[r]) : 0;
    p.init[r] =
        p.runs.valid[r] && t.init_of_row != nullptr ? __ldg(t.init_of_row + p.runs.row[r]) : -1;
  }
  return p;
}

// Issues lane l's copies of a pipelined portion of table t (its rows: LoadPortionRows') into
// `stage`'s regions (gradients, params, exp_avg, exp_avg_sq; adamw_pipeline.cuh's layout). A row
// that starts over copies its init params and zeroes its moments' runs.
__device__ __forceinline__ void IssueRowPortion(const RowTable& t, const RowStep& step,
                                                const PortionRows& p, char* stage, uint32_t lane) {
  char* data = stage + kHeaderBytes;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!p.runs.valid[r]) continue;
    const uint64_t row = p.runs.row[r];
    const uint32_t col = p.runs.col[r];
    CopyAsync16(RunInRegion<float>(data, lane, r), step.grads + t.grad_offset + row * t.dim + col);
    if (p.init[r] < 0) {
      const uint64_t at = p.key[r] * t.dim + col;
      CopyAsync16(RunInRegion<float>(data + kRegionBytes, lane, r), t.params + at);
      CopyAsync16(RunInRegion<float>(data + 2 * kRegionBytes, lane, r), t.exp_avg + at);
      CopyAsync16(RunInRegion<float>(data + 3 * kRegionBytes, lane, r), t.exp_avg_sq + at);
    } else {
      CopyAsync16(RunInRegion<float>(data + kRegionBytes, lane, r),
                  t.init_params + static_cast<uint64_t>(p.init[r]) * t.dim + col);
      const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      *reinterpret_cast<float4*>(RunInRegion<float>(data + 2 * kRegionBytes, lane, r)) = zero;
      *reinterpret_cast<float4*>(RunInRegion<float>(data + 3 * kRegionBytes, lane, r)) = zero;
    }
  }
}

// Updates lane l's runs of pipelined portion `portion` of table t from `stage` and stores them
// to the rows' slots.
__device__ __forceinline__ void ComputeRowPortion(const RowTable& t, const RowStep& step,
                                                  uint64_t portion, const char* stage,
                                                  uint32_t lane) {
  const PortionRuns runs = RunsOf(t, portion, lane);
  uint64_t at[2];  // Both keys' loads first (this lane's own, two issues ago: in L1).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    at[r] = runs.valid[r] ? __ldg(step.keys + t.first_row + runs.row[r]) * t.dim + runs.col[r] : 0;
  }
  const char* data = stage + kHeaderBytes;
  const AdamWStepScalars s = t.s;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!runs.valid[r]) continue;
    float g[4], p[4], m[4], v[4];
    char* region = const_cast<char*>(data);
    Load4(reinterpret_cast<const float*>(RunInRegion<float>(region, lane, r)), g);
    Load4(reinterpret_cast<const float*>(RunInRegion<float>(region + kRegionBytes, lane, r)), p);
    Load4(reinterpret_cast<const float*>(RunInRegion<float>(region + 2 * kRegionBytes, lane, r)),
          m);
    Load4(reinterpret_cast<const float*>(RunInRegion<float>(region + 3 * kRegionBytes, lane, r)),
          v);
#pragma unroll
    for (int j = 0; j < 4; ++j) SparseAdamUpdate(s, g[j], p[j], m[j], v[j]);
    Store4(t.params + at[r], p);
    Store4(t.exp_avg + at[r], m);
    Store4(t.exp_avg_sq + at[r], v);
  }
}

// Units of 4 elements (16 bytes) in a pipelined portion: the standalone launch's units
// (TableRowsUpdate) of the pipelined tables.
constexpr uint64_t kUnitsPerPortion = kPortionNumel / 4;

// Updates unit u of the pipelined tables' units (kUnitsPerPortion per portion) in the
// standalone launch, a thread per unit: the gradient and the key first (neither waits on the
// other), then the row the key names. A unit past its table's elements (the last portion's
// padding) does nothing.
__device__ __forceinline__ void UpdateUnit4(const RowTable& table, const RowStep& step,
                                            uint64_t u) {
  const auto element = static_cast<uint32_t>((u - table.first_unit * kUnitsPerPortion) * 4);
  const auto dim = static_cast<uint32_t>(table.dim);
  const uint32_t r = element / dim;
  if (r >= table.rows) return;
  const uint32_t col = element - r * dim;
  float4 grad = Load16(step.grads + table.grad_offset + element);
  const int64_t key = __ldg(step.keys + table.first_row + r);
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

// Updates element unit u of an elementwise table, one element at a time (bf16 state, or
// 1-element units).
__device__ __forceinline__ void UpdateElements(const RowTable& table, const int64_t* keys,
                                               const float* grads, uint64_t u) {
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

// Updates row r (key `key`) of a table with int8 state on one warp, lane l taking elements l,
// l + 32, ...:
// SparseAdamUpdateInt8Row's two passes. The lanes' new moments give the row's new scales (a
// warp max), then each lane recomputes its elements and stores them quantized; the scales are
// written last, once every lane has read the old ones. `books` is the block's copy in shared
// memory. The table's fields are read once into registers: the stores through them would
// otherwise make the compiler read them again after each one.
__device__ __forceinline__ void UpdateRowInt8(const RowTable& table, const Int8Codebooks& books,
                                              uint64_t key, const float* grads, uint64_t r,
                                              uint32_t lane) {
  const uint64_t dim = table.dim;
  const AdamWStepScalars s = table.s;
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

// Updates the int8 tables' rows a warp each: this thread's units u, u + stride, ... (whole warps:
// u's warp starts at a multiple of 32, and stride and int8_units are multiples of 32). (Loading
// each key two rows ahead and bringing the next row into L2 while a row is computed ran 4-7%
// slower in a launch of its own, and no faster in the row phase: docs/benchmarks.md, run T7.)
__device__ __forceinline__ void UpdateInt8Rows(const RowStep& step, const Int8Codebooks& books,
                                               uint64_t u, uint64_t stride, uint32_t lane) {
  const RowTable* int8 = step.tables + step.pipelined + step.elementwise;
  for (; u < step.int8_units; u += stride) {
    const RowTable& t = int8[TableOf(int8, step.int8, u)];
    const uint64_t r = (u - t.first_unit) / kInt8RowUnits;
    UpdateRowInt8(t, books, static_cast<uint64_t>(step.keys[t.first_row + r]), step.grads, r, lane);
  }
}

}  // namespace row_phase
}  // namespace gpu
}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_CUDA_TABLE_ROWS_UPDATE_CUH_
