// Bad input over real gRPC: every case checks the exact status code, that the message names the
// field or tensor at fault, and that the shard's whole state (params, exp_avg, exp_avg_sq as
// bytes, steps, version) is bit-identical afterwards; then that a good push still applies.
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>

#include "tests/integration/service_harness.h"

namespace fusedps::integration {
namespace {

using PushStream = std::vector<v1::PushGradientsRequest>;

// Tensors "w" [16, 33] and "s" [] in group "custom", "b" [33] in "default", one push applied.
class BadInputTest : public ServiceTest {
 protected:
  void SetUp() override {
    ServiceTest::SetUp();
    if (HasFatalFailure()) return;
    ASSERT_NO_FATAL_FAILURE(RegisterGroup("custom", CustomHyperparameters()));
    ASSERT_NO_FATAL_FAILURE(
        RegisterTensors({{"w", {16, 33}, "custom"}, {"b", {33}, ""}, {"s", {}, "custom"}}));
    PushAndStep(MakePushHeader(v1::DTYPE_FLOAT32), GradDType::kFloat32, Grads(1));
  }

  std::map<std::string, std::vector<float>> Grads(uint32_t seed) {
    return RandomGrads({"w", "b", "s"}, seed);
  }

  // The shard still takes a good push after the bad one, as the next version.
  void ExpectGoodPushApplies(uint64_t version) {
    const v1::PushGradientsResponse ack = PushAndStep(
        MakePushHeader(v1::DTYPE_FLOAT32, "after", version + 1), GradDType::kFloat32, Grads(77));
    EXPECT_EQ(ack.version(), version + 1);
    ExpectMatchesHost(version + 1);
  }
};

std::string F32(std::vector<float> values) { return Encode(GradDType::kFloat32, values); }

std::string Half(uint16_t bits, size_t count) {
  std::string bytes(count * 2, '\0');
  for (size_t i = 0; i < count; ++i) std::memcpy(&bytes[i * 2], &bits, 2);
  return bytes;
}

// Well-formed fp32 chunks of every tensor, with w split in two.
std::vector<v1::TensorChunk> GoodChunks() {
  return {Chunk("w", 0, F32(RandomValues(300, 5))), Chunk("w", 300, F32(RandomValues(228, 6))),
          Chunk("b", 0, F32(RandomValues(33, 7))), Chunk("s", 0, F32({0.5f}))};
}

PushStream Stream(const v1::PushHeader& header, const std::vector<v1::TensorChunk>& chunks) {
  return Messages<v1::PushGradientsRequest>(header, chunks);
}

v1::PushHeader WithScale(float scale) {
  v1::PushHeader header = MakePushHeader(v1::DTYPE_FLOAT32);
  header.set_grad_scale(scale);
  return header;
}

struct PushCase {
  const char* name;
  std::function<PushStream()> messages;
  grpc::StatusCode code;
  std::vector<std::string> message_has;  // Substrings of the error message.
};

const PushCase kPushCases[] = {
    {"UnknownTensorInHeader",
     [] {
       return Stream(MakePushHeader(v1::DTYPE_FLOAT32, "c", 5, {"w", "nope"}), GoodChunks());
     },
     grpc::StatusCode::NOT_FOUND,
     {"'nope'"}},
    {"ChunkOfUnknownTensor",
     [] {
       std::vector<v1::TensorChunk> chunks = GoodChunks();
       chunks.insert(chunks.begin() + 2, Chunk("nope", 0, F32({1})));
       return Stream(MakePushHeader(v1::DTYPE_FLOAT32), chunks);
     },
     grpc::StatusCode::NOT_FOUND,
     {"chunks.tensor", "'nope'"}},
    {"ChunkOfTensorNotInHeader",
     [] {
       return Stream(MakePushHeader(v1::DTYPE_FLOAT32, "", 0, {"w", "s"}), GoodChunks());
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"chunks.tensor", "'b'"}},
    {"ChunksMissing",
     [] {
       std::vector<v1::TensorChunk> chunks = GoodChunks();
       chunks.erase(chunks.begin() + 1);  // w's elements [300, 528).
       return Stream(MakePushHeader(v1::DTYPE_FLOAT32), chunks);
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"'w'", "300", "528", "missing"}},
    {"TensorWithNoChunks",
     [] {
       std::vector<v1::TensorChunk> chunks = GoodChunks();
       chunks.pop_back();  // No chunk of s at all.
       return Stream(MakePushHeader(v1::DTYPE_FLOAT32), chunks);
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"'s'", "missing"}},
    {"ChunkPastTheEnd",
     [] {
       std::vector<v1::TensorChunk> chunks = GoodChunks();
       chunks[1] = Chunk("w", 300, F32(RandomValues(229, 6)));  // One element too many.
       return Stream(MakePushHeader(v1::DTYPE_FLOAT32), chunks);
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"'w'", "529", "528"}},
    {"OffsetPastTheEnd",
     [] {
       std::vector<v1::TensorChunk> chunks = GoodChunks();
       chunks.push_back(Chunk("b", 40, F32({1})));
       return Stream(MakePushHeader(v1::DTYPE_FLOAT32), chunks);
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"'b'", "40", "33"}},
    {"HugeOffset",
     [] {
       std::vector<v1::TensorChunk> chunks = GoodChunks();
       chunks.push_back(Chunk("b", std::numeric_limits<uint64_t>::max(), F32({1})));
       return Stream(MakePushHeader(v1::DTYPE_FLOAT32), chunks);
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"'b'"}},
    {"OverlappingChunks",
     [] {
       std::vector<v1::TensorChunk> chunks = GoodChunks();
       chunks.push_back(Chunk("w", 299, F32({1, 2})));
       return Stream(MakePushHeader(v1::DTYPE_FLOAT32), chunks);
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"'w'", "overlaps"}},
    {"DataNotAMultipleOfTheElementSize",
     [] {
       std::vector<v1::TensorChunk> chunks = GoodChunks();
       chunks[2] = Chunk("b", 0, F32(RandomValues(33, 7)) + "xy");
       return Stream(MakePushHeader(v1::DTYPE_FLOAT32), chunks);
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"'b'", "134", "multiple"}},
    {"OddBytesOfBFloat16",
     [] {
       return Stream(MakePushHeader(v1::DTYPE_BFLOAT16, "", 0, {"s"}),
                     {Chunk("s", 0, std::string(3, '\0'))});
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"'s'", "multiple"}},
    {"TensorTwiceInHeader",
     [] {
       return Stream(MakePushHeader(v1::DTYPE_FLOAT32, "", 0, {"w", "b", "w"}), GoodChunks());
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"header.tensors[2]", "'w'"}},
    {"DTypeUnspecified",
     [] { return Stream(MakePushHeader(v1::DTYPE_UNSPECIFIED), GoodChunks()); },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"header.grad_dtype", "0"}},
    {"DTypeOutOfRange",
     [] { return Stream(MakePushHeader(static_cast<v1::DType>(7)), GoodChunks()); },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"header.grad_dtype", "7"}},
    {"NoHeader",
     [] {
       PushStream messages = Stream(MakePushHeader(v1::DTYPE_FLOAT32), GoodChunks());
       messages.erase(messages.begin());  // The first message has only chunks.
       return messages;
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"header"}},
    {"EmptyStream", [] { return PushStream{}; }, grpc::StatusCode::INVALID_ARGUMENT, {"header"}},
    {"SecondHeaderMidStream",
     [] {
       PushStream messages = Stream(MakePushHeader(v1::DTYPE_FLOAT32), GoodChunks());
       *messages[2].mutable_header() = MakePushHeader(v1::DTYPE_FLOAT32);
       return messages;
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"header"}},
    {"GradScaleZero",
     [] { return Stream(WithScale(0.0f), GoodChunks()); },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"header.grad_scale"}},
    {"GradScaleNaN",
     [] { return Stream(WithScale(std::numeric_limits<float>::quiet_NaN()), GoodChunks()); },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"header.grad_scale"}},
    {"GradScaleNegative",
     [] { return Stream(WithScale(-2.0f), GoodChunks()); },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"header.grad_scale"}},
    {"GradScaleInfinite",
     [] { return Stream(WithScale(std::numeric_limits<float>::infinity()), GoodChunks()); },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"header.grad_scale"}},
    {"WorkerCountAboveOne",
     [] {
       v1::PushHeader header = MakePushHeader(v1::DTYPE_FLOAT32);
       header.set_worker_count(2);
       return Stream(header, GoodChunks());
     },
     grpc::StatusCode::UNIMPLEMENTED,
     {"header.worker_count"}},
};

