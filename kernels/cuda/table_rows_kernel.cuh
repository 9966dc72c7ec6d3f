// table_rows_kernel.cuh (CUDA backend only): the device side of embedding tables
// (docs/dev/embedding-tables.md) as the backend sees them: a step's table as its update reads it
// (RowTable; a step's tables are listed by RowStep, adamw_kernel.cuh); the update of a step of
// tables alone in a launch of its own; and the launch that gathers rows by key for lookups and
// reads of whole fields. Every step is one launch: a step with dense tensors updates its rows in
// the row phase of its AdamWApply launch (table_rows_update.cuh).
#ifndef FUSEDPS_KERNELS_CUDA_TABLE_ROWS_KERNEL_CUH_
#define FUSEDPS_KERNELS_CUDA_TABLE_ROWS_KERNEL_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/adamw_math.h"
#include "kernels/cuda/adamw_kernel.cuh"
#include "kernels/quant_math.h"

namespace fusedps {
namespace gpu {

// One table of a step, as the update reads it (device memory).
struct RowTable {
  float* params = nullptr;   // The table's [rows, dim] fp32 params, row-major (its arena range).
  float* exp_avg = nullptr;  // fp32 state; null with bf16 state.
  float* exp_avg_sq = nullptr;
  // bf16 state (bf16 bit patterns, rounded to nearest even after each update); null otherwise.
  uint16_t* exp_avg16 = nullptr;
  uint16_t* exp_avg_sq16 = nullptr;
  // int8 state (codes, [rows, dim]; one fp32 scale per row in absmax_m and absmax_v, [rows]),
  // with the int8 codebooks; null otherwise. Such tables are updated a warp per row:
  // kInt8RowUnits units a row (sparse_adam_math.h's SparseAdamUpdateInt8Row, spread over the
  // warp's lanes).
  uint8_t* exp_avg8 = nullptr;
  uint8_t* exp_avg_sq8 = nullptr;
  float* absmax_m = nullptr;
  float* absmax_v = nullptr;
  const Int8Codebooks* books = nullptr;
  int64_t* step = nullptr;   // The tensor's device step count: the launch adds one.
  uint64_t first_row = 0;    // Its first row in the launch's keys (and gradient rows).
  uint64_t rows = 0;         // Its rows in the launch (pushed, unique).
  uint64_t grad_offset = 0;  // Its first gradient element in the launch's grads.
  // Its first unit in its list of RowStep's units: a portion of 256 elements (pipelined), an
  // element unit of `width` elements (elementwise) or a lane of a row (int8 state).
  uint64_t first_unit = 0;
  uint64_t dim = 0;
  uint64_t width = 1;  // Elements per unit: 4 (dim % 4 == 0, 16-byte aligned rows) or 1.
  AdamWStepScalars s;  // For the table's incremented step (MakeStepScalars).
  // Rows that start over (a hashed table's new rows; PreparedTableRows::init_of_row), or null:
  // per row of the table in the launch, -1 or the row of init_params ([n, dim] fp32, 16-byte
  // aligned) whose values its params start from, its moments from zero.
  const int32_t* init_of_row = nullptr;
  const float* init_params = nullptr;
};

// The width of a table's units (RowTable::width): 4 when its dim is a multiple of 4 and its
// fields' and gradient rows' starts are 16-byte aligned, else 1. (Not used for int8 state.) A
// table with fp32 state and width 4 goes in RowStep's pipelined list.
uint64_t RowUnitWidth(const RowTable& table, const float* grads);

// Lanes of a warp, the units of one row of a table with int8 state.
constexpr uint64_t kInt8RowUnits = 32;

// Whether the tables of `rows` (a step with no dense tensor) run in a launch of their own: they
// do when none or all of them have int8 state (TableRowsUpdate and TableRowsUpdateInt8 in
// table_rows_kernel.cu, each shaped for its kind). A step with dense tensors, or with int8 and
// other tables, updates its rows in its AdamWApply launch (LaunchAdamWApply's `rows`).
bool RunsAlone(const RowStep& rows);

// Updates the rows of a step of tables alone in one launch ("fusedps_table_rows_update" in
// `launches`, or "fusedps_table_rows_update_int8" when they have int8 state), with the math of
// AdamWApply's row phase (the same bits); every listed table's step advances by one. sm_count:
// the device's SMs (the int8 launch's grid is a few blocks per SM). Errors: INTERNAL unless
// RunsAlone(rows). REQUIRES: as LaunchAdamWApply's for `rows`.
absl::Status LaunchTableRowsUpdate(LaunchCounter& launches, cudaStream_t stream,
                                   const RowStep& rows, int sm_count);

// One field of a table as a gather reads it: one of f32 (fp32 values), bf16 (bf16 bit patterns)
// and int8 (codes, with a scale per row in scales, dequantized with the map `values`: 256 fp32,
// quant_math.h) set; device memory.
struct RowSource {
  const float* f32 = nullptr;
  const uint16_t* bf16 = nullptr;
  const uint8_t* int8 = nullptr;
  const float* scales = nullptr;
  const float* values = nullptr;
};

// Copies `count` rows of a [rows, dim] field to out as fp32 (row i is row keys[i] of the
// field) in one launch ("fusedps_table_rows_gather"), widening bf16 and dequantizing int8.
// keys null: rows 0 to count - 1, in order. REQUIRES: keys in [0, rows); device memory.
absl::Status LaunchTableRowsGather(LaunchCounter& launches, int grid, cudaStream_t stream,
                                   const RowSource& field, uint64_t dim, const int64_t* keys,
                                   uint64_t count, float* out);

}  // namespace gpu
}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_CUDA_TABLE_ROWS_KERNEL_CUH_
