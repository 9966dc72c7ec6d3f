#include "server/models/model_files.h"

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/file_io.h"
#include "common/logging.h"
#include "nlohmann/json.hpp"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/checkpoint/shard_files.h"

namespace fusedps {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr char kModelsDir[] = "models";
constexpr char kModelFile[] = "model.json";
constexpr char kDeletedPrefix[] = ".deleted-";

json ToJson(const ConsistencyOptions& c) {
  return {{"mode", ConsistencyModeName(c.mode)},
          {"replicas_to_aggregate", c.replicas_to_aggregate},
          {"total_replicas", c.total_replicas},
          {"round_timeout_seconds", absl::ToDoubleSeconds(c.round_timeout)},
          {"max_staleness", c.max_staleness},
          {"staleness_lr_scaling", c.staleness_lr_scaling}};
}

absl::StatusOr<ConsistencyOptions> ConsistencyFromJson(const json& j) {
  ConsistencyOptions c;
  absl::StatusOr<ConsistencyMode> mode = ParseConsistencyMode(j.at("mode").get<std::string>());
  if (!mode.ok()) return mode.status();
  c.mode = *mode;
  c.replicas_to_aggregate = j.at("replicas_to_aggregate").get<uint32_t>();
  c.total_replicas = j.at("total_replicas").get<uint32_t>();
  c.round_timeout = absl::Seconds(j.at("round_timeout_seconds").get<double>());
  c.max_staleness = j.at("max_staleness").get<uint64_t>();
  c.staleness_lr_scaling = j.at("staleness_lr_scaling").get<bool>();
  if (absl::Status s = ValidateConsistency(c); !s.ok()) return s;
  return c;
}

// A fresh .deleted-* path under `parent`.
std::string TrashPath(const std::string& parent, const std::string& name) {
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  return absl::StrCat(parent, "/", kDeletedPrefix, name, "-",
                      std::chrono::duration_cast<std::chrono::nanoseconds>(now).count());
}

void RemoveTrash(const std::string& path) {
  std::error_code error;
  fs::remove_all(path, error);
  if (error) LOG(WARNING) << "cannot remove " << path << ": " << error.message();
}

}  // namespace

absl::StatusOr<std::vector<ModelFile>> ReadModelFiles(const std::string& root) {
  std::vector<ModelFile> models;
  for (const std::string& parent : {root, absl::StrCat(root, "/", kModelsDir)}) {
    std::error_code error;
    for (const fs::directory_entry& entry : fs::directory_iterator(parent, error)) {
      if (absl::StartsWith(entry.path().filename().string(), kDeletedPrefix)) {
        RemoveTrash(entry.path().string());
      }
    }
  }
  const std::string models_dir = absl::StrCat(root, "/", kModelsDir);
  std::error_code error;
  for (const fs::directory_entry& entry : fs::directory_iterator(models_dir, error)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_directory() || !ValidateModelName(name).ok() || name == kDefaultModel) continue;
    const std::string path = absl::StrCat(entry.path().string(), "/", kModelFile);
    absl::StatusOr<std::string> text = file_io::ReadFile(path);
    if (absl::IsNotFound(text.status())) continue;  // Its creation did not finish.
    const auto lost = [&](absl::string_view why) {
      return absl::DataLossError(absl::StrCat(path, ": ", why));
    };
    if (!text.ok()) return lost(text.status().message());
    json j = json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) return lost("not a JSON object");
    try {
      if (j.at("name").get<std::string>() != name) return lost("names another model");
      absl::StatusOr<ConsistencyOptions> consistency = ConsistencyFromJson(j.at("consistency"));
      if (!consistency.ok()) return lost(consistency.status().message());
      models.push_back({name, *consistency});
    } catch (const json::exception& e) {
      return lost(e.what());
    }
  }
  std::sort(models.begin(), models.end(),
            [](const ModelFile& a, const ModelFile& b) { return a.name < b.name; });
  return models;
}