void PrintTo(const PushCase& c, std::ostream* os) { *os << c.name; }

class BadPushTest : public BadInputTest, public ::testing::WithParamInterface<PushCase> {};

TEST_P(BadPushTest, IsRejectedAndChangesNothing) {
  const PushCase& c = GetParam();
  const ShardState before = Snapshot();
  auto [status, ack] = Push(c.messages());
  EXPECT_EQ(status.error_code(), c.code) << status.error_message();
  for (const std::string& part : c.message_has) {
    EXPECT_NE(status.error_message().find(part), std::string::npos)
        << "'" << status.error_message() << "' does not contain '" << part << "'";
  }
  ExpectSameState(before, Snapshot());
  ExpectGoodPushApplies(before.version);
}

INSTANTIATE_TEST_SUITE_P(Push, BadPushTest, ::testing::ValuesIn(kPushCases),
                         [](const ::testing::TestParamInfo<PushCase>& info) {
                           return std::string(info.param.name);
                         });

// A non-finite gradient is not an error: the whole push is skipped.
struct NonFiniteCase {
  const char* name;
  GradDType dtype;
  std::string bad_element;  // Wire bytes of one element of w.
};

const NonFiniteCase kNonFiniteCases[] = {
    {"Float32NaN", GradDType::kFloat32, F32({std::numeric_limits<float>::quiet_NaN()})},
    {"Float32PlusInf", GradDType::kFloat32, F32({std::numeric_limits<float>::infinity()})},
    {"Float32MinusInf", GradDType::kFloat32, F32({-std::numeric_limits<float>::infinity()})},
    {"Float16Inf", GradDType::kFloat16, Half(0x7c00, 1)},
    {"Float16NaN", GradDType::kFloat16, Half(0x7e00, 1)},
    {"BFloat16Inf", GradDType::kBFloat16, Half(0x7f80, 1)},
};

