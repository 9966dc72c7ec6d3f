#include "server/models/model_registry.h"

#include <chrono>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "server/models/model_files.h"

namespace fusedps {
namespace {

bool SameConsistency(const ConsistencyOptions& a, const ConsistencyOptions& b) {
  if (a.mode != b.mode) return false;
  switch (a.mode) {
    case ConsistencyMode::kSync:
      return a.replicas_to_aggregate == b.replicas_to_aggregate &&
             a.total_replicas == b.total_replicas && a.round_timeout == b.round_timeout;
    case ConsistencyMode::kBounded:
      return a.max_staleness == b.max_staleness && a.staleness_lr_scaling == b.staleness_lr_scaling;
    case ConsistencyMode::kAsync:
      return true;
  }
  return true;
}

std::string Describe(const ConsistencyOptions& c) {
  switch (c.mode) {
    case ConsistencyMode::kSync:
      return absl::StrCat("sync (replicas_to_aggregate ", c.replicas_to_aggregate,
                          ", total_replicas ", c.total_replicas, ", round_timeout ",
                          absl::FormatDuration(c.round_timeout), ")");
    case ConsistencyMode::kBounded:
      return absl::StrCat("bounded (max_staleness ", c.max_staleness,
                          c.staleness_lr_scaling ? ", staleness_lr_scaling" : "", ")");
    case ConsistencyMode::kAsync:
      break;
  }
  return "async";
}

// Waits until `model` has no holder but the caller, or `deadline`; true when it has none.
// Out of the registry's map (or with no calls left), no holder can appear, so a count of 1
// stays 1.
bool WaitUntilSole(const std::shared_ptr<Model>& model, absl::Time deadline) {
  while (model.use_count() > 1 && absl::Now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return model.use_count() == 1;
}

}  // namespace

ModelRegistry::ModelRegistry(ModelOptions options, ConsistencyOptions default_consistency)
    : options_(std::move(options)), default_consistency_(default_consistency) {}

ModelRegistry::~ModelRegistry() {
  std::map<std::string, std::shared_ptr<Model>, std::less<>> models;
  std::vector<std::shared_ptr<Model>> held;
  {
    MutexLock lock(&mu_);
    models.swap(models_);
    held.swap(held_);
  }
  // No call holds a model any more (the gRPC server is gone), but the engines' last callbacks
  // may still hold one (a push's assembly holds its model): each is destroyed here, once it is
  // the last holder, never on its own engine's threads.
  for (auto& [name, model] : models) held.push_back(std::move(model));
  for (std::shared_ptr<Model>& model : held) {
    while (!WaitUntilSole(model, absl::Now() + absl::Seconds(10))) {
      LOG(WARNING) << "model '" << model->name() << "' is still held " << model.use_count() - 1
                   << " times at shutdown; waiting";
    }
    model.reset();  // Drains its engine and frees its backend's memory.
  }
}

absl::StatusOr<std::shared_ptr<Model>> ModelRegistry::Make(const std::string& name,
                                                           const ConsistencyOptions& consistency,
                                                           const std::string& restore) {
  absl::StatusOr<std::unique_ptr<Model>> made = Model::Make(name, consistency, options_);
  if (!made.ok()) {
    return absl::Status(made.status().code(),
                        absl::StrCat("model '", name, "': ", made.status().message()));
  }
  std::shared_ptr<Model> model = *std::move(made);
  if (absl::Status s = RestoreModel(*model, restore, options_.metrics); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("model '", name, "': ", s.message()));
  }
  return model;
}

absl::Status ModelRegistry::Open(const std::string& restore) {
  MutexLock admin(&admin_mu_);
  const std::string& root = options_.checkpoint.root;
  std::vector<ModelFile> files;
  if (!root.empty()) {
    absl::StatusOr<std::vector<ModelFile>> read = ReadModelFiles(root);
    if (!read.ok()) return read.status();
    files = *std::move(read);
  }
  files.insert(files.begin(), ModelFile{kDefaultModel, default_consistency_});
  for (const ModelFile& file : files) {
    const std::string model_restore =
        file.name == kDefaultModel || restore == "none" ? restore : "latest";
    absl::StatusOr<std::shared_ptr<Model>> model = Make(file.name, file.consistency, model_restore);
    if (!model.ok()) return model.status();
    MutexLock lock(&mu_);
    models_[file.name] = *std::move(model);
  }
  return absl::OkStatus();
}

void ModelRegistry::StartCheckpoints() {
  for (const std::shared_ptr<Model>& model : List()) model->StartCheckpoints();
}

absl::StatusOr<std::shared_ptr<Model>> ModelRegistry::Find(absl::string_view name) const {
  if (name.empty()) name = kDefaultModel;
  {
    MutexLock lock(&mu_);
    auto it = models_.find(name);
    if (it != models_.end()) return it->second;
  }
  if (absl::Status s = ValidateModelName(name); !s.ok()) return s;
  return absl::NotFoundError(absl::StrCat(
      "model '", name, "' does not exist on this server: create it first (CreateModel; ",
      "`fusedps models create ", name, "`; Client.create_model)"));
}

absl::StatusOr<ModelRegistry::Created> ModelRegistry::Create(
    const std::string& name, std::optional<ConsistencyOptions> consistency) {
  if (absl::Status s = ValidateModelName(name, "CreateModelRequest.name"); !s.ok()) return s;
  const ConsistencyOptions wanted = consistency.value_or(default_consistency_);
  if (absl::Status s = ValidateConsistency(wanted); !s.ok()) return s;
  MutexLock admin(&admin_mu_);
  ReapHeld();
  {
    MutexLock lock(&mu_);
    auto it = models_.find(name);
    if (it != models_.end()) {
      const ConsistencyOptions& has = it->second->engine().consistency();
      if (consistency.has_value() && !SameConsistency(has, wanted)) {
        return absl::AlreadyExistsError(
            absl::StrCat("model '", name, "' exists with consistency ", Describe(has), ", not ",
                         Describe(wanted), ": delete it first, or create it under another name"));
      }
      return Created{it->second, false};
    }
  }
  const std::string& root = options_.checkpoint.root;
  if (!root.empty()) {
    if (absl::Status s = WriteModelFile(root, {name, wanted}); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("model '", name, "': ", s.message()));
    }
  }
  absl::StatusOr<std::shared_ptr<Model>> model = Make(name, wanted, "none");
  if (!model.ok()) {
    if (!root.empty()) RemoveModelFiles(root, name).IgnoreError();
    return model.status();
  }
  (*model)->StartCheckpoints();
  {
    MutexLock lock(&mu_);
    models_[name] = *model;
  }
  LOG(INFO) << "model '" << name << "' created (" << Describe(wanted) << ")";
  return Created{*std::move(model), true};
}

