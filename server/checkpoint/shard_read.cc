// ShardReader (shard_files.h): a checkpoint's manifest and file headers checked, then its data
// read by one thread per file into page-locked buffers that UpdateEngine::Restore uploads as
// they fill. A manifest may come from another tool (fusedps.checkpoint.from_torch), so it is
// held to the rules registration holds a client to.
#include <algorithm>
#include <initializer_list>
#include <set>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_io.h"
#include "common/mutex.h"
#include "kernels/quant_math.h"
#include "nlohmann/json.hpp"
#include "server/checkpoint/shard_files.h"
#include "server/schema/hyperparameters.h"

namespace fusedps::checkpoint {
namespace {

using nlohmann::json;

// Typed access to the manifest, with DATA_LOSS naming the manifest and the key.
class ManifestReader {
 public:
  explicit ManifestReader(const Loaded& c) : path_(absl::StrCat(c.directory, "/manifest.json")) {}

  absl::Status Bad(const std::string& where, const std::string& why) const {
    return absl::DataLossError(absl::StrCat(path_, ": ", where, " ", why));
  }
  absl::StatusOr<const json*> Get(const json& object, const std::string& key, json::value_t type,
                                  const std::string& where) const {
    if (!object.is_object() || !object.contains(key)) return Bad(where, "lacks \"" + key + "\"");
    const json& v = object[key];
    const bool ok = type == json::value_t::number_float      ? v.is_number()
                    : type == json::value_t::number_unsigned ? v.is_number_unsigned()
                                                             : v.type() == type;
    if (!ok) return Bad(absl::StrCat(where, ".", key), "has the wrong type");
    return &v;
  }

