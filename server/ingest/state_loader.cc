#include "server/ingest/state_loader.h"

#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace fusedps {

std::optional<TensorField> TensorFieldFromProto(int value) {
  if (value == v1::TENSOR_FIELD_UNSPECIFIED) return TensorField::kParam;
  if (value < v1::TENSOR_FIELD_PARAM || value > v1::TENSOR_FIELD_MAX_EXP_AVG_SQ) {
    return std::nullopt;
  }
  return static_cast<TensorField>(value);
}

namespace {

int IndexOf(TensorField field) { return static_cast<int>(field) - 1; }

// `s` with the field it is about in front of its message.
absl::Status AboutField(const absl::Status& s, TensorField field) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat("field ", TensorFieldName(field), ": ", s.message()));
}

}  // namespace

StateLoader::StateLoader(UpdateEngine* engine, std::shared_ptr<const ShardView> view)
    : engine_(engine), view_(std::move(view)) {}

absl::StatusOr<std::unique_ptr<StateLoader>> StateLoader::Begin(
    UpdateEngine* engine, StagingPool* staging, const v1::LoadStateHeader& header,
    const std::function<bool()>& cancelled) {
  std::unique_ptr<StateLoader> l(new StateLoader(engine, engine->view()));
  const ShardView& view = *l->view_;
  if (absl::Status s = CheckPlanHash(view, header.plan_hash(), "header.plan_hash",
                                     /*registering=*/false);
      !s.ok()) {
    return s;
  }
  if (header.tensors().empty()) {
    return absl::InvalidArgumentError("header.tensors is empty: a load names at least one");
  }
  std::vector<ChunkAssembler::Expected> expected[kFields];
  absl::flat_hash_set<uint32_t> seen;
  for (int i = 0; i < header.tensors_size(); ++i) {
    const v1::TensorState& state = header.tensors(i);
    const std::string at = absl::StrCat("header.tensors[", i, "]");
    const std::optional<uint32_t> tensor = view.FindTensor(state.name());
    if (!tensor.has_value()) {
      return absl::NotFoundError(
          absl::StrCat(at, ".name ", QuoteName(state.name()), " is not registered"));
    }
    if (!seen.insert(*tensor).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, ".name names tensor ", QuoteName(state.name()), " a second time"));
    }
    if (state.step() < 0) {
      return absl::InvalidArgumentError(absl::StrCat(at, ".step of ", QuoteName(state.name()),
                                                     " is ", state.step(), "; at least 0"));
    }
    const TensorMeta& meta = view.tensor(*tensor);
    if (meta.hashed.has_value()) {
      // Its slots mean nothing without the index of which key holds which: a checkpoint's
      // restore brings both (docs/checkpoints.md).
      return absl::InvalidArgumentError(
          absl::StrCat(at, ".name ", QuoteName(state.name()),
                       " is a hashed embedding table: LoadState does not write one (restore "
                       "it from a checkpoint)"));
    }
    bool listed[kFields] = {};
    for (int value : state.fields()) {
      const std::optional<TensorField> field = TensorFieldFromProto(value);
      if (!field.has_value()) {
        return absl::InvalidArgumentError(absl::StrCat(at, ".fields of ", QuoteName(state.name()),
                                                       ": ", value, " is not a TensorField"));
      }
      const int f = IndexOf(*field);
      if (listed[f]) {
        return absl::InvalidArgumentError(absl::StrCat(at, ".fields of ", QuoteName(state.name()),
                                                       " lists ", TensorFieldName(*field),
                                                       " a second time"));
      }
      listed[f] = true;
      if (*field == TensorField::kMaxExpAvgSq &&
          !view.groups()[meta.group].hyperparameters.amsgrad) {
        return absl::FailedPreconditionError(absl::StrCat(
            at, ".fields of ", QuoteName(state.name()),
            ": max_exp_avg_sq exists only in param groups with amsgrad, and its group ",
            QuoteName(view.groups()[meta.group].name), " has none"));
      }
      expected[f].push_back({meta.name, meta.numel});
      l->tensors_of_[f].push_back(*tensor);
    }
    l->load_.tensors.push_back(*tensor);
    l->load_.steps.push_back(state.step());
  }
  uint64_t bytes[kFields], total = 0;
  for (int f = 0; f < kFields; ++f) {
    bytes[f] = ChunkAssembler::StagingBytes(expected[f], sizeof(float));
    total += bytes[f];
  }
  absl::StatusOr<StagingPool::Reservation> reserved = staging->Reserve(total, cancelled);
  if (!reserved.ok()) return reserved.status();
  l->window_ = *std::move(reserved);
  // Each field's values in the window, one field after the other (16-byte aligned: every
  // field's bytes are a multiple of 32); without an arena, each assembler holds its own.
  char* memory = l->window_.data();
  for (int f = 0; f < kFields; ++f) {
    if (expected[f].empty()) continue;
    absl::StatusOr<ChunkAssembler> assembler =
        ChunkAssembler::Create(std::move(expected[f]), sizeof(float), memory);
    if (!assembler.ok()) return assembler.status();
    l->fields_[f].emplace(*std::move(assembler));
    if (memory != nullptr) memory += bytes[f];
  }
  return l;
}

absl::Status StateLoader::AddChunks(
    const google::protobuf::RepeatedPtrField<v1::TensorChunk>& chunks) {
  for (const v1::TensorChunk& chunk : chunks) {
    const std::optional<TensorField> field = TensorFieldFromProto(chunk.field());
    if (!field.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("chunks.field of ", QuoteName(chunk.tensor()),
                                                     ": ", static_cast<int>(chunk.field()),
                                                     " is not a TensorField"));
    }
    std::optional<ChunkAssembler>& assembler = fields_[IndexOf(*field)];
    if (!assembler.has_value() || !assembler->Expects(chunk.tensor())) {
      if (!view_->FindTensor(chunk.tensor()).has_value()) {
        return absl::NotFoundError(
            absl::StrCat("chunks.tensor ", QuoteName(chunk.tensor()), " is not registered"));
      }
      return absl::InvalidArgumentError(
          absl::StrCat("chunks.field ", TensorFieldName(*field), " of ", QuoteName(chunk.tensor()),
                       " is not among the fields header.tensors lists for it"));
    }
    if (absl::Status s = assembler->AddChunk(chunk.tensor(), chunk.offset(), chunk.data());
        !s.ok()) {
      return AboutField(s, *field);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> StateLoader::Commit() {
  load_.writes.clear();
  for (int f = 0; f < kFields; ++f) {
    if (!fields_[f].has_value()) continue;
    const TensorField field = static_cast<TensorField>(f + 1);
    if (absl::Status s = fields_[f]->Finish(); !s.ok()) return AboutField(s, field);
    const char* values = static_cast<const char*>(fields_[f]->staging());
    for (size_t i = 0; i < tensors_of_[f].size(); ++i) {
      WriteRequest w;
      w.field = field;
      w.tensor = tensors_of_[f][i];
      w.count = view_->tensor(w.tensor).numel;
      w.src = values + fields_[f]->staging_offsets()[i] * sizeof(float);
      load_.writes.push_back(w);
    }
  }
  return UpdateEngine::Wait<uint64_t>(
      [&](UpdateEngine::Done<uint64_t> done) { engine_->LoadState(&load_, done); });
}

}  // namespace fusedps
