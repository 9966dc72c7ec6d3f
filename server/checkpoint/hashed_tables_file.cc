#include "server/checkpoint/hashed_tables_file.h"

#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace fusedps::checkpoint {
namespace {

std::string SlotKeysName(const std::string& table) { return table + ".slot_keys"; }
std::string SlotStampsName(const std::string& table) { return table + ".slot_stamps"; }

absl::Span<const uint8_t> Bytes(const std::vector<int64_t>& v) {
  return absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(v.data()),
                             v.size() * sizeof(int64_t));
}

}  // namespace

v1::CheckpointManifest::HashedTable HashedTableToManifest(const HashedKeys& keys,
                                                          const HashedRowIndexState& index) {
  v1::CheckpointManifest::HashedTable out;
  out.set_seed(keys.seed);
  out.set_init_std(keys.init_std);
  out.set_evictions_total(index.evictions_total);
  out.set_lookups_total(index.lookups_total);
  out.set_lookup_misses_total(index.lookup_misses_total);
  return out;
}

absl::StatusOr<safetensors::WriteResult> WriteHashedTables(const ShardCut& cut,
                                                           const std::string& path) {
  // Per slot arrays (the file's form) of every hashed table, alive until the write returns.
  std::vector<std::vector<int64_t>> arrays;
  std::vector<safetensors::TensorView> views;
  arrays.reserve(2 * cut.hashed_tables.size());
  for (const auto& [tensor, index] : cut.hashed_tables) {
    const std::string& name = cut.view->tensor(tensor).name;
    std::vector<int64_t>& keys = arrays.emplace_back(index.capacity, 0);
    std::vector<int64_t>& stamps = arrays.emplace_back(index.capacity, -1);
    for (size_t i = 0; i < index.slots.size(); ++i) {
      keys[index.slots[i]] = index.keys[i];
      stamps[index.slots[i]] = index.stamps[i];
    }
    views.push_back({SlotKeysName(name), safetensors::DType::kI64, {index.capacity}, Bytes(keys)});
    views.push_back(
        {SlotStampsName(name), safetensors::DType::kI64, {index.capacity}, Bytes(stamps)});
  }
  return safetensors::WriteFile(path, views, {{}, /*fsync=*/true});
}

absl::StatusOr<HashedKeys> HashedKeysFromManifest(
    const v1::CheckpointManifest::HashedTable& hashed) {
  const double init_std = hashed.init_std();
  const auto as_float = static_cast<float>(init_std);
  if (!std::isfinite(init_std) || init_std < 0 || static_cast<double>(as_float) != init_std) {
    return absl::DataLossError(
        absl::StrCat("init_std = ", init_std, " is not a finite fp32 value >= 0"));
  }
  return HashedKeys{hashed.seed(), as_float};
}

absl::Status ReadHashedTables(const Loaded& checkpoint, const v1::CheckpointManifest& manifest,
                              RestoredShard* shard) {
  bool any = false;
  for (const TensorMeta& t : shard->tensors) any |= t.hashed.has_value();
  if (!any) return absl::OkStatus();
  absl::StatusOr<safetensors::File> file = ReadWholeFile(checkpoint, kHashedTablesFileName);
  if (!file.ok()) return file.status();
  const std::string path = absl::StrCat(checkpoint.directory, "/", kHashedTablesFileName);
  size_t expected_entries = 0;
  for (uint32_t t = 0; t < shard->tensors.size(); ++t) {
    const TensorMeta& meta = shard->tensors[t];
    if (!meta.hashed.has_value()) continue;
    expected_entries += 2;
    const int64_t capacity = meta.shape[0];
    std::vector<int64_t> arrays[2];
    const std::string names[2] = {SlotKeysName(meta.name), SlotStampsName(meta.name)};
    for (int k = 0; k < 2; ++k) {
      const safetensors::Entry* entry = file->Find(names[k]);
      if (entry == nullptr || entry->dtype != safetensors::DType::kI64 ||
          entry->shape != std::vector<int64_t>{capacity}) {
        return absl::DataLossError(absl::StrCat(path, ": no I64 entry ", QuoteName(names[k]),
                                                " of shape [", capacity,
                                                "] (the table's capacity)"));
      }
      const absl::Span<const uint8_t> data = file->Data(*entry);
      arrays[k].resize(static_cast<size_t>(capacity));
      std::memcpy(arrays[k].data(), data.data(), data.size());
    }
    const v1::CheckpointManifest::HashedTable& counters =
        manifest.tensors(static_cast<int>(t)).hashed();
    HashedRowIndexState state;
    state.capacity = capacity;
    for (int64_t slot = 0; slot < capacity; ++slot) {
      const int64_t stamp = arrays[1][static_cast<size_t>(slot)];
      if (stamp == -1) continue;
      if (stamp < 0 || stamp > shard->steps[t]) {
        return absl::DataLossError(absl::StrCat(path, ": ", names[1], "[", slot, "] = ", stamp,
                                                " is not -1 (free) or a step in [0, ",
                                                shard->steps[t], "] (the table's)"));
      }
      state.slots.push_back(slot);
      state.keys.push_back(arrays[0][static_cast<size_t>(slot)]);
      state.stamps.push_back(stamp);
    }
    state.evictions_total = counters.evictions_total();
    state.lookups_total = counters.lookups_total();
    state.lookup_misses_total = counters.lookup_misses_total();
    if (absl::Status s = HashedRowIndex::Import(state).status(); !s.ok()) {
      return absl::DataLossError(
          absl::StrCat(path, ": table ", QuoteName(meta.name), ": ", s.message()));
    }
    shard->hashed_tables.emplace(t, std::move(state));
  }
  if (file->entries().size() != expected_entries) {
    return absl::DataLossError(absl::StrCat(path, " holds ", file->entries().size(),
                                            " entries; the manifest's hashed tables make ",
                                            expected_entries));
  }
  return absl::OkStatus();
}

}  // namespace fusedps::checkpoint