 private:
  std::string path_;
};

#define FUSEDPS_ASSIGN(lhs, expr)               \
  auto lhs##_or = (expr);                       \
  if (!lhs##_or.ok()) return lhs##_or.status(); \
  const json& lhs = **lhs##_or

// A dtype's name in a manifest ("fp32", "bf16", "int8"), or DATA_LOSS naming the key.
template <typename DType>
absl::StatusOr<DType> ParseDTypeName(const ManifestReader& m, const json& object,
                                     const std::string& key, const std::string& where,
                                     std::initializer_list<DType> allowed,
                                     const char* (*name_of)(DType)) {
  FUSEDPS_ASSIGN(v, m.Get(object, key, json::value_t::string, where));
  std::string names;
  for (DType d : allowed) {
    if (v.get<std::string>() == name_of(d)) return d;
    absl::StrAppend(&names, names.empty() ? "" : ", ", name_of(d));
  }
  return m.Bad(absl::StrCat(where, ".", key),
               absl::StrCat("is \"", v.get<std::string>(), "\", not one of ", names));
}

// A group's storage: state_dtype, params_dtype and rounding_seed, each fp32 (or 0) when absent
// (a checkpoint written before they existed).
absl::Status ReadStorage(const ManifestReader& m, const json& g, const std::string& where,
                         AdamWHyperparameters* h) {
  if (g.contains("state_dtype")) {
    absl::StatusOr<StateDType> dtype = ParseDTypeName(
        m, g, "state_dtype", where,
        {StateDType::kFloat32, StateDType::kBFloat16, StateDType::kInt8}, &StateDTypeName);
    if (!dtype.ok()) return dtype.status();
    h->state_dtype = *dtype;
  }
  if (g.contains("params_dtype")) {
    absl::StatusOr<ParamsDType> dtype =
        ParseDTypeName(m, g, "params_dtype", where, {ParamsDType::kFloat32, ParamsDType::kBFloat16},
                       &ParamsDTypeName);
    if (!dtype.ok()) return dtype.status();
    h->params_dtype = *dtype;
  }
  if (g.contains("rounding_seed")) {
    FUSEDPS_ASSIGN(seed, m.Get(g, "rounding_seed", json::value_t::number_unsigned, where));
    h->rounding_seed = seed.get<uint64_t>();
  }
  return absl::OkStatus();
}

// A tensor's layout as the manifest lists it (optional) must be the one its group gives it.
absl::Status CheckLayout(const ManifestReader& m, const json& t, const std::string& where,
                         TensorLayout layout) {
  if (t.contains("params_dtype")) {
    absl::StatusOr<ParamsDType> dtype =
        ParseDTypeName(m, t, "params_dtype", where, {ParamsDType::kFloat32, ParamsDType::kBFloat16},
                       &ParamsDTypeName);
    if (!dtype.ok()) return dtype.status();
    if (*dtype != layout.params) {
      return m.Bad(where + ".params_dtype",
                   absl::StrCat("is ", ParamsDTypeName(*dtype), "; its group stores ",
                                ParamsDTypeName(layout.params)));
    }
  }
  if (t.contains("state_dtype")) {
    absl::StatusOr<StateDType> dtype = ParseDTypeName(
        m, t, "state_dtype", where,
        {StateDType::kFloat32, StateDType::kBFloat16, StateDType::kInt8}, &StateDTypeName);
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
absl::Status CheckCodebooks(const ManifestReader& m, const json& root, bool int8_state) {
  if (!root.contains("int8_codebooks") && !int8_state) return absl::OkStatus();
  FUSEDPS_ASSIGN(books, m.Get(root, "int8_codebooks", json::value_t::object, "manifest"));
  const Int8Codebooks& ours = DynamicCodebooks();
  for (const auto& [key, book] :
       {std::pair{"exp_avg", &ours.exp_avg}, {"exp_avg_sq", &ours.exp_avg_sq}}) {
    FUSEDPS_ASSIGN(values, m.Get(books, key, json::value_t::array, "int8_codebooks"));
    const std::string where = absl::StrCat("int8_codebooks.", key);
    if (values.size() != kQuantMapSize) {
      return m.Bad(where, absl::StrCat("has ", values.size(), " values, not ", kQuantMapSize));
    }
    for (int i = 0; i < kQuantMapSize; ++i) {
      const float v = values[i].is_number() ? static_cast<float>(values[i].get<double>()) : -2.0f;
      if (FloatToBits(v) != FloatToBits(book->values[i])) {
        return m.Bad(absl::StrCat(where, "[", i, "]"),
                     absl::StrCat("= ", values[i].dump(), " is not this server's ", book->values[i],
                                  ": its codes would mean other values"));
      }
    }
  }
  return absl::OkStatus();
}

// A group's hyperparameters in format_version 3: protobuf's JSON mapping of
// fusedps.v1.Hyperparameters (server/schema/hyperparameters.h).
absl::Status ReadHyperparameters(const ManifestReader& m, const json& g, const std::string& where,
                                 AdamWHyperparameters* h) {
  FUSEDPS_ASSIGN(v, m.Get(g, "hyperparameters", json::value_t::object, where));
  absl::StatusOr<AdamWHyperparameters> read = HyperparametersFromJson(v.dump());
  if (!read.ok()) return m.Bad(where, std::string(read.status().message()));
  *h = *read;
  return absl::OkStatus();
}

// A group's hyperparameters in format_version 2 (written before 3): each a key of the group,
// decoupled_weight_decay a bool, the storage fields by their dtype names (ReadStorage).
absl::Status ReadHyperparametersV2(const ManifestReader& m, const json& g, const std::string& where,
                                   AdamWHyperparameters* h_out) {
  AdamWHyperparameters& h = *h_out;
  for (auto [key, field] : {std::pair{"lr", &h.lr},
                            {"beta1", &h.beta1},
                            {"beta2", &h.beta2},
                            {"eps", &h.eps},
                            {"weight_decay", &h.weight_decay}}) {
    FUSEDPS_ASSIGN(v, m.Get(g, key, json::value_t::number_float, where));
    *field = v.get<double>();
  }
  for (auto [key, field] : {std::pair{"amsgrad", &h.amsgrad},
                            {"maximize", &h.maximize},
                            {"decoupled_weight_decay", &h.decoupled_weight_decay}}) {
    FUSEDPS_ASSIGN(v, m.Get(g, key, json::value_t::boolean, where));
    *field = v.get<bool>();
  }
  return ReadStorage(m, g, where, &h);
}

absl::StatusOr<std::vector<ParamGroupSpec>> ReadGroups(const ManifestReader& m, const json& root) {
  FUSEDPS_ASSIGN(groups, m.Get(root, "param_groups", json::value_t::array, "manifest"));
  std::vector<ParamGroupSpec> out;
  std::set<std::string> names;
  for (size_t i = 0; i < groups.size(); ++i) {
    const json& g = groups[i];
    const std::string where = absl::StrCat("param_groups[", i, "]");
    FUSEDPS_ASSIGN(name, m.Get(g, "name", json::value_t::string, where));
    ParamGroupSpec spec;
    spec.name = name.get<std::string>();
    absl::Status s = root.value("format_version", 0) == kFormatVersion
                         ? ReadHyperparameters(m, g, where, &spec.hyperparameters)
                         : ReadHyperparametersV2(m, g, where, &spec.hyperparameters);
    if (!s.ok()) return s;
    s = CheckName(spec.name, kMaxGroupNameBytes, where + ".name");
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

absl::Status ReadTensors(const ManifestReader& m, const json& root, RestoredShard* out) {
  RestoredShard& shard = *out;
  absl::flat_hash_map<std::string, uint32_t> groups;
  for (uint32_t g = 0; g < shard.groups.size(); ++g) groups[shard.groups[g].name] = g;
  FUSEDPS_ASSIGN(tensors, m.Get(root, "tensors", json::value_t::array, "manifest"));
  std::set<std::string> names;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const json& t = tensors[i];
    const std::string where = absl::StrCat("tensors[", i, "]");
    FUSEDPS_ASSIGN(name, m.Get(t, "name", json::value_t::string, where));
    FUSEDPS_ASSIGN(shape, m.Get(t, "shape", json::value_t::array, where));
    FUSEDPS_ASSIGN(group, m.Get(t, "param_group", json::value_t::string, where));
    FUSEDPS_ASSIGN(step, m.Get(t, "step", json::value_t::number_unsigned, where));
    TensorMeta meta;
    meta.name = name.get<std::string>();
    for (const json& d : shape) {
      if (!d.is_number_integer()) return m.Bad(where + ".shape", "has a non-integer");
      meta.shape.push_back(d.get<int64_t>());
    }
    if (absl::Status s = CheckName(meta.name, kMaxTensorNameBytes, where + ".name"); !s.ok()) {
      return m.Bad(where, std::string(s.message()));
    }
    absl::StatusOr<uint64_t> numel = NumelOf(meta.shape);
    if (!numel.ok()) return m.Bad(where + ".shape", std::string(numel.status().message()));
    meta.numel = *numel;
    auto g = groups.find(group.get<std::string>());
    if (g == groups.end()) return m.Bad(where + ".param_group", "names no group");
    meta.group = g->second;
    if (absl::Status s = CheckLayout(
            m, t, where, LayoutOf(shard.groups[meta.group].hyperparameters, meta.numel));
        !s.ok()) {
      return s;
    }
    if (!names.insert(meta.name).second) return m.Bad(where, "repeats the name " + meta.name);
    shard.tensors.push_back(std::move(meta));
    shard.steps.push_back(step.get<int64_t>());
  }
  return absl::OkStatus();
}

absl::Status ReadRetries(const ManifestReader& m, const json& root, RestoredShard* shard) {
  FUSEDPS_ASSIGN(clients, m.Get(root, "retry_table", json::value_t::array, "manifest"));
  for (size_t i = 0; i < clients.size(); ++i) {
    const std::string where = absl::StrCat("retry_table[", i, "]");
    FUSEDPS_ASSIGN(id, m.Get(clients[i], "client_id", json::value_t::string, where));
    FUSEDPS_ASSIGN(highest, m.Get(clients[i], "highest", json::value_t::number_unsigned, where));
    FUSEDPS_ASSIGN(replies, m.Get(clients[i], "replies", json::value_t::array, where));
    RetryTable::ClientRecord record{id.get<std::string>(), highest.get<uint64_t>(), {}};
    for (size_t k = 0; k < replies.size(); ++k) {
      const std::string at = absl::StrCat(where, ".replies[", k, "]");
      const json& r = replies[k];
      FUSEDPS_ASSIGN(seq, m.Get(r, "sequence_number", json::value_t::number_unsigned, at));
      FUSEDPS_ASSIGN(version, m.Get(r, "version", json::value_t::number_unsigned, at));
      FUSEDPS_ASSIGN(skipped, m.Get(r, "skipped", json::value_t::boolean, at));
      FUSEDPS_ASSIGN(updated, m.Get(r, "tensors_updated", json::value_t::number_unsigned, at));
      FUSEDPS_ASSIGN(bytes, m.Get(r, "grad_bytes", json::value_t::number_unsigned, at));
      PushReply reply;
      reply.version = version.get<uint64_t>();
      reply.skipped = skipped.get<bool>();
      reply.tensors_updated = updated.get<uint32_t>();
      reply.grad_bytes = bytes.get<uint64_t>();
      if (r.contains("round_workers")) {  // Checkpoints before it have none: 0, as async's.
        FUSEDPS_ASSIGN(workers, m.Get(r, "round_workers", json::value_t::number_unsigned, at));
        reply.round_workers = workers.get<uint32_t>();
      }
      if (r.contains("round_timed_out")) {  // Nor these: false and none.
        FUSEDPS_ASSIGN(timed_out, m.Get(r, "round_timed_out", json::value_t::boolean, at));
        reply.round_timed_out = timed_out.get<bool>();
        FUSEDPS_ASSIGN(missing, m.Get(r, "missing_replicas", json::value_t::array, at));
        for (const json& id : missing) {
          if (!id.is_string() || id.get<std::string>().size() > RetryTable::kMaxClientIdBytes) {
            return m.Bad(absl::StrCat(at, ".missing_replicas"),
                         "holds something other than client_ids");
          }
          reply.missing_replicas.push_back(id.get<std::string>());
        }
      }
      record.replies.emplace_back(seq.get<uint64_t>(), reply);
    }
    shard->retries.push_back(std::move(record));
  }
  return absl::OkStatus();
}

constexpr int kSlotsPerFile = 3;  // Buffers in flight per data file.

// The buffers' file, read whole and checked against the manifest's CRC-32.
absl::StatusOr<std::shared_ptr<const BufferSet>> ReadBuffers(const Loaded& checkpoint) {
  absl::StatusOr<uint32_t> crc32 = ExpectedCrc32(checkpoint, kBuffersFileName);
  if (!crc32.ok()) return crc32.status();
  const std::string path = absl::StrCat(checkpoint.directory, "/", kBuffersFileName);
  absl::StatusOr<std::string> bytes = file_io::ReadFile(path);
  if (!bytes.ok()) return absl::DataLossError(bytes.status().message());
  if (safetensors::Crc32(0, bytes->data(), bytes->size()) != *crc32) {
    return absl::DataLossError(absl::StrCat(path, ": its CRC-32 is not the manifest's"));
  }
  absl::StatusOr<safetensors::File> file = safetensors::File::Parse(*std::move(bytes), path);
  if (!file.ok()) return absl::DataLossError(file.status().message());
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
  const ManifestReader m(checkpoint);
  const json& root = checkpoint.manifest;
  std::unique_ptr<ShardReader> reader(new ShardReader(engine));
  RestoredShard& shard = reader->shard_;
  shard.version = checkpoint.version;
  absl::StatusOr<std::vector<ParamGroupSpec>> groups = ReadGroups(m, root);
  if (!groups.ok()) return groups.status();
  shard.groups = *std::move(groups);
  if (absl::Status s = ReadTensors(m, root, &shard); !s.ok()) return s;
  bool int8_state = false;
  for (const TensorMeta& t : shard.tensors) {
    int8_state |=
        LayoutOf(shard.groups[t.group].hyperparameters, t.numel).state == StateDType::kInt8;
  }
  if (absl::Status s = CheckCodebooks(m, root, int8_state); !s.ok()) return s;
  if (absl::Status s = ReadRetries(m, root, &shard); !s.ok()) return s;
  // Optional: checkpoints from before sharding have none.
  if (root.contains("plan_hash")) {
    FUSEDPS_ASSIGN(plan_hash, m.Get(root, "plan_hash", json::value_t::string, "manifest"));
    shard.plan_hash = plan_hash.get<std::string>();
    if (shard.plan_hash.size() > kMaxPlanHashBytes) {
      return m.Bad("plan_hash", absl::StrCat("has more than ", kMaxPlanHashBytes, " bytes"));
    }
  }
  FUSEDPS_ASSIGN(copy_name, m.Get(root, "param_copy_dtype", json::value_t::string, "manifest"));

  // The files the writer made of this shard (SnapshotLayout's fields), less a param copy of
  // another dtype than the server's.
  const ParamCopyDType copy = engine->param_copy_dtype();
  shard.param_copy =
      copy != ParamCopyDType::kNone && copy_name.get<std::string>() == ParamCopyDTypeName(copy);
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

  if (root["files"].contains(kBuffersFileName)) {
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

#undef FUSEDPS_ASSIGN

}  // namespace fusedps::checkpoint
