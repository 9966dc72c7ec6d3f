// hashed_rows.h: the slots of one hashed embedding table on the CPU: which int64 feature key
// holds which of the table's `capacity` rows, which rows are free, and which to evict.
//
// Any int64 is a key. A key gets a slot (a row index in [0, capacity)) the first time an applied
// push names it, and keeps it until it is evicted; its row then starts from row_init.h's
// initializer (hashed_row_step.h writes it). Each used slot has a stamp: the table step at
// which its row was last created or updated. A push's new keys, taken in the order PlanSlots
// is given them, take:
//   1. free slots, smallest index first (a slot is free until its first use: nothing frees one);
//   2. then the used slots in ascending (stamp, slot) order, i.e. least recently updated first,
//      ties to the smallest slot, skipping the slots of the push's own keys: a key a push
//      names is never evicted by that push. The keys of those slots are evicted (counted).
// A lookup reads slots only: it creates nothing, evicts nothing and stamps nothing.
//
// A push resolves its keys in two phases, so that it can be refused or skipped (a non-finite
// gradient) with nothing changed: PlanSlots is const and returns the plan (or the error);
// Commit applies it and stamps every key of the push with the table's new step.
//
// Thread safety: none. One thread at a time, Lookup included (it counts): the engine's single
// writer, as for dense state. A plan is valid until the next Commit (Commit checks).
//
// Usage:
//   HashedRowIndex index(capacity);
//   absl::StatusOr<HashedRowIndex::SlotPlan> plan = index.PlanSlots(unique_keys);
//   if (!plan.ok()) ...;  // more unique keys than capacity: nothing changed
//   index.Commit(*plan, new_step);  // then initialize the rows of plan->created, update all
#ifndef FUSEDPS_KERNELS_HASHED_ROWS_H_
#define FUSEDPS_KERNELS_HASHED_ROWS_H_

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace fusedps {

// Everything a bit-exact restore of a HashedRowIndex needs, as plain vectors (a checkpoint's):
// the used slots in ascending slot order, each with its key and stamp, and the counters.
// Free slots are the others; the eviction order follows from (stamp, slot).
struct HashedRowIndexState {
  int64_t capacity = 0;
  std::vector<int64_t> slots;   // Ascending, each in [0, capacity).
  std::vector<int64_t> keys;    // keys[i] is in slots[i]; unique.
  std::vector<int64_t> stamps;  // stamps[i] is slots[i]'s; >= 0.
  int64_t evictions_total = 0;
  int64_t lookups_total = 0;
  int64_t lookup_misses_total = 0;  // <= lookups_total.

  bool operator==(const HashedRowIndexState& other) const;
  bool operator!=(const HashedRowIndexState& other) const { return !(*this == other); }
};

class HashedRowIndex {
 public:
  // Where a push's keys go, from PlanSlots; Commit applies it. Its fields are for reading.
  struct SlotPlan {
    std::vector<int64_t> keys;          // The push's unique keys, in the order given.
    std::vector<int64_t> slots;         // slots[i]: keys[i]'s slot once committed.
    std::vector<int64_t> created;       // The i whose keys[i] get a new row, ascending.
    std::vector<int64_t> evicted_keys;  // The keys whose slots they take, oldest first.
    uint64_t generation = 0;            // The index's state the plan was made for.
  };

  // An empty index of `capacity` slots, all free. REQUIRES: capacity >= 0 (aborts otherwise).
  explicit HashedRowIndex(int64_t capacity);

  // An index from a state Export returned (or a checkpoint's). Errors, INVALID_ARGUMENT naming
  // the field: capacity < 0; slots, keys and stamps of different lengths; a slot outside
  // [0, capacity) or not above the previous one; a repeated key; a stamp or counter below 0;
  // lookup misses above lookups.
  static absl::StatusOr<HashedRowIndex> Import(const HashedRowIndexState& state);

  // The whole index. Import(Export()) continues exactly as this index would.
  HashedRowIndexState Export() const;

  // Per key, its slot, or -1 when the table holds no row for it. Creates, evicts and stamps
  // nothing; counts keys.size() lookups (duplicates each) and the -1s as misses.
  std::vector<int64_t> Lookup(absl::Span<const int64_t> keys);

  // Where a push of these keys would go; changes nothing and counts nothing. keys are the
  // push's unique keys (coalesced); new keys take slots in their order (the rules above).
  // Errors, INVALID_ARGUMENT: more keys than capacity ("keys: 17 unique keys exceed the
  // table's capacity of 16 rows"; refused whole, as it can never fit); a repeated key.
  absl::StatusOr<SlotPlan> PlanSlots(absl::Span<const int64_t> keys) const;

  // Applies `plan`: evicts its evicted_keys, gives its new keys their slots, and stamps every
  // slot of the plan with `step` (the table's step after the push). Nothing else changes.
  // REQUIRES (aborts otherwise): the plan is PlanSlots' on this index with no Commit or Import
  // since; step is above every stamp in the index.
  void Commit(const SlotPlan& plan, int64_t step);

  // Reads, counting nothing.
  int64_t FindSlot(int64_t key) const;  // -1 when absent.
  // REQUIRES: slot in [0, capacity). stamp is -1 for a free slot (key then unspecified).
  int64_t SlotKey(int64_t slot) const { return key_of_slot_[slot]; }
  int64_t SlotStamp(int64_t slot) const { return stamp_of_slot_[slot]; }

  int64_t capacity() const { return capacity_; }
  int64_t rows_in_use() const { return capacity_ - static_cast<int64_t>(free_slots_.size()); }
  int64_t evictions_total() const { return evictions_total_; }
  int64_t lookups_total() const { return lookups_total_; }
  int64_t lookup_misses_total() const { return lookup_misses_total_; }

 private:
  void Unlink(int64_t slot);
  void AppendNewest(int64_t slot, int64_t stamp);

  int64_t capacity_ = 0;
  absl::flat_hash_map<int64_t, int64_t> slot_of_key_;
  std::vector<int64_t> key_of_slot_;    // [capacity]
  std::vector<int64_t> stamp_of_slot_;  // [capacity]; -1: free.
  // The used slots as a list in ascending (stamp, slot) order, oldest first: a Commit's stamp is
  // above all others, so its slots, ascending, go to the newest end. -1 ends the list.
  std::vector<int64_t> older_, newer_;  // [capacity]
  int64_t oldest_ = -1, newest_ = -1;
  std::vector<int64_t> free_slots_;  // Descending: back() is the smallest.
  int64_t evictions_total_ = 0;
  int64_t lookups_total_ = 0;
  int64_t lookup_misses_total_ = 0;
  uint64_t generation_ = 0;  // Counts Commits.
};

}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_HASHED_ROWS_H_
