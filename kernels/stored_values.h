// stored_values.h: conversions on the host between fp32 values and a field's stored form
// (tensor_layout.h), for reads and writes that are not the step's: the CPU backend's reads and
// writes, and the CUDA backend's fp32 writes into bf16 or int8 storage (converted here, then
// uploaded). The step itself never converts through here.
#ifndef FUSEDPS_KERNELS_STORED_VALUES_H_
#define FUSEDPS_KERNELS_STORED_VALUES_H_

#include <cstdint>

#include "kernels/backend.h"
#include "kernels/tensor_layout.h"

namespace fusedps {

// The fp32 values of stored elements [0, count) of `field` (exp_avg, exp_avg_sq or params; not
// the scales): fp32 copied, bf16 widened exactly, int8 codes dequantized with `scales` (the
// tensor's, block 0 first; unused otherwise). Nothing happens for count 0.
void StoredToFloat(TensorLayout layout, TensorField field, const void* stored, const float* scales,
                   uint64_t count, float* out);

// Stores fp32 values as elements [offset, offset + count) of `field` in its stored form:
// fp32 copied, bf16 rounded to nearest even, int8 quantized block by block (scales[b] gets
// block b's absmax; blocks of layout.scale_block elements; REQUIRES whole blocks: offset a
// multiple of the block, count one too or reaching the field's end). `stored` and `scales` point at
// the tensor's element 0 and block 0. Nothing happens for count 0 (the pointers may then be null).
void FloatToStored(TensorLayout layout, TensorField field, const float* values, uint64_t offset,
                   uint64_t count, void* stored, float* scales);

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_STORED_VALUES_H_
