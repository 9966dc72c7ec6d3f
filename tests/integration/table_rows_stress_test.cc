// A stress test of embedding tables over real gRPC, for the sanitizers (ASan, UBSan, TSan):
// trainers push table rows in two parts each (the parts' TableRows gathered by one assembly,
// concurrently), beside readers that look rows up, all at once. Every push must be applied
// once, at its own version, and the table must then be, bit for bit, the pushes replayed in
// version order through kernels/row_sparse.h's step (the CPU backend's math, checked against
// a float64 SparseAdam in kernels/row_sparse_test.cc); each reader's versions only grow.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "kernels/row_sparse.h"
#include "tests/integration/service_harness.h"

namespace fusedps::integration {
namespace {

constexpr int64_t kRows = 64;
constexpr int64_t kDim = 4;
constexpr int kTrainers = 4;
constexpr int kPushes = 8;  // Per trainer; bounded so that the test ends under TSan too.
constexpr int kReaders = 2;

AdamWHyperparameters TableGroup() {
  AdamWHyperparameters h;
  h.lr = 0.05;
  h.beta1 = 0.8;
  h.beta2 = 0.95;
  h.eps = 1e-6;
  h.weight_decay = 0.01;
  return h;
}

std::string Bytes(const void* data, size_t size) {
  return std::string(static_cast<const char*>(data), size);
}

// One push: its keys (with repeats), its fp32 rows, and the version it was applied at.
struct RowPush {
  std::vector<int64_t> keys;
  std::vector<float> grads;
  uint64_t version = 0;
};

class TableRowsStressTest : public ServiceTest {
 protected:
  // Registers table "emb" ([kRows, kDim], values `initial`) in group "tables".
  void RegisterTable(const std::vector<float>& initial) {
    RegisterGroup("tables", TableGroup());
    v1::RegisterTensorsRequest header;
    v1::TensorSpec* spec = header.mutable_header()->add_tensors();
    spec->set_name("emb");
    spec->add_shape(kRows);
    spec->add_shape(kDim);
    spec->set_param_group("tables");
    spec->mutable_table();
    v1::RegisterTensorsRequest values;
    *values.add_chunks() = Chunk("emb", 0, Bytes(initial.data(), initial.size() * 4));
    v1::RegisterTensorsResponse response;
    const grpc::Status status = ServiceTest::RegisterTensors({header, values}, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }

  // Part `index` of 2 of trainer `client`'s push `sequence_number`: rows [begin, end) of it.
  std::vector<v1::PushGradientsRequest> Part(const std::string& client, uint64_t sequence_number,
                                             uint32_t index, const RowPush& push, size_t begin,
                                             size_t end) {
    v1::PushHeader header = MakePushHeader(v1::DTYPE_FLOAT32, client, sequence_number);
    header.add_tables("emb");
    header.set_part_index(index);
    header.set_part_count(2);
    std::vector<v1::PushGradientsRequest> messages(1);
    *messages[0].mutable_header() = header;
    for (size_t i = begin; i < end; ++i) {  // A message per row: many TakeTableRows.
      v1::TableRows* rows = messages.emplace_back().add_table_rows();
      rows->set_table("emb");
      rows->set_keys(Bytes(&push.keys[i], sizeof(int64_t)));
      rows->set_grads(Bytes(&push.grads[i * kDim], kDim * sizeof(float)));
    }
    return messages;
  }

  // Looks up `keys`; returns the status, and the version and rows read.
  grpc::Status Lookup(const std::vector<int64_t>& keys, uint64_t* version,
                      std::vector<float>* rows) {
    grpc::ClientContext context;
    SetDeadline(context);
    v1::LookupRowsRequest request;
    request.set_table("emb");
    request.set_keys(Bytes(keys.data(), keys.size() * sizeof(int64_t)));
    request.set_max_chunk_bytes(64);  // Several messages.
    auto reader = stub_->LookupRows(&context, request);
    v1::LookupRowsResponse message;
    std::string bytes;
    bool first = true;
    while (reader->Read(&message)) {
      if (first) *version = message.version();
      first = false;
      bytes += message.rows();
    }
    rows->resize(bytes.size() / sizeof(float));
    std::memcpy(rows->data(), bytes.data(), bytes.size());
    return reader->Finish();
  }
};

TEST_F(TableRowsStressTest, PushesInPartsAndLookupsAtOnceApplyEachPushOnceInVersionOrder) {
  const std::vector<float> initial = RandomValues(kRows * kDim, 17);
  ASSERT_NO_FATAL_FAILURE(RegisterTable(initial));
  std::vector<RowPush> pushes(kTrainers * kPushes);
  for (size_t p = 0; p < pushes.size(); ++p) {
    const std::vector<float> values = RandomValues(12 * kDim, 100 + static_cast<uint32_t>(p));
    for (int i = 0; i < 12; ++i) pushes[p].keys.push_back((p * 7 + i * 5) % kRows);
    pushes[p].keys[11] = pushes[p].keys[0];  // A key in both parts: summed across them.
    pushes[p].grads = values;
  }
  std::atomic<bool> done{false};
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kTrainers; ++t) {
    threads.emplace_back([&, t] {
      const std::string client = absl::StrCat("trainer-", t);
      for (int n = 0; n < kPushes; ++n) {
        RowPush& push = pushes[t * kPushes + n];
        std::pair<grpc::Status, v1::PushGradientsResponse> results[2];
        std::thread other([&] { results[1] = Push(Part(client, n + 1, 1, push, 6, 12)); });
        results[0] = Push(Part(client, n + 1, 0, push, 0, 6));
        other.join();
        for (const auto& [status, reply] : results) {
          if (!status.ok() || reply.version() != results[0].second.version() ||
              reply.tensors_updated() != 1) {
            ++failures;
          }
        }
        push.version = results[0].second.version();
      }
    });
  }
  std::atomic<int> lookups{0};
  for (int r = 0; r < kReaders; ++r) {
    threads.emplace_back([&, r] {
      uint64_t last = 0;
      std::vector<int64_t> keys = {static_cast<int64_t>(r), 63, 5, static_cast<int64_t>(r)};
      while (!done.load()) {
        uint64_t version = 0;
        std::vector<float> rows;
        const grpc::Status s = Lookup(keys, &version, &rows);
        if (!s.ok() || version < last || rows.size() != keys.size() * kDim ||
            std::memcmp(&rows[0], &rows[3 * kDim], kDim * sizeof(float)) != 0) {
          ++failures;
        }
        last = version;
        ++lookups;
      }
    });
  }
  for (int t = 0; t < kTrainers; ++t) threads[t].join();
  done = true;
  for (size_t t = kTrainers; t < threads.size(); ++t) threads[t].join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(lookups.load(), 0);

