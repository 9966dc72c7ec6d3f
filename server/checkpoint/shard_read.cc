// ReadCheckpoint (shard_files.h): a checkpoint's files read, checked and turned into the shard
// that UpdateEngine::Restore loads. Everything is checked before anything is restored; a
// manifest may come from another tool (fusedps.checkpoint.from_torch), so it is held to the
// rules registration holds a client to.
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "server/checkpoint/shard_files.h"

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
  absl::StatusOr<const json*> Get(const json& object, const std::string& key,
                                  json::value_t type, const std::string& where) const {
    if (!object.is_object() || !object.contains(key)) return Bad(where, "lacks \"" + key + "\"");
    const json& v = object[key];
    const bool ok = type == json::value_t::number_float
                        ? v.is_number()
                        : type == json::value_t::number_unsigned ? v.is_number_unsigned()
                                                                 : v.type() == type;
    if (!ok) return Bad(absl::StrCat(where, ".", key), "has the wrong type");
    return &v;
  }

 private:
  std::string path_;
};

#define FUSEDPS_ASSIGN(lhs, expr)       \
  auto lhs##_or = (expr);               \
  if (!lhs##_or.ok()) return lhs##_or.status(); \
  const json& lhs = **lhs##_or

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
    AdamWHyperparameters& h = spec.hyperparameters;
    for (auto [key, field] : {std::pair{"lr", &h.lr}, {"beta1", &h.beta1}, {"beta2", &h.beta2},
                              {"eps", &h.eps}, {"weight_decay", &h.weight_decay}}) {
      FUSEDPS_ASSIGN(v, m.Get(g, key, json::value_t::number_float, where));
      *field = v.get<double>();
    }
    for (auto [key, field] : {std::pair{"amsgrad", &h.amsgrad}, {"maximize", &h.maximize},
                              {"decoupled_weight_decay", &h.decoupled_weight_decay}}) {
      FUSEDPS_ASSIGN(v, m.Get(g, key, json::value_t::boolean, where));
      *field = v.get<bool>();
    }
    absl::Status s = CheckName(spec.name, kMaxGroupNameBytes, where + ".name");
    if (s.ok()) s = ValidateHyperparameters(h);
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

absl::Status ReadTensors(const ManifestReader& m, const json& root, LoadedShard* loaded) {
  RestoredShard& shard = loaded->shard;
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
    if (!names.insert(meta.name).second) return m.Bad(where, "repeats the name " + meta.name);
    shard.tensors.push_back(std::move(meta));
    TensorState state;
    state.step = step.get<int64_t>();
    shard.states.push_back(state);
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
      record.replies.emplace_back(seq.get<uint64_t>(), reply);
    }
    shard->retries.push_back(std::move(record));
  }
  return absl::OkStatus();
}

// Points each tensor's `slot` at its values in `file`, which must hold exactly `expected`
// (indices into the shard's tensors) with their shapes, in `dtype`.
using Setter = void (*)(TensorState& state, const uint8_t* values);

