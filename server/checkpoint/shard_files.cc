#include "server/checkpoint/shard_files.h"

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/file_io.h"
#include "kernels/quant_math.h"
#include "nlohmann/json.hpp"
#include "server/schema/hyperparameters.h"

namespace fusedps::checkpoint {
namespace {

using nlohmann::json;

// A group: its name, and its hyperparameters in protobuf's JSON mapping of
// fusedps.v1.Hyperparameters (format_version 3).
json GroupJson(const ParamGroupSpec& g) {
  return {{"name", g.name},
          {"hyperparameters", json::parse(HyperparametersToJson(g.hyperparameters))}};
}

json ManifestBody(const CheckpointSnapshot& snapshot, const WriteSettings& settings) {
  const ShardCut& cut = snapshot.cut;
  json groups = json::array();
  for (const ParamGroupSpec& g : cut.view->groups()) groups.push_back(GroupJson(g));
  json tensors = json::array();
  bool int8_state = false;
  for (uint32_t t = 0; t < cut.view->tensor_count(); ++t) {
    const TensorMeta& m = cut.view->tensor(t);
    const TensorLayout layout = cut.view->layout(t);
    int8_state |= layout.state == StateDType::kInt8;
    tensors.push_back({{"name", m.name},
                       {"shape", m.shape},
                       {"param_group", cut.view->groups()[m.group].name},
                       {"step", cut.steps[t]},
                       {"params_dtype", ParamsDTypeName(layout.params)},
                       {"state_dtype", StateDTypeName(layout.state)}});
  }
  json retries = json::array();
  for (const RetryTable::ClientRecord& r : cut.retries) {
    json replies = json::array();
    for (const auto& [sequence_number, reply] : r.replies) {
      replies.push_back({{"sequence_number", sequence_number},
                         {"version", reply.version},
                         {"skipped", reply.skipped},
                         {"tensors_updated", reply.tensors_updated},
                         {"grad_bytes", reply.grad_bytes},
                         {"round_workers", reply.round_workers},
                         {"round_timed_out", reply.round_timed_out},
                         {"missing_replicas", reply.missing_replicas}});
    }
    retries.push_back({{"client_id", r.client_id}, {"highest", r.highest}, {"replies", replies}});
  }
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  json body = {{"server_version", settings.server_version},
               {"created_unix_seconds", now},
               {"param_copy_dtype", ParamCopyDTypeName(settings.param_copy_dtype)},
               {"plan_hash", cut.view->plan_hash()},
               {"param_groups", groups},
               {"tensors", tensors},
               {"retry_table", retries}};
  if (int8_state) body["int8_codebooks"] = Int8CodebooksJson();
  return body;
}

// The tensors of one field as safetensors views, in their stored form; their data from a full
// snapshot, if any.
std::vector<safetensors::TensorView> ViewsOf(const CheckpointSnapshot& snapshot,
                                             const SnapshotField& field, ParamCopyDType copy) {
  std::vector<safetensors::TensorView> views;
  const ShardView& view = *snapshot.cut.view;
  for (size_t i = 0; i < field.tensors.size(); ++i) {
    const uint32_t t = field.tensors[i];
    const TensorMeta& m = view.tensor(t);
    safetensors::TensorView v{m.name, DTypeOf(field, view.layout(t), copy), ShapeOf(field, m), {}};
    if (snapshot.data != nullptr) {
      v.data =
          absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(snapshot.data + field.offsets[i]),
                              StoredBytes(view, field, t));
    }
    views.push_back(std::move(v));
  }
  return views;
}

// One field's file from a fenced snapshot: tensors read through the fence a buffer at a time.
absl::StatusOr<safetensors::WriteResult> WriteFenced(const CheckpointSnapshot& snapshot,
                                                     const SnapshotField& field,
                                                     const WriteSettings& settings,
                                                     const std::string& path) {
  const std::vector<safetensors::TensorView> views =
      ViewsOf(snapshot, field, settings.param_copy_dtype);
  absl::StatusOr<safetensors::Writer> writer =
      safetensors::Writer::Create(path, views, {{}, /*fsync=*/true, /*data_appended=*/true});
  if (!writer.ok()) return writer.status();
  const ShardView& view = *snapshot.cut.view;
  const auto stored_end = [&](size_t i) {  // Where tensor i's data ends in the snapshot.
    return field.offsets[i] + StoredBytes(view, field, field.tensors[i]);
  };
  for (size_t begin = 0; begin < field.tensors.size();) {
    size_t end = begin + 1;
    while (end < field.tensors.size() &&
           stored_end(end) - field.offsets[begin] <= settings.fence_buffer_bytes) {
      ++end;
    }
    if (stored_end(end - 1) - field.offsets[begin] > settings.fence_buffer_bytes) {
      return absl::InternalError(absl::StrCat("tensor ", views[begin].name, " does not fit the ",
                                              settings.fence_buffer_bytes,
                                              "-byte snapshot buffer"));
    }
    if (absl::Status s = snapshot.fence->Read(field, begin, end, settings.fence_buffer); !s.ok()) {
      return s;
    }
    for (size_t i = begin; i < end; ++i) {
      const uint64_t bytes = StoredBytes(view, field, field.tensors[i]);
      if (absl::Status s = writer->Append(
              settings.fence_buffer + (field.offsets[i] - field.offsets[begin]), bytes);
          !s.ok()) {
        return s;
      }
    }
    begin = end;
  }
  return writer->Finish();
}

// The buffers' file, kBuffersFileName: each buffer as it is, in name order.
absl::StatusOr<safetensors::WriteResult> WriteBuffers(const BufferSet& buffers,
                                                      const std::string& path) {
  std::vector<safetensors::TensorView> views;
  for (const auto& [name, b] : buffers.buffers()) {
    views.push_back(
        {b->name, b->dtype, b->shape,
         absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(b->data.data()), b->data.size())});
  }
  return safetensors::WriteFile(path, views, {{}, /*fsync=*/true});
}

}  // namespace

