// tensor_layout.h: how one tensor's values are stored, decided at registration by its param
// group's state_dtype and params_dtype and by its size, and the stored form of each of its
// fields (what checkpoints hold, bit for bit). Host and device.
//
//   field            stored as                                    elements
//   params           fp32 | bf16 (params_dtype)                   numel
//   exp_avg(_sq)     fp32 | bf16 | int8 codes (the layout's state) numel
//   max_exp_avg_sq   fp32 (amsgrad needs fp32 state)              numel
//   *_absmax         fp32 scales of int8 state                    QuantBlocks(numel), else 0
//
// A group's int8 state applies to its tensors of kMinQuantNumel elements or more; smaller ones
// keep fp32 state (quant_math.h).
#ifndef FUSEDPS_KERNELS_TENSOR_LAYOUT_H_
#define FUSEDPS_KERNELS_TENSOR_LAYOUT_H_

#include <cstdint>

#include "kernels/adamw_math.h"
#include "kernels/quant_math.h"

namespace fusedps {

struct TensorLayout {
  ParamsDType params = ParamsDType::kFloat32;
  StateDType state = StateDType::kFloat32;
};

FUSEDPS_HOST_DEVICE TensorLayout LayoutOf(const AdamWHyperparameters& group, uint64_t numel) {
  TensorLayout layout;
  layout.params = group.params_dtype;
  layout.state = group.state_dtype == StateDType::kInt8 && !QuantizesState(StateDType::kInt8, numel)
                     ? StateDType::kFloat32
                     : group.state_dtype;
  return layout;
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
