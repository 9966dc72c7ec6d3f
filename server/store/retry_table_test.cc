// Tests of the retry table: each retry gets its own push's reply, in bounded memory.
#include "server/store/retry_table.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace fusedps {
namespace {

using Kind = RetryTable::Kind;

PushReply ReplyFor(uint64_t version) {
  PushReply reply;
  reply.version = version;
  reply.tensors_updated = 3;
  reply.grad_bytes = 100 * version;
  return reply;
}

void Apply(RetryTable& table, const std::string& client, uint64_t sequence_number,
           uint64_t version) {
  ASSERT_EQ(table.Begin(client, sequence_number).kind, Kind::kNew);
  table.Finish(client, sequence_number, ReplyFor(version));
}

TEST(RetryTableTest, UntrackedPushesAreNeverRemembered) {
  RetryTable table(4);
  EXPECT_EQ(table.Begin("", 5).kind, Kind::kUntracked);
  EXPECT_EQ(table.Begin("a", 0).kind, Kind::kUntracked);
  EXPECT_EQ(table.clients(), 0u);
}

// The proto promises a retry the reply of the push it repeats. Before the table kept one reply
// per client, a retry of sequence number 1 after 2 and 3 got 3's reply.
TEST(RetryTableTest, EachRetryGetsItsOwnPushesReply) {
  RetryTable table(4);
  Apply(table, "a", 1, 10);
  Apply(table, "a", 2, 11);
  Apply(table, "a", 3, 12);
  for (uint64_t seq : {1, 2, 3}) {
    RetryTable::Verdict verdict = table.Lookup("a", seq);
    ASSERT_EQ(verdict.kind, Kind::kDone) << seq;
    EXPECT_EQ(verdict.reply.version, 9 + seq);
    EXPECT_EQ(verdict.reply.grad_bytes, 100 * (9 + seq));
    EXPECT_TRUE(verdict.reply.duplicate);
  }
  EXPECT_EQ(table.Lookup("a", 4).kind, Kind::kNew);
}

TEST(RetryTableTest, KeepsTheLastRepliesPerClientAndCallsOlderOnesStale) {
  RetryTable table(4);
  const uint64_t kept = RetryTable::kRepliesPerClient;
  for (uint64_t seq = 1; seq <= kept + 5; ++seq) Apply(table, "a", seq * 2, seq);
  for (uint64_t seq = 1; seq <= 5; ++seq) {
    RetryTable::Verdict verdict = table.Lookup("a", seq * 2);
    EXPECT_EQ(verdict.kind, Kind::kStale) << seq;
    EXPECT_EQ(verdict.highest, (kept + 5) * 2);
  }
  for (uint64_t seq = 6; seq <= kept + 5; ++seq) {
    EXPECT_EQ(table.Lookup("a", seq * 2).kind, Kind::kDone) << seq;
  }
  // A number between two remembered ones, never sent, is stale too: never applied.
  EXPECT_EQ(table.Lookup("a", 13).kind, Kind::kStale);
}

TEST(RetryTableTest, WaitersOfAPushInFlightGetItsReplyOnce) {
  RetryTable table(4);
  ASSERT_EQ(table.Begin("a", 7).kind, Kind::kNew);
  EXPECT_EQ(table.Begin("a", 7).kind, Kind::kInFlight);
  std::vector<absl::StatusOr<PushReply>> got;
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(table.Await("a", 7, [&](absl::StatusOr<PushReply> r) { got.push_back(r); }).kind,
              Kind::kInFlight);
  }
  EXPECT_TRUE(got.empty());
  table.Finish("a", 7, ReplyFor(3));
  ASSERT_EQ(got.size(), 2u);
  for (const auto& reply : got) {
    ASSERT_TRUE(reply.ok());
    EXPECT_EQ(reply->version, 3u);
    EXPECT_TRUE(reply->duplicate);
  }
  // Await on a done push returns its reply and drops the waiter.
  RetryTable::Verdict verdict =
      table.Await("a", 7, [&](absl::StatusOr<PushReply> r) { got.push_back(r); });
  EXPECT_EQ(verdict.kind, Kind::kDone);
  EXPECT_EQ(got.size(), 2u);
}

TEST(RetryTableTest, AnAbandonedPushCanBeSentAgain) {
  RetryTable table(4);
  Apply(table, "a", 3, 1);
  ASSERT_EQ(table.Begin("a", 5).kind, Kind::kNew);
  absl::Status waited;
  table.Await("a", 5, [&](absl::StatusOr<PushReply> r) { waited = r.status(); });
  table.Abandon("a", 5, absl::InternalError("device fault"));
  EXPECT_EQ(waited.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(table.Lookup("a", 5).kind, Kind::kNew);
  EXPECT_EQ(table.Lookup("a", 3).kind, Kind::kDone);
  EXPECT_EQ(table.Lookup("a", 2).kind, Kind::kStale);
}

// Before the table was bounded, 200 pushes under distinct client ids grew the server for good.
TEST(RetryTableTest, ForgetsTheLeastRecentlyUsedClientsBeyondItsBound) {
  RetryTable table(3);
  for (int c = 0; c < 200; ++c) Apply(table, absl::StrCat("client-", c), 1, c);
  EXPECT_EQ(table.clients(), 3u);
  EXPECT_EQ(table.evictions(), 197u);
  EXPECT_EQ(table.Lookup("client-199", 1).kind, Kind::kDone);
  EXPECT_EQ(table.Lookup("client-0", 1).kind, Kind::kNew);  // Forgotten.
  // A lookup makes a client recent: client-197 survives the next two newcomers.
  table.Lookup("client-197", 1);
  Apply(table, "x", 1, 0);
  Apply(table, "y", 1, 0);
  EXPECT_EQ(table.Lookup("client-197", 1).kind, Kind::kDone);
  EXPECT_EQ(table.Lookup("client-199", 1).kind, Kind::kNew);
}

TEST(RetryTableTest, AClientWithAPushInFlightIsNotForgotten) {
  RetryTable table(1);
  ASSERT_EQ(table.Begin("a", 1).kind, Kind::kNew);
  Apply(table, "b", 1, 0);
  EXPECT_EQ(table.Begin("a", 1).kind, Kind::kInFlight);
  table.Finish("a", 1, ReplyFor(1));
  Apply(table, "c", 1, 0);
  EXPECT_EQ(table.clients(), 1u);
}

// Many threads: each client's pushes are begun once, each retry sees in-flight or done.
TEST(RetryTableTest, ConcurrentClientsAndRetries) {
  RetryTable table(64);
  std::atomic<int> applied{0}, duplicates{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      const std::string client = absl::StrCat("c", t % 4);  // Two threads per client.
      for (uint64_t seq = 1; seq <= 500; ++seq) {
        RetryTable::Verdict verdict = table.Begin(client, seq);
        if (verdict.kind == Kind::kNew) {
          ++applied;
          table.Finish(client, seq, ReplyFor(seq));
        } else {
          ++duplicates;
        }
        table.Lookup(client, seq / 2 + 1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(applied.load(), 4 * 500);
  EXPECT_EQ(duplicates.load(), 4 * 500);
}

}  // namespace
}  // namespace fusedps