void PrintTo(const NonFiniteCase& c, std::ostream* os) { *os << c.name; }

class NonFinitePushTest : public BadInputTest,
                          public ::testing::WithParamInterface<NonFiniteCase> {};

TEST_P(NonFinitePushTest, SkipsTheWholeStep) {
  const NonFiniteCase& c = GetParam();
  const ShardState before = Snapshot();
  // Finite grads everywhere except element 527 (the last) of w.
  std::string w = Encode(c.dtype, RandomValues(528, 20));
  w.replace(527 * ElementSize(c.dtype), ElementSize(c.dtype), c.bad_element);
  const std::vector<v1::TensorChunk> chunks = {Chunk("w", 0, w),
                                               Chunk("b", 0, Encode(c.dtype, RandomValues(33, 21))),
                                               Chunk("s", 0, Encode(c.dtype, {0.25f}))};
  auto [status, ack] = Push(Stream(MakePushHeader(ToProto(c.dtype), "nf", 1), chunks));
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(ack.step_skipped());
  EXPECT_EQ(ack.skip_reason(), "non_finite_grad");
  EXPECT_EQ(ack.version(), before.version);
  EXPECT_EQ(ack.tensors_updated(), 0u);
  EXPECT_FALSE(ack.duplicate());
  ExpectSameState(before, Snapshot());
  ExpectGoodPushApplies(before.version);
}

INSTANTIATE_TEST_SUITE_P(Push, NonFinitePushTest, ::testing::ValuesIn(kNonFiniteCases),
                         [](const ::testing::TestParamInfo<NonFiniteCase>& info) {
                           return std::string(info.param.name);
                         });

void ExpectError(const grpc::Status& status, grpc::StatusCode code, const std::string& part) {
  EXPECT_EQ(status.error_code(), code) << status.error_message();
  EXPECT_NE(status.error_message().find(part), std::string::npos)
      << "'" << status.error_message() << "' does not contain '" << part << "'";
}

TEST_F(BadInputTest, PullOfUnknownTensorIsNotFound) {
  const ShardState before = Snapshot();
  Pulled pulled = Pull({"w", "nope"}, v1::DTYPE_FLOAT32);
  ExpectError(pulled.status, grpc::StatusCode::NOT_FOUND, "'nope'");
  EXPECT_EQ(pulled.messages, 0u);
  ExpectSameState(before, Snapshot());
}

