#include "server/store/retry_table.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fusedps {

absl::Status StalePushError(uint64_t sequence_number, uint64_t highest) {
  return absl::AbortedError(absl::StrCat(
      "header.sequence_number = ", sequence_number, " is not above ", highest,
      ", the highest this client_id has pushed, and its reply is no longer kept: it is not "
      "applied"));
}

RetryTable::RetryTable(size_t max_clients) : max_clients_(std::max<size_t>(max_clients, 1)) {}

RetryTable::Verdict RetryTable::ClassifyLocked(Client* client, uint64_t sequence_number) const {
  Verdict verdict;
  if (client == nullptr || sequence_number > client->highest) {
    verdict.kind = Kind::kNew;
    return verdict;
  }
  auto it = client->pushes.find(sequence_number);
  if (it == client->pushes.end()) {
    verdict.kind = Kind::kStale;
    verdict.highest = client->highest;
  } else if (it->second.in_flight) {
    verdict.kind = Kind::kInFlight;
  } else {
    verdict.kind = Kind::kDone;
    verdict.reply = it->second.reply;
    verdict.reply.duplicate = true;
  }
  return verdict;
}

RetryTable::Client* RetryTable::FindLocked(absl::string_view client_id) {
  auto it = clients_.find(client_id);
  if (it == clients_.end()) return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second.lru);
  return &it->second;
}

RetryTable::Client& RetryTable::AddLocked(absl::string_view client_id) {
  lru_.emplace_front(client_id);
  Client& client = clients_[client_id];
  client.lru = lru_.begin();
  EvictLocked();
  return client;
}

void RetryTable::EvictLocked() {
  // The least recently used client without a push in flight goes first; the newest (front)
  // is never evicted here, since it is being added.
  for (auto it = lru_.end(); clients_.size() > max_clients_ && it != std::next(lru_.begin());) {
    --it;
    auto client = clients_.find(*it);
    const bool in_flight = std::any_of(client->second.pushes.begin(), client->second.pushes.end(),
                                       [](const auto& push) { return push.second.in_flight; });
    if (in_flight) continue;
    clients_.erase(client);
    it = lru_.erase(it);
    ++evictions_;
  }
}

RetryTable::Verdict RetryTable::Lookup(absl::string_view client_id, uint64_t sequence_number) {
  if (!Tracked(client_id, sequence_number)) return Verdict{};
  MutexLock lock(&mu_);
  return ClassifyLocked(FindLocked(client_id), sequence_number);
}

RetryTable::Verdict RetryTable::AwaitLocked(Client* client, uint64_t sequence_number,
                                            Waiter* waiter) {
  Verdict verdict = ClassifyLocked(client, sequence_number);
  if (verdict.kind == Kind::kInFlight && *waiter) {
    client->pushes[sequence_number].waiters.push_back(std::move(*waiter));
  }
  return verdict;
}

RetryTable::Verdict RetryTable::Await(absl::string_view client_id, uint64_t sequence_number,
                                      Waiter waiter) {
  if (!Tracked(client_id, sequence_number)) return Verdict{};
  MutexLock lock(&mu_);
  return AwaitLocked(FindLocked(client_id), sequence_number, &waiter);
}

RetryTable::Verdict RetryTable::Begin(absl::string_view client_id, uint64_t sequence_number,
                                      Waiter waiter) {
  if (!Tracked(client_id, sequence_number)) return Verdict{};
  MutexLock lock(&mu_);
  Client* found = FindLocked(client_id);
  Verdict verdict = AwaitLocked(found, sequence_number, &waiter);
  if (verdict.kind != Kind::kNew) return verdict;
  Client& client = found != nullptr ? *found : AddLocked(client_id);
  Entry& entry = client.pushes[sequence_number];
  entry.in_flight = true;
  entry.previous_highest = client.highest;
  client.highest = sequence_number;
  return verdict;
}

