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
#include "server/checkpoint/hashed_tables_file.h"
#include "server/schema/hyperparameters.h"

namespace fusedps::checkpoint {
namespace {

using Manifest = v1::CheckpointManifest;

// The manifest without what PendingCheckpoint::Commit adds (format, serial, version, files).
Manifest ManifestBody(const CheckpointSnapshot& snapshot, const WriteSettings& settings) {
  const ShardCut& cut = snapshot.cut;
  Manifest body;
  body.set_server_version(settings.server_version);
  body.set_created_unix_seconds(
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  // ParamCopyDType has the proto's codes, kNone DTYPE_UNSPECIFIED (server/schema's asserts).
  body.set_param_copy_dtype(static_cast<v1::DType>(settings.param_copy_dtype));
  body.set_plan_hash(cut.view->plan_hash());
  for (const ParamGroupSpec& g : cut.view->groups()) {
    v1::ParamGroup* group = body.add_param_groups();
    group->set_name(g.name);
    *group->mutable_hyperparameters() = HyperparametersToProto(g.hyperparameters);
  }
  bool int8_state = false;
  for (uint32_t t = 0; t < cut.view->tensor_count(); ++t) {
    const TensorMeta& m = cut.view->tensor(t);
    const TensorLayout layout = cut.view->layout(t);
    int8_state |= layout.state == StateDType::kInt8;
    Manifest::Tensor* tensor = body.add_tensors();
    tensor->set_name(m.name);
    for (int64_t d : m.shape) tensor->add_shape(d);
    tensor->set_param_group(cut.view->groups()[m.group].name);
    tensor->set_step(cut.steps[t]);
    // The kernels' dtype enums take the proto's values (server/schema/hyperparameters.cc).
    tensor->set_params_dtype(static_cast<v1::DType>(layout.params));
    tensor->set_state_dtype(static_cast<v1::StateDType>(layout.state));
    tensor->set_table(m.table);
    if (m.hashed.has_value()) {
      const auto index = cut.hashed_tables.find(t);
      *tensor->mutable_hashed() = HashedTableToManifest(
          *m.hashed, index != cut.hashed_tables.end() ? index->second : HashedRowIndexState{});
    }
  }
  for (const RetryTable::ClientRecord& r : cut.retries) {
    Manifest::RetryClient* client = body.add_retry_table();
    client->set_client_id(r.client_id);
    client->set_highest(r.highest);
    for (const auto& [sequence_number, reply] : r.replies) {
      Manifest::Reply* out = client->add_replies();
      out->set_sequence_number(sequence_number);
      out->set_version(reply.version);
      out->set_skipped(reply.skipped);
      out->set_tensors_updated(reply.tensors_updated);
      out->set_grad_bytes(reply.grad_bytes);
      out->set_round_workers(reply.round_workers);
      out->set_round_timed_out(reply.round_timed_out);
      for (const std::string& id : reply.missing_replicas) out->add_missing_replicas(id);
    }
  }
  if (int8_state) *body.mutable_int8_codebooks() = ManifestCodebooks();
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
    // A scale per block of 256 elements, or per row of a table (tensor_layout.h).
    TensorLayout int8;
    int8.state = StateDType::kInt8;
    int8.scale_block = tensor.table ? tensor.table_dim() : kQuantBlock;
    return {static_cast<int64_t>(ScaleCount(int8, tensor.numel))};
  }
  return tensor.shape;
}

Manifest::Int8Codebooks ManifestCodebooks() {
  const Int8Codebooks& books = DynamicCodebooks();
  Manifest::Int8Codebooks out;
  for (float v : books.exp_avg.values) out.add_exp_avg(v);
  for (float v : books.exp_avg_sq.values) out.add_exp_avg_sq(v);
  return out;
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
  if (!snapshot.cut.hashed_tables.empty()) {
    absl::StatusOr<safetensors::WriteResult> hashed =
        WriteHashedTables(snapshot.cut, pending->PathOf(kHashedTablesFileName));
    if (!hashed.ok()) return abandon(hashed.status());
    if (absl::Status s = pending->AddFile(kHashedTablesFileName, hashed->bytes, hashed->crc32);
        !s.ok()) {
      return s;
    }
    written.bytes += hashed->bytes;
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
