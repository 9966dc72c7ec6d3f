#include "kernels/hashed_rows.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace fusedps {
namespace {

// A broken invariant: the caller's bug, not bad input. Crash loudly.
[[noreturn]] void Die(const char* what) {
  std::fprintf(stderr, "HashedRowIndex: %s\n", what);
  std::abort();
}

}  // namespace

bool HashedRowIndexState::operator==(const HashedRowIndexState& other) const {
  return capacity == other.capacity && slots == other.slots && keys == other.keys &&
         stamps == other.stamps && evictions_total == other.evictions_total &&
         lookups_total == other.lookups_total && lookup_misses_total == other.lookup_misses_total;
}

HashedRowIndex::HashedRowIndex(int64_t capacity) : capacity_(capacity) {
  if (capacity < 0) Die("capacity below 0");
  const auto n = static_cast<size_t>(capacity);
  key_of_slot_.assign(n, 0);
  stamp_of_slot_.assign(n, -1);
  older_.assign(n, -1);
  newer_.assign(n, -1);
  free_slots_.resize(n);
  std::iota(free_slots_.rbegin(), free_slots_.rend(), int64_t{0});  // Descending.
}

absl::StatusOr<HashedRowIndex> HashedRowIndex::Import(const HashedRowIndexState& state) {
  if (state.capacity < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("state.capacity = ", state.capacity, " is below 0"));
  }
  if (state.keys.size() != state.slots.size() || state.stamps.size() != state.slots.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state.slots, state.keys and state.stamps have different lengths: ", state.slots.size(),
        ", ", state.keys.size(), ", ", state.stamps.size()));
  }
  const struct {
    const char* name;
    int64_t value;
  } counters[] = {{"evictions_total", state.evictions_total},
                  {"lookups_total", state.lookups_total},
                  {"lookup_misses_total", state.lookup_misses_total}};
  for (const auto& counter : counters) {
    if (counter.value < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("state.", counter.name, " = ", counter.value, " is below 0"));
    }
  }
  if (state.lookup_misses_total > state.lookups_total) {
    return absl::InvalidArgumentError(
        absl::StrCat("state.lookup_misses_total = ", state.lookup_misses_total,
                     " is above state.lookups_total = ", state.lookups_total));
  }
  HashedRowIndex index(state.capacity);
  std::vector<int64_t> order(state.slots.size());
  for (size_t i = 0; i < state.slots.size(); ++i) {
    const int64_t slot = state.slots[i];
    if (slot < 0 || slot >= state.capacity || (i > 0 && slot <= state.slots[i - 1])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "state.slots[", i, "] = ", slot, " is outside [", i > 0 ? state.slots[i - 1] + 1 : 0,
          ", ", state.capacity, ") (slots ascend, below capacity)"));
    }
    if (state.stamps[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("state.stamps[", i, "] = ", state.stamps[i], " is below 0"));
    }
    if (!index.slot_of_key_.emplace(state.keys[i], slot).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("state.keys[", i, "] = ", state.keys[i], " repeats an earlier key"));
    }
    index.key_of_slot_[slot] = state.keys[i];
    order[i] = static_cast<int64_t>(i);
  }
  // The eviction order: (stamp, slot) ascending; slots already ascend, so a stable sort by stamp.
  std::stable_sort(order.begin(), order.end(),
                   [&state](int64_t a, int64_t b) { return state.stamps[a] < state.stamps[b]; });
  for (const int64_t i : order) index.AppendNewest(state.slots[i], state.stamps[i]);
  // The free slots: the others, descending.
  index.free_slots_.clear();
  for (int64_t slot = state.capacity - 1; slot >= 0; --slot) {
    if (index.stamp_of_slot_[slot] < 0) index.free_slots_.push_back(slot);
  }
  index.evictions_total_ = state.evictions_total;
  index.lookups_total_ = state.lookups_total;
  index.lookup_misses_total_ = state.lookup_misses_total;
  return index;
}

