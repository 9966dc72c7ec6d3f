#include "kernels/tensor_table.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace fusedps {
namespace {

// Elements from one tensor's offset to the next one's in an arena: 8 (16 bytes in any dtype),
// and whole blocks in the int8 arena (so that a block's scale index is offset / kQuantBlock).
uint64_t Padded(uint64_t numel, uint64_t multiple) {
  return (numel + multiple - 1) / multiple * multiple;
}

// Where a tensor of `numel` elements starts in a params or state arena whose tensors so far end
// at `end`: a tensor of a kernel portion or more (256 elements, 1 KB of fp32) starts on a
// multiple of 256, so that none of its portions straddles a 1 KB boundary; a smaller one right
// after the last. (On an H100, 1000 tensors of 100,000 elements, three in four of them off a
// 1 KB boundary, stepped at 91.5% of copy bandwidth, and of 102,400 at 93.8%:
// docs/benchmarks.md, issue 16.) The padding is at most 255 elements per tensor.
uint64_t StartIn(uint64_t end, uint64_t numel) {
  return numel >= kQuantBlock ? Padded(end, kQuantBlock) : end;
}

// Where a tensor starts in its params and state arenas, given the arenas' ends (`sizes`), and
// the ends after it.
struct Placement {
  uint64_t param = 0, state = 0;
  ArenaSizes after;
};

// Where an int8 table's row scales start in its codes' arena, in bytes from its state offset:
// after its codes, on a 16-byte boundary (fp32 scales, one per row, rows * 4 bytes).
uint64_t RowScalesAt(uint64_t numel) { return Padded(numel, 16); }

Placement Place(const ArenaSizes& sizes, TensorLayout layout, uint32_t group, uint64_t numel,
                uint64_t table_dim) {
  Placement p;
  p.after = sizes;
  ArenaSizes& a = p.after;
  const bool packable = Packable(layout, numel);
  if (packable) {
    // Joins the open run of its group, or starts one on a whole portion (256 elements).
    const bool joins = a.run_open && a.run_group == group;
    p.param = joins ? a.params32 : Padded(a.params32, kQuantBlock);
    p.state = joins ? a.state32 : Padded(a.state32, kQuantBlock);
    a.params32 = p.param + numel;
    a.state32 = p.state + numel;
    a.run_open = true;
    a.run_group = group;
    a.canonical += numel;
    return p;
  }
  a.run_open = false;
  a.canonical += AlignedNumel(numel);
  uint64_t& params = layout.params == ParamsDType::kFloat32 ? a.params32 : a.params16;
  p.param = StartIn(params, numel);
  params = p.param + AlignedNumel(numel);
  switch (layout.state) {
    case StateDType::kFloat32:
      p.state = StartIn(a.state32, numel);
      a.state32 = p.state + AlignedNumel(numel);
      break;
    case StateDType::kBFloat16:
      p.state = StartIn(a.state16, numel);
      a.state16 = p.state + AlignedNumel(numel);
      break;
    case StateDType::kInt8:
      p.state = StartIn(a.state8, numel);
      // A table's row scales follow its codes in the same arena (RowScalesAt).
      a.state8 =
          p.state +
          Padded(table_dim == 0 ? numel : RowScalesAt(numel) + numel / table_dim * 4, kQuantBlock);
      break;
  }
  return p;
}

bool SameStorage(const AdamWHyperparameters& a, const AdamWHyperparameters& b) {
  return a.state_dtype == b.state_dtype && a.params_dtype == b.params_dtype &&
         a.rounding_seed == b.rounding_seed;
}

}  // namespace

absl::Status TensorTable::CheckGroup(uint32_t group, const AdamWHyperparameters& hyper) const {
  if (group > groups_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("param group index ", group, " skips ", groups_.size()));
  }
  if (hyper.amsgrad && hyper.state_dtype != StateDType::kFloat32) {
    return absl::InvalidArgumentError(absl::StrCat("param group index ", group,
                                                   ": amsgrad needs fp32 state, not ",
                                                   StateDTypeName(hyper.state_dtype)));
  }
  if (group < groups_.size() && !SameStorage(groups_[group], hyper) &&
      std::find(groups_of_.begin(), groups_of_.end(), group) != groups_of_.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "param group index ", group,
        " has tensors: its state_dtype, params_dtype and rounding_seed cannot change"));
  }
  return absl::OkStatus();
}

