// model_files.h: models on disk, under the server's checkpoint root (--checkpoint-dir), so that
// creating and deleting a model survive a restart.
//
// Layout under the root (checkpoint_dir.h says what a checkpoint directory holds):
//   checkpoint-<serial>/, latest   the "default" model's checkpoints (as before models existed)
//   models/<name>/model.json       model <name> exists: its name and consistency options,
//                                  written durably (tmp, fsync, rename, fsync of the directory)
//                                  when it is created
//   models/<name>/checkpoint-*/    its checkpoints
//   .deleted-*                     a model's files being removed: moved here in one rename,
//                                  then removed; a restart removes any it finds
//
// A model is deleted durably by renaming its directory to a .deleted-* name (one rename, then
// an fsync of the parent): a crash before the rename leaves the model as it was, after it the
// model is gone. The default model's checkpoints lie in the root itself, beside the others'
// directories: they are moved to a .deleted-* directory oldest first, so that a crash half-way
// leaves the newest ones, and a restart restores the model as it was before the delete began
// (which the caller never saw succeed).
#ifndef FUSEDPS_SERVER_MODELS_MODEL_FILES_H_
#define FUSEDPS_SERVER_MODELS_MODEL_FILES_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/engine/consistency.h"
#include "server/metrics/metrics.h"
#include "server/models/model.h"

namespace fusedps {

struct ModelFile {
  std::string name;
  ConsistencyOptions consistency;
};

// The models under root (models/*/model.json), by name; removes .deleted-* leftovers first.
// Errors: DATA_LOSS naming the file for a model.json that cannot be read or parsed, or that
// names another model than its directory.
absl::StatusOr<std::vector<ModelFile>> ReadModelFiles(const std::string& root);

// Records model `model.name` under root, durably. Errors: the errno's status.
absl::Status WriteModelFile(const std::string& root, const ModelFile& model);

// Removes model `name`'s files under root durably (above); for "default" its checkpoints.
// Errors: the errno's status of the rename or the fsync (the model's files are then as they
// were, or for "default" some of its oldest checkpoints are gone). A removal that fails after
// the rename is only logged.
absl::Status RemoveModelFiles(const std::string& root, const std::string& name);

// Loads `model` (empty) as `restore` says: "latest" (its newest good checkpoint under
// Model::checkpoint_root, or nothing when there is none or no root), "none" (nothing), or a
// checkpoint directory's path (which must load). Records the restore's time in `metrics`.
// Errors: the checkpoint's (DATA_LOSS, FAILED_PRECONDITION, ...), prefixed with
// "--restore=<restore>"; INTERNAL after a device fault.
absl::Status RestoreModel(Model& model, const std::string& restore, Metrics* metrics);

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_MODELS_MODEL_FILES_H_
