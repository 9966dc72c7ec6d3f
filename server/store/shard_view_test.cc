// Tests of the shard view and the checks registration shares.
#include "server/store/shard_view.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace fusedps {
namespace {

std::shared_ptr<const ShardView> ViewWithWAndB() {
  return ShardView::Initial()->WithTensors({{"w", {2, 3}, 0, 6}, {"b", {}, 0, 1}});
}

TEST(ShardViewTest, SpecsAreNewIdenticalOrConflicting) {
  std::shared_ptr<const ShardView> view = ViewWithWAndB();
  std::vector<bool> is_new;
  ASSERT_TRUE(view->CheckTensorSpecs({{"w", {2, 3}, "default"}, {"c", {4}, ""}}, &is_new).ok());
  EXPECT_EQ(is_new, (std::vector<bool>{false, true}));
  EXPECT_EQ(view->CheckTensorSpecs({{"c", {4}, ""}, {"w", {3, 2}, ""}}, &is_new).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(view->CheckTensorSpecs({{"d", {1}, "nope"}}, &is_new).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(view->CheckTensorSpecs({{"e", {1}, ""}, {"e", {1}, ""}}, &is_new).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(view->CheckTensorSpecs({{"f", {2, -1}, ""}}, &is_new).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(view->CheckTensorSpecs({{"", {1}, ""}}, &is_new).code(),
            absl::StatusCode::kInvalidArgument);
}

// The proto says names are 1..256 bytes (UTF-8): a 256-byte name of 2-byte characters is fine,
// one more byte is not.
TEST(ShardViewTest, NameLimitsCountBytes) {
  std::string name;
  for (int i = 0; i < 128; ++i) name += "\xC3\xA9";  // U+00E9, two bytes.
  std::vector<bool> is_new;
  EXPECT_TRUE(ShardView::Initial()->CheckTensorSpecs({{name, {1}, ""}}, &is_new).ok());
  name += "x";
  absl::Status too_long = ShardView::Initial()->CheckTensorSpecs({{name, {1}, ""}}, &is_new);
  EXPECT_EQ(too_long.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_long.message().find("1 to 256 bytes, has 257"), std::string::npos) << too_long;
}

TEST(ShardViewTest, ResolvesNamesInOrderOrAll) {
  std::shared_ptr<const ShardView> view = ViewWithWAndB();
  EXPECT_EQ(*view->Resolve({}), (std::vector<uint32_t>{0, 1}));
  EXPECT_EQ(*view->Resolve({"b", "w"}), (std::vector<uint32_t>{1, 0}));
  EXPECT_EQ(view->Resolve({"w", "x"}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(view->parameter_count(), 7u);
}

// An error that echoed a 20 KB name made a status larger than gRPC's default metadata limit, so
// a client saw RESOURCE_EXHAUSTED instead of NOT_FOUND.
TEST(ShardViewTest, ErrorsCarryAtMostTheFirst64BytesOfAName) {
  const std::string huge(20480, 'n');
  absl::Status s = ViewWithWAndB()->Resolve({huge}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_LT(s.message().size(), 200u);
  EXPECT_NE(s.message().find("(20480 bytes)"), std::string::npos) << s;
  // Never in the middle of a UTF-8 character.
  std::string accents;
  for (int i = 0; i < 40; ++i) accents += "\xC3\xA9";
  EXPECT_EQ(QuoteName(accents), "'" + accents.substr(0, 64) + "...' (80 bytes)");
  EXPECT_EQ(QuoteName("x" + accents), "'x" + accents.substr(0, 62) + "...' (81 bytes)");
}

TEST(ShardViewTest, ViewsAreImmutableSnapshots) {
  std::shared_ptr<const ShardView> before = ViewWithWAndB();
  AdamWHyperparameters h;
  h.lr = 0.5;
  std::shared_ptr<const ShardView> after =
      before->WithGroup(1, {"fast", h})->WithTensors({{"c", {3}, 1, 3}});
  EXPECT_EQ(before->tensor_count(), 2u);
  EXPECT_EQ(before->groups().size(), 1u);
  EXPECT_FALSE(before->FindTensor("c").has_value());
  EXPECT_EQ(after->tensor_count(), 3u);
  EXPECT_EQ(after->group_name_of(2), "fast");
  EXPECT_EQ(after->tensor(*after->FindTensor("w")).numel, 6u);
}

TEST(ShardViewTest, LayoutFollowsTheGroupAndTheSize) {
  AdamWHyperparameters int8;
  int8.state_dtype = StateDType::kInt8;
  int8.params_dtype = ParamsDType::kBFloat16;
  std::shared_ptr<const ShardView> view = ShardView::Initial()->WithGroup(1, {"q", int8});
  view = view->WithTensors(
      {{"big", {4096}, 1, 4096}, {"small", {4095}, 1, 4095}, {"plain", {8192}, 0, 8192}});
  EXPECT_EQ(view->layout(0).state, StateDType::kInt8);
  EXPECT_EQ(view->layout(0).params, ParamsDType::kBFloat16);
  EXPECT_EQ(view->layout(1).state, StateDType::kFloat32);  // Under kMinQuantNumel.
  EXPECT_EQ(view->layout(1).params, ParamsDType::kBFloat16);
  EXPECT_TRUE(IsFloat32Layout(view->layout(2)));
}

}  // namespace
}  // namespace fusedps