std::vector<RetryTable::Waiter> RetryTable::TakeLocked(absl::string_view client_id,
                                                       uint64_t sequence_number,
                                                       const PushReply* reply) {
  auto client = clients_.find(client_id);
  if (client == clients_.end()) return {};
  std::map<uint64_t, Entry>& pushes = client->second.pushes;
  auto it = pushes.find(sequence_number);
  if (it == pushes.end()) return {};
  std::vector<Waiter> waiters = std::move(it->second.waiters);
  if (reply != nullptr) {
    it->second = Entry{false, *reply, {}, 0};
    // Keep the last kRepliesPerClient done pushes (those in flight stay).
    size_t done = std::count_if(pushes.begin(), pushes.end(),
                                [](const auto& push) { return !push.second.in_flight; });
    for (auto old = pushes.begin(); done > kRepliesPerClient && old != pushes.end();) {
      if (old->second.in_flight) {
        ++old;
        continue;
      }
      old = pushes.erase(old);
      --done;
    }
  } else {
    // Forgotten: the client's highest falls back to what it was without this push, so that
    // the push can be sent again under the same sequence number.
    uint64_t highest = it->second.previous_highest;
    pushes.erase(it);
    if (!pushes.empty()) highest = std::max(highest, pushes.rbegin()->first);
    if (client->second.highest == sequence_number) client->second.highest = highest;
  }
  return waiters;
}

void RetryTable::Finish(absl::string_view client_id, uint64_t sequence_number,
                        const PushReply& reply) {
  if (!Tracked(client_id, sequence_number)) return;
  std::vector<Waiter> waiters;
  {
    MutexLock lock(&mu_);
    waiters = TakeLocked(client_id, sequence_number, &reply);
  }
  PushReply duplicate = reply;
  duplicate.duplicate = true;
  for (Waiter& waiter : waiters) waiter(duplicate);
}

void RetryTable::Abandon(absl::string_view client_id, uint64_t sequence_number,
                         const absl::Status& error) {
  if (!Tracked(client_id, sequence_number)) return;
  std::vector<Waiter> waiters;
  {
    MutexLock lock(&mu_);
    waiters = TakeLocked(client_id, sequence_number, nullptr);
  }
  for (Waiter& waiter : waiters) waiter(error);
}

std::vector<RetryTable::ClientRecord> RetryTable::Export() const {
  MutexLock lock(&mu_);
  std::vector<ClientRecord> records;
  for (const std::string& id : lru_) {
    const Client& client = clients_.find(id)->second;
    ClientRecord record{id, client.highest, {}};
    bool in_flight_seen = false;
    for (const auto& [sequence_number, entry] : client.pushes) {
      if (!entry.in_flight) {
        record.replies.emplace_back(sequence_number, entry.reply);
      } else if (!in_flight_seen) {
        // The first push in flight (they begin in ascending order): the highest before it.
        record.highest = entry.previous_highest;
        in_flight_seen = true;
      }
    }
    if (record.highest > 0) records.push_back(std::move(record));
  }
  return records;
}

void RetryTable::Import(const std::vector<ClientRecord>& records) {
  MutexLock lock(&mu_);
  clients_.clear();
  lru_.clear();
  for (const ClientRecord& record : records) {
    if (clients_.size() >= max_clients_) break;
    if (clients_.contains(record.client_id)) continue;
    lru_.push_back(record.client_id);
    Client& client = clients_[record.client_id];
    client.lru = std::prev(lru_.end());
    client.highest = record.highest;
    for (const auto& [sequence_number, reply] : record.replies) {
      client.pushes[sequence_number] = Entry{false, reply, {}, 0};
    }
  }
}

size_t RetryTable::clients() const {
  MutexLock lock(&mu_);
  return clients_.size();
}

uint64_t RetryTable::evictions() const {
  MutexLock lock(&mu_);
  return evictions_;
}

}  // namespace fusedps
