#include "kernels/backend_tables.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"

namespace fusedps {
namespace {

// `what` with its index, for errors: "table_rows[2]".
std::string Entry(size_t i) { return absl::StrCat("table_rows[", i, "]"); }

// Table `tensor` seen as [rows, dim] in the fp32 arenas, after the checks every use of a table
// makes: a registered tensor, a dim that divides it, fp32 params and state. `field` names the
// request's fields in errors ("table_rows[2]" or "request").
absl::StatusOr<RowSparseTable> TableView(const TensorTable& table, const Arenas& arenas,
                                         uint32_t tensor, uint64_t dim, const std::string& field) {
  if (tensor >= table.size()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".tensor = ", tensor,
                                                   " is not a registered tensor (", table.size(),
                                                   " registered)"));
  }
  const uint64_t numel = table.numel(tensor);
  if (dim < 1 || numel % dim != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".dim = ", dim, " does not divide tensor ", tensor, "'s ", numel, " elements"));
  }
  const TensorLayout layout = table.layout(tensor);
  if (layout.params != ParamsDType::kFloat32) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".tensor = ", tensor,
                     ": an embedding table needs fp32 params (its group's params_dtype)"));
  }
  if (layout.state == StateDType::kInt8 && table.table_dim(tensor) != dim) {
    // Its scales are per row of the registered dim (tensor_table.h).
    return absl::InvalidArgumentError(absl::StrCat(field, ".dim = ", dim, " is not tensor ", tensor,
                                                   "'s registered dim ", table.table_dim(tensor),
                                                   " (int8 state)"));
  }
  RowSparseTable view;
  view.params = absl::MakeSpan(arenas.params32 + table.param_offset(tensor), numel);
  const uint64_t state = table.state_offset(tensor);
  view.state = layout.state;
  switch (layout.state) {
    case StateDType::kBFloat16:
      view.exp_avg16 = absl::MakeSpan(arenas.exp_avg16 + state, numel);
      view.exp_avg_sq16 = absl::MakeSpan(arenas.exp_avg_sq16 + state, numel);
      break;
    case StateDType::kInt8: {
      const auto scales = [&](TensorField f) {
        return absl::MakeSpan(reinterpret_cast<float*>(table.FieldOf(arenas, f, tensor).data),
                              numel / dim);
      };
      view.exp_avg8 = absl::MakeSpan(arenas.exp_avg8 + state, numel);
      view.exp_avg_sq8 = absl::MakeSpan(arenas.exp_avg_sq8 + state, numel);
      view.exp_avg_absmax = scales(TensorField::kExpAvgAbsmax);
      view.exp_avg_sq_absmax = scales(TensorField::kExpAvgSqAbsmax);
      break;
    }
    case StateDType::kFloat32:
      view.exp_avg = absl::MakeSpan(arenas.exp_avg32 + state, numel);
      view.exp_avg_sq = absl::MakeSpan(arenas.exp_avg_sq32 + state, numel);
      break;
  }
  view.rows = static_cast<int64_t>(numel / dim);
  view.dim = static_cast<int64_t>(dim);
  view.step = table.step(tensor);
  return view;
}

// status with its message after `prefix`: "table_rows[2].keys[3] = ..." (separator ".") or
// "table_rows[2]: hyper.amsgrad ..." (": ").
absl::Status Prefixed(const std::string& prefix, const char* separator,
                      const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat(prefix, separator, status.message()));
}

}  // namespace

absl::StatusOr<std::vector<PreparedTableRows>> PrepareTableRows(const TensorTable& table,
                                                                const Arenas& arenas,
                                                                const StepRequest& request,
                                                                bool* finite) {
  *finite = true;
  std::vector<PreparedTableRows> prepared;
  if (request.table_rows.empty()) return prepared;
  std::vector<bool> named(table.size(), false);
  for (uint32_t t : request.tensors) {
    if (t < named.size()) named[t] = true;
  }
  // Every check first, so that an error changes nothing.
  for (size_t i = 0; i < request.table_rows.size(); ++i) {
    const TableRows& rows = request.table_rows[i];
    absl::StatusOr<RowSparseTable> view = TableView(table, arenas, rows.tensor, rows.dim, Entry(i));
    if (!view.ok()) return view.status();
    if (named[rows.tensor]) {
      return absl::InvalidArgumentError(
          absl::StrCat(Entry(i), ".tensor = ", rows.tensor,
                       " is named twice in the step (by tensors or another table_rows entry)"));
    }
    named[rows.tensor] = true;
    const AdamWHyperparameters& hyper = table.hyper_of(rows.tensor);
    if (absl::Status s = CheckRowSparseStep(*view, hyper, request.grad_scale); !s.ok()) {
      return Prefixed(Entry(i), ": ", s);
    }
    if (absl::Status s = CheckRowSparsePush(*view, rows.keys, rows.grads); !s.ok()) {
      return Prefixed(Entry(i), ".", s);
    }
    if (rows.init_params.size() != rows.init_rows.size() * rows.dim) {
      return absl::InvalidArgumentError(
          absl::StrCat(Entry(i), ".init_params has ", rows.init_params.size(),
                       " floats, not init_rows x dim = ", rows.init_rows.size(), " x ", rows.dim));
    }
    if (rows.init_rows.size() > static_cast<size_t>(INT32_MAX)) {
      return absl::InvalidArgumentError(absl::StrCat(
          Entry(i), ".init_rows has ", rows.init_rows.size(), " rows, above 2^31 - 1"));
    }
    PreparedTableRows p;
    p.tensor = rows.tensor;
    p.view = *view;
    p.s = MakeStepScalars(hyper, view->step + 1, request.grad_scale, request.lr_divisor);
    prepared.push_back(std::move(p));
  }
  for (size_t i = 0; i < prepared.size(); ++i) {
    const TableRows& rows = request.table_rows[i];
    PreparedTableRows& p = prepared[i];
    p.rows = CoalesceRows(rows.keys, rows.grads, p.view.dim);
    if (!rows.init_rows.empty()) {
      // Each row that starts over must be one of the (unique, ascending) pushed rows, once.
      p.init_of_row.assign(p.rows.keys.size(), -1);
      for (size_t j = 0; j < rows.init_rows.size(); ++j) {
        const auto at = std::lower_bound(p.rows.keys.begin(), p.rows.keys.end(), rows.init_rows[j]);
        const auto r = static_cast<size_t>(at - p.rows.keys.begin());
        if (at == p.rows.keys.end() || *at != rows.init_rows[j] || p.init_of_row[r] != -1) {
          return absl::InvalidArgumentError(
              absl::StrCat(Entry(i), ".init_rows[", j, "] = ", rows.init_rows[j],
                           " is not one of the step's keys, or is named twice"));
        }
        p.init_of_row[r] = static_cast<int32_t>(j);
      }
      p.init_params = rows.init_params;
    }
    if (*finite && !UnscaleRowGrads(p.s, absl::MakeSpan(p.rows.grads))) *finite = false;
  }
  return prepared;
}

