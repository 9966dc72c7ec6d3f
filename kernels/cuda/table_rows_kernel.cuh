// table_rows_kernel.cuh (CUDA backend only): the device side of embedding tables
// (docs/dev/embedding-tables.md): one launch that updates the pushed rows of a step's tables
// with torch.optim.SparseAdam's math (kernels/sparse_adam_math.h, bit for bit the CPU backend's),
// a second one for the step's tables with int8 state, if any (a warp per row), and one that
// gathers rows by key for lookups. The host prepares a step's rows first
// (kernels/backend_tables.h: duplicate keys summed, gradients divided by grad_scale and negated
// for maximize, every value checked finite), so the update only reads them.
//
// A step's rows are laid out flat: the keys of every table one after another (each table's
// unique and ascending), and their fp32 gradient rows in the same order, each `dim` wide. The
// launch walks units: a unit is `width` consecutive elements of one row (width 4, one 16-byte
// load of each of param, exp_avg, exp_avg_sq and the gradient, where the table's dim and
// addresses allow it; else 1), a thread each, a block per kThreads units, so that every SM is
// as full of threads, and so of loads in flight, as the kernel's registers allow (how and why:
// table_rows_kernel.cu). An element is read and written by its unit's thread alone, since keys
// are unique within a table.
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
  // with the int8 codebooks; null otherwise. Such tables are updated by a launch of their own
  // (LaunchTableRowsUpdate's int8), a warp per row: kInt8RowUnits units a row
  // (sparse_adam_math.h's SparseAdamUpdateInt8Row, spread over the warp's lanes).
  uint8_t* exp_avg8 = nullptr;
  uint8_t* exp_avg_sq8 = nullptr;
  float* absmax_m = nullptr;
  float* absmax_v = nullptr;
  const Int8Codebooks* books = nullptr;
  int64_t* step = nullptr;   // The tensor's device step count: the launch adds one.
  uint64_t first_row = 0;    // Its first row in the launch's keys (and gradient rows).
  uint64_t grad_offset = 0;  // Its first gradient element in the launch's grads.
  uint64_t first_unit = 0;   // Its first unit in the launch's units.
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
// fields' and gradient rows' starts are 16-byte aligned, else 1. (Not used for int8 state.)
uint64_t RowUnitWidth(const RowTable& table, const float* grads);

// Lanes of a warp, the units of one row of a table with int8 state.
constexpr uint64_t kInt8RowUnits = 32;

// Updates the rows of `units` units in one launch ("fusedps_table_rows_update" in
// `launches`, or "fusedps_table_rows_update_int8" for tables with int8 state, int8 true: every
// table then has int8 state, and none otherwise): row r is key keys[r] of the table t with
// tables[t].first_row <= r < tables[t + 1].first_row, its gradient grads[tables[t].grad_offset + (r
// - first_row) * dim,
// ... + dim) (already unscaled), updated by SparseAdamUpdate from its stored values or, for a
// row that starts over (init_of_row), its init params and zero moments; every table's step advances
// by one, rows or none. The launch has a block per kThreads units (up to 2^31 - 1 blocks; past
// that its threads loop), not a grid that fills the device once: see table_rows_kernel.cu.
// REQUIRES: table_count >= 1; tables in order of first_unit, the first's 0, each table's units
// (its rows * dim / width, or rows * kInt8RowUnits with int8 state) before the next's; keys
// within each table unique and in [0, rows); everything in device memory and unchanged until
// the launch is done.
// sm_count: the device's SMs (the int8 launch's grid is a few blocks per SM).
absl::Status LaunchTableRowsUpdate(LaunchCounter& launches, cudaStream_t stream,
                                   const RowTable* tables, uint32_t table_count,
                                   const int64_t* keys, const float* grads, uint64_t units,
                                   bool int8, int sm_count);

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
