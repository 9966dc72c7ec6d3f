#include "server/ingest/registration.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

namespace fusedps {

Registration::Registration(UpdateEngine* engine, std::unique_lock<std::timed_mutex> turn)
    : engine_(engine), turn_(std::move(turn)) {}

absl::StatusOr<std::unique_ptr<Registration>> Registration::Begin(
    UpdateEngine* engine, StagingPool* staging, std::timed_mutex* gate,
    const std::vector<TensorSpec>& specs, uint64_t window_bytes,
    const std::function<bool()>& cancelled, std::string plan_hash) {
  std::unique_lock<std::timed_mutex> turn(*gate, std::defer_lock);
  while (!turn.try_lock_for(std::chrono::milliseconds(50))) {
    if (cancelled()) {
      return absl::CancelledError("cancelled while waiting for another registration to end");
    }
  }
  std::unique_ptr<Registration> r(new Registration(engine, std::move(turn)));
  r->view_ = engine->view();
  if (absl::Status s = CheckPlanHash(*r->view_, plan_hash, "header.plan_hash",
                                     /*registering=*/true);
      !s.ok()) {
    return s;
  }
  r->plan_hash_ = std::move(plan_hash);
  if (absl::Status s = r->view_->CheckTensorSpecs(specs, &r->is_new_); !s.ok()) return s;

  std::vector<ChunkAssembler::Expected> expected;
  std::vector<TensorMeta> added;
  uint64_t new_bytes = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const uint64_t numel = *NumelOf(specs[i].shape);
    // A hashed table's slots take no values: its rows come from its initializer on first use.
    const uint64_t sent = specs[i].hashed.has_value() ? 0 : numel;
    expected.push_back({specs[i].name, sent, r->is_new_[i]});
    if (!r->is_new_[i]) continue;
    const absl::string_view group =
        specs[i].param_group.empty() ? absl::string_view(kDefaultParamGroup) : specs[i].param_group;
    added.push_back({specs[i].name, specs[i].shape, *r->view_->FindGroup(group), numel,
                     specs[i].table, specs[i].hashed});
    new_bytes += sent * sizeof(float);
  }
  r->tracker_.emplace(ChunkAssembler::Tracker(std::move(expected), sizeof(float)));
  r->index_of_.assign(specs.size(), 0);
  if (added.empty()) return r;

  r->created_ = static_cast<uint32_t>(added.size());
  absl::StatusOr<uint32_t> first = UpdateEngine::Wait<uint32_t>(
      [&](UpdateEngine::Done<uint32_t> done) { engine->BeginRegistration(added, done); });
  if (!first.ok()) return first.status();
  r->begun_ = true;
  for (size_t i = 0, k = 0; i < specs.size(); ++i) {
    if (r->is_new_[i]) r->index_of_[i] = *first + static_cast<uint32_t>(k++);
  }
  // A window of whole floats, no larger than the values or the pool.
  const uint64_t window =
      std::min({new_bytes, window_bytes, staging->capacity()}) / sizeof(float) * sizeof(float);
  if (window > 0) {
    absl::StatusOr<StagingPool::Reservation> reserved = staging->Reserve(window, cancelled);
    if (!reserved.ok()) return reserved.status();
    r->window_ = *std::move(reserved);
  }
  return r;
}

Registration::~Registration() {
  if (!begun_ || committed_) return;
  // The result does not matter: after a fault the engine refuses it, and the shard is stopping.
  UpdateEngine::Wait<bool>([&](UpdateEngine::Done<bool> done) {
    engine_->AbortRegistration(done);
  }).IgnoreError();
}

absl::Status Registration::AddChunks(
    const google::protobuf::RepeatedPtrField<v1::TensorChunk>& chunks) {
  for (const v1::TensorChunk& chunk : chunks) {
    absl::StatusOr<std::optional<uint64_t>> claimed =
        ClaimChunk(*tracker_, *view_, chunk.tensor(), chunk.offset(), chunk.data().size());
    if (!claimed.ok()) return claimed.status();
    if (!claimed->has_value()) continue;  // Empty, or a tensor registered already.
    const uint32_t tensor = index_of_[tracker_->IndexOf(chunk.tensor())];
    const char* src = chunk.data().data();
    uint64_t offset = chunk.offset();
    uint64_t count = chunk.data().size() / sizeof(float);
    if (window_.bytes() == 0) return absl::InternalError("values arrived for no window");
    while (count > 0) {
      if (window_used_ == window_.bytes()) {
        if (absl::Status s = Flush(); !s.ok()) return s;
      }
      const uint64_t n = std::min(count, (window_.bytes() - window_used_) / sizeof(float));
      char* dst = window_.data() + window_used_;
      std::memcpy(dst, src, n * sizeof(float));
      writes_.push_back({tensor, offset, reinterpret_cast<const float*>(dst), n});
      window_used_ += n * sizeof(float);
      src += n * sizeof(float);
      offset += n;
      count -= n;
    }
  }
  return absl::OkStatus();
}

absl::Status Registration::Flush() {
  if (writes_.empty()) return absl::OkStatus();
  absl::StatusOr<bool> written = UpdateEngine::Wait<bool>(
      [&](UpdateEngine::Done<bool> done) { engine_->WriteParams(std::move(writes_), done); });
  writes_.clear();
  window_used_ = 0;
  return written.status();
}

absl::StatusOr<RegistrationOutcome> Registration::Commit() {
  if (absl::Status s = Flush(); !s.ok()) return s;
  if (absl::Status s = tracker_->Finish(); !s.ok()) return s;
  RegistrationOutcome outcome;
  outcome.created = created_;
  outcome.existing = static_cast<uint32_t>(is_new_.size()) - created_;
  if (!begun_) {
    outcome.version = engine_->version();
    return outcome;
  }
  absl::StatusOr<uint64_t> version = UpdateEngine::Wait<uint64_t>(
      [&](UpdateEngine::Done<uint64_t> done) { engine_->CommitRegistration(plan_hash_, done); });
  if (!version.ok()) return version.status();
  committed_ = true;
  outcome.version = *version;
  return outcome;
}

}  // namespace fusedps
