#include "server/store/shard_store.h"

#include <vector>

#include "gtest/gtest.h"

namespace fusedps {
namespace {

TEST(ShardStoreTest, RegistrationIsIdempotentAndConflictsFailWhole) {
  ShardStore store(MakeCpuBackend({.threads = 1}));
  const std::vector<float> w(6, 1.0f), b(1, 2.0f);
  auto first = store.RegisterTensors({{"w", {2, 3}, ""}, {"b", {}, ""}}, {w.data(), b.data()});
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->created, 2u);
  auto again = store.RegisterTensors({{"w", {2, 3}, "default"}}, {w.data()});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->created, 0u);
  EXPECT_EQ(again->existing, 1u);
  const std::vector<float> c(4, 3.0f);
  auto conflict = store.RegisterTensors({{"c", {4}, ""}, {"w", {3, 2}, ""}}, {c.data(), w.data()});
  EXPECT_EQ(conflict.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(store.Lookup({"c"}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.parameter_count(), 7u);
  auto missing_group = store.RegisterTensors({{"d", {1}, "nope"}}, {c.data()});
  EXPECT_EQ(missing_group.status().code(), absl::StatusCode::kNotFound);
  auto twice = store.RegisterTensors({{"e", {1}, ""}, {"e", {1}, ""}}, {c.data(), c.data()});
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  auto negative = store.RegisterTensors({{"f", {2, -1}, ""}}, {c.data()});
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ShardStoreTest, HyperparametersAreValidatedAndAmsgradIsFixed) {
  ShardStore store(MakeCpuBackend({.threads = 1}));
  AdamWHyperparameters h;
  h.beta1 = 1.0;
  EXPECT_EQ(store.RegisterParamGroup({"g", h}).status().code(),
            absl::StatusCode::kInvalidArgument);
  h.beta1 = 0.9;
  h.amsgrad = true;
  EXPECT_TRUE(*store.RegisterParamGroup({"g", h}));
  EXPECT_FALSE(*store.RegisterParamGroup({"g", h}));  // Identical: a no-op.
  h.lr = 0.5;
  EXPECT_EQ(store.RegisterParamGroup({"g", h}).status().code(), absl::StatusCode::kAlreadyExists);
  HyperparameterUpdate update;
  update.lr = 0.25;
  auto changed = store.SetHyperparameters("g", update);
  ASSERT_TRUE(changed.ok());
  EXPECT_EQ(changed->hyperparameters.lr, 0.25);
  EXPECT_TRUE(changed->hyperparameters.amsgrad);
  update.amsgrad = false;
  EXPECT_EQ(store.SetHyperparameters("g", update).status().code(),
            absl::StatusCode::kInvalidArgument);
  update = {};
  update.eps = -1;
  EXPECT_EQ(store.SetHyperparameters("g", update).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.SetHyperparameters("h", {}).status().code(), absl::StatusCode::kNotFound);
}

TEST(ShardStoreTest, RetriedPushIsAppliedOnce) {
  ShardStore store(MakeCpuBackend({.threads = 1}));
  const std::vector<float> w(8, 1.0f), grads(8, 0.5f);
  ASSERT_TRUE(store.RegisterTensors({{"w", {8}, ""}}, {w.data()}).ok());
  ReadyPush push{"trainer-0", 1, {0}, {0}, grads.data(), GradDType::kFloat32, 0.0f};
  auto first = store.ApplyPush(push);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->version, 1u);
  EXPECT_FALSE(first->duplicate);
  auto retry = store.ApplyPush(push);
  ASSERT_TRUE(retry.ok());
  EXPECT_TRUE(retry->duplicate);
  EXPECT_EQ(retry->version, 1u);
  EXPECT_EQ((*store.Lookup({"w"}))[0].step, 1);
  push.sequence_number = 2;
  EXPECT_EQ(store.ApplyPush(push)->version, 2u);
  EXPECT_EQ((*store.Lookup({"w"}))[0].step, 2);
}

}  // namespace
}  // namespace fusedps
