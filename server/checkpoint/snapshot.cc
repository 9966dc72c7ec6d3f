// snapshot.cc: the layout of a checkpoint's values (snapshot.h).
#include "server/checkpoint/snapshot.h"

#include <utility>

#include "kernels/quant_math.h"

namespace fusedps {

namespace {

int ElementBytes(const ShardView& view, const SnapshotField& field, uint32_t tensor) {
  return field.param_copy ? 2 : StoredElementBytes(view.layout(tensor), field.field);
}

// The bytes from a tensor's offset to the next one's in the snapshot: the tensor's padding in
// its arena (tensor_table.h), and a multiple of 16 bytes.
uint64_t PaddedBytes(const ShardView& view, const SnapshotField& field, uint32_t tensor) {
  const uint64_t count = StoredElements(view, field, tensor);
  const int element = ElementBytes(view, field, tensor);
  if (field.field == TensorField::kExpAvgAbsmax || field.field == TensorField::kExpAvgSqAbsmax) {
    return (count * 4 + 15) / 16 * 16;
  }
  if (element == 1) return (count + kQuantBlock - 1) / kQuantBlock * kQuantBlock;
  return AlignedNumel(count) * static_cast<uint64_t>(element);
}

// Whether `field` holds `tensor` in a checkpoint of `view` (SnapshotLayout).
bool Holds(const ShardView& view, const SnapshotField& field, uint32_t tensor,
           ParamCopyDType copy) {
  const TensorLayout layout = view.layout(tensor);
  if (field.param_copy) {
    return copy != ParamCopyDType::kNone && layout.params == ParamsDType::kFloat32;
  }
  switch (field.field) {
    case TensorField::kMaxExpAvgSq:
      return view.groups()[view.tensor(tensor).group].hyperparameters.amsgrad;
    case TensorField::kExpAvgAbsmax:
    case TensorField::kExpAvgSqAbsmax:
      return layout.state == StateDType::kInt8;
    default:
      return true;
  }
}

}  // namespace

uint64_t StoredElements(const ShardView& view, const SnapshotField& field, uint32_t tensor) {
  const uint64_t numel = view.tensor(tensor).numel;
  return field.param_copy ? numel : StoredCount(view.layout(tensor), field.field, numel);
}

uint64_t StoredBytes(const ShardView& view, const SnapshotField& field, uint32_t tensor) {
  return StoredElements(view, field, tensor) *
         static_cast<uint64_t>(ElementBytes(view, field, tensor));
}

std::vector<SnapshotField> SnapshotLayout(const ShardView& view, ParamCopyDType copy,
                                          uint64_t* bytes) {
  std::vector<SnapshotField> fields = {
      {"params", TensorField::kParam, false, {}, {}},
      {"exp_avg", TensorField::kExpAvg, false, {}, {}},
      {"exp_avg_sq", TensorField::kExpAvgSq, false, {}, {}},
      {"max_exp_avg_sq", TensorField::kMaxExpAvgSq, false, {}, {}},
      {"exp_avg_absmax", TensorField::kExpAvgAbsmax, false, {}, {}},
      {"exp_avg_sq_absmax", TensorField::kExpAvgSqAbsmax, false, {}, {}},
      {"param_copy", TensorField::kParam, true, {}, {}}};
  uint64_t offset = 0;
  for (SnapshotField& f : fields) {
    // Largest elements first: each tensor's data then starts aligned to its element size in the
    // field's file, whatever the dtypes before it.
    for (const int element : {4, 2, 1}) {
      for (uint32_t t = 0; t < view.tensor_count(); ++t) {
        if (!Holds(view, f, t, copy) || ElementBytes(view, f, t) != element) continue;
        f.tensors.push_back(t);
        f.offsets.push_back(offset);
        offset += PaddedBytes(view, f, t);
      }
    }
  }
  // Fields of no tensors are left out (no max_exp_avg_sq without amsgrad, no scales without
  // int8 state, no copy without one), but params and the moments (an empty shard has them).
  std::vector<SnapshotField> kept;
  for (SnapshotField& f : fields) {
    const bool always =
        !f.param_copy && (f.field == TensorField::kParam || f.field == TensorField::kExpAvg ||
                          f.field == TensorField::kExpAvgSq);
    if (!f.tensors.empty() || always) kept.push_back(std::move(f));
  }
  *bytes = offset;
  return kept;
}

}  // namespace fusedps
