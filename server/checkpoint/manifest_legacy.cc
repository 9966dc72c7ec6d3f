#include "server/checkpoint/manifest_legacy.h"

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/json_util.h"
#include "kernels/backend.h"
#include "kernels/tensor_layout.h"

namespace fusedps::checkpoint {
namespace {

using nlohmann::json;
using Manifest = v1::CheckpointManifest;

// The kernels' dtype enums take the proto's values (server/schema/hyperparameters.cc): a
// conversion is a cast.

enum class Type { kString, kUnsigned, kNumber, kBool, kArray, kObject };

bool IsA(const json& v, Type type) {
  switch (type) {
    case Type::kString:
      return v.is_string();
    case Type::kUnsigned:
      return v.is_number_unsigned();
    case Type::kNumber:
      return v.is_number();
    case Type::kBool:
      return v.is_boolean();
    case Type::kArray:
      return v.is_array();
    case Type::kObject:
      return v.is_object();
  }
  return false;
}

// Typed access to the manifest's JSON, with DATA_LOSS naming the manifest and the key.
class Keys {
 public:
  explicit Keys(const std::string& path) : path_(path) {}

  absl::Status Bad(const std::string& where, const std::string& why) const {
    return absl::DataLossError(absl::StrCat(path_, ": ", where, " ", why));
  }
  // object[key], which must be there.
  absl::StatusOr<const json*> Get(const json& object, const std::string& key, Type type,
                                  const std::string& where) const {
    if (!object.is_object() || !object.contains(key)) return Bad(where, "lacks \"" + key + "\"");
    const json& v = object[key];
    if (!IsA(v, type)) return Bad(absl::StrCat(where, ".", key), "has the wrong type");
    return &v;
  }
  const std::string& path() const { return path_; }