TEST_F(BadInputTest, PullWithBadOptionsIsInvalidArgument) {
  const ShardState before = Snapshot();
  ExpectError(Pull({}, v1::DTYPE_FLOAT32, v1::TENSOR_FIELD_PARAM, (4 << 20) + 1).status,
              grpc::StatusCode::INVALID_ARGUMENT, "max_chunk_bytes");
  ExpectError(Pull({}, v1::DTYPE_FLOAT32, v1::TENSOR_FIELD_PARAM, 8).status,
              grpc::StatusCode::INVALID_ARGUMENT, "max_chunk_bytes");
  ExpectError(Pull({}, static_cast<v1::DType>(7)).status, grpc::StatusCode::INVALID_ARGUMENT,
              "dtype");
  ExpectError(Pull({}, v1::DTYPE_FLOAT32, static_cast<v1::TensorField>(9)).status,
              grpc::StatusCode::INVALID_ARGUMENT, "field");
  ExpectError(Pull({"w"}, v1::DTYPE_FLOAT32, v1::TENSOR_FIELD_MAX_EXP_AVG_SQ).status,
              grpc::StatusCode::FAILED_PRECONDITION, "'w'");
  Pulled largest = Pull({}, v1::DTYPE_FLOAT32, v1::TENSOR_FIELD_PARAM, 4 << 20);
  EXPECT_TRUE(largest.status.ok()) << largest.status.error_message();
  ExpectSameState(before, Snapshot());
}

TEST_F(BadInputTest, BadHyperparametersAreInvalidArgument) {
  const ShardState before = Snapshot();
  const std::string groups_before = GetInfo().SerializeAsString();
  struct Case {
    const char* field;
    std::function<void(v1::Hyperparameters*)> set;
  };
  const Case cases[] = {
      {"beta1", [](v1::Hyperparameters* h) { h->set_beta1(1.0); }},
      {"beta2", [](v1::Hyperparameters* h) { h->set_beta2(-0.1); }},
      {"lr", [](v1::Hyperparameters* h) { h->set_lr(std::nan("")); }},
      {"lr", [](v1::Hyperparameters* h) { h->set_lr(-1e-3); }},
      {"eps", [](v1::Hyperparameters* h) { h->set_eps(-1.0); }},
      {"weight_decay",
       [](v1::Hyperparameters* h) {
         h->set_weight_decay(std::numeric_limits<double>::infinity());
       }},
      {"amsgrad", [](v1::Hyperparameters* h) { h->set_amsgrad(true); }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.field);
    v1::SetHyperparametersRequest set;
    set.set_param_group("custom");
    c.set(set.mutable_hyperparameters());
    set.mutable_hyperparameters()->set_lr(set.hyperparameters().has_lr()
                                              ? set.hyperparameters().lr()
                                              : 0.5);  // A good change beside the bad one.
    v1::SetHyperparametersResponse set_response;
    grpc::ClientContext set_context;
    SetDeadline(set_context);
    ExpectError(stub_->SetHyperparameters(&set_context, set, &set_response),
                grpc::StatusCode::INVALID_ARGUMENT, "hyperparameters." + std::string(c.field));

    if (std::string(c.field) == "amsgrad") continue;  // A new group may choose amsgrad.
    v1::RegisterParamGroupRequest group;
    group.mutable_param_group()->set_name("bad");
    c.set(group.mutable_param_group()->mutable_hyperparameters());
    v1::RegisterParamGroupResponse group_response;
    grpc::ClientContext group_context;
    SetDeadline(group_context);
    ExpectError(stub_->RegisterParamGroup(&group_context, group, &group_response),
                grpc::StatusCode::INVALID_ARGUMENT, "hyperparameters." + std::string(c.field));
  }
  v1::SetHyperparametersRequest unknown;
  unknown.set_param_group("nope");
  unknown.mutable_hyperparameters()->set_lr(0.1);
  v1::SetHyperparametersResponse response;
  grpc::ClientContext context;
  SetDeadline(context);
  ExpectError(stub_->SetHyperparameters(&context, unknown, &response), grpc::StatusCode::NOT_FOUND,
              "'nope'");

  EXPECT_EQ(GetInfo().SerializeAsString(), groups_before) << "a group or its values changed";
  ExpectSameState(before, Snapshot());
  ExpectGoodPushApplies(before.version);  // With the old hyperparameters.
}