  // Every push at its own version, 1..N; replayed in that order, the table's bits.
  std::sort(pushes.begin(), pushes.end(),
            [](const RowPush& a, const RowPush& b) { return a.version < b.version; });
  for (size_t p = 0; p < pushes.size(); ++p) ASSERT_EQ(pushes[p].version, p + 1);
  std::vector<float> params = initial, exp_avg(kRows * kDim), exp_avg_sq(kRows * kDim);
  RowSparseTable table{
      absl::MakeSpan(params), absl::MakeSpan(exp_avg), absl::MakeSpan(exp_avg_sq), kRows, kDim, 0};
  for (const RowPush& push : pushes) {
    ASSERT_TRUE(*ApplyRowSparseStep(table, TableGroup(), push.keys, push.grads, 0.0f));
  }
  std::vector<int64_t> all(kRows);
  for (int64_t i = 0; i < kRows; ++i) all[i] = i;
  uint64_t version = 0;
  std::vector<float> rows;
  ASSERT_TRUE(Lookup(all, &version, &rows).ok());
  EXPECT_EQ(version, pushes.size());
  ASSERT_EQ(rows.size(), params.size());
  EXPECT_EQ(std::memcmp(rows.data(), params.data(), params.size() * sizeof(float)), 0);
}

}  // namespace
}  // namespace fusedps::integration
