// tensor_table.h: the host-side table of a shard's tensors and param groups that every backend
// keeps: each tensor's numel, group, step and storage layout (tensor_layout.h), where it lies
// in each arena, and each group's hyperparameters.
//
// Arenas. A backend keeps one arena per stored dtype of each field: params in fp32 and in bf16;
// exp_avg and exp_avg_sq in fp32, bf16 and int8 (codes); max_exp_avg_sq beside the fp32 state;
// the int8 state's scales; the param copy beside the fp32 params. A tensor lies in the arenas
// of its layout only, at its param offset (params, param copy) and state offset (state, scales:
// block b of an int8 tensor's scales is at state_offset / kQuantBlock + b). An embedding table
// with int8 state is the exception: its scales, one per row (tensor_layout.h), lie in the int8
// arena of their field right after its codes, from the first 16-byte boundary (FieldOf says
// where), and the scales arena's entries of its blocks are unused. Offsets count
// elements of the arena's dtype and are multiples of 8 (16 bytes in any dtype), and of
// kQuantBlock in the int8 arena, so vector accesses are aligned and a block's scale index is a
// division. A tensor of kQuantBlock (256) elements or more starts on a multiple of 256 in
// every params and state arena, so that no 256-element portion of the CUDA kernel straddles a
// 1 KB boundary (misaligned tensors cost 2 points of bandwidth on an H100); a smaller one
// packs right after the last. Small fp32 tensors are the exception (Packable): consecutive ones
// of one group lie end to end, in a run that starts on a multiple of 256, so that the CUDA
// kernel can step a run of equal steps as one tensor (Packs). Besides, every tensor has a canonical
// offset, as if every arena were fp32: the layout of a full push's staged gradients and of the
// sync-round accumulator.
//
// Tensors are appended; only the newest can be removed (Truncate, to undo a registration that
// failed).
//
// Usage:
//   TensorTable table;
//   RETURN_IF_ERROR(table.SetGroup(0, AdamWHyperparameters{}));
//   absl::StatusOr<ArenaSizes> sizes = table.ArenaSizesWith(new_tensors);
//   ... grow the arenas to *sizes ...
//   table.Append(new_tensors);
#ifndef FUSEDPS_KERNELS_TENSOR_TABLE_H_
#define FUSEDPS_KERNELS_TENSOR_TABLE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/adamw_math.h"
#include "kernels/backend.h"
#include "kernels/tensor_layout.h"

namespace fusedps {

// Tensors the CUDA kernel may step together as one (a pack): fp32 params and fp32 state, of
// fewer than kPackBelow elements (under one 2048-element chunk of the kernel: tensors that
// small are costly to step one by one, and most end in a partial 256-element portion), a whole
// number of 8-element runs (no padding between them in any arena). On an H100, 10,000 tensors
// of 1,000 elements were 3.4 us slower than one tensor of the same elements, and as one pack
// as fast (docs/benchmarks.md, issue 16, runs E1, E6 and E7).
constexpr uint64_t kPackBelow = 2048;
inline bool Packable(TensorLayout layout, uint64_t numel) {
  return IsFloat32Layout(layout) && numel > 0 && numel < kPackBelow && numel % 8 == 0;
}

// Tensors [first, first + count) of one group, end to end in every arena, with one step.
struct TensorPack {
  uint32_t first = 0;
  uint32_t count = 0;
  bool operator==(const TensorPack& o) const { return first == o.first && count == o.count; }
};

// The elements each arena needs.
struct ArenaSizes {
  uint64_t canonical = 0;  // fp32 elements, every tensor (staging, accumulator).
  uint64_t params32 = 0;   // fp32 params, and the param copy beside them.
  uint64_t params16 = 0;   // bf16 params.
  uint64_t state32 = 0;    // fp32 exp_avg, exp_avg_sq, max_exp_avg_sq.
  uint64_t state16 = 0;    // bf16 exp_avg, exp_avg_sq.
  uint64_t state8 = 0;     // int8 exp_avg, exp_avg_sq codes.
  // Whether the arenas end with a run of Packable tensors of group run_group, which the next
  // Packable tensor of that group joins.
  bool run_open = false;
  uint32_t run_group = 0;
  uint64_t scales() const { return state8 / kQuantBlock; }  // Per state, fp32.
};

// A backend's arenas, for finding a stored field (FieldOf). Null where unused.
struct Arenas {
  float* params32 = nullptr;
  uint16_t* params16 = nullptr;
  float* exp_avg32 = nullptr;
  float* exp_avg_sq32 = nullptr;
  float* max_exp_avg_sq = nullptr;
  uint16_t* exp_avg16 = nullptr;
  uint16_t* exp_avg_sq16 = nullptr;
  uint8_t* exp_avg8 = nullptr;
  uint8_t* exp_avg_sq8 = nullptr;
  float* exp_avg_absmax = nullptr;
  float* exp_avg_sq_absmax = nullptr;
};

// Where a stored field of one tensor starts, and its element size (tensor_layout.h).
struct StoredField {
  char* data = nullptr;
  int element_bytes = 4;
  uint64_t count = 0;  // Elements.
};

class TensorTable {
 public:
  // Creates (group == group count) or replaces group `group`.
  // Errors: INVALID_ARGUMENT when `group` would leave a gap, for amsgrad without fp32 state, or
  // when a replacement changes state_dtype, params_dtype or rounding_seed of a group that has
  // tensors (their storage depends on them).
  absl::Status SetGroup(uint32_t group, const AdamWHyperparameters& hyper);
  // SetGroup's checks alone: changes nothing.
  absl::Status CheckGroup(uint32_t group, const AdamWHyperparameters& hyper) const;