void ApplyTableRows(std::vector<PreparedTableRows>& prepared) {
  for (PreparedTableRows& p : prepared) {
    const auto dim = static_cast<size_t>(p.view.dim);
    for (size_t r = 0; r < p.init_of_row.size(); ++r) {
      if (p.init_of_row[r] < 0) continue;
      const size_t at = static_cast<size_t>(p.rows.keys[r]) * dim;
      std::memcpy(p.view.params.data() + at,
                  p.init_params.data() + static_cast<size_t>(p.init_of_row[r]) * dim,
                  dim * sizeof(float));
      ZeroRowMoments(p.view, p.rows.keys[r]);
    }
    UpdateTableRows(p.view, p.s, p.rows.keys, p.rows.grads);
  }
}

absl::StatusOr<TableField> CheckReadRows(const TensorTable& table, const Arenas& arenas,
                                         const ReadRowsRequest& request) {
  absl::StatusOr<RowSparseTable> view =
      TableView(table, arenas, request.tensor, request.dim, "request");
  if (!view.ok()) return view.status();
  TableField source;
  switch (request.field) {
    case TensorField::kParam:
      source.f32 = view->params.data();
      break;
    case TensorField::kExpAvg:
      source.f32 = view->exp_avg.data();
      source.bf16 = view->exp_avg16.data();
      source.int8 = view->exp_avg8.data();
      source.scales = view->exp_avg_absmax.data();
      break;
    case TensorField::kExpAvgSq:
      source.f32 = view->exp_avg_sq.data();
      source.bf16 = view->exp_avg_sq16.data();
      source.int8 = view->exp_avg_sq8.data();
      source.scales = view->exp_avg_sq_absmax.data();
      source.signed_map = false;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("request.field = ", TensorFieldName(request.field),
                       ": a table's rows are read from param, exp_avg or exp_avg_sq"));
  }
  for (size_t i = 0; i < request.keys.size(); ++i) {
    if (request.keys[i] < 0 || request.keys[i] >= view->rows) {
      return absl::InvalidArgumentError(absl::StrCat("keys[", i, "] = ", request.keys[i],
                                                     " is outside [0, ", view->rows,
                                                     ") (the table's rows)"));
    }
  }
  if (!request.keys.empty() && request.dst == nullptr) {
    return absl::InvalidArgumentError("request.dst is null");
  }
  return source;
}

absl::Status ReadTableRows(const TensorTable& table, const Arenas& arenas,
                           const ReadRowsRequest& request) {
  absl::StatusOr<TableField> source = CheckReadRows(table, arenas, request);
  if (!source.ok()) return source.status();
  const auto dim = static_cast<size_t>(request.dim);
  for (size_t i = 0; i < request.keys.size(); ++i) {
    const size_t at = static_cast<size_t>(request.keys[i]) * dim;
    if (source->bf16 != nullptr) {
      for (size_t j = 0; j < dim; ++j)
        request.dst[i * dim + j] = BFloat16ToFloat(source->bf16[at + j]);
    } else if (source->int8 != nullptr) {
      const Int8Codebooks& books = DynamicCodebooks();
      const float* values = source->signed_map ? books.exp_avg.values : books.exp_avg_sq.values;
      const float scale = source->scales[request.keys[i]];
      for (size_t j = 0; j < dim; ++j) {
        request.dst[i * dim + j] = Dequantize(values, source->int8[at + j], scale);
      }
    } else {
      std::memcpy(request.dst + i * dim, source->f32 + at, dim * sizeof(float));
    }
  }
  return absl::OkStatus();
}

}  // namespace fusedps
