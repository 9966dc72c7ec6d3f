#include "server/ingest/table_rows.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fusedps {

TableRowsAssembler::TableRowsAssembler(const ShardView& view, std::vector<uint32_t> tables,
                                       GradDType dtype, uint64_t max_bytes)
    : dtype_(dtype), max_bytes_(max_bytes) {
  for (uint32_t t : tables) {
    const TensorMeta& meta = view.tensor(t);
    tables_.push_back({meta.name, static_cast<uint64_t>(meta.shape[0]), meta.table_dim(),
                       meta.hashed.has_value()});
    ready_.push_back({t, {}, {}});
  }
}

absl::Status TableRowsAssembler::Add(const v1::TableRows& rows, const std::string& field) {
  size_t k = 0;
  while (k < tables_.size() && tables_[k].name != rows.table()) ++k;
  if (k == tables_.size()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".table ", QuoteName(rows.table()),
                                                   " is not one of the push's header.tables"));
  }
  const Table& table = tables_[k];
  const std::string& keys = rows.keys();
  if (keys.size() % sizeof(int64_t) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".keys has ", keys.size(), " bytes, not a whole number of int64 keys (8 bytes)"));
  }
  const uint64_t n = keys.size() / sizeof(int64_t);
  const uint64_t element_bytes = DTypeSize(dtype_);
  if (rows.grads().size() % element_bytes != 0 ||
      rows.grads().size() / element_bytes / table.dim != n ||
      rows.grads().size() / element_bytes % table.dim != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".grads has ", rows.grads().size(), " bytes, not keys x dim = ", n, " x ", table.dim,
        " elements of ", element_bytes, " bytes (table ", QuoteName(table.name), ")"));
  }
  const uint64_t added = n * (sizeof(int64_t) + table.dim * sizeof(float));
  if (bytes_ + added > max_bytes_) {
    return absl::ResourceExhaustedError(
        absl::StrCat(field, ": the push's table rows would take ", bytes_ + added,
                     " bytes; a push holds at most ", max_bytes_, " (--staging-pool-bytes)"));
  }
  // Dense ids only: any int64 is a hashed table's key. Little-endian hosts only (as all).
  if (!table.hashed) {
    for (uint64_t i = 0; i < n; ++i) {
      int64_t key;
      std::memcpy(&key, keys.data() + i * sizeof(int64_t), sizeof(key));
      if (key < 0 || static_cast<uint64_t>(key) >= table.rows) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".keys[", i, "] = ", key, " is outside [0, ", table.rows,
                         ") (the rows of table ", QuoteName(table.name), ")"));
      }
    }
  }
  ReadyTableRows& ready = ready_[k];
  const size_t first = ready.keys.size();
  ready.keys.resize(first + n);
  std::memcpy(ready.keys.data() + first, keys.data(), keys.size());
  const uint64_t count = n * table.dim;
  const size_t at = ready.grads.size();
  ready.grads.resize(at + count);
  LoadFloats(rows.grads().data(), dtype_, count, ready.grads.data() + at);
  bytes_ += added;
  wire_bytes_ += keys.size() + rows.grads().size();
  return absl::OkStatus();
}

std::vector<ReadyTableRows> TableRowsAssembler::Take() { return std::move(ready_); }

}  // namespace fusedps