 private:
  const std::string& path_;
};

#define FUSEDPS_GET(lhs, expr)                  \
  auto lhs##_or = (expr);                       \
  if (!lhs##_or.ok()) return lhs##_or.status(); \
  const json& lhs = **lhs##_or

// object[key], a dtype's name ("fp32", "bf16", "int8", "none": the kernels' names), as the
// proto's enum.
template <typename Proto, typename Kernel>
absl::StatusOr<Proto> DTypeOfName(const Keys& k, const json& object, const std::string& key,
                                  const std::string& where, std::initializer_list<Kernel> allowed,
                                  const char* (*name_of)(Kernel)) {
  FUSEDPS_GET(v, k.Get(object, key, Type::kString, where));
  std::string names;
  for (Kernel d : allowed) {
    if (v.get<std::string>() == name_of(d)) return static_cast<Proto>(d);
    absl::StrAppend(&names, names.empty() ? "" : ", ", name_of(d));
  }
  return k.Bad(absl::StrCat(where, ".", key),
               absl::StrCat("is \"", v.get<std::string>(), "\", not one of ", names));
}

constexpr std::initializer_list<StateDType> kStateDTypes = {
    StateDType::kFloat32, StateDType::kBFloat16, StateDType::kInt8};
constexpr std::initializer_list<ParamsDType> kParamsDTypes = {ParamsDType::kFloat32,
                                                              ParamsDType::kBFloat16};

// Format 3: the group's "hyperparameters", protobuf's JSON mapping of fusedps.v1.Hyperparameters.
absl::Status HyperparametersV3(const Keys& k, const json& g, const std::string& where,
                               v1::Hyperparameters* h) {
  FUSEDPS_GET(v, k.Get(g, "hyperparameters", Type::kObject, where));
  const auto status = google::protobuf::util::JsonStringToMessage(v.dump(), h);
  if (!status.ok()) {
    return k.Bad(where, absl::StrCat("hyperparameters: ", std::string(status.message().data(),
                                                                      status.message().size())));
  }
  return absl::OkStatus();
}

// Format 2: each hyperparameter a key of the group; the storage keys optional.
absl::Status HyperparametersV2(const Keys& k, const json& g, const std::string& where,
                               v1::Hyperparameters* h) {
  for (auto [key, set] : {std::pair{"lr", &v1::Hyperparameters::set_lr},
                          {"beta1", &v1::Hyperparameters::set_beta1},
                          {"beta2", &v1::Hyperparameters::set_beta2},
                          {"eps", &v1::Hyperparameters::set_eps},
                          {"weight_decay", &v1::Hyperparameters::set_weight_decay}}) {
    FUSEDPS_GET(v, k.Get(g, key, Type::kNumber, where));
    (h->*set)(v.get<double>());
  }
  for (auto [key, set] : {std::pair{"amsgrad", &v1::Hyperparameters::set_amsgrad},
                          {"maximize", &v1::Hyperparameters::set_maximize}}) {
    FUSEDPS_GET(v, k.Get(g, key, Type::kBool, where));
    (h->*set)(v.get<bool>());
  }
  FUSEDPS_GET(decoupled, k.Get(g, "decoupled_weight_decay", Type::kBool, where));
  h->set_weight_decay_mode(decoupled.get<bool>() ? v1::WEIGHT_DECAY_MODE_DECOUPLED
                                                 : v1::WEIGHT_DECAY_MODE_L2);
  if (g.contains("state_dtype")) {
    absl::StatusOr<v1::StateDType> dtype =
        DTypeOfName<v1::StateDType>(k, g, "state_dtype", where, kStateDTypes, &StateDTypeName);
    if (!dtype.ok()) return dtype.status();
    h->set_state_dtype(*dtype);
  }
  if (g.contains("params_dtype")) {
    absl::StatusOr<v1::DType> dtype =
        DTypeOfName<v1::DType>(k, g, "params_dtype", where, kParamsDTypes, &ParamsDTypeName);
    if (!dtype.ok()) return dtype.status();
    h->set_params_dtype(*dtype);
  }
  if (g.contains("rounding_seed")) {
    FUSEDPS_GET(seed, k.Get(g, "rounding_seed", Type::kUnsigned, where));
    h->set_rounding_seed(seed.get<uint64_t>());
  }
  return absl::OkStatus();
}

absl::Status Groups(const Keys& k, const json& m, int format_version, Manifest* out) {
  FUSEDPS_GET(groups, k.Get(m, "param_groups", Type::kArray, "manifest"));
  for (size_t i = 0; i < groups.size(); ++i) {
    const std::string where = absl::StrCat("param_groups[", i, "]");
    FUSEDPS_GET(name, k.Get(groups[i], "name", Type::kString, where));
    v1::ParamGroup* group = out->add_param_groups();
    group->set_name(name.get<std::string>());
    const absl::Status s =
        format_version == 3
            ? HyperparametersV3(k, groups[i], where, group->mutable_hyperparameters())
            : HyperparametersV2(k, groups[i], where, group->mutable_hyperparameters());
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status Tensors(const Keys& k, const json& m, Manifest* out) {
  FUSEDPS_GET(tensors, k.Get(m, "tensors", Type::kArray, "manifest"));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const json& t = tensors[i];
    const std::string where = absl::StrCat("tensors[", i, "]");
    FUSEDPS_GET(name, k.Get(t, "name", Type::kString, where));
    FUSEDPS_GET(shape, k.Get(t, "shape", Type::kArray, where));
    FUSEDPS_GET(group, k.Get(t, "param_group", Type::kString, where));
    FUSEDPS_GET(step, k.Get(t, "step", Type::kUnsigned, where));
    if (step.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return k.Bad(where + ".step", "has the wrong type");
    }
    Manifest::Tensor* tensor = out->add_tensors();
    tensor->set_name(name.get<std::string>());
    for (const json& d : shape) {
      if (!d.is_number_integer()) return k.Bad(where + ".shape", "has a non-integer");
      tensor->add_shape(d.get<int64_t>());
    }
    tensor->set_param_group(group.get<std::string>());
    tensor->set_step(step.get<int64_t>());
    if (t.contains("params_dtype")) {
      absl::StatusOr<v1::DType> dtype =
          DTypeOfName<v1::DType>(k, t, "params_dtype", where, kParamsDTypes, &ParamsDTypeName);
      if (!dtype.ok()) return dtype.status();
      tensor->set_params_dtype(*dtype);
    }
    if (t.contains("state_dtype")) {
      absl::StatusOr<v1::StateDType> dtype =
          DTypeOfName<v1::StateDType>(k, t, "state_dtype", where, kStateDTypes, &StateDTypeName);
      if (!dtype.ok()) return dtype.status();
      tensor->set_state_dtype(*dtype);
    }
  }
  return absl::OkStatus();
}

absl::Status Reply(const Keys& k, const json& r, const std::string& at, Manifest::Reply* reply) {
  FUSEDPS_GET(seq, k.Get(r, "sequence_number", Type::kUnsigned, at));
  FUSEDPS_GET(version, k.Get(r, "version", Type::kUnsigned, at));
  FUSEDPS_GET(skipped, k.Get(r, "skipped", Type::kBool, at));
  FUSEDPS_GET(updated, k.Get(r, "tensors_updated", Type::kUnsigned, at));
  FUSEDPS_GET(bytes, k.Get(r, "grad_bytes", Type::kUnsigned, at));
  reply->set_sequence_number(seq.get<uint64_t>());
  reply->set_version(version.get<uint64_t>());
  reply->set_skipped(skipped.get<bool>());
  reply->set_tensors_updated(updated.get<uint32_t>());
  reply->set_grad_bytes(bytes.get<uint64_t>());
  if (r.contains("round_workers")) {  // Checkpoints before it have none: 0, as async's.
    FUSEDPS_GET(workers, k.Get(r, "round_workers", Type::kUnsigned, at));
    reply->set_round_workers(workers.get<uint32_t>());
  }
  if (r.contains("round_timed_out")) {  // Nor these: false and none.
    FUSEDPS_GET(timed_out, k.Get(r, "round_timed_out", Type::kBool, at));
    reply->set_round_timed_out(timed_out.get<bool>());
    FUSEDPS_GET(missing, k.Get(r, "missing_replicas", Type::kArray, at));
    for (const json& id : missing) {
      if (!id.is_string()) {
        return k.Bad(at + ".missing_replicas", "holds something other than client_ids");
      }
      reply->add_missing_replicas(id.get<std::string>());
    }
  }
  return absl::OkStatus();
}

absl::Status Retries(const Keys& k, const json& m, Manifest* out) {
  FUSEDPS_GET(clients, k.Get(m, "retry_table", Type::kArray, "manifest"));
  for (size_t i = 0; i < clients.size(); ++i) {
    const std::string where = absl::StrCat("retry_table[", i, "]");
    FUSEDPS_GET(id, k.Get(clients[i], "client_id", Type::kString, where));
    FUSEDPS_GET(highest, k.Get(clients[i], "highest", Type::kUnsigned, where));
    FUSEDPS_GET(replies, k.Get(clients[i], "replies", Type::kArray, where));
    Manifest::RetryClient* client = out->add_retry_table();
    client->set_client_id(id.get<std::string>());
    client->set_highest(highest.get<uint64_t>());
    for (size_t r = 0; r < replies.size(); ++r) {
      const absl::Status s =
          Reply(k, replies[r], absl::StrCat(where, ".replies[", r, "]"), client->add_replies());
      if (!s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

absl::Status Codebooks(const Keys& k, const json& m, Manifest* out) {
  if (!m.contains("int8_codebooks")) return absl::OkStatus();  // The reader says if it must be.
  FUSEDPS_GET(books, k.Get(m, "int8_codebooks", Type::kObject, "manifest"));
  Manifest::Int8Codebooks* to = out->mutable_int8_codebooks();
  for (auto [key, add] :
       {std::pair{"exp_avg", to->mutable_exp_avg()}, {"exp_avg_sq", to->mutable_exp_avg_sq()}}) {
    FUSEDPS_GET(values, k.Get(books, key, Type::kArray, "int8_codebooks"));
    for (size_t i = 0; i < values.size(); ++i) {
      if (!values[i].is_number()) {
        return k.Bad(absl::StrCat("int8_codebooks.", key, "[", i, "]"), "has the wrong type");
      }
      add->Add(static_cast<float>(values[i].get<double>()));
    }
  }
  return absl::OkStatus();
}

absl::Status Files(const Keys& k, const json& m, Manifest* out) {
  FUSEDPS_GET(files, k.Get(m, "files", Type::kObject, "manifest"));
  for (const auto& [name, entry] : files.items()) {
    if (!entry.is_object() || !entry.contains("bytes") || !entry["bytes"].is_number_unsigned() ||
        !entry.contains("crc32") || !entry["crc32"].is_number_unsigned() ||
        entry["crc32"].get<uint64_t>() > 0xffffffffu) {
      return absl::DataLossError(absl::StrCat(k.path(), ": a bad entry for ", name));
    }
    Manifest::File& file = (*out->mutable_files())[name];
    file.set_bytes(entry["bytes"].get<uint64_t>());
    file.set_crc32(entry["crc32"].get<uint32_t>());
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::CheckpointManifest> LegacyManifestToProto(const json& m,
                                                             const std::string& path) {
  const Keys k(path);
  Manifest out;
  FUSEDPS_GET(format, k.Get(m, "format", Type::kString, "manifest"));
  FUSEDPS_GET(format_version, k.Get(m, "format_version", Type::kUnsigned, "manifest"));
  FUSEDPS_GET(serial, k.Get(m, "serial", Type::kUnsigned, "manifest"));
  FUSEDPS_GET(version, k.Get(m, "version", Type::kUnsigned, "manifest"));
  out.set_format(format.get<std::string>());
  out.set_format_version(format_version.get<uint32_t>());
  out.set_serial(serial.get<uint64_t>());
  out.set_version(version.get<uint64_t>());
  // Informational: taken when they have their type.
  if (m.contains("server_version") && m["server_version"].is_string()) {
    out.set_server_version(m["server_version"].get<std::string>());
  }
  if (m.contains("created_unix_seconds") && m["created_unix_seconds"].is_number()) {
    out.set_created_unix_seconds(m["created_unix_seconds"].get<double>());
  }
  FUSEDPS_GET(copy, k.Get(m, "param_copy_dtype", Type::kString, "manifest"));
  {
    // "none", "bf16" or "fp16" (--param-copy-dtype's spelling) before format 4.
    const std::string name = copy.get<std::string>();
    absl::StatusOr<ParamCopyDType> parsed = ParseParamCopyDType(name);
    if (!parsed.ok()) {
      return k.Bad("param_copy_dtype",
                   absl::StrCat("is \"", name, "\", not one of none, bf16, fp16"));
    }
    out.set_param_copy_dtype(static_cast<v1::DType>(*parsed));  // The proto's codes; kNone: 0.
  }
  if (m.contains("plan_hash")) {  // Checkpoints from before sharding have none.
    FUSEDPS_GET(plan_hash, k.Get(m, "plan_hash", Type::kString, "manifest"));
    out.set_plan_hash(plan_hash.get<std::string>());
  }
  if (absl::Status s = Groups(k, m, static_cast<int>(out.format_version()), &out); !s.ok()) {
    return s;
  }
  if (absl::Status s = Tensors(k, m, &out); !s.ok()) return s;
  if (absl::Status s = Retries(k, m, &out); !s.ok()) return s;
  if (absl::Status s = Codebooks(k, m, &out); !s.ok()) return s;
  if (absl::Status s = Files(k, m, &out); !s.ok()) return s;
  return out;
}

#undef FUSEDPS_GET

}  // namespace fusedps::checkpoint