absl::Status TensorTable::SetGroup(uint32_t group, const AdamWHyperparameters& hyper) {
  if (absl::Status s = CheckGroup(group, hyper); !s.ok()) return s;
  if (group == groups_.size()) {
    groups_.push_back(hyper);
  } else {
    groups_[group] = hyper;
  }
  return absl::OkStatus();
}

absl::StatusOr<ArenaSizes> TensorTable::ArenaSizesWith(absl::Span<const NewTensor> tensors) const {
  ArenaSizes sizes = sizes_;
  for (const NewTensor& t : tensors) {
    if (t.param_group >= groups_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("param group index ", t.param_group, " is not registered"));
    }
    sizes = Place(sizes, LayoutOf(groups_[t.param_group], t.numel, t.table_dim), t.param_group,
                  t.numel, t.table_dim)
                .after;
  }
  return sizes;
}

void TensorTable::Append(absl::Span<const NewTensor> tensors) {
  for (const NewTensor& t : tensors) {
    const TensorLayout layout = LayoutOf(groups_[t.param_group], t.numel, t.table_dim);
    const Placement p = Place(sizes_, layout, t.param_group, t.numel, t.table_dim);
    offsets_.push_back(sizes_.canonical);
    param_offsets_.push_back(p.param);
    state_offsets_.push_back(p.state);
    numels_.push_back(t.numel);
    groups_of_.push_back(t.param_group);
    layouts_.push_back(layout);
    rounding_keys_.push_back(t.rounding_key);
    table_dims_.push_back(t.table_dim);
    steps_.push_back(0);
    sizes_ = p.after;
  }
}

void TensorTable::Truncate(uint32_t count) {
  if (count >= size()) return;
  for (auto* v :
       {&offsets_, &param_offsets_, &state_offsets_, &numels_, &rounding_keys_, &table_dims_}) {
    v->resize(count);
  }
  groups_of_.resize(count);
  layouts_.resize(count);
  steps_.resize(count);
  // The sizes of the tensors that remain, recounted (truncation is rare).
  std::vector<NewTensor> kept;
  for (uint32_t t = 0; t < count; ++t) {
    kept.push_back({numels_[t], groups_of_[t], 0, table_dims_[t]});
  }
  sizes_ = ArenaSizes{};
  sizes_ = *ArenaSizesWith(kept);
}

void TensorTable::AdvanceSteps(absl::Span<const uint32_t> tensors) {
  for (uint32_t t : tensors) ++steps_[t];
}

std::vector<TensorPack> TensorTable::Packs() const {
  std::vector<TensorPack> packs;
  // Whether tensor t + 1 lies right after t, in t's pack if t is in one.
  const auto continues = [&](uint32_t t) {
    const uint32_t u = t + 1;
    return Packable(layouts_[t], numels_[t]) && Packable(layouts_[u], numels_[u]) &&
           groups_of_[t] == groups_of_[u] && steps_[t] == steps_[u] &&
           offsets_[u] == offsets_[t] + numels_[t] &&
           param_offsets_[u] == param_offsets_[t] + numels_[t] &&
           state_offsets_[u] == state_offsets_[t] + numels_[t];
  };
  for (uint32_t t = 0; t < size();) {
    uint32_t end = t + 1;
    while (end < size() && continues(end - 1)) ++end;
    if (end - t >= 2) packs.push_back({t, end - t});
    t = end;
  }
  return packs;
}

absl::Status TensorTable::CheckRead(const ReadRequest& request, uint32_t tensor,
                                    ParamCopyDType copy) const {
  if (tensor >= size()) {
    return absl::InvalidArgumentError(absl::StrCat("read of tensor ", tensor, " of ", size()));
  }
  const TensorLayout l = layout(tensor);
  switch (request.field) {
    case TensorField::kParam:
      if (request.param_copy &&
          (copy == ParamCopyDType::kNone || l.params != ParamsDType::kFloat32)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "the param copy of tensor ", tensor,
            " needs a backend that keeps a copy and fp32 params (bf16 params are their own)"));
      }
      return absl::OkStatus();
    case TensorField::kExpAvg:
    case TensorField::kExpAvgSq:
      break;
    case TensorField::kMaxExpAvgSq:
      if (!hyper_of(tensor).amsgrad) {
        return absl::FailedPreconditionError("max_exp_avg_sq exists only with amsgrad");
      }
      break;
    case TensorField::kExpAvgAbsmax:
    case TensorField::kExpAvgSqAbsmax:
      if (l.state != StateDType::kInt8 || !request.stored) {
        return absl::FailedPreconditionError(
            absl::StrCat(TensorFieldName(request.field), " of tensor ", tensor,
                         " exists only for int8 state, and only in its stored form"));
      }
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("field ", static_cast<int>(request.field), " is not a TensorField"));
  }
  if (request.param_copy) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a read of the param copy needs field param, not ", TensorFieldName(request.field)));
  }
  return absl::OkStatus();
}

