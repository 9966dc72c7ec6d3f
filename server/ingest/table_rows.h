// table_rows.h: a push's embedding-table rows (PushGradientsRequest.table_rows; proto
// TableRows), gathered from its messages and parts into fp32 rows per table and checked as they
// come, for the engine's step (ReadyPush::tables). Free of gRPC.
//
// A table's rows may come in several TableRows, in any messages of any part: they are appended
// in the order they are added (the step sums duplicate keys, kernels/row_sparse.h). Rows are
// host memory outside the staging pool, bounded by `max_bytes` (fp32 bytes of keys and grads
// per push).
//
// Thread safety: none; the assembly calls it under its lock.
#ifndef FUSEDPS_SERVER_INGEST_TABLE_ROWS_H_
#define FUSEDPS_SERVER_INGEST_TABLE_ROWS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "fusedps/v1/parameter_service.pb.h"
#include "kernels/adamw_math.h"
#include "server/engine/update_engine.h"
#include "server/store/shard_view.h"

namespace fusedps {

class TableRowsAssembler {
 public:
  // tables: the push header's (CheckedPushHeader::tables), tables of `view`; dtype: the push's
  // grad_dtype.
  TableRowsAssembler(const ShardView& view, std::vector<uint32_t> tables, GradDType dtype,
                     uint64_t max_bytes);

  // Adds one TableRows; `field` names it in errors ("table_rows[2]"). Errors, nothing added:
  // INVALID_ARGUMENT for a table the header's tables do not name, keys that are not whole
  // little-endian int64s, a key outside [0, rows) (dense ids), grads that are not keys x dim
  // elements of the push's grad_dtype; RESOURCE_EXHAUSTED when the push's rows would pass
  // max_bytes.
  absl::Status Add(const v1::TableRows& rows, const std::string& field);

  // The rows of every table of the header, in its order (a table without rows has none), as
  // the engine takes them; moves them out.
  std::vector<ReadyTableRows> Take();

  // The wire bytes (keys and grads) added so far, for the reply's grad_bytes.
  uint64_t wire_bytes() const { return wire_bytes_; }

 private:
  struct Table {
    std::string name;
    uint64_t rows = 0;
    uint64_t dim = 0;
    bool hashed = false;  // Any int64 is a key (the engine finds its slot).
  };
  std::vector<Table> tables_;
  std::vector<ReadyTableRows> ready_;  // Parallel to tables_.
  const GradDType dtype_;
  const uint64_t max_bytes_;
  uint64_t bytes_ = 0;       // fp32 bytes held, against max_bytes_.
  uint64_t wire_bytes_ = 0;  // As received.
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_INGEST_TABLE_ROWS_H_
