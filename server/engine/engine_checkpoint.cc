// The update engine's jobs that move whole values in and out: Snapshot (a consistent cut of the
// shard, for a checkpoint to write), Restore (a whole shard streamed into an empty engine) and
// LoadState (values and steps written into a running shard). See update_engine.h.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/mutex.h"
#include "server/engine/update_engine.h"

namespace fusedps {

namespace {

// A read of `field`'s tensors [begin, end) into dst, at their offsets less the first's.
ReadRequest ReadOf(const SnapshotField& field, size_t begin, size_t end, void* dst,
                   std::vector<uint64_t>* offsets) {
  offsets->clear();
  for (size_t i = begin; i < end; ++i) offsets->push_back(field.offsets[i] - field.offsets[begin]);
  ReadRequest request;
  request.field = field.field;
  request.param_copy = field.param_copy;
  request.stored = !field.param_copy;  // Bit for bit, codes and scales included.
  request.tensors = absl::MakeConstSpan(field.tensors).subspan(begin, end - begin);
  request.dst_offsets = *offsets;
  request.dst = dst;
  return request;
}

}  // namespace

// The fenced snapshot's access to the backend: the engine thread waits in the Snapshot job
// until this is destroyed, so the caller's thread is the only one that queues work meanwhile.
class UpdateEngine::Fence final : public SnapshotFence {
 public:
  Fence(UpdateEngine* engine, std::shared_ptr<Notification> released)
      : engine_(engine), released_(std::move(released)) {}
  ~Fence() override { released_->Notify(); }

  absl::Status Read(const SnapshotField& field, size_t begin, size_t end, void* dst) override {
    std::vector<uint64_t> offsets;
    const ReadRequest request = ReadOf(field, begin, end, dst, &offsets);
    if (absl::Status s = engine_->Checked(engine_->backend_->Read(request)); !s.ok()) return s;
    absl::StatusOr<Marker> marker = engine_->backend_->Mark();
    if (!marker.ok()) return engine_->Checked(marker.status());
    return engine_->Checked(engine_->backend_->Wait(*marker).status());
  }

