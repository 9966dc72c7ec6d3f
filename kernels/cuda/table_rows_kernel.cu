// table_rows_kernel.cu: the embedding tables' launches of their own (table_rows_kernel.cuh): the
// update of a step of tables alone, and the row gather. A step with dense tensors updates its
// rows in its AdamWApply launch instead (table_rows_update.cuh: the row phase, and why).
//
// How the update of a step of tables alone is organised, and why. Per 16-byte unit (4 elements
// of a row) it reads param, exp_avg, exp_avg_sq and the gradient and writes the first three
// back, with a few dozen fp32 operations between: a copy with arithmetic, so its speed is how
// many loads the device keeps in flight. A thread takes one unit (UpdateUnit4): it loads the
// unit's gradient and its row's key together, then the three fields of the row the key names,
// then does the math and the stores. Each load of a warp is 32 consecutive units: 512
// contiguous bytes of the gradients and whole rows of the table.
//
// What keeps loads in flight is resident threads: the launch has a block per kThreads units, not
// a grid of a few blocks per SM walked grid-stride, so each SM holds as many blocks as the
// kernel's registers allow (6 blocks of 256 threads) and refills them as blocks finish. On an
// H200 (docs/benchmarks.md, run T4) this reached 85-88% of the copy roof, against 73-75% for the
// kernel before it (the same thread per 16-byte unit on the backend's apply grid: 2 blocks per
// SM). Held to 4 or 2 blocks per SM (by shared memory), this kernel ran at 70-74% and 61-62%; the
// row phase of AdamWApply, held to 2 blocks per SM by the dense pipeline's shared memory, runs at
// about 71% (run T7). Tried and dropped: 2, 4 or 8 units per thread with all their loads issued
// before the math (73-79%, 50-52% for 8): the registers cost resident warps, and a warp's math,
// while none of its own loads are in flight, is hidden only by other warps; streaming cache hints
// (ld/st .cs), 1-3 points slower with a unit per thread.
//
// Tables with int8 state take a launch of their own (TableRowsUpdateInt8), a warp per row, so
// that their registers (the row's two passes and the warp max) do not cost the kernel above its
// resident blocks: a step of tables alone with both kinds runs AdamWApply's row phase instead.
#include <algorithm>
#include <cstdint>
#include <limits>

#include "kernels/cuda/table_rows_kernel.cuh"
#include "kernels/cuda/table_rows_update.cuh"

namespace fusedps {
namespace gpu {
namespace {

// The warps of the whole grid, each over rows first, r, r + warps, ...
__device__ uint64_t FirstRow() { return uint64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32; }
__device__ uint64_t RowStride() { return uint64_t{gridDim.x} * kWarpsPerBlock; }

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

// The pipelined tables' units (UpdateUnit4), then the elementwise tables' (UpdateElements), a
// thread each.
__global__ void __launch_bounds__(kThreads) TableRowsUpdate(RowStep step) {
  if (blockIdx.x == 0) {
    for (uint32_t t = threadIdx.x; t < step.table_count(); t += blockDim.x) {
      *step.tables[t].step += 1;
    }
  }
  const RowTable* pipelined = step.tables;
  const RowTable* elementwise = step.tables + step.pipelined;
  const uint64_t pipelined_units = step.portions * row_phase::kUnitsPerPortion;
  // A unit per thread; the loop only matters past the grid's limit of 2^31 - 1 blocks.
  for (uint64_t u = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
       u < pipelined_units + step.element_units; u += uint64_t{gridDim.x} * blockDim.x) {
    if (u < pipelined_units) {
      const uint64_t portion = u / row_phase::kUnitsPerPortion;
      row_phase::UpdateUnit4(pipelined[row_phase::TableOf(pipelined, step.pipelined, portion)],
                             step, u);
    } else {
      const uint64_t e = u - pipelined_units;
      row_phase::UpdateElements(elementwise[row_phase::TableOf(elementwise, step.elementwise, e)],
                                step.keys, step.grads, e);
    }
  }
}

// The int8 tables' rows: a grid of a few blocks per SM, each copying the codebooks into shared
// memory once (10 KB: the quantizers' lookups are on the row's critical path) and walking rows
// grid-stride, a warp per row.
__global__ void __launch_bounds__(kThreads) TableRowsUpdateInt8(RowStep step) {
  __shared__ Int8Codebooks books;
  {
    const auto* src = reinterpret_cast<const uint4*>(step.tables[0].books);
    auto* dst = reinterpret_cast<uint4*>(&books);
    for (uint32_t i = threadIdx.x; i < sizeof(Int8Codebooks) / 16; i += blockDim.x) {
      dst[i] = src[i];
    }
  }
  if (blockIdx.x == 0) {
    for (uint32_t t = threadIdx.x; t < step.table_count(); t += blockDim.x) {
      *step.tables[t].step += 1;
    }
  }
  __syncthreads();
  row_phase::UpdateInt8Rows(step, books, uint64_t{blockIdx.x} * blockDim.x + threadIdx.x,
                            uint64_t{gridDim.x} * blockDim.x, threadIdx.x % 32);
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

bool RunsAlone(const RowStep& rows) {
  return rows.table_count() > 0 && (rows.int8 == 0 || rows.pipelined + rows.elementwise == 0);
}

absl::Status LaunchTableRowsUpdate(LaunchCounter& launches, cudaStream_t stream,
                                   const RowStep& rows, int sm_count) {
  if (!RunsAlone(rows)) {
    return absl::InternalError("these table rows need AdamWApply's row phase, not a launch alone");
  }
  if (rows.int8 > 0) {  // kInt8BlocksPerSm blocks per SM, walked grid-stride.
    return launches.Launch("fusedps_table_rows_update_int8", TableRowsUpdateInt8,
                           Blocks(sm_count * kInt8BlocksPerSm, rows.int8_units, kThreads), 0,
                           stream, rows);
  }
  // A block per kThreads units (see the top), up to the grid's limit.
  return launches.Launch(
      "fusedps_table_rows_update", TableRowsUpdate,
      Blocks(std::numeric_limits<int>::max(),
             rows.portions * row_phase::kUnitsPerPortion + rows.element_units, kThreads),
      0, stream, rows);
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