absl::Status WriteModelFile(const std::string& root, const ModelFile& model) {
  const std::string directory = ModelDirectory(root, model.name);
  std::error_code error;
  fs::create_directories(directory, error);
  if (error) return absl::ErrnoToStatus(error.value(), absl::StrCat("cannot create ", directory));
  const std::string path = absl::StrCat(directory, "/", kModelFile);
  const std::string tmp = absl::StrCat(path, ".tmp");
  const std::string text =
      json{{"name", model.name}, {"consistency", ToJson(model.consistency)}}.dump(2) + "\n";
  {
    file_io::Fd fd(open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (fd.get() < 0) return file_io::Errno("cannot create", tmp);
    if (absl::Status s = file_io::WriteAll(fd.get(), text.data(), text.size(), tmp); !s.ok()) {
      return s;
    }
    if (fsync(fd.get()) != 0) return file_io::Errno("cannot fsync", tmp);
    if (absl::Status s = fd.Close(tmp); !s.ok()) return s;
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) return file_io::Errno("cannot rename", tmp);
  if (absl::Status s = file_io::SyncPath(directory); !s.ok()) return s;
  const std::string models_dir = absl::StrCat(root, "/", kModelsDir);
  if (absl::Status s = file_io::SyncPath(models_dir); !s.ok()) return s;
  return file_io::SyncPath(root);
}

absl::Status RemoveModelFiles(const std::string& root, const std::string& name) {
  if (name != kDefaultModel) {
    const std::string directory = ModelDirectory(root, name);
    const std::string parent = absl::StrCat(root, "/", kModelsDir);
    if (access(directory.c_str(), F_OK) != 0) return absl::OkStatus();  // Nothing written.
    const std::string trash = TrashPath(parent, name);
    if (rename(directory.c_str(), trash.c_str()) != 0) {
      return file_io::Errno("cannot rename", directory);
    }
    if (absl::Status s = file_io::SyncPath(parent); !s.ok()) return s;
    RemoveTrash(trash);
    return absl::OkStatus();
  }
  // The default model: its checkpoints, oldest first, then `latest`.
  std::vector<std::pair<uint64_t, std::string>> checkpoints = checkpoint::ListCheckpoints(root);
  if (checkpoints.empty()) return absl::OkStatus();
  const std::string trash = TrashPath(root, name);
  if (mkdir(trash.c_str(), 0755) != 0) return file_io::Errno("cannot create", trash);
  std::reverse(checkpoints.begin(), checkpoints.end());
  for (const auto& [serial, directory] : checkpoints) {
    const std::string to = absl::StrCat(trash, "/", checkpoint::DirectoryName(serial));
    if (rename(directory.c_str(), to.c_str()) != 0) {
      return file_io::Errno("cannot rename", directory);
    }
    if (absl::Status s = file_io::SyncPath(root); !s.ok()) return s;
  }
  const std::string latest = absl::StrCat(root, "/", checkpoint::kLatestName);
  if (unlink(latest.c_str()) != 0 && errno != ENOENT) {
    LOG(WARNING) << "cannot remove " << latest << ": " << strerror(errno);
  }
  RemoveTrash(trash);
  return file_io::SyncPath(root);
}

absl::Status RestoreModel(Model& model, const std::string& restore, Metrics* metrics) {
  const std::string& root = model.checkpoint_root();
  if (restore == "none" || (restore == "latest" && root.empty())) return absl::OkStatus();
  UpdateEngine& engine = model.engine();
  const auto start = std::chrono::steady_clock::now();
  uint64_t bytes = 0;
  const auto load = [&](const checkpoint::Loaded& c) -> absl::Status {
    absl::StatusOr<std::unique_ptr<checkpoint::ShardReader>> reader =
        checkpoint::ShardReader::Open(c, &engine);
    if (!reader.ok()) return reader.status();
    absl::StatusOr<uint64_t> version =
        UpdateEngine::Wait<uint64_t>([&](UpdateEngine::Done<uint64_t> done) {
          engine.Restore(&(*reader)->shard(), reader->get(), done);
        });
    if (!version.ok()) {
      // A restore that failed is undone (DATA_LOSS: the next older checkpoint is tried), but
      // after a device fault, which stops the server.
      return absl::Status(version.status().code(), absl::StrCat("restoring ", c.directory, ": ",
                                                                version.status().message()));
    }
    bytes = (*reader)->bytes();
    return absl::OkStatus();
  };
  absl::StatusOr<checkpoint::Loaded> loaded;
  if (restore == "latest") {
    loaded = checkpoint::LoadLatestGood(
        root, load, [](const std::string& directory, const absl::Status& why) {
          LOG(ERROR) << "checkpoint " << directory << " is skipped: " << why;
        });
    if (absl::IsNotFound(loaded.status())) {
      LOG(INFO) << "model '" << model.name() << "': no complete checkpoint under " << root
                << ": it starts empty";
      return absl::OkStatus();
    }
  } else {
    loaded = checkpoint::ReadManifest(restore);
    if (loaded.ok()) {
      if (absl::Status s = load(*loaded); !s.ok()) loaded = s;
    }
  }
  if (!loaded.ok()) {
    return absl::Status(loaded.status().code(),
                        absl::StrCat("--restore=", restore, ": ", loaded.status().message()));
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (metrics != nullptr) metrics->RecordCheckpointPhase("restore", seconds);
  LOG(INFO) << "model '" << model.name() << "': restored version " << loaded->version << " from "
            << loaded->directory << ": " << bytes << " bytes in " << seconds << " s ("
            << bytes / std::max(seconds, 1e-9) / 1e9 << " GB/s)";
  if (restore == "latest") model.Restored({loaded->version, loaded->directory});
  return absl::OkStatus();
}

}  // namespace fusedps