 private:
  UpdateEngine* const engine_;
  const std::shared_ptr<Notification> released_;
};

void UpdateEngine::Snapshot(void* buffer, uint64_t buffer_bytes, bool fenced,
                            Done<CheckpointSnapshot> done) {
  Submit(
      [this, buffer, buffer_bytes, fenced, done] {
        const auto fail = [this, done](absl::Status s) {
          Complete({0, [done, s](absl::StatusOr<WorkDone>) { done(s); }});
        };
        if (absl::Status s = fault_->status(); !s.ok()) return fail(s);
        auto snapshot = std::make_shared<CheckpointSnapshot>();
        ShardCut& cut = snapshot->cut;
        cut.view = view();
        cut.version = queued_version_;
        cut.generation = generation_;
        cut.buffers = buffers();
        for (uint32_t t = 0; t < cut.view->tensor_count(); ++t) {
          cut.steps.push_back(backend_->step(t));
        }
        for (const auto& [t, index] : hashed_) cut.hashed_tables.emplace(t, index.Export());
        uint64_t bytes = 0;
        snapshot->fields = SnapshotLayout(*cut.view, backend_->param_copy_dtype(), &bytes);
        if (!fenced) {
          if (bytes > buffer_bytes) {
            return fail(absl::OutOfRangeError(absl::StrCat(
                "the snapshot needs ", bytes, " bytes, the buffer has ", buffer_bytes)));
          }
          std::vector<uint64_t> offsets;
          for (const SnapshotField& f : snapshot->fields) {
            if (f.tensors.empty()) continue;  // An empty shard's fields.
            // Whole fields, at their own offsets in the buffer (the first field's is 0).
            const ReadRequest request =
                ReadOf(f, 0, f.tensors.size(), static_cast<char*>(buffer) + f.offsets[0], &offsets);
            if (absl::Status s = Checked(backend_->Read(request)); !s.ok()) return fail(s);
          }
          snapshot->data = static_cast<const char*>(buffer);
        }
        absl::StatusOr<Marker> marker = backend_->Mark();
        if (!marker.ok()) return fail(Checked(marker.status()));
        std::shared_ptr<Notification> released;
        if (fenced) {
          released = std::make_shared<Notification>();
          snapshot->fence = std::make_unique<Fence>(this, released);
        }
        // The retry table once every push before the cut has finished, and none after it has
        // (completions run in stream order): it matches the cut.
        Complete({*marker, [this, snapshot, done](absl::StatusOr<WorkDone> work) {
                    if (!work.ok()) return done(work.status());
                    snapshot->cut.retries = retries_->Export();
                    done(std::move(*snapshot));
                  }});
        // Fenced: hold the engine thread (no step, no registration) until the fence goes.
        if (released != nullptr) released->WaitForNotification();
      },
      [done](const absl::Status& s) { done(s); });
}

absl::Status UpdateEngine::WriteValues(const WriteRequest& write, bool derive_copy) {
  // fp32 params (stored or not, the same values) come with their copy; bf16 params have none.
  if (derive_copy && write.field == TensorField::kParam && !write.param_copy &&
      write.tensor < backend_->tensor_count() &&
      backend_->layout(write.tensor).params == ParamsDType::kFloat32) {
    const float* values = static_cast<const float*>(write.src);
    std::vector<float> aligned;  // A file of another tool may hold fp32 at any byte offset.
    if (reinterpret_cast<uintptr_t>(write.src) % alignof(float) != 0) {
      aligned.resize(write.count);
      std::memcpy(aligned.data(), write.src, write.count * sizeof(float));
      values = aligned.data();
    }
    return backend_->WriteParams(write.tensor, write.offset,
                                 absl::MakeConstSpan(values, write.count));
  }
  return backend_->Write(write);
}

absl::Status UpdateEngine::RestoreValues(const RestoredShard& shard, const ShardView& view,
                                         RestoreSource* source, uint32_t first) {
  // The fields a checkpoint of this shard holds, and the values each must get.
  const bool derive_copy =
      backend_->param_copy_dtype() != ParamCopyDType::kNone && !shard.param_copy;
  uint64_t bytes = 0;
  const std::vector<SnapshotField> fields = SnapshotLayout(
      view, shard.param_copy ? backend_->param_copy_dtype() : ParamCopyDType::kNone, &bytes);
  // Elements of each field's stored form (the param copy's 16-bit values): the writes count
  // them so.
  std::vector<uint64_t> expected(fields.size()), written(fields.size());
  for (size_t f = 0; f < fields.size(); ++f) {
    for (uint32_t t : fields[f].tensors) expected[f] += StoredElements(view, fields[f], t);
  }
  for (;;) {
    RestoreSource::Batch batch;
    absl::StatusOr<bool> more = source->Next(&batch);
    if (!more.ok()) return more.status();
    if (!*more) break;
    absl::Status status;
    for (WriteRequest w : batch.writes) {
      const auto f = std::find_if(fields.begin(), fields.end(), [&](const SnapshotField& x) {
        return x.field == w.field && x.param_copy == w.param_copy;
      });
      if (w.tensor >= shard.tensors.size() || f == fields.end() || (!w.param_copy && !w.stored)) {
        status = absl::DataLossError(absl::StrCat("a restore wrote tensor ", w.tensor, " of ",
                                                  shard.tensors.size(),
                                                  ", a field the "
                                                  "checkpoint does not hold, or not in its "
                                                  "stored form"));
        break;
      }
      w.tensor += first;
      if (!(status = Checked(WriteValues(w, derive_copy), true)).ok()) break;
      written[static_cast<size_t>(f - fields.begin())] += w.count;
    }
    // Wait for the copies before the memory goes back (whatever happened).
    absl::StatusOr<Marker> marker = backend_->Mark();
    if (!marker.ok()) return Checked(marker.status());
    if (absl::Status s = Checked(backend_->Wait(*marker).status()); !s.ok()) return s;
    source->Release(batch.slot);
    if (!status.ok()) return status;
  }
  for (size_t f = 0; f < fields.size(); ++f) {
    if (written[f] != expected[f]) {
      return absl::DataLossError(absl::StrCat("a restore wrote ", written[f], " values of ",
                                              fields[f].name, ", the shard has ", expected[f]));
    }
  }
  for (uint32_t i = 0; i < shard.tensors.size(); ++i) {
    if (absl::Status s = Checked(backend_->SetStep(first + i, shard.steps[i]), true); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

void UpdateEngine::Restore(const RestoredShard* shard, RestoreSource* source, Done<uint64_t> done) {
  Submit(
      [this, shard, source, done] {
        if (absl::Status s = fault_->status(); !s.ok()) return done(s);
        std::shared_ptr<const ShardView> restored = view();
        if (restored->tensor_count() != 0 || restored->groups().size() != 1 ||
            queued_version_ != 0 || !pending_tensors_.empty()) {
          return done(absl::FailedPreconditionError(
              "a restore needs an empty shard: no tensors, no param groups but \"default\""));
        }
        // Undoes a restore that failed: no tensors, and "default" as the view has it (a later
        // group replaces any other the backend kept).
        const AdamWHyperparameters initial = restored->groups()[0].hyperparameters;
        const auto undo = [&](absl::Status cause) {
          if (!fault_->status().ok()) return done(cause);  // Nothing more runs on the device.
          absl::Status s = Checked(backend_->TruncateTensors(0));
          if (s.ok()) s = Checked(backend_->SetParamGroup(0, initial));
          done(s.ok() ? cause : s);
        };
        for (uint32_t g = 0; g < shard->groups.size(); ++g) {
          const ParamGroupSpec& group = shard->groups[g];
          if (absl::Status s = Checked(backend_->SetParamGroup(g, group.hyperparameters), true);
              !s.ok()) {
            return undo(s);
          }
          restored = restored->WithGroup(g, group);
        }
        std::vector<NewTensor> added;
        for (const TensorMeta& t : shard->tensors) {
          added.push_back(
              {t.numel, t.group, TensorRoundingKey(t.name.data(), t.name.size()), t.table_dim()});
        }
        absl::StatusOr<uint32_t> first = backend_->AddTensors(added);
        if (!first.ok()) return undo(Checked(first.status(), true));
        restored = restored->WithTensors(shard->tensors);
        if (!shard->plan_hash.empty()) restored = restored->WithPlanHash(shard->plan_hash);
        if (absl::Status s = RestoreValues(*shard, *restored, source, *first); !s.ok()) {
          return undo(s);
        }
        // The hashed tables' indexes (checked by the reader: Import cannot fail here).
        absl::flat_hash_map<uint32_t, HashedRowIndex> hashed;
        for (uint32_t t = 0; t < shard->tensors.size(); ++t) {
          if (!shard->tensors[t].hashed.has_value()) continue;
          const auto state = shard->hashed_tables.find(t);
          absl::StatusOr<HashedRowIndex> index =
              state == shard->hashed_tables.end()
                  ? absl::StatusOr<HashedRowIndex>(HashedRowIndex(shard->tensors[t].shape[0]))
                  : HashedRowIndex::Import(state->second);
          if (!index.ok()) return undo(index.status());
          hashed.emplace(t, *std::move(index));
        }
        hashed_ = std::move(hashed);
        retries_->Import(shard->retries);
        queued_version_ = shard->version;
        ++generation_;
        {
          WriterMutexLock lock(&progress_mu_);
          version_ = shard->version;
          steps_ = shard->steps;
          for (const auto& [t, index] : hashed_) {
            hashed_rows_in_use_[t] = static_cast<uint64_t>(index.rows_in_use());
          }
        }
        {
          MutexLock lock(&view_mu_);
          view_ = std::move(restored);
          buffers_ = shard->buffers != nullptr ? shard->buffers : BufferSet::Empty();
        }
        done(shard->version);
      },
      [done](const absl::Status& s) { done(s); });
}

absl::Status UpdateEngine::CheckLoad(const StateLoad& load) const {
  if (consistency_.mode == ConsistencyMode::kSync && !round_.members.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("the sync round at version ", queued_version_,
                                                      " holds ", round_.members.size(),
                                                      " pushes; load state between rounds"));
  }
  std::shared_ptr<const ShardView> current = view();
  for (const WriteRequest& w : load.writes) {
    const bool known_field = w.field >= TensorField::kParam && w.field <= TensorField::kMaxExpAvgSq;
    if (!known_field || w.tensor >= current->tensor_count() || w.param_copy || w.stored ||
        w.offset > current->tensor(w.tensor).numel ||
        w.count > current->tensor(w.tensor).numel - w.offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a load writes elements [", w.offset, ", +", w.count, ") of field ",
          static_cast<int>(w.field), " of tensor ", w.tensor, " of ", current->tensor_count(),
          w.param_copy ? ", as the param copy" : "", w.stored ? ", in its stored form" : ""));
    }
    const uint32_t group = current->tensor(w.tensor).group;
    if (w.field == TensorField::kMaxExpAvgSq && !current->groups()[group].hyperparameters.amsgrad) {
      return absl::FailedPreconditionError(absl::StrCat(
          "max_exp_avg_sq of ", QuoteName(current->tensor(w.tensor).name), ": its param group ",
          QuoteName(current->groups()[group].name), " has no amsgrad"));
    }
  }
  if (load.tensors.size() != load.steps.size()) {
    return absl::InvalidArgumentError(absl::StrCat("a load sets ", load.steps.size(), " steps of ",
                                                   load.tensors.size(), " tensors"));
  }
  for (size_t i = 0; i < load.tensors.size(); ++i) {
    if (load.tensors[i] >= current->tensor_count() || load.steps[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("a load sets tensor ", load.tensors[i], " of ",
                                                     current->tensor_count(), " to step ",
                                                     load.steps[i]));
    }
  }
  return absl::OkStatus();
}

void UpdateEngine::LoadState(const StateLoad* load, Done<uint64_t> done) {
  Submit(
      [this, load, done] {
        const auto fail = [this, done](absl::Status s) {
          Complete({0, [done, s](absl::StatusOr<WorkDone>) { done(s); }});
        };
        if (absl::Status s = fault_->status(); !s.ok()) return fail(s);
        if (absl::Status s = CheckLoad(*load); !s.ok()) return fail(s);
        // Checked: from here on, an error is a fault (the shard stops; nothing half-loaded is
        // ever served).
        const bool derive_copy = backend_->param_copy_dtype() != ParamCopyDType::kNone;
        for (const WriteRequest& w : load->writes) {
          if (absl::Status s = Checked(WriteValues(w, derive_copy)); !s.ok()) return fail(s);
        }
        for (size_t i = 0; i < load->tensors.size(); ++i) {
          if (absl::Status s = Checked(backend_->SetStep(load->tensors[i], load->steps[i]));
              !s.ok()) {
            return fail(s);
          }
        }
        absl::StatusOr<Marker> marker = backend_->Mark();
        if (!marker.ok()) return fail(Checked(marker.status()));
        const uint64_t version = ++queued_version_;
        ++generation_;
        Complete({*marker, [this, load, done, version](absl::StatusOr<WorkDone> work) {
                    if (!work.ok()) return done(work.status());
                    {
                      WriterMutexLock lock(&progress_mu_);
                      version_ = version;
                      for (size_t i = 0; i < load->tensors.size(); ++i) {
                        steps_[load->tensors[i]] = load->steps[i];
                      }
                    }
                    done(version);
                  }});
      },
      [done](const absl::Status& s) { done(s); });
}

}  // namespace fusedps