// A message over the server's max receive size (8 MiB) is refused by gRPC before the service.
TEST_F(BadInputTest, OversizedMessageIsResourceExhausted) {
  const ShardState before = Snapshot();
  std::vector<v1::TensorChunk> chunks = GoodChunks();
  chunks[0] = Chunk("w", 0, std::string(9 * kMiB, '\0'));
  auto [status, ack] = Push(Stream(MakePushHeader(v1::DTYPE_FLOAT32), chunks));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  ExpectSameState(before, Snapshot());
  ExpectGoodPushApplies(before.version);
}

struct RegisterCase {
  const char* name;
  std::vector<TensorDef> specs;
  std::vector<v1::TensorChunk> chunks;
  grpc::StatusCode code;
  std::string message_has;
};

TEST_F(BadInputTest, BadRegistrationRegistersNothing) {
  const RegisterCase cases[] = {
      {"UnknownGroup",
       {{"x", {2}, "nope"}},
       {Chunk("x", 0, F32({1, 2}))},
       grpc::StatusCode::NOT_FOUND,
       "'nope'"},
      {"ChunksMissing",
       {{"x", {4}, ""}, {"y", {2}, ""}},
       {Chunk("x", 0, F32({1, 2, 3, 4})), Chunk("y", 0, F32({1}))},
       grpc::StatusCode::INVALID_ARGUMENT,
       "'y'"},
      {"NegativeDim", {{"x", {2, -1}, ""}}, {}, grpc::StatusCode::INVALID_ARGUMENT, "shape[1]"},
      {"EmptyName", {{"", {2}, ""}}, {}, grpc::StatusCode::INVALID_ARGUMENT, "name"},
      {"NameTwice",
       {{"x", {1}, ""}, {"x", {1}, ""}},
       {Chunk("x", 0, F32({1}))},
       grpc::StatusCode::INVALID_ARGUMENT,
       "'x'"},
      {"ChunkOfUnknownTensor",
       {{"x", {1}, ""}},
       {Chunk("x", 0, F32({1})), Chunk("nope", 0, F32({1}))},
       grpc::StatusCode::NOT_FOUND,
       "'nope'"},
      {"ChunkPastTheEnd",
       {{"x", {2}, ""}},
       {Chunk("x", 1, F32({1, 2}))},
       grpc::StatusCode::INVALID_ARGUMENT,
       "'x'"},
      {"TooManyElements",
       {{"x", {1 << 20, 1 << 20}, ""}},
       {},
       grpc::StatusCode::INVALID_ARGUMENT,
       "'x'"},
      {"NameTooLong",
       {{std::string(257, 'n'), {1}, ""}},
       {},
       grpc::StatusCode::INVALID_ARGUMENT,
       "header.tensors[0].name"},
  };
  const ShardState before = Snapshot();
  for (const RegisterCase& c : cases) {
    SCOPED_TRACE(c.name);
    v1::RegisterTensorsHeader header;
    for (const TensorDef& def : c.specs) {
      v1::TensorSpec* spec = header.add_tensors();
      spec->set_name(def.name);
      for (int64_t d : def.shape) spec->add_shape(d);
      spec->set_param_group(def.param_group);
    }
    v1::RegisterTensorsResponse response;
    ExpectError(RegisterTensors(Messages<v1::RegisterTensorsRequest>(header, c.chunks), &response),
                c.code, c.message_has);
    ExpectSameState(before, Snapshot());
    EXPECT_EQ(GetInfo().tensor_count(), 3u);
  }
  // No header at all.
  v1::RegisterTensorsRequest chunk_only;
  *chunk_only.add_chunks() = Chunk("x", 0, F32({1}));
  v1::RegisterTensorsResponse response;
  ExpectError(RegisterTensors({chunk_only}, &response), grpc::StatusCode::INVALID_ARGUMENT,
              "header");
  ExpectSameState(before, Snapshot());
}

}  // namespace
}  // namespace fusedps::integration
