#include "server/models/model.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace fusedps {

absl::Status ValidateModelName(absl::string_view name, absl::string_view field) {
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(field, " '", name, "' ", why));
  };
  if (name.empty() || name.size() > kMaxModelNameBytes) {
    return bad(absl::StrCat("must be 1 to ", kMaxModelNameBytes, " characters"));
  }
  const auto letter_or_digit = [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9');
  };
  if (!letter_or_digit(name[0])) return bad("must start with a letter (a-z) or a digit");
  for (char c : name) {
    if (!letter_or_digit(c) && c != '.' && c != '_' && c != '-') {
      return bad("may hold only a-z, 0-9, '.', '_' and '-'");
    }
  }
  return absl::OkStatus();
}

std::string ModelDirectory(const std::string& root, absl::string_view name) {
  if (root.empty()) return "";
  if (name == kDefaultModel) return root;
  return absl::StrCat(root, "/models/", name);
}

absl::StatusOr<std::unique_ptr<Model>> Model::Make(std::string name, ConsistencyOptions consistency,
                                                   const ModelOptions& options) {
  if (absl::Status s = ValidateConsistency(consistency); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<OptimizerBackend>> backend = options.make_backend();
  if (!backend.ok()) return backend.status();
  if (options.arena.host != nullptr) {
    if (absl::Status s = (*backend)->ShareStagingArena(options.arena); !s.ok()) return s;
  }
  std::unique_ptr<Model> model(new Model());
  model->name_ = std::move(name);
  model->retries_ = std::make_unique<RetryTable>(options.retry_table_clients);
  model->engine_ = std::make_unique<UpdateEngine>(
      *std::move(backend), options.fault, model->retries_.get(), consistency,
      options.metrics != nullptr ? options.metrics->consistency(model->name_) : nullptr);
  model->assemblies_ = std::make_unique<PushAssemblies>(options.push_part_wait);
  if (!options.checkpoint.root.empty()) {
    checkpoint::CheckpointerOptions checkpoint = options.checkpoint;
    checkpoint.root = ModelDirectory(options.checkpoint.root, model->name_);
    checkpoint.model = model->name_;
    model->checkpoint_root_ = checkpoint.root;
    WriterMutexLock lock(&model->checkpointer_mu_);  // Free: no other thread sees it yet.
    model->checkpointer_ = std::make_unique<checkpoint::Checkpointer>(
        model->engine_.get(), options.metrics, std::move(checkpoint));
  }
  return model;
}

Model::~Model() {
  StopCheckpoints();
  assemblies_.reset();
  engine_.reset();
  retries_.reset();
}

uint64_t Model::memory_bytes() const {
  uint64_t bytes = 0;
  for (const auto& [kind, b] : engine_->memory_bytes()) bytes += b;
  return bytes;
}

absl::Status Model::DeletedError() const {
  return absl::NotFoundError(absl::StrCat("model '", name_, "' was deleted"));
}

absl::StatusOr<checkpoint::CheckpointResult> Model::CheckpointNow() {
  ReaderMutexLock lock(&checkpointer_mu_);
  if (deleted()) return DeletedError();
  if (checkpointer_ == nullptr) {
    return absl::FailedPreconditionError(
        "the server has no --checkpoint-dir, so it cannot write a checkpoint");
  }
  return checkpointer_->CheckpointNow();
}

void Model::Restored(const checkpoint::CheckpointResult& result) {
  ReaderMutexLock lock(&checkpointer_mu_);
  if (checkpointer_ != nullptr) checkpointer_->Restored(result);
}

void Model::StartCheckpoints() {
  ReaderMutexLock lock(&checkpointer_mu_);
  if (checkpointer_ != nullptr) checkpointer_->Start();
}

void Model::StopCheckpoints() {
  // Waits for the checkpoints asked for to be written; the destructor lets the one in
  // progress finish.
  WriterMutexLock lock(&checkpointer_mu_);
  checkpointer_.reset();
}

}  // namespace fusedps
