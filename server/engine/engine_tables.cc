// UpdateEngine's embedding tables (update_engine.h; docs/dev/embedding-tables.md): lookups of
// rows by key, in stream order, and the slots of hashed tables. A push's table rows go through
// the step job (update_engine.cc), which hands them to the backend with the dense tensors; for a
// hashed table it first finds or makes its keys' slots here (PlanHashedRows), and commits the
// plan once the step is queued and applied, so that a refused or skipped push changes nothing.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/hashed_row_step.h"
#include "server/engine/update_engine.h"

namespace fusedps {

absl::StatusOr<UpdateEngine::HashedRowsStep> UpdateEngine::PlanHashedRows(
    const ReadyTableRows& rows, const TensorMeta& meta) const {
  const auto index = hashed_.find(rows.tensor);
  if (index == hashed_.end() || !meta.hashed.has_value()) {
    return absl::InternalError(
        absl::StrCat("table ", QuoteName(meta.name), " has no index of hashed keys"));
  }
  // The unique keys ascending, as the backend coalesces them (kernels/hashed_row_step.h's
  // ApplyHashedRowStep plans the same order): new keys take slots in this order. One sort of
  // the keys' positions gives both the unique keys and each position's unique key.
  std::vector<size_t> order(rows.keys.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return rows.keys[a] < rows.keys[b]; });
  std::vector<int64_t> unique;
  std::vector<size_t> unique_of(rows.keys.size());  // Per position, its key's in `unique`.
  for (const size_t i : order) {
    if (unique.empty() || unique.back() != rows.keys[i]) unique.push_back(rows.keys[i]);
    unique_of[i] = unique.size() - 1;
  }
  absl::StatusOr<HashedRowIndex::SlotPlan> plan = index->second.PlanSlots(unique);
  if (!plan.ok()) {
    return absl::Status(
        plan.status().code(),
        absl::StrCat("table_rows of table ", QuoteName(meta.name), ": ", plan.status().message()));
  }
  HashedRowsStep step;
  step.tensor = rows.tensor;
  step.slots.resize(rows.keys.size());
  for (size_t i = 0; i < rows.keys.size(); ++i) step.slots[i] = plan->slots[unique_of[i]];
  std::vector<int64_t> created_keys;
  for (const int64_t i : plan->created) {
    step.init_rows.push_back(plan->slots[static_cast<size_t>(i)]);
    created_keys.push_back(plan->keys[static_cast<size_t>(i)]);
  }
  const int64_t dim = static_cast<int64_t>(meta.table_dim());
  step.init_params.resize(created_keys.size() * static_cast<size_t>(dim));
  InitRows(meta.hashed->seed, meta.hashed->init_std, dim, created_keys, step.init_params.data());
  step.plan = *std::move(plan);
  return step;
}

absl::StatusOr<UpdateEngine::TablesStep> UpdateEngine::PlanTables(
    absl::Span<const ReadyTableRows> tables) const {
  const std::shared_ptr<const ShardView> view = this->view();
  TablesStep step;
  step.hashed->reserve(tables.size());  // No reallocation: step.rows point into it.
  for (size_t i = 0; i < tables.size(); ++i) {
    const ReadyTableRows& t = tables[i];
    const bool known = t.tensor < view->tensor_count();
    const uint64_t dim = known ? view->tensor(t.tensor).table_dim() : 0;
    if (known && view->tensor(t.tensor).hashed.has_value()) {
      absl::StatusOr<HashedRowsStep> planned = PlanHashedRows(t, view->tensor(t.tensor));
      if (!planned.ok()) return planned.status();
      HashedRowsStep& h = step.hashed->emplace_back(*std::move(planned));
      h.position = i;
      step.rows.push_back({t.tensor, dim, h.slots, t.grads, h.init_rows, h.init_params});
    } else {
      // Unknown tensors and dims the backend refuses, naming the field.
      step.rows.push_back({t.tensor, dim, t.keys, t.grads});
    }
    step.tensors.push_back(t.tensor);
  }
  return step;
}

std::vector<uint64_t> UpdateEngine::CommitTables(const TablesStep& step, size_t table_count) {
  std::vector<uint64_t> evictions(table_count, 0);
  for (const HashedRowsStep& h : *step.hashed) {
    HashedRowIndex& index = hashed_.at(h.tensor);
    index.Commit(h.plan, backend_->step(h.tensor));
    evictions[h.position] = h.plan.evicted_keys.size();
    WriterMutexLock lock(&progress_mu_);
    hashed_rows_in_use_[h.tensor] = static_cast<uint64_t>(index.rows_in_use());
  }
  return evictions;
}

