// ParameterServiceImpl::LookupRows (service.h): rows of an embedding table by key, read by one
// engine job in stream order, then streamed in messages of at most max_chunk_bytes of rows.
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/adamw_math.h"
#include "server/ingest/pull_request.h"
#include "server/ingest/state_loader.h"
#include "server/service/convert.h"
#include "server/service/service.h"

namespace fusedps {
namespace {

// The request checked against the view: the engine's job, the wire dtype and the chunk size.
struct LookupPlan {
  RowsJob job;
  bool bf16 = false;
  uint32_t chunk_bytes = kDefaultPullChunkBytes;
};

absl::StatusOr<LookupPlan> CheckLookup(const v1::LookupRowsRequest& request,
                                       const ShardView& view) {
  LookupPlan plan;
  if (request.dtype() == v1::DTYPE_BFLOAT16) {
    plan.bf16 = true;
  } else if (request.dtype() != v1::DTYPE_UNSPECIFIED && request.dtype() != v1::DTYPE_FLOAT32) {
    return absl::InvalidArgumentError(absl::StrCat("dtype = ", v1::DType_Name(request.dtype()),
                                                   ": rows are read as FLOAT32 or BFLOAT16"));
  }
  const std::optional<TensorField> field = TensorFieldFromProto(request.field());
  if (!field || (*field != TensorField::kParam && *field != TensorField::kExpAvg &&
                 *field != TensorField::kExpAvgSq)) {
    return absl::InvalidArgumentError(
        absl::StrCat("field = ", static_cast<int>(request.field()),
                     ": a table's rows are read from PARAM, EXP_AVG or EXP_AVG_SQ"));
  }
  plan.job.field = *field;
  absl::StatusOr<uint32_t> chunk_bytes = PullChunkBytes(request.max_chunk_bytes());
  if (!chunk_bytes.ok()) return chunk_bytes.status();
  plan.chunk_bytes = *chunk_bytes;
  const std::optional<uint32_t> table = view.FindTensor(request.table());
  if (!table.has_value()) {
    return absl::NotFoundError(
        absl::StrCat("table ", QuoteName(request.table()), " is not registered"));
  }
  if (!view.tensor(*table).table) {
    return absl::InvalidArgumentError(
        absl::StrCat("table: tensor ", QuoteName(request.table()),
                     " is not an embedding table (PullParameters reads it whole)"));
  }
  plan.job.tensor = *table;
  if (request.keys().size() % sizeof(int64_t) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "keys has ", request.keys().size(), " bytes, not a whole number of int64 keys (8 bytes)"));
  }
  plan.job.keys.resize(request.keys().size() / sizeof(int64_t));
  std::memcpy(plan.job.keys.data(), request.keys().data(), request.keys().size());
  return plan;
}

}  // namespace

grpc::Status ParameterServiceImpl::LookupRows(grpc::ServerContext* context,
                                              const v1::LookupRowsRequest* request,
                                              grpc::ServerWriter<v1::LookupRowsResponse>* writer) {
  absl::StatusOr<std::shared_ptr<Model>> model =
      services_.AdmitModel(*context, Rpc::kLookupRows, request->model());
  if (!model.ok()) return ToGrpc(model.status());
  UpdateEngine& engine = (*model)->engine();
  const std::shared_ptr<const ShardView> view = engine.view();
  absl::StatusOr<LookupPlan> plan = CheckLookup(*request, *view);
  if (!plan.ok()) return ToGrpc(plan.status());
  const TensorMeta& table = view->tensor(plan->job.tensor);
  const uint64_t dim = table.table_dim();
  const uint64_t count = plan->job.keys.size();
  absl::StatusOr<RowsResult> rows = UpdateEngine::Wait<RowsResult>(
      [&](UpdateEngine::Done<RowsResult> done) { engine.ReadRows(std::move(plan->job), done); });
  if (!rows.ok()) return ToGrpc(rows.status());
  // The reply's bytes: the fp32 rows as they are, or their bf16 halves; each message copies
  // its slice once (no whole copy of a large lookup first).
  std::vector<uint16_t> half;
  if (plan->bf16) {
    half.resize(rows->rows.size());
    StoreFloats(rows->rows.data(), half.size(), GradDType::kBFloat16, half.data());
  }
  const char* const bytes = plan->bf16 ? reinterpret_cast<const char*>(half.data())
                                       : reinterpret_cast<const char*>(rows->rows.data());
  const size_t total =
      plan->bf16 ? half.size() * sizeof(uint16_t) : rows->rows.size() * sizeof(float);
  v1::LookupRowsResponse first;
  first.set_version(rows->version);
  first.set_step(rows->step);
  first.set_dim(dim);
  first.set_count(count);
  size_t at = 0;
  v1::LookupRowsResponse* message = &first;
  v1::LookupRowsResponse next;
  do {
    const size_t n = std::min<size_t>(plan->chunk_bytes, total - at);
    message->set_rows(bytes + at, n);
    at += n;
    if (!writer->Write(*message)) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    next.Clear();
    message = &next;
  } while (at < total);
  services_.metrics->RecordTableLookup((*model)->name(), table.name, count, rows->misses);
  return grpc::Status::OK;
}

}  // namespace fusedps
