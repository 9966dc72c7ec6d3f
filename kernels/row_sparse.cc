#include "kernels/row_sparse.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <numeric>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/quant_math.h"
#include "kernels/sparse_adam_math.h"

namespace fusedps {
namespace {

// Whether `count` floats make `rows` rows of `dim` (without forming rows * dim, which may
// overflow).
bool IsRowsByDim(size_t count, int64_t rows, int64_t dim) {
  const auto d = static_cast<size_t>(dim);
  return count % d == 0 && count / d == static_cast<size_t>(rows);
}

absl::Status CheckTable(const RowSparseTable& table) {
  if (table.dim < 1) {
    return absl::InvalidArgumentError(absl::StrCat("table.dim = ", table.dim, " is below 1"));
  }
  if (table.rows < 0) {
    return absl::InvalidArgumentError(absl::StrCat("table.rows = ", table.rows, " is below 0"));
  }
  if (table.step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("table.step = ", table.step, " is below 0"));
  }
  const bool bf16 = table.state == StateDType::kBFloat16;
  const bool int8 = table.state == StateDType::kInt8;
  // A moment's array for the table's state: its name ("exp_avg", "exp_avg16", "exp_avg8") and
  // size.
  const auto moment = [&](const char* name, size_t f32, size_t f16, size_t f8) {
    if (bf16) return std::make_pair(absl::StrCat(name, "16"), f16);
    if (int8) return std::make_pair(absl::StrCat(name, "8"), f8);
    return std::make_pair(std::string(name), f32);
  };
  const auto rows = static_cast<size_t>(table.rows);
  const struct {
    std::pair<std::string, size_t> array;
    int64_t per_row;  // Elements per row: dim, or 1 (the int8 scales).
  } fields[] = {
      {{"params", table.params.size()}, table.dim},
      {moment("exp_avg", table.exp_avg.size(), table.exp_avg16.size(), table.exp_avg8.size()),
       table.dim},
      {moment("exp_avg_sq", table.exp_avg_sq.size(), table.exp_avg_sq16.size(),
              table.exp_avg_sq8.size()),
       table.dim},
      {{"exp_avg_absmax", int8 ? table.exp_avg_absmax.size() : rows}, 1},
      {{"exp_avg_sq_absmax", int8 ? table.exp_avg_sq_absmax.size() : rows}, 1}};
  for (const auto& field : fields) {
    const auto& [name, size] = field.array;
    if (!IsRowsByDim(size, table.rows, field.per_row)) {
      return absl::InvalidArgumentError(
          absl::StrCat("table.", name, " has ", size, " elements, not rows * ",
                       field.per_row == 1 ? "1" : "dim", " = ", table.rows, " * ", field.per_row));
    }
  }
  if (table.state != StateDType::kFloat32 &&
      (!table.exp_avg.empty() || !table.exp_avg_sq.empty())) {
    return absl::InvalidArgumentError("table: fp32 moments beside low-precision ones");
  }
  return absl::OkStatus();
}

// tensor_layout.h's StateDTypeName, which this library does not link.
const char* StateName(StateDType state) {
  return state == StateDType::kFloat32 ? "fp32" : state == StateDType::kBFloat16 ? "bf16" : "int8";
}

absl::Status CheckHyperparameters(const AdamWHyperparameters& hyper, StateDType state,
                                  uint64_t numel) {
  if (hyper.amsgrad) {
    return absl::InvalidArgumentError("hyper.amsgrad: row-sparse steps do not support amsgrad");
  }
  if (!hyper.decoupled_weight_decay && hyper.weight_decay != 0.0) {
    return absl::InvalidArgumentError(
        "hyper.decoupled_weight_decay: row-sparse steps support decoupled weight decay only");
  }
  if (hyper.params_dtype != ParamsDType::kFloat32) {
    return absl::InvalidArgumentError("hyper.params_dtype: row-sparse tables keep fp32 params");
  }
  // A group's int8 state applies to tables of kMinQuantNumel elements or more; smaller ones keep
  // fp32 state (tensor_layout.h's LayoutOf).
  const StateDType expected =
      hyper.state_dtype == StateDType::kInt8 && !QuantizesState(StateDType::kInt8, numel)
          ? StateDType::kFloat32
          : hyper.state_dtype;
  if (expected != state) {
    return absl::InvalidArgumentError(absl::StrCat("hyper.state_dtype: the table's moments are ",
                                                   StateName(state), ", not ",
                                                   StateName(expected)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckRowSparsePush(const RowSparseTable& table, absl::Span<const int64_t> keys,
                                absl::Span<const float> grads) {
  for (size_t i = 0; i < keys.size(); ++i) {
    if (keys[i] < 0 || keys[i] >= table.rows) {
      return absl::InvalidArgumentError(absl::StrCat(
          "keys[", i, "] = ", keys[i], " is outside [0, ", table.rows, ") (the table's rows)"));
    }
  }
  if (!IsRowsByDim(grads.size(), static_cast<int64_t>(keys.size()), table.dim)) {
    return absl::InvalidArgumentError(absl::StrCat("grads has ", grads.size(),
                                                   " floats, not keys.size() * dim = ", keys.size(),
                                                   " * ", table.dim));
  }
  return absl::OkStatus();
}

CoalescedRows CoalesceRows(absl::Span<const int64_t> keys, absl::Span<const float> grads,
                           int64_t dim) {
  const auto row_size = static_cast<size_t>(dim);
  std::vector<size_t> order(keys.size());
  std::iota(order.begin(), order.end(), size_t{0});
  // Stable: duplicates stay in push order, so they are summed in it.
  std::stable_sort(order.begin(), order.end(),
                   [&keys](size_t a, size_t b) { return keys[a] < keys[b]; });
  CoalescedRows out;
  out.keys.reserve(keys.size());  // At most: no reallocation of a large push's rows.
  out.grads.reserve(grads.size());
  for (size_t k = 0; k < order.size();) {
    const int64_t key = keys[order[k]];
    const float* first = grads.data() + order[k] * row_size;
    out.keys.push_back(key);
    const size_t at = out.grads.size();
    out.grads.insert(out.grads.end(), first, first + row_size);
    for (++k; k < order.size() && keys[order[k]] == key; ++k) {
      const float* row = grads.data() + order[k] * row_size;
      for (size_t j = 0; j < row_size; ++j) out.grads[at + j] += row[j];
    }
  }
  return out;
}

absl::Status CheckRowSparseStep(const RowSparseTable& table, const AdamWHyperparameters& hyper,
                                float grad_scale) {
  if (absl::Status s = CheckTable(table); !s.ok()) return s;
  if (absl::Status s = CheckHyperparameters(hyper, table.state, table.params.size()); !s.ok()) {
    return s;
  }
  if (!std::isfinite(grad_scale)) {
    return absl::InvalidArgumentError(absl::StrCat("grad_scale = ", grad_scale, " is not finite"));
  }
  return absl::OkStatus();
}

bool UnscaleRowGrads(const AdamWStepScalars& s, absl::Span<float> grads) {
  for (float& g : grads) {
    g = SparseAdamGrad(s, g);
    if (!std::isfinite(g)) return false;
  }
  return true;
}

void UpdateTableRows(RowSparseTable& table, const AdamWStepScalars& s,
                     absl::Span<const int64_t> rows, absl::Span<const float> grads) {
  const auto dim = static_cast<size_t>(table.dim);
  const Int8Codebooks* books = table.state == StateDType::kInt8 ? &DynamicCodebooks() : nullptr;
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto row = static_cast<size_t>(rows[i]);
    const size_t offset = row * dim;
    const float* g = grads.data() + i * dim;
    float* param = table.params.data() + offset;
    switch (table.state) {
      case StateDType::kBFloat16: {
        uint16_t* exp_avg = table.exp_avg16.data() + offset;
        uint16_t* exp_avg_sq = table.exp_avg_sq16.data() + offset;
        for (size_t j = 0; j < dim; ++j) {
          SparseAdamUpdateBFloat16State(s, g[j], param[j], exp_avg[j], exp_avg_sq[j]);
        }
        break;
      }
      case StateDType::kInt8:
        SparseAdamUpdateInt8Row(s, *books, dim, g, param, table.exp_avg8.data() + offset,
                                table.exp_avg_sq8.data() + offset, table.exp_avg_absmax[row],
                                table.exp_avg_sq_absmax[row]);
        break;
      case StateDType::kFloat32: {
        float* exp_avg = table.exp_avg.data() + offset;
        float* exp_avg_sq = table.exp_avg_sq.data() + offset;
        for (size_t j = 0; j < dim; ++j) {
          SparseAdamUpdate(s, g[j], param[j], exp_avg[j], exp_avg_sq[j]);
        }
        break;
      }
    }
  }
}

void ZeroRowMoments(RowSparseTable& table, int64_t row) {
  const auto dim = static_cast<size_t>(table.dim);
  const size_t offset = static_cast<size_t>(row) * dim;
  switch (table.state) {
    case StateDType::kBFloat16:
      std::fill_n(table.exp_avg16.data() + offset, dim, uint16_t{0});
      std::fill_n(table.exp_avg_sq16.data() + offset, dim, uint16_t{0});
      break;
    case StateDType::kInt8:
      std::fill_n(table.exp_avg8.data() + offset, dim, uint8_t{0});
      std::fill_n(table.exp_avg_sq8.data() + offset, dim, uint8_t{0});
      table.exp_avg_absmax[static_cast<size_t>(row)] = 0.0f;
      table.exp_avg_sq_absmax[static_cast<size_t>(row)] = 0.0f;
      break;
    case StateDType::kFloat32:
      std::fill_n(table.exp_avg.data() + offset, dim, 0.0f);
      std::fill_n(table.exp_avg_sq.data() + offset, dim, 0.0f);
      break;
  }
}

absl::StatusOr<bool> ApplyRowSparseStep(RowSparseTable& table, const AdamWHyperparameters& hyper,
                                        absl::Span<const int64_t> keys,
                                        absl::Span<const float> grads, float grad_scale) {
  if (absl::Status s = CheckRowSparseStep(table, hyper, grad_scale); !s.ok()) return s;
  if (absl::Status s = CheckRowSparsePush(table, keys, grads); !s.ok()) return s;

  CoalescedRows rows = CoalesceRows(keys, grads, table.dim);
  const AdamWStepScalars s = MakeStepScalars(hyper, table.step + 1, grad_scale);
  // All or nothing: every gradient is checked before any state is written.
  if (!UnscaleRowGrads(s, absl::MakeSpan(rows.grads))) return false;
  ++table.step;
  UpdateTableRows(table, s, rows.keys, rows.grads);
  return true;
}

}  // namespace fusedps