absl::Status TensorTable::CheckWrite(const WriteRequest& request, ParamCopyDType copy) const {
  ReadRequest as_read;
  as_read.field = request.field;
  as_read.param_copy = request.param_copy;
  as_read.stored = request.stored;
  if (absl::Status s = CheckRead(as_read, request.tensor, copy); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("write: ", s.message()));
  }
  const TensorLayout l = layout(request.tensor);
  const uint64_t count = StoredCount(l, request.field, numel(request.tensor));
  if (request.offset > count || request.count > count - request.offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "write of elements [", request.offset, ", +", request.count, ") of ",
        TensorFieldName(request.field), " of tensor ", request.tensor, ", which has ", count));
  }
  const bool into_int8 =
      (request.field == TensorField::kExpAvg || request.field == TensorField::kExpAvgSq) &&
      l.state == StateDType::kInt8;
  const uint64_t block = l.scale_block;
  if (into_int8 && !request.stored &&
      (request.offset % block != 0 ||
       (request.count % block != 0 && request.offset + request.count != count))) {
    return absl::InvalidArgumentError(
        absl::StrCat("an fp32 write of int8 ", TensorFieldName(request.field), " of tensor ",
                     request.tensor, " must cover whole blocks of ", block, " elements: [",
                     request.offset, ", +", request.count, ") does not"));
  }
  return absl::OkStatus();
}

absl::Status TensorTable::CheckStep(uint32_t tensor, int64_t step) const {
  if (tensor >= size()) {
    return absl::InvalidArgumentError(absl::StrCat("step of tensor ", tensor, " of ", size()));
  }
  if (step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", tensor, " step ", step, " < 0"));
  }
  return absl::OkStatus();
}

bool TensorTable::any_amsgrad() const {
  return std::any_of(groups_.begin(), groups_.end(),
                     [](const AdamWHyperparameters& h) { return h.amsgrad; });
}

StoredField TensorTable::FieldOf(const Arenas& a, TensorField field, uint32_t tensor) const {
  const TensorLayout l = layout(tensor);
  const uint64_t p = param_offset(tensor), s = state_offset(tensor);
  StoredField out;
  out.element_bytes = StoredElementBytes(l, field);
  out.count = StoredCount(l, field, numel(tensor));
  const auto at = [](auto* arena, uint64_t offset) {
    return arena == nullptr ? nullptr : reinterpret_cast<char*>(arena + offset);
  };
  switch (field) {
    case TensorField::kParam:
      out.data = l.params == ParamsDType::kFloat32 ? at(a.params32, p) : at(a.params16, p);
      break;
    case TensorField::kExpAvg:
      out.data = l.state == StateDType::kFloat32    ? at(a.exp_avg32, s)
                 : l.state == StateDType::kBFloat16 ? at(a.exp_avg16, s)
                                                    : at(a.exp_avg8, s);
      break;
    case TensorField::kExpAvgSq:
      out.data = l.state == StateDType::kFloat32    ? at(a.exp_avg_sq32, s)
                 : l.state == StateDType::kBFloat16 ? at(a.exp_avg_sq16, s)
                                                    : at(a.exp_avg_sq8, s);
      break;
    case TensorField::kMaxExpAvgSq:
      out.data = at(a.max_exp_avg_sq, s);
      break;
    case TensorField::kExpAvgAbsmax:
      out.data = table_dims_[tensor] == 0 ? at(a.exp_avg_absmax, s / kQuantBlock)
                                          : at(a.exp_avg8, s + RowScalesAt(numel(tensor)));
      break;
    case TensorField::kExpAvgSqAbsmax:
      out.data = table_dims_[tensor] == 0 ? at(a.exp_avg_sq_absmax, s / kQuantBlock)
                                          : at(a.exp_avg_sq8, s + RowScalesAt(numel(tensor)));
      break;
  }
  return out;
}

}  // namespace fusedps