absl::StatusOr<UpdateEngine::RoundKeys> UpdateEngine::CheckRoundKeys(const ReadyPush& push) const {
  const std::shared_ptr<const ShardView> view = this->view();
  RoundKeys added;
  for (const ReadyTableRows& t : push.tables) {
    if (t.tensor >= view->tensor_count() || !view->tensor(t.tensor).hashed.has_value()) continue;
    const TensorMeta& meta = view->tensor(t.tensor);
    const auto held = round_.hashed_keys.find(t.tensor);
    std::vector<int64_t> fresh;
    for (const int64_t key : t.keys) {
      if (held == round_.hashed_keys.end() || !held->second.contains(key)) fresh.push_back(key);
    }
    std::sort(fresh.begin(), fresh.end());
    fresh.erase(std::unique(fresh.begin(), fresh.end()), fresh.end());
    const uint64_t before = held == round_.hashed_keys.end() ? 0 : held->second.size();
    const uint64_t capacity = meta.numel / meta.table_dim();
    if (before + fresh.size() > capacity) {
      return absl::InvalidArgumentError(absl::StrCat(
          "table_rows of table ", QuoteName(meta.name), ": the sync round's pushes would name ",
          before + fresh.size(), " unique keys (", fresh.size(),
          " new in this push), above the "
          "table's capacity of ",
          capacity, " (a round's step takes them all at once)"));
    }
    added.emplace_back(t.tensor, std::move(fresh));
  }
  return added;
}

void UpdateEngine::AddRoundKeys(RoundKeys keys) {
  for (auto& [tensor, fresh] : keys) round_.hashed_keys[tensor].insert(fresh.begin(), fresh.end());
}

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
        const TensorMeta& meta = view->tensor(job.tensor);
        const uint64_t dim = meta.table_dim();
        auto result = std::make_shared<RowsResult>();
        result->rows.resize(job.keys.size() * dim);
        ReadRowsRequest request;
        request.field = job.field;
        request.tensor = job.tensor;
        request.dim = dim;
        request.keys = job.keys;
        request.dst = result->rows.data();
        // A hashed table: the backend reads the slots of the keys the table holds into `held`
        // (or, when it holds every key, straight into the result); the others are the
        // initializer's rows (zeros for the moments), written here.
        std::vector<int64_t> slots;
        auto held = std::make_shared<std::vector<float>>();
        std::vector<size_t> held_at;  // The key index of each held row.
        if (meta.hashed.has_value()) {
          const auto index = hashed_.find(job.tensor);
          if (index == hashed_.end()) {
            return fail(Checked(absl::InternalError(
                absl::StrCat("table ", QuoteName(meta.name), " has no index of hashed keys"))));
          }
          const std::vector<int64_t> found = index->second.Lookup(job.keys);
          for (size_t i = 0; i < found.size(); ++i) {
            if (found[i] >= 0) {
              slots.push_back(found[i]);
              held_at.push_back(i);
              continue;
            }
            ++result->misses;  // Its moments stay zero; its params are its initializer's.
            if (job.field == TensorField::kParam) {
              InitRows(meta.hashed->seed, meta.hashed->init_std, static_cast<int64_t>(dim),
                       absl::MakeConstSpan(&job.keys[i], 1), result->rows.data() + i * dim);
            }
          }
          request.keys = slots;
          if (held_at.size() == job.keys.size()) {
            held_at.clear();  // Every key held: its rows go straight into the result.
          } else {
            held->resize(slots.size() * dim);
            request.dst = held->data();
          }
        }
        if (absl::Status s = Checked(backend_->ReadRows(request), true); !s.ok()) return fail(s);
        absl::StatusOr<Marker> marker = backend_->Mark();
        if (!marker.ok()) return fail(Checked(marker.status()));
        result->version = queued_version_;
        result->step = backend_->step(job.tensor);
        Complete({*marker, [done, result, held, held_at = std::move(held_at),
                            dim](absl::StatusOr<WorkDone> work) {
                    if (!work.ok()) return done(work.status());
                    for (size_t j = 0; j < held_at.size(); ++j) {
                      std::memcpy(result->rows.data() + held_at[j] * dim, held->data() + j * dim,
                                  dim * sizeof(float));
                    }
                    done(std::move(*result));
                  }});
      },
      [done](const absl::Status& s) { done(s); });
}

}  // namespace fusedps