std::vector<std::shared_ptr<Model>> ModelRegistry::List() const {
  std::vector<std::shared_ptr<Model>> models;
  MutexLock lock(&mu_);
  models.reserve(models_.size());
  for (const auto& [name, model] : models_) models.push_back(model);
  return models;
}

absl::StatusOr<ModelRegistry::Deleted> ModelRegistry::Delete(const std::string& name,
                                                             absl::Time deadline) {
  MutexLock admin(&admin_mu_);
  ReapHeld();
  std::shared_ptr<Model> model;
  {
    MutexLock lock(&mu_);
    auto it = models_.find(name);
    if (it == models_.end()) {
      if (absl::Status s = ValidateModelName(name, "DeleteModelRequest.name"); !s.ok()) return s;
      return absl::NotFoundError(absl::StrCat("model '", name, "' does not exist"));
    }
    model = std::move(it->second);
    models_.erase(it);
  }
  model->MarkDeleted();
  Deleted deleted;
  deleted.freed_bytes = model->memory_bytes();
  model->StopCheckpoints();
  absl::Status files = absl::OkStatus();
  if (!options_.checkpoint.root.empty()) {
    files = RemoveModelFiles(options_.checkpoint.root, name);
  }
  // The calls in flight finish quickly (or fail with NOT_FOUND): wait for them to let go.
  if (WaitUntilSole(model, deadline)) {
    Destroy(std::move(model));
    deleted.memory_freed = true;
  } else {
    LOG(WARNING) << "model '" << name << "' deleted; calls still hold it, so its "
                 << deleted.freed_bytes << " bytes are freed when they are done";
    MutexLock lock(&mu_);
    held_.push_back(std::move(model));
  }
  if (name == kDefaultModel) {
    absl::StatusOr<std::shared_ptr<Model>> fresh = Make(name, default_consistency_, "none");
    if (!fresh.ok()) return fresh.status();
    (*fresh)->StartCheckpoints();
    MutexLock lock(&mu_);
    models_[name] = *std::move(fresh);
  }
  if (!files.ok()) {
    return absl::Status(files.code(),
                        absl::StrCat("model '", name, "' is deleted from the running server, ",
                                     "but its files could not be removed (a restart may bring ",
                                     "it back): ", files.message()));
  }
  LOG(INFO) << "model '" << name << "' deleted (" << deleted.freed_bytes << " bytes)";
  return deleted;
}

void ModelRegistry::Destroy(std::shared_ptr<Model> model) {
  const std::map<std::string, uint64_t> launches = model->engine().launch_counts();
  const uint64_t evictions = model->retries().evictions();
  model.reset();  // Drains the engine and frees the backend's memory.
  MutexLock lock(&mu_);
  for (const auto& [kernel, count] : launches) retired_.kernel_launches[kernel] += count;
  retired_.retry_table_evictions += evictions;
}

void ModelRegistry::ReapHeld() {
  std::vector<std::shared_ptr<Model>> free;
  {
    MutexLock lock(&mu_);
    for (auto it = held_.begin(); it != held_.end();) {
      // Out of the map, a model can gain no holder: a count of 1 stays 1.
      if (it->use_count() == 1) {
        free.push_back(std::move(*it));
        it = held_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (std::shared_ptr<Model>& model : free) Destroy(std::move(model));
}

ModelRegistry::Retired ModelRegistry::retired() const {
  MutexLock lock(&mu_);
  return retired_;
}

}  // namespace fusedps
