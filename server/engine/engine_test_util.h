// engine_test_util.h: helpers of the update engine's tests (a shard of float tensors on a
// test's engine, and pushes into it).
#ifndef FUSEDPS_SERVER_ENGINE_ENGINE_TEST_UTIL_H_
#define FUSEDPS_SERVER_ENGINE_ENGINE_TEST_UTIL_H_

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/notification.h"
#include "gtest/gtest.h"
#include "server/engine/update_engine.h"

namespace fusedps {

template <typename T>
absl::StatusOr<T> Sync(const std::function<void(UpdateEngine::Done<T>)>& submit) {
  return UpdateEngine::Wait<T>(submit);
}

// Registers float tensors of the given sizes (values 1.0) and returns their indices.
inline std::vector<uint32_t> Register(UpdateEngine& engine, const std::vector<uint64_t>& sizes,
                                      const std::string& prefix = "t") {
  std::vector<TensorMeta> metas;
  for (size_t i = 0; i < sizes.size(); ++i) {
    metas.push_back({prefix + std::to_string(i), {static_cast<int64_t>(sizes[i])}, 0, sizes[i]});
  }
  absl::StatusOr<uint32_t> first = Sync<uint32_t>(
      [&](UpdateEngine::Done<uint32_t> done) { engine.BeginRegistration(metas, done); });
  EXPECT_TRUE(first.ok()) << first.status();
  std::vector<std::vector<float>> values;
  std::vector<ParamWrite> writes;
  for (size_t i = 0; i < sizes.size(); ++i) {
    values.emplace_back(sizes[i], 1.0f);
    writes.push_back({*first + static_cast<uint32_t>(i), 0, values.back().data(), sizes[i]});
  }
  EXPECT_TRUE(Sync<bool>([&](UpdateEngine::Done<bool> d) { engine.WriteParams(writes, d); }).ok());
  EXPECT_TRUE(Sync<uint64_t>([&](UpdateEngine::Done<uint64_t> d) {
                engine.CommitRegistration("", d);
              }).ok());
  std::vector<uint32_t> indices;
  for (size_t i = 0; i < sizes.size(); ++i) indices.push_back(*first + static_cast<uint32_t>(i));
  return indices;
}

// One push's outcome, filled on the completion thread: for pushes that wait (a sync round) or
// run several at once.
struct PushOutcome {
  Notification done, consumed;
  absl::StatusOr<StepResult> result = absl::UnknownError("not yet");
};

// Submits `push` (alive until out->done) and returns at once.
inline void PushAsync(UpdateEngine& engine, const ReadyPush* push, PushOutcome* out) {
  engine.Step(
      push,
      [out](absl::StatusOr<StepResult> r) {
        out->result = std::move(r);
        out->done.Notify();
      },
      [out] { out->consumed.Notify(); });
}

// Sync mode, K of N, with a round timeout (zero: none).
inline ConsistencyOptions SyncMode(uint32_t k, uint32_t n,
                                   absl::Duration timeout = absl::ZeroDuration()) {
  ConsistencyOptions c;
  c.mode = ConsistencyMode::kSync;
  c.replicas_to_aggregate = k;
  c.total_replicas = n;
  c.round_timeout = timeout;
  return c;
}

inline ReadyPush PushOf(const std::vector<uint32_t>& tensors, const std::vector<uint64_t>& sizes,
                        const std::vector<float>& grads, std::string client = "",
                        uint64_t sequence_number = 0) {
  ReadyPush push;
  push.client_id = std::move(client);
  push.sequence_number = sequence_number;
  push.tensors = tensors;
  uint64_t offset = 0;
  for (uint64_t n : sizes) {
    push.grad_offsets.push_back(offset);
    offset += AlignedNumel(n);
  }
  push.grads = grads.data();
  push.grad_bytes = offset * 4;
  return push;
}

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_ENGINE_ENGINE_TEST_UTIL_H_