HashedRowIndexState HashedRowIndex::Export() const {
  HashedRowIndexState state;
  state.capacity = capacity_;
  for (int64_t slot = 0; slot < capacity_; ++slot) {
    if (stamp_of_slot_[slot] < 0) continue;
    state.slots.push_back(slot);
    state.keys.push_back(key_of_slot_[slot]);
    state.stamps.push_back(stamp_of_slot_[slot]);
  }
  state.evictions_total = evictions_total_;
  state.lookups_total = lookups_total_;
  state.lookup_misses_total = lookup_misses_total_;
  return state;
}

std::vector<int64_t> HashedRowIndex::Lookup(absl::Span<const int64_t> keys) {
  std::vector<int64_t> slots(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    slots[i] = FindSlot(keys[i]);
    lookup_misses_total_ += slots[i] < 0;
  }
  lookups_total_ += static_cast<int64_t>(keys.size());
  return slots;
}

int64_t HashedRowIndex::FindSlot(int64_t key) const {
  const auto it = slot_of_key_.find(key);
  return it == slot_of_key_.end() ? -1 : it->second;
}

absl::StatusOr<HashedRowIndex::SlotPlan> HashedRowIndex::PlanSlots(
    absl::Span<const int64_t> keys) const {
  if (static_cast<int64_t>(keys.size()) > capacity_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "keys: ", keys.size(), " unique keys exceed the table's capacity of ", capacity_, " rows"));
  }
  SlotPlan plan;
  plan.keys.assign(keys.begin(), keys.end());
  plan.slots.assign(keys.size(), -1);
  plan.generation = generation_;
  absl::flat_hash_set<int64_t> seen;
  absl::flat_hash_set<int64_t> own_slots;  // Slots the push's keys hold already.
  seen.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!seen.insert(keys[i]).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("keys[", i, "] = ", keys[i], " repeats an earlier key"));
    }
    plan.slots[i] = FindSlot(keys[i]);
    if (plan.slots[i] >= 0) {
      own_slots.insert(plan.slots[i]);
    } else {
      plan.created.push_back(static_cast<int64_t>(i));
    }
  }
  size_t next_free = free_slots_.size();  // free_slots_[next_free - 1] is the next one.
  int64_t candidate = oldest_;
  for (const int64_t i : plan.created) {
    if (next_free > 0) {
      plan.slots[i] = free_slots_[--next_free];
      continue;
    }
    // Full: the oldest slot not the push's own. It exists, as keys.size() <= capacity.
    while (own_slots.contains(candidate)) candidate = newer_[candidate];
    plan.slots[i] = candidate;
    plan.evicted_keys.push_back(key_of_slot_[candidate]);
    candidate = newer_[candidate];
  }
  return plan;
}

void HashedRowIndex::Commit(const SlotPlan& plan, int64_t step) {
  if (plan.generation != generation_) Die("Commit of a plan made before another Commit");
  if (newest_ >= 0 && step <= stamp_of_slot_[newest_]) Die("Commit's step is not above a stamp");
  for (const int64_t key : plan.evicted_keys) slot_of_key_.erase(key);
  for (const int64_t i : plan.created) {
    const int64_t slot = plan.slots[i];
    if (stamp_of_slot_[slot] < 0) {
      if (free_slots_.empty() || free_slots_.back() != slot) Die("plan's free slot is not next");
      free_slots_.pop_back();
    }
    key_of_slot_[slot] = plan.keys[i];
    slot_of_key_[plan.keys[i]] = slot;
  }
  evictions_total_ += static_cast<int64_t>(plan.evicted_keys.size());
  std::vector<int64_t> slots = plan.slots;
  std::sort(slots.begin(), slots.end());
  for (const int64_t slot : slots) {
    if (stamp_of_slot_[slot] >= 0) Unlink(slot);
    AppendNewest(slot, step);
  }
  ++generation_;
}

void HashedRowIndex::Unlink(int64_t slot) {
  const int64_t older = older_[slot], newer = newer_[slot];
  (older >= 0 ? newer_[older] : oldest_) = newer;
  (newer >= 0 ? older_[newer] : newest_) = older;
  older_[slot] = newer_[slot] = -1;
}

void HashedRowIndex::AppendNewest(int64_t slot, int64_t stamp) {
  stamp_of_slot_[slot] = stamp;
  older_[slot] = newest_;
  newer_[slot] = -1;
  (newest_ >= 0 ? newer_[newest_] : oldest_) = slot;
  newest_ = slot;
}

}  // namespace fusedps
