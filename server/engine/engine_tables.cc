// UpdateEngine's embedding tables (update_engine.h; docs/dev/embedding-tables.md): lookups of
// rows by key, in stream order. A push's table rows go through the step job
// (update_engine.cc), which hands them to the backend with the dense tensors.
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/engine/update_engine.h"

namespace fusedps {

void UpdateEngine::ReadRows(RowsJob job, Done<RowsResult> done) {
  Submit(
      [this, job = std::move(job), done] {
        const auto fail = [this, done](absl::Status s) {
          Complete({0, [done, s](absl::StatusOr<WorkDone>) { done(s); }});
        };
        if (absl::Status s = fault_->status(); !s.ok()) return fail(s);
        const std::shared_ptr<const ShardView> view = this->view();
        if (job.tensor >= view->tensor_count() || !view->tensor(job.tensor).table) {
          return fail(absl::InvalidArgumentError(
              absl::StrCat("tensor ", job.tensor, " is not an embedding table of the shard")));
        }
        const uint64_t dim = view->tensor(job.tensor).table_dim();
        auto result = std::make_shared<RowsResult>();
        result->rows.resize(job.keys.size() * dim);
        ReadRowsRequest request;
        request.field = job.field;
        request.tensor = job.tensor;
        request.dim = dim;
        request.keys = job.keys;
        request.dst = result->rows.data();
        if (absl::Status s = Checked(backend_->ReadRows(request), true); !s.ok()) return fail(s);
        absl::StatusOr<Marker> marker = backend_->Mark();
        if (!marker.ok()) return fail(Checked(marker.status()));
        result->version = queued_version_;
        result->step = backend_->step(job.tensor);
        Complete({*marker, [done, result](absl::StatusOr<WorkDone> work) {
                    if (!work.ok()) return done(work.status());
                    done(std::move(*result));
                  }});
      },
      [done](const absl::Status& s) { done(s); });
}

}  // namespace fusedps
