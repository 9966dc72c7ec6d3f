// retry_table.h: which pushes each trainer has already had applied, so that a retry is applied
// exactly once, in bounded memory.
//
// A push that carries a client_id and a sequence_number > 0 is tracked. Per client the table
// keeps the highest sequence number taken and the replies of its last kRepliesPerClient pushes
// (applied or skipped), and it keeps at most `max_clients` clients, forgetting the one used
// least recently (never one with a push in flight). A push is classified as:
//   kNew       above the client's highest: apply it (Begin marks it in flight);
//   kInFlight  the same sequence number is being applied: its reply will be this one's too;
//   kDone      a remembered push: answer with its reply, duplicate = true, apply nothing;
//   kStale     not above the highest, and not remembered: apply nothing (ABORTED).
// The update engine calls Begin when it queues a step and Finish or Abandon when the step is
// done or failed; gRPC threads call Await at header time, so that a retry is answered before its
// payload is read (Lookup is for tests and tools). Exactly-once holds within the bounds: a client
// forgotten by the LRU (max_clients others pushed since) can have an old push applied again.
//
// Thread-safe.
//
// Usage:
//   RetryTable table(10000);
//   RetryTable::Verdict v = table.Begin("trainer-0", 7);  // engine: kNew -> queue the step
//   ... table.Finish("trainer-0", 7, reply)  -> runs the waiters Await added meanwhile
#ifndef FUSEDPS_SERVER_STORE_RETRY_TABLE_H_
#define FUSEDPS_SERVER_STORE_RETRY_TABLE_H_

#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/mutex.h"

namespace fusedps {

// What a push's reply says (PushGradientsResponse).
struct PushReply {
  uint64_t version = 0;
  bool skipped = false;
  uint32_t tensors_updated = 0;
  uint64_t grad_bytes = 0;
  bool duplicate = false;
  uint32_t round_workers = 0;  // sync mode: the pushes the round's step averaged.
  // sync mode: the round closed by its timeout, and the client_ids it waited for in vain
  // (PushGradientsResponse.missing_replicas).
  bool round_timed_out = false;
  std::vector<std::string> missing_replicas;
  // The version the commit's pull read (PushCommit.pull); 0 without one. Set on the way out,
  // after the step: never in the table (a duplicate's reply carries none).
  uint64_t pulled_version = 0;
};

class RetryTable {
 public:
  static constexpr size_t kRepliesPerClient = 16;
  static constexpr size_t kMaxClientIdBytes = 256;

  enum class Kind { kUntracked, kNew, kInFlight, kDone, kStale };
  struct Verdict {
    Kind kind = Kind::kUntracked;
    PushReply reply;       // kDone: the first reply, with duplicate = true.
    uint64_t highest = 0;  // kStale: the client's highest sequence number.
  };
  // Runs with the reply of the push it waits for (duplicate = true), or its error.
  using Waiter = std::function<void(absl::StatusOr<PushReply>)>;

  explicit RetryTable(size_t max_clients);

  // True when a push with these fields is tracked (client_id non-empty, sequence_number > 0).
  static bool Tracked(absl::string_view client_id, uint64_t sequence_number) {
    return !client_id.empty() && sequence_number != 0;
  }

  // Classifies a push without changing anything (but the client's recency).
  Verdict Lookup(absl::string_view client_id, uint64_t sequence_number) ABSL_LOCKS_EXCLUDED(mu_);

  // Lookup, and for kInFlight registers `waiter`, which runs (once) when that push is finished
  // or abandoned; for the other kinds `waiter` is dropped without running.
  Verdict Await(absl::string_view client_id, uint64_t sequence_number, Waiter waiter)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Lookup, and for kNew marks the push in flight (it becomes the client's highest); for
  // kInFlight registers `waiter` (when given) as Await does, under the same lock.
  Verdict Begin(absl::string_view client_id, uint64_t sequence_number, Waiter waiter = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The push begun under these keys is done with `reply`: remembered, and its waiters run
  // (outside the table's lock) with it, duplicate = true.
  void Finish(absl::string_view client_id, uint64_t sequence_number, const PushReply& reply)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The push begun under these keys failed: forgotten (a retry may apply it), and its waiters
  // run with `error`.
  void Abandon(absl::string_view client_id, uint64_t sequence_number, const absl::Status& error)
      ABSL_LOCKS_EXCLUDED(mu_);

  // What a checkpoint keeps of one client: its highest sequence number and its remembered
  // replies (by sequence number), as of the pushes done so far.
  struct ClientRecord {
    std::string client_id;
    uint64_t highest = 0;
    std::vector<std::pair<uint64_t, PushReply>> replies;  // Ascending sequence numbers.
  };
  // Every client's record, most recently used first, leaving out the pushes in flight (as if
  // they had not begun): the table as of the last push finished. The checkpoint takes it when
  // every push before its cut is finished and none after it is, so that the records match the
  // cut exactly.
  std::vector<ClientRecord> Export() const ABSL_LOCKS_EXCLUDED(mu_);
  // Replaces the contents with `records` (most recently used first), keeping the first
  // max_clients. For a restore, before any push. REQUIRES: no push in flight.
  void Import(const std::vector<ClientRecord>& records) ABSL_LOCKS_EXCLUDED(mu_);

  size_t clients() const ABSL_LOCKS_EXCLUDED(mu_);      // Clients remembered now.
  uint64_t evictions() const ABSL_LOCKS_EXCLUDED(mu_);  // Clients forgotten by the LRU so far.

 private:
  struct Entry {
    bool in_flight = false;
    PushReply reply;
    std::vector<Waiter> waiters;
    uint64_t previous_highest = 0;  // The client's highest before this push began.
  };
  struct Client {
    uint64_t highest = 0;
    std::map<uint64_t, Entry> pushes;      // By sequence number; at most kRepliesPerClient done.
    std::list<std::string>::iterator lru;  // Its place in lru_.
  };

  Verdict ClassifyLocked(Client* client, uint64_t sequence_number) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Also marks it most recently used.
  Client* FindLocked(absl::string_view client_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // REQUIRES: not present.
  Client& AddLocked(absl::string_view client_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Classifies; for kInFlight moves *waiter (when set) into that push's waiters.
  Verdict AwaitLocked(Client* client, uint64_t sequence_number, Waiter* waiter)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EvictLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<Waiter> TakeLocked(absl::string_view client_id, uint64_t sequence_number,
                                 const PushReply* reply) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t max_clients_;
  mutable Mutex mu_;
  absl::flat_hash_map<std::string, Client> clients_ ABSL_GUARDED_BY(mu_);
  // Client ids, most recently used first.
  std::list<std::string> lru_ ABSL_GUARDED_BY(mu_);
  uint64_t evictions_ ABSL_GUARDED_BY(mu_) = 0;
};

// ABORTED for a push that RetryTable classified kStale.
absl::Status StalePushError(uint64_t sequence_number, uint64_t highest);

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_STORE_RETRY_TABLE_H_