  // The arena sizes once `tensors` are appended. Changes nothing.
  // Errors: INVALID_ARGUMENT for a tensor of an unknown group.
  absl::StatusOr<ArenaSizes> ArenaSizesWith(absl::Span<const NewTensor> tensors) const;

  // Appends the tensors at the end of the arenas, with step 0.
  // REQUIRES: ArenaSizesWith(tensors) succeeded.
  void Append(absl::Span<const NewTensor> tensors);

  // Removes tensors [count, size()), the newest ones. REQUIRES: count <= size().
  void Truncate(uint32_t count);

  // One more step for each of the tensors.
  void AdvanceSteps(absl::Span<const uint32_t> tensors);
  // The packs of the table as it is: maximal runs, of two tensors or more, of Packable tensors
  // of one group that lie end to end in the canonical, params and state arenas and have the
  // same step. In tensor order; a tensor in none is stepped on its own.
  std::vector<TensorPack> Packs() const;
  // A restored tensor's step. REQUIRES: tensor < size().
  void SetStep(uint32_t tensor, int64_t step) { steps_[tensor] = step; }

  // Checks a Write (backend.h) against the table: the tensor, the field and its form, the
  // range (whole blocks for an fp32 write into int8 state). Errors as Write's.
  absl::Status CheckWrite(const WriteRequest& request, ParamCopyDType copy) const;
  // Checks one tensor of a Read: the field and its form. Errors as Read's.
  absl::Status CheckRead(const ReadRequest& request, uint32_t tensor, ParamCopyDType copy) const;
  // INVALID_ARGUMENT unless `step` may be SetStep's for `tensor` (backend.h).
  absl::Status CheckStep(uint32_t tensor, int64_t step) const;

  // Where `field` of `tensor` is stored in `arenas`, in its stored form. REQUIRES: CheckRead
  // or CheckWrite passed for it.
  StoredField FieldOf(const Arenas& arenas, TensorField field, uint32_t tensor) const;

  uint32_t size() const { return static_cast<uint32_t>(numels_.size()); }
  const ArenaSizes& sizes() const { return sizes_; }
  uint64_t arena_numel() const { return sizes_.canonical; }
  uint64_t offset(uint32_t tensor) const { return offsets_[tensor]; }  // Canonical.
  uint64_t param_offset(uint32_t tensor) const { return param_offsets_[tensor]; }
  uint64_t state_offset(uint32_t tensor) const { return state_offsets_[tensor]; }
  uint64_t numel(uint32_t tensor) const { return numels_[tensor]; }
  uint32_t group_of(uint32_t tensor) const { return groups_of_[tensor]; }
  TensorLayout layout(uint32_t tensor) const { return layouts_[tensor]; }
  uint64_t rounding_key(uint32_t tensor) const { return rounding_keys_[tensor]; }
  uint64_t table_dim(uint32_t tensor) const { return table_dims_[tensor]; }  // 0: not a table.
  int64_t step(uint32_t tensor) const { return steps_[tensor]; }
  const AdamWHyperparameters& hyper_of(uint32_t tensor) const {
    return groups_[groups_of_[tensor]];
  }
  const std::vector<AdamWHyperparameters>& groups() const { return groups_; }
  const std::vector<int64_t>& steps() const { return steps_; }
  bool any_amsgrad() const;

 private:
  std::vector<AdamWHyperparameters> groups_;
  std::vector<uint64_t> offsets_, param_offsets_, state_offsets_;
  std::vector<uint64_t> numels_;
  std::vector<uint32_t> groups_of_;
  std::vector<TensorLayout> layouts_;
  std::vector<uint64_t> rounding_keys_;
  std::vector<uint64_t> table_dims_;
  std::vector<int64_t> steps_;
  ArenaSizes sizes_;
};

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_TENSOR_TABLE_H_