std::string FileOf(const SnapshotField& field) { return absl::StrCat(field.name, ".safetensors"); }

safetensors::DType DTypeOf(const SnapshotField& field, TensorLayout layout, ParamCopyDType copy) {
  if (field.param_copy) {
    return copy == ParamCopyDType::kFloat16 ? safetensors::DType::kF16 : safetensors::DType::kBF16;
  }
  switch (StoredElementBytes(layout, field.field)) {
    case 1:
      return safetensors::DType::kU8;
    case 2:
      return safetensors::DType::kBF16;
    default:
      return safetensors::DType::kF32;
  }
}

std::vector<int64_t> ShapeOf(const SnapshotField& field, const TensorMeta& tensor) {
  if (field.field == TensorField::kExpAvgAbsmax || field.field == TensorField::kExpAvgSqAbsmax) {
    return {static_cast<int64_t>(QuantBlocks(tensor.numel))};
  }
  return tensor.shape;
}

json Int8CodebooksJson() {
  const auto values = [](const QuantCodebook& book) {
    json out = json::array();
    // A float's double is exact, and nlohmann prints doubles so that they read back the same.
    for (float v : book.values) out.push_back(static_cast<double>(v));
    return out;
  };
  const Int8Codebooks& books = DynamicCodebooks();
  return {{"exp_avg", values(books.exp_avg)}, {"exp_avg_sq", values(books.exp_avg_sq)}};
}

absl::StatusOr<Written> WriteCheckpoint(const CheckpointSnapshot& snapshot,
                                        const WriteSettings& settings) {
  absl::StatusOr<PendingCheckpoint> pending =
      PendingCheckpoint::Begin(settings.root, snapshot.cut.version);
  if (!pending.ok()) return pending.status();
  const size_t n = snapshot.fields.size();
  std::vector<absl::StatusOr<safetensors::WriteResult>> results(n,
                                                                absl::UnknownError("not written"));
  const auto write = [&](size_t i) {
    const SnapshotField& field = snapshot.fields[i];
    const std::string path = pending->PathOf(FileOf(field));
    if (snapshot.fence != nullptr) {
      results[i] = WriteFenced(snapshot, field, settings, path);
    } else {
      results[i] = safetensors::WriteFile(path, ViewsOf(snapshot, field, settings.param_copy_dtype),
                                          {{}, /*fsync=*/true});
    }
  };
  if (snapshot.fence != nullptr) {
    for (size_t i = 0; i < n; ++i) write(i);  // One buffer: one file at a time.
  } else {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < n; ++i) threads.emplace_back(write, i);
    for (std::thread& t : threads) t.join();
  }
  Written written{pending->directory(), pending->serial(), snapshot.cut.version, 0};
  // A failed checkpoint gives its space back (a full disk stays usable for the next one).
  const auto abandon = [&](const absl::Status& s) {
    std::error_code error;
    std::filesystem::remove_all(pending->directory(), error);
    return s;
  };
  for (size_t i = 0; i < n; ++i) {
    if (!results[i].ok()) return abandon(results[i].status());
    if (absl::Status s =
            pending->AddFile(FileOf(snapshot.fields[i]), results[i]->bytes, results[i]->crc32);
        !s.ok()) {
      return s;
    }
    written.bytes += results[i]->bytes;
  }
  if (snapshot.cut.buffers != nullptr && !snapshot.cut.buffers->empty()) {
    absl::StatusOr<safetensors::WriteResult> buffers =
        WriteBuffers(*snapshot.cut.buffers, pending->PathOf(kBuffersFileName));
    if (!buffers.ok()) return abandon(buffers.status());
    if (absl::Status s = pending->AddFile(kBuffersFileName, buffers->bytes, buffers->crc32);
        !s.ok()) {
      return s;
    }
    written.bytes += buffers->bytes;
  }
  absl::StatusOr<uint64_t> manifest_bytes =
      pending->Commit(ManifestBody(snapshot, settings), settings.keep);
  // A commit that failed after its manifest's rename leaves a complete checkpoint: keep it.
  if (!manifest_bytes.ok()) {
    if (access(pending->PathOf(kManifestName).c_str(), F_OK) == 0) return manifest_bytes.status();
    return abandon(manifest_bytes.status());
  }
  written.bytes += *manifest_bytes;
  return written;
}

}  // namespace fusedps::checkpoint
