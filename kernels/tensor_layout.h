// tensor_layout.h: how one tensor's values are stored, decided at registration by its param
// group's state_dtype and params_dtype and by its size, and the stored form of each of its
// fields (what checkpoints hold, bit for bit). Host and device.
//
//   field            stored as                                    elements
//   params           fp32 | bf16 (params_dtype)                   numel
//   exp_avg(_sq)     fp32 | bf16 | int8 codes (the layout's state) numel
//   max_exp_avg_sq   fp32 (amsgrad needs fp32 state)              numel
//   *_absmax         fp32 scales of int8 state                    numel / scale_block (rounded
//                                                                up), else 0
//
// A group's int8 state applies to its tensors of kMinQuantNumel elements or more; smaller ones
// keep fp32 state (quant_math.h). A dense tensor's int8 state has a scale per block of
// kQuantBlock (256) elements of the flat tensor; an embedding table's a scale per row (a block
// of `dim` elements), so that updating some rows never re-quantizes the others (the row-wise
// state of TorchRec's optimizers; docs/dev/embedding-tables.md).
#ifndef FUSEDPS_KERNELS_TENSOR_LAYOUT_H_
#define FUSEDPS_KERNELS_TENSOR_LAYOUT_H_

#include <cstdint>

#include "kernels/adamw_math.h"
#include "kernels/quant_math.h"

namespace fusedps {

struct TensorLayout {
  ParamsDType params = ParamsDType::kFloat32;
  StateDType state = StateDType::kFloat32;
  // Elements per scale of int8 state: kQuantBlock, or an embedding table's dim. Meaningful only
  // for int8 state.
  uint64_t scale_block = kQuantBlock;
};

// How a tensor of `numel` elements of `group` is stored. table_dim: 0 for a dense tensor, an
// embedding table's dim (>= 1, dividing numel) for a table.
FUSEDPS_HOST_DEVICE TensorLayout LayoutOf(const AdamWHyperparameters& group, uint64_t numel,
                                          uint64_t table_dim = 0) {
  TensorLayout layout;
  layout.params = group.params_dtype;
  layout.state = group.state_dtype == StateDType::kInt8 && !QuantizesState(StateDType::kInt8, numel)
                     ? StateDType::kFloat32
                     : group.state_dtype;
  layout.scale_block = table_dim > 0 ? table_dim : kQuantBlock;
  return layout;
}

// Scales per int8 state field of a tensor of `numel` elements (0 for other state).
FUSEDPS_HOST_DEVICE uint64_t ScaleCount(TensorLayout layout, uint64_t numel) {
  return layout.state == StateDType::kInt8 ? (numel + layout.scale_block - 1) / layout.scale_block
                                           : 0;
}

FUSEDPS_HOST_DEVICE bool IsFloat32Layout(TensorLayout layout) {
  return layout.params == ParamsDType::kFloat32 && layout.state == StateDType::kFloat32;
}

FUSEDPS_HOST_DEVICE int ParamsBytes(ParamsDType dtype) {
  return dtype == ParamsDType::kFloat32 ? 4 : 2;
}

FUSEDPS_HOST_DEVICE int StateBytes(StateDType dtype) {
  return dtype == StateDType::kFloat32 ? 4 : dtype == StateDType::kBFloat16 ? 2 : 1;
}

// "fp32", "bf16", "int8": the spelling of checkpoint manifests, flags and metrics.
const char* StateDTypeName(StateDType dtype);
const char* ParamsDTypeName(ParamsDType dtype);

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_TENSOR_LAYOUT_H_
