// backend_tables.h: the backends' embedding tables (backend.h: TableRows in a Step, ReadRows),
// the host side both share. A dense-id table is a registered tensor of rows * dim elements read
// as a row-major [rows, dim] matrix: its params and moments lie in the fp32 arenas (the moments
// in the bf16 or int8 ones for a group with bf16 or int8 state, int8 with a scale per row) at
// the tensor's offsets (tensor_table.h), and
// its step count is the tensor's. The step of its pushed
// rows is row_sparse.h's (torch.optim.SparseAdam's math, sparse_adam_math.h): this file checks a
// step's rows against the tensor table, prepares them (duplicates summed, gradients unscaled,
// finiteness) and, on the CPU backend, applies them, so that a backend steps dense tensors and
// tables together, all or nothing. The CUDA backend prepares rows here and applies them on the
// device (kernels/cuda/table_rows_kernel.cuh), with the same math bit for bit.
//
// `arenas` are the backend's: host memory on the CPU backend, device memory on the CUDA backend,
// where the spans of PreparedTableRows::view and CheckReadRows' result only say where rows lie
// (nothing here reads or writes through them but ApplyTableRows and ReadTableRows, the CPU's).
//
// Thread safety: none; the backend's one calling thread (backend.h).
//
// Usage (CpuBackend::Step):
//   bool finite = true;
//   absl::StatusOr<std::vector<PreparedTableRows>> rows =
//       PrepareTableRows(table, arenas, request, &finite);
//   if (!rows.ok()) return rows.status();   // nothing changed
//   if (!finite) ... skip the whole step ...
//   ... step the dense tensors ...
//   ApplyTableRows(*rows);                  // then advance the tables' steps
#ifndef FUSEDPS_KERNELS_BACKEND_TABLES_H_
#define FUSEDPS_KERNELS_BACKEND_TABLES_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/adamw_math.h"
#include "kernels/backend.h"
#include "kernels/row_sparse.h"
#include "kernels/tensor_table.h"

namespace fusedps {

// One table's rows of a step, checked and ready to apply.
struct PreparedTableRows {
  uint32_t tensor = 0;
  RowSparseTable view;  // Spans into the arenas; its step is the table's before this step.
  AdamWStepScalars s;   // For the table's next step.
  // The pushed rows, duplicates summed (CoalesceRows), each gradient already divided by the
  // grad_scale and negated for maximize (UnscaleRowGrads).
  CoalescedRows rows;
  // Rows that start over (TableRows::init_rows): empty when none, else per row of `rows`, the
  // row of init_params its params start from (its moments from zero), or -1 (the stored row).
  std::vector<int32_t> init_of_row;
  absl::Span<const float> init_params;
};

// Checks request.table_rows against `table` (the tensors, their dims, layouts and groups, the
// keys and grads), with OptimizerBackend::Step's errors for them (INVALID_ARGUMENT naming
// "table_rows[i]..." and the limit), and prepares each. *finite is set false when a gradient
// is not finite after summing and unscaling (the step must then be skipped whole). Reads only
// where the tables lie in `arenas`; changes nothing.
absl::StatusOr<std::vector<PreparedTableRows>> PrepareTableRows(const TensorTable& table,
                                                                const Arenas& arenas,
                                                                const StepRequest& request,
                                                                bool* finite);

// Starts the rows that start over from their init_params and zero moments, then updates the
// prepared tables' pushed rows (row_sparse.h's UpdateTableRows). The caller then advances each
// table's step (TensorTable::AdvanceSteps).
void ApplyTableRows(std::vector<PreparedTableRows>& prepared);

// Where a table's field lies in the arenas, [rows, dim] row-major: fp32 values, or the moments
// of a table with bf16 state (bf16 bit patterns: bf16 set) or int8 state (codes: int8 set, with
// one scale per row in scales, dequantized with the signed map for exp_avg, the unsigned one
// for exp_avg_sq: quant_math.h). Of f32, bf16 and int8, one is set.
struct TableField {
  const float* f32 = nullptr;
  const uint16_t* bf16 = nullptr;
  const uint8_t* int8 = nullptr;
  const float* scales = nullptr;  // [rows] fp32, with int8.
  bool signed_map = true;         // int8: exp_avg's map (else exp_avg_sq's).
};

// OptimizerBackend::ReadRows's checks (its errors): on success, where the field lies.
absl::StatusOr<TableField> CheckReadRows(const TensorTable& table, const Arenas& arenas,
                                         const ReadRowsRequest& request);

// OptimizerBackend::ReadRows on host arenas (the CPU backend's): checks it and copies the rows.
absl::Status ReadTableRows(const TensorTable& table, const Arenas& arenas,
                           const ReadRowsRequest& request);

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_BACKEND_TABLES_H_
