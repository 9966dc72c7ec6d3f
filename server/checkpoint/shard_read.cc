// ShardReader (shard_files.h): a checkpoint's manifest and file headers checked, then its data
// read by one thread per file into page-locked buffers that UpdateEngine::Restore uploads as
// they fill. The manifest comes as the message (Loaded::manifest, whatever the file's format:
// manifest.h), and may come from another tool (fusedps.checkpoint.from_torch), so it is held
// to the rules registration holds a client to.
#include <algorithm>
#include <initializer_list>
#include <set>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_io.h"
#include "common/mutex.h"
#include "kernels/quant_math.h"
#include "server/checkpoint/hashed_tables_file.h"
#include "server/checkpoint/shard_files.h"
#include "server/schema/hyperparameters.h"

namespace fusedps::checkpoint {
namespace {

using Manifest = v1::CheckpointManifest;

// DATA_LOSS naming the manifest and where in it.
class ManifestErrors {
 public:
  explicit ManifestErrors(const Loaded& c) : path_(absl::StrCat(c.directory, "/", kManifestName)) {}

  absl::Status Bad(const std::string& where, const std::string& why) const {
    return absl::DataLossError(absl::StrCat(path_, ": ", where, " ", why));
  }

 private:
  std::string path_;
};

// A tensor's dtype as the manifest lists it: the kernels' enum, or DATA_LOSS naming the key for
// a value it does not allow. The kernels' enums take the proto's values
// (server/schema/hyperparameters.cc).
template <typename Kernel, typename Proto>
absl::StatusOr<Kernel> DTypeOf(const ManifestErrors& m, Proto dtype, const std::string& where,
                               std::initializer_list<Kernel> allowed,
                               const std::string& (*proto_name)(Proto)) {
  std::string names;
  for (Kernel d : allowed) {
    if (static_cast<int>(dtype) == static_cast<int>(d)) return d;
    absl::StrAppend(&names, names.empty() ? "" : ", ", proto_name(static_cast<Proto>(d)));
  }
  return m.Bad(where, absl::StrCat("is ", static_cast<int>(dtype), " (", proto_name(dtype),
                                   "), not one of ", names));
}

// A tensor's layout as the manifest lists it (UNSPECIFIED: not listed) must be the one its
// group gives it.
absl::Status CheckLayout(const ManifestErrors& m, const Manifest::Tensor& t,
                         const std::string& where, TensorLayout layout) {
  if (t.params_dtype() != v1::DTYPE_UNSPECIFIED) {
    absl::StatusOr<ParamsDType> dtype =
        DTypeOf(m, t.params_dtype(), where + ".params_dtype",
                {ParamsDType::kFloat32, ParamsDType::kBFloat16}, &v1::DType_Name<v1::DType>);
    if (!dtype.ok()) return dtype.status();
    if (*dtype != layout.params) {
      return m.Bad(where + ".params_dtype",
                   absl::StrCat("is ", ParamsDTypeName(*dtype), "; its group stores ",
                                ParamsDTypeName(layout.params)));
    }
  }
  if (t.state_dtype() != v1::STATE_DTYPE_UNSPECIFIED) {
    absl::StatusOr<StateDType> dtype =
        DTypeOf(m, t.state_dtype(), where + ".state_dtype",
                {StateDType::kFloat32, StateDType::kBFloat16, StateDType::kInt8},
                &v1::StateDType_Name<v1::StateDType>);
    if (!dtype.ok()) return dtype.status();
    if (*dtype != layout.state) {
      return m.Bad(where + ".state_dtype",
                   absl::StrCat("is ", StateDTypeName(*dtype), "; its group and size give ",
                                StateDTypeName(layout.state)));
    }
  }
  return absl::OkStatus();
}

// The manifest's int8_codebooks, required when a tensor has int8 state: each value must be the
// server's own (DynamicCodebooks), bit for bit, or the codes would mean other values.
absl::Status CheckCodebooks(const ManifestErrors& m, const Manifest& manifest, bool int8_state) {
  if (!manifest.has_int8_codebooks()) {
    return int8_state ? m.Bad("manifest", "lacks \"int8_codebooks\"") : absl::OkStatus();
  }
  const Int8Codebooks& ours = DynamicCodebooks();
  const Manifest::Int8Codebooks& theirs = manifest.int8_codebooks();
  for (const auto& [key, values, book] :
       {std::tuple{"exp_avg", &theirs.exp_avg(), &ours.exp_avg},
        std::tuple{"exp_avg_sq", &theirs.exp_avg_sq(), &ours.exp_avg_sq}}) {
    const std::string where = absl::StrCat("int8_codebooks.", key);
    if (values->size() != kQuantMapSize) {
      return m.Bad(where, absl::StrCat("has ", values->size(), " values, not ", kQuantMapSize));
    }
    for (int i = 0; i < kQuantMapSize; ++i) {
      if (FloatToBits(values->Get(i)) != FloatToBits(book->values[i])) {
        return m.Bad(absl::StrCat(where, "[", i, "]"),
                     absl::StrCat("= ", values->Get(i), " is not this server's ", book->values[i],
                                  ": its codes would mean other values"));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ParamGroupSpec>> ReadGroups(const ManifestErrors& m,
                                                       const Manifest& manifest) {
  std::vector<ParamGroupSpec> out;
  std::set<std::string> names;
  for (int i = 0; i < manifest.param_groups_size(); ++i) {
    const v1::ParamGroup& g = manifest.param_groups(i);
    const std::string where = absl::StrCat("param_groups[", i, "]");
    if (!g.has_hyperparameters()) return m.Bad(where, "lacks \"hyperparameters\"");
    ParamGroupSpec spec;
    spec.name = g.name();
    absl::Status s = CheckName(spec.name, kMaxGroupNameBytes, where + ".name");
    if (s.ok()) {
      absl::StatusOr<AdamWHyperparameters> h = HyperparametersFromProto(g.hyperparameters());
      s = h.status();
      if (h.ok()) spec.hyperparameters = *h;
    }
    if (s.ok()) s = ValidateHyperparameters(spec.hyperparameters);
    if (!s.ok()) return m.Bad(where, std::string(s.message()));
    if (!names.insert(spec.name).second) return m.Bad(where, "repeats the name " + spec.name);
    if (i == 0 && spec.name != kDefaultParamGroup) {
      return m.Bad(where, "must be the group \"default\"");
    }
    out.push_back(std::move(spec));
  }
  if (out.empty()) return m.Bad("param_groups", "is empty (\"default\" comes first)");
  return out;
}

absl::Status ReadTensors(const ManifestErrors& m, const Manifest& manifest, RestoredShard* out) {
  RestoredShard& shard = *out;
  absl::flat_hash_map<std::string, uint32_t> groups;
  for (uint32_t g = 0; g < shard.groups.size(); ++g) groups[shard.groups[g].name] = g;
  std::set<std::string> names;
  for (int i = 0; i < manifest.tensors_size(); ++i) {
    const Manifest::Tensor& t = manifest.tensors(i);
    const std::string where = absl::StrCat("tensors[", i, "]");
    TensorMeta meta;
    meta.name = t.name();
    meta.shape.assign(t.shape().begin(), t.shape().end());
    if (absl::Status s = CheckName(meta.name, kMaxTensorNameBytes, where + ".name"); !s.ok()) {
      return m.Bad(where, std::string(s.message()));
    }
    absl::StatusOr<uint64_t> numel = NumelOf(meta.shape);
    if (!numel.ok()) return m.Bad(where + ".shape", std::string(numel.status().message()));
    meta.numel = *numel;
    if (t.step() < 0) return m.Bad(where + ".step", absl::StrCat("= ", t.step(), " is negative"));
    auto g = groups.find(t.param_group());
    if (g == groups.end()) return m.Bad(where + ".param_group", "names no group");
    meta.group = g->second;
    if (absl::Status s = CheckLayout(
            m, t, where, LayoutOf(shard.groups[meta.group].hyperparameters, meta.numel));
        !s.ok()) {
      return s;
    }
    meta.table = t.table();
    if (meta.table && (meta.shape.size() != 2 || meta.shape[1] < 1)) {
      return m.Bad(where + ".shape", "is not [rows, dim >= 1], as an embedding table's is");
    }
    if (meta.table) {
      if (absl::Status s = CheckTableGroup(shard.groups[meta.group], where + ".param_group");
          !s.ok()) {
        return m.Bad(where + ".param_group", std::string(s.message()));
      }
    }
    if (t.has_hashed()) {
      if (!meta.table) return m.Bad(where + ".hashed", "is set for a tensor that is not a table");
      absl::StatusOr<HashedKeys> keys = HashedKeysFromManifest(t.hashed());
      if (!keys.ok()) return m.Bad(where + ".hashed", std::string(keys.status().message()));
      meta.hashed = *keys;
    }
    if (!names.insert(meta.name).second) return m.Bad(where, "repeats the name " + meta.name);
    shard.tensors.push_back(std::move(meta));
    shard.steps.push_back(t.step());
  }
  return absl::OkStatus();
}

absl::Status ReadRetries(const ManifestErrors& m, const Manifest& manifest, RestoredShard* shard) {
  for (int i = 0; i < manifest.retry_table_size(); ++i) {
    const Manifest::RetryClient& client = manifest.retry_table(i);
    RetryTable::ClientRecord record{client.client_id(), client.highest(), {}};
    for (int k = 0; k < client.replies_size(); ++k) {
      const Manifest::Reply& r = client.replies(k);
      PushReply reply;
      reply.version = r.version();
      reply.skipped = r.skipped();
      reply.tensors_updated = r.tensors_updated();
      reply.grad_bytes = r.grad_bytes();
      reply.round_workers = r.round_workers();
      reply.round_timed_out = r.round_timed_out();
      for (const std::string& id : r.missing_replicas()) {
        if (id.size() > RetryTable::kMaxClientIdBytes) {
          return m.Bad(absl::StrCat("retry_table[", i, "].replies[", k, "].missing_replicas"),
                       "holds something other than client_ids");
        }
        reply.missing_replicas.push_back(id);
      }
      record.replies.emplace_back(r.sequence_number(), reply);
    }
    shard->retries.push_back(std::move(record));
  }
  return absl::OkStatus();
}

constexpr int kSlotsPerFile = 3;  // Buffers in flight per data file.

// The buffers' file, read whole and checked against the manifest's CRC-32.
absl::StatusOr<std::shared_ptr<const BufferSet>> ReadBuffers(const Loaded& checkpoint) {
  absl::StatusOr<safetensors::File> file = ReadWholeFile(checkpoint, kBuffersFileName);
  if (!file.ok()) return file.status();
  const std::string path = absl::StrCat(checkpoint.directory, "/", kBuffersFileName);
  std::vector<BufferValue> buffers;
  for (const safetensors::Entry& e : file->entries()) {
    const absl::Span<const uint8_t> data = file->Data(e);
    buffers.push_back({e.name, e.dtype, e.shape,
                       std::string(reinterpret_cast<const char*>(data.data()), data.size())});
  }
  absl::StatusOr<std::shared_ptr<const BufferSet>> set = BufferSet::Of(std::move(buffers));
  if (!set.ok()) return absl::DataLossError(absl::StrCat(path, ": ", set.status().message()));
  return set;
}

}  // namespace

// One data file: its reader, and which tensor each of its entries is (in data order).
struct ShardReader::Part {
  SnapshotField field;  // Its tensors: those of reader.entries(), by position.
  safetensors::Reader reader;
  uint32_t crc32 = 0;  // The manifest's.
};

ShardReader::ShardReader(UpdateEngine* engine) : engine_(engine) {}

absl::StatusOr<std::unique_ptr<ShardReader>> ShardReader::Open(const Loaded& checkpoint,
                                                               UpdateEngine* engine,
                                                               uint64_t slot_bytes) {
  if (slot_bytes == 0 || slot_bytes % 4 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("slot_bytes ", slot_bytes, " is not a positive multiple of 4"));
  }
  const ManifestErrors m(checkpoint);
  const Manifest& manifest = checkpoint.manifest;
  std::unique_ptr<ShardReader> reader(new ShardReader(engine));
  RestoredShard& shard = reader->shard_;
  shard.version = checkpoint.version;
  absl::StatusOr<std::vector<ParamGroupSpec>> groups = ReadGroups(m, manifest);
  if (!groups.ok()) return groups.status();
  shard.groups = *std::move(groups);
  if (absl::Status s = ReadTensors(m, manifest, &shard); !s.ok()) return s;
  bool int8_state = false;
  for (const TensorMeta& t : shard.tensors) {
    int8_state |=
        LayoutOf(shard.groups[t.group].hyperparameters, t.numel).state == StateDType::kInt8;
  }
  if (absl::Status s = CheckCodebooks(m, manifest, int8_state); !s.ok()) return s;
  if (absl::Status s = ReadRetries(m, manifest, &shard); !s.ok()) return s;
  if (absl::Status s = ReadHashedTables(checkpoint, manifest, &shard); !s.ok()) return s;
  shard.plan_hash = manifest.plan_hash();  // Empty in checkpoints from before sharding.
  if (shard.plan_hash.size() > kMaxPlanHashBytes) {
    return m.Bad("plan_hash", absl::StrCat("has more than ", kMaxPlanHashBytes, " bytes"));
  }
  // The param copy's file: read when it has the engine's dtype (--param-copy-dtype).
  const v1::DType copy_dtype = manifest.param_copy_dtype();
  if (copy_dtype != v1::DTYPE_UNSPECIFIED && copy_dtype != v1::DTYPE_BFLOAT16 &&
      copy_dtype != v1::DTYPE_FLOAT16) {
    return m.Bad("param_copy_dtype", absl::StrCat("is ", v1::DType_Name(copy_dtype),
                                                  ", not one of DTYPE_UNSPECIFIED (none), "
                                                  "DTYPE_BFLOAT16, DTYPE_FLOAT16"));
  }

  // The files the writer made of this shard (SnapshotLayout's fields), less a param copy of
  // another dtype than the server's.
  const ParamCopyDType copy = engine->param_copy_dtype();
  shard.param_copy = copy != ParamCopyDType::kNone && copy_dtype == static_cast<v1::DType>(copy);
  std::shared_ptr<const ShardView> view = ShardView::Initial();
  for (uint32_t g = 0; g < shard.groups.size(); ++g) view = view->WithGroup(g, shard.groups[g]);
  view = view->WithTensors(shard.tensors);
  uint64_t snapshot_bytes = 0;
  const ParamCopyDType file_copy = shard.param_copy ? copy : ParamCopyDType::kNone;
  absl::flat_hash_map<std::string, uint32_t> by_name;
  for (uint32_t t = 0; t < shard.tensors.size(); ++t) by_name[shard.tensors[t].name] = t;
  for (SnapshotField& field : SnapshotLayout(*view, file_copy, &snapshot_bytes)) {
    const std::string name = FileOf(field);
    absl::StatusOr<uint32_t> crc32 = ExpectedCrc32(checkpoint, name);
    if (!crc32.ok()) return crc32.status();
    absl::StatusOr<safetensors::Reader> file =
        safetensors::Reader::Open(absl::StrCat(checkpoint.directory, "/", name));
    if (!file.ok()) return absl::DataLossError(file.status().message());
    // Exactly the field's tensors, each with the dtype and shape of its stored form (its
    // layout's); in the file's order.
    const std::string& path = file->path();
    if (file->entries().size() != field.tensors.size()) {
      return absl::DataLossError(absl::StrCat(path, " holds ", file->entries().size(),
                                              " tensors, the manifest ", field.tensors.size()));
    }
    std::vector<bool> wanted(shard.tensors.size());
    for (uint32_t t : field.tensors) wanted[t] = true;
    field.tensors.clear();
    for (const safetensors::Entry& e : file->entries()) {
      const auto t = by_name.find(e.name);
      if (t == by_name.end() || !wanted[t->second]) {
        return absl::DataLossError(absl::StrCat(path, ": tensor ", QuoteName(e.name),
                                                " is not one the manifest puts in this file"));
      }
      const safetensors::DType dtype = DTypeOf(field, view->layout(t->second), file_copy);
      const std::vector<int64_t> shape = ShapeOf(field, shard.tensors[t->second]);
      if (e.dtype != dtype || e.shape != shape) {
        return absl::DataLossError(absl::StrCat(
            path, ": tensor ", QuoteName(e.name), " is ", safetensors::DTypeName(e.dtype), " [",
            absl::StrJoin(e.shape, ", "), "]; the manifest's layout makes it ",
            safetensors::DTypeName(dtype), " [", absl::StrJoin(shape, ", "), "]"));
      }
      wanted[t->second] = false;  // Once.
      field.tensors.push_back(t->second);
    }
    reader->bytes_ += file->data_left();
    reader->parts_.push_back(
        std::make_unique<Part>(Part{std::move(field), *std::move(file), *crc32}));
  }

  if (manifest.files().count(kBuffersFileName) != 0) {
    absl::StatusOr<std::shared_ptr<const BufferSet>> buffers = ReadBuffers(checkpoint);
    if (!buffers.ok()) return buffers.status();
    shard.buffers = *std::move(buffers);
  }

  const int slots = kSlotsPerFile * static_cast<int>(reader->parts_.size());
  absl::StatusOr<void*> buffers =
      engine->AllocateHostBuffer(slot_bytes * static_cast<uint64_t>(slots));
  if (!buffers.ok()) return buffers.status();
  reader->buffers_ = static_cast<char*>(*buffers);
  reader->buffer_bytes_ = slot_bytes;
  {
    MutexLock lock(&reader->mu_);  // Free: no reader thread runs yet.
    for (int i = 0; i < slots; ++i) reader->free_slots_.push_back(i);
  }
  for (const std::unique_ptr<Part>& part : reader->parts_) {
    reader->threads_.emplace_back(&ShardReader::ReadPart, reader.get(), part.get());
  }
  return reader;
}

ShardReader::~ShardReader() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.SignalAll();
  for (std::thread& t : threads_) t.join();
  if (buffers_ != nullptr) engine_->FreeHostBuffer(buffers_);
}

void ShardReader::ReadPart(Part* part) {
  const std::vector<safetensors::Entry>& entries = part->reader.entries();
  uint64_t at = 0;   // Bytes of the data read so far.
  size_t entry = 0;  // The first entry not read whole.
  const auto fail = [&](absl::Status s) {
    MutexLock lock(&mu_);
    if (error_.ok()) error_ = std::move(s);
    cv_.SignalAll();
  };
  while (part->reader.data_left() > 0) {
    Batch batch;
    {
      MutexLock lock(&mu_);
      while (!stopping_ && error_.ok() && free_slots_.empty()) cv_.Wait(&mu_);
      if (stopping_ || !error_.ok()) return;
      batch.slot = free_slots_.back();
      free_slots_.pop_back();
    }
    char* data = buffers_ + static_cast<uint64_t>(batch.slot) * buffer_bytes_;
    uint64_t n = std::min(buffer_bytes_, part->reader.data_left());
    // Whole elements: a cut inside an entry falls on one of its element boundaries (always so
    // in the server's files, whose entries are aligned to their element size; another tool's
    // may not be).
    for (size_t e = entry; e < entries.size() && entries[e].begin < at + n; ++e) {
      if (entries[e].end > at + n) {
        n -= (at + n - entries[e].begin) % safetensors::DTypeSize(entries[e].dtype);
        break;
      }
    }
    if (absl::Status s = part->reader.Read(data, n); !s.ok()) {
      return fail(absl::DataLossError(s.message()));
    }
    // The pieces of the tensors in [at, at + n), in their stored form.
    for (; entry < entries.size() && entries[entry].begin < at + n; ++entry) {
      const safetensors::Entry& e = entries[entry];
      const uint64_t element = safetensors::DTypeSize(e.dtype);
      const uint64_t begin = std::max(e.begin, at), end = std::min(e.end, at + n);
      if (end > begin) {
        WriteRequest w;
        w.field = part->field.field;
        w.param_copy = part->field.param_copy;
        w.stored = !part->field.param_copy;
        w.tensor = part->field.tensors[entry];
        w.offset = (begin - e.begin) / element;
        w.count = (end - begin) / element;
        w.src = data + (begin - at);
        batch.writes.push_back(w);
      }
      if (e.end > at + n) break;  // Goes on in the next slot.
    }
    at += n;
    MutexLock lock(&mu_);
    ready_.push_back(std::move(batch));
    cv_.SignalAll();
  }
  if (part->reader.crc32() != part->crc32) {
    return fail(absl::DataLossError(
        absl::StrCat(part->reader.path(), " does not match its crc32 in the manifest")));
  }
  MutexLock lock(&mu_);
  ++parts_done_;
  cv_.SignalAll();
}

absl::StatusOr<bool> ShardReader::Next(Batch* batch) {
  MutexLock lock(&mu_);
  while (error_.ok() && ready_.empty() && parts_done_ != parts_.size()) cv_.Wait(&mu_);
  if (!error_.ok()) return error_;
  if (ready_.empty()) return false;  // Every file read whole, and checked.
  *batch = std::move(ready_.front());
  ready_.pop_front();
  return true;
}

void ShardReader::Release(int slot) {
  MutexLock lock(&mu_);
  free_slots_.push_back(slot);
  cv_.SignalAll();
}

}  // namespace fusedps::checkpoint