absl::Status Bind(const safetensors::File& file, const std::string& path,
                  const std::vector<uint32_t>& expected, safetensors::DType dtype,
                  RestoredShard* shard, Setter set) {
  if (file.entries().size() != expected.size()) {
    return absl::DataLossError(absl::StrCat(path, " holds ", file.entries().size(),
                                            " tensors, the manifest ", expected.size()));
  }
  for (uint32_t t : expected) {
    const TensorMeta& meta = shard->tensors[t];
    const safetensors::File::Entry* e = file.Find(meta.name);
    if (e == nullptr || e->dtype != dtype || e->shape != meta.shape) {
      return absl::DataLossError(absl::StrCat(path, ": tensor ", QuoteName(meta.name),
                                              " is missing or has another dtype or shape"));
    }
    set(shard->states[t], file.Data(*e).data());
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<LoadedShard>> ReadCheckpoint(const Loaded& checkpoint,
                                                            ParamCopyDType copy) {
  const ManifestReader m(checkpoint);
  const json& root = checkpoint.manifest;
  auto loaded = std::make_unique<LoadedShard>();
  RestoredShard& shard = loaded->shard;
  shard.version = checkpoint.version;
  absl::StatusOr<std::vector<ParamGroupSpec>> groups = ReadGroups(m, root);
  if (!groups.ok()) return groups.status();
  shard.groups = *std::move(groups);
  if (absl::Status s = ReadTensors(m, root, loaded.get()); !s.ok()) return s;
  if (absl::Status s = ReadRetries(m, root, &shard); !s.ok()) return s;
  FUSEDPS_ASSIGN(copy_name, m.Get(root, "param_copy_dtype", json::value_t::string, "manifest"));

  // Which tensors each file holds, by the manifest.
  std::vector<uint32_t> all, amsgrad;
  for (uint32_t t = 0; t < shard.tensors.size(); ++t) {
    all.push_back(t);
    if (shard.groups[shard.tensors[t].group].hyperparameters.amsgrad) amsgrad.push_back(t);
  }
  struct Part {
    std::string field;
    const std::vector<uint32_t>* tensors;
    safetensors::DType dtype;
    Setter set;
  };
  std::vector<Part> parts = {
      {"params", &all, safetensors::DType::kF32,
       [](TensorState& s, const uint8_t* v) { s.params = reinterpret_cast<const float*>(v); }},
      {"exp_avg", &all, safetensors::DType::kF32,
       [](TensorState& s, const uint8_t* v) { s.exp_avg = reinterpret_cast<const float*>(v); }},
      {"exp_avg_sq", &all, safetensors::DType::kF32, [](TensorState& s, const uint8_t* v) {
         s.exp_avg_sq = reinterpret_cast<const float*>(v);
       }}};
  if (!amsgrad.empty()) {
    parts.push_back({"max_exp_avg_sq", &amsgrad, safetensors::DType::kF32,
                     [](TensorState& s, const uint8_t* v) {
                       s.max_exp_avg_sq = reinterpret_cast<const float*>(v);
                     }});
  }
  const std::string server_copy = ParamCopyName(copy);
  if (copy != ParamCopyDType::kNone && copy_name.get<std::string>() == server_copy) {
    parts.push_back({"param_copy", &all,
                     copy == ParamCopyDType::kFloat16 ? safetensors::DType::kF16
                                                      : safetensors::DType::kBF16,
                     [](TensorState& s, const uint8_t* v) {
                       s.param_copy = reinterpret_cast<const uint16_t*>(v);
                     }});
  }
  // Read and check the files in parallel (sha256 and parsing run at memory speed per thread).
  std::vector<absl::StatusOr<safetensors::File>> files(parts.size(),
                                                       absl::UnknownError("not read"));
  {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < parts.size(); ++i) {
      threads.emplace_back([&, i] {
        const std::string name = parts[i].field + ".safetensors";
        absl::StatusOr<std::string> bytes = ReadVerified(checkpoint, name);
        if (!bytes.ok()) {
          files[i] = bytes.status();
          return;
        }
        files[i] = safetensors::File::Parse(*std::move(bytes),
                                            absl::StrCat(checkpoint.directory, "/", name));
      });
    }
    for (std::thread& t : threads) t.join();
  }
  loaded->files.reserve(parts.size());  // No reallocation: states point into the files.
  for (size_t i = 0; i < parts.size(); ++i) {
    if (!files[i].ok()) return absl::DataLossError(files[i].status().message());
    loaded->files.push_back(*std::move(files[i]));
    const std::string path = absl::StrCat(checkpoint.directory, "/", parts[i].field,
                                          ".safetensors");
    if (absl::Status s = Bind(loaded->files.back(), path, *parts[i].tensors, parts[i].dtype,
                              &shard, parts[i].set);
        !s.ok()) {
      return s;
    }
    for (const safetensors::File::Entry& e : loaded->files.back().entries()) {
      loaded->bytes += e.end - e.begin;
    }
  }
  return loaded;
}

#undef FUSEDPS_ASSIGN

}  // namespace fusedps::checkpoint
