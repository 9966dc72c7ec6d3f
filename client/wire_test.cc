// Tests of client/wire.h: chunk planning, partitioning, element conversions, pull reassembly,
// call deadlines and proto mapping.
#include "client/wire.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/half_float.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/support/status.h"
#include "gtest/gtest.h"

namespace fusedps::client {
namespace {

using internal::ChunkSpan;
using internal::MessagePlan;
using internal::PlanChunks;
using internal::TensorExtent;

// Checks every property PlanChunks promises.
void ExpectValidPlan(const std::vector<TensorExtent>& tensors, size_t element_bytes,
                     size_t max_chunk_bytes, const std::vector<MessagePlan>& plan) {
  const uint64_t capacity = max_chunk_bytes / element_bytes;
  size_t tensor = 0;
  uint64_t offset = 0;
  auto skip_finished = [&] {
    while (tensor < tensors.size() && offset == tensors[tensor].numel) {
      ++tensor;
      offset = 0;
    }
  };
  skip_finished();
  for (size_t m = 0; m < plan.size(); ++m) {
    ASSERT_FALSE(plan[m].empty()) << "message " << m;
    uint64_t payload = 0;
    size_t metadata = 0;
    for (const ChunkSpan& span : plan[m]) {
      ASSERT_GT(span.numel, 0u);
      // Chunks come in tensor order and offset order, without gaps or overlaps.
      ASSERT_EQ(span.tensor, tensor) << "message " << m;
      ASSERT_EQ(span.offset, offset) << "message " << m;
      ASSERT_LE(span.numel, tensors[tensor].numel - offset);
      payload += span.numel;
      metadata += tensors[span.tensor].name_bytes + internal::kChunkFramingBytes;
      offset += span.numel;
      skip_finished();
    }
    EXPECT_LE(payload * element_bytes, max_chunk_bytes) << "message " << m;
    if (plan[m].size() > 1) {
      EXPECT_LE(metadata, internal::kMaxChunkMetadataBytes);
    }
    if (m + 1 < plan.size()) {
      // Not the last: full of payload, or the next chunk's metadata would not fit.
      const size_t next_metadata = tensors[tensor].name_bytes + internal::kChunkFramingBytes;
      EXPECT_TRUE(payload == capacity ||
                  metadata + next_metadata > internal::kMaxChunkMetadataBytes)
          << "message " << m << " is not full";
    }
  }
  EXPECT_EQ(tensor, tensors.size()) << "elements left unplanned";
}

// The --dtype spellings of the fusedps CLI and fusedps-bench.
TEST(DTypeNameTest, ShortAndLongSpellings) {
  const std::pair<const char*, DType> spellings[] = {
      {"fp32", DType::kFloat32},      {"float32", DType::kFloat32}, {"bf16", DType::kBFloat16},
      {"bfloat16", DType::kBFloat16}, {"fp16", DType::kFloat16},    {"float16", DType::kFloat16}};
  for (const auto& [name, dtype] : spellings) {
    absl::StatusOr<DType> parsed = ParseDType(name);
    ASSERT_TRUE(parsed.ok()) << name;
    EXPECT_EQ(*parsed, dtype) << name;
  }
  EXPECT_STREQ(DTypeName(DType::kFloat32), "fp32");
  EXPECT_STREQ(DTypeName(DType::kBFloat16), "bf16");
  EXPECT_STREQ(DTypeName(DType::kFloat16), "fp16");
  absl::StatusOr<DType> bad = ParseDType("int8");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "must be fp32, bf16 or fp16, not int8");
}

TEST(PlanChunksTest, NoTensorsNoMessages) {
  EXPECT_TRUE(PlanChunks({}, 4, 1 << 20).value().empty());
}

TEST(PlanChunksTest, EmptyTensorsGetNoChunks) {
  const std::vector<TensorExtent> tensors = {{0, 1}, {0, 1}};
  EXPECT_TRUE(PlanChunks(tensors, 4, 1 << 20).value().empty());
}

TEST(PlanChunksTest, ZeroDimTensorIsOneElement) {
  const std::vector<TensorExtent> tensors = {{0, 5}, {1, 5}, {0, 5}};
  const std::vector<MessagePlan> plan = PlanChunks(tensors, 2, 4).value();
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_EQ(plan[0], (MessagePlan{{1, 0, 1}}));
}

TEST(PlanChunksTest, ThreeMillionFloatsInOneMebibyteMessages) {
  const std::vector<TensorExtent> tensors = {{3'000'000, 6}};
  const std::vector<MessagePlan> plan = PlanChunks(tensors, 4, 1 << 20).value();
  ASSERT_EQ(plan.size(), 12u);  // ceil(12e6 bytes / 1 MiB)
  for (size_t m = 0; m < 11; ++m) EXPECT_EQ(plan[m], (MessagePlan{{0, m * 262144, 262144}}));
  EXPECT_EQ(plan[11], (MessagePlan{{0, 11 * 262144, 3'000'000 - 11 * 262144}}));
  ExpectValidPlan(tensors, 4, 1 << 20, plan);
}

TEST(PlanChunksTest, SmallTensorsShareAMessageAndLargeOnesSpill) {
  const std::vector<TensorExtent> tensors = {{10, 1}, {100, 1}, {1000, 1}, {3, 1}};
  const std::vector<MessagePlan> plan = PlanChunks(tensors, 4, 2048).value();  // 512 elements
  ASSERT_EQ(plan.size(), 3u);
  EXPECT_EQ(plan[0], (MessagePlan{{0, 0, 10}, {1, 0, 100}, {2, 0, 402}}));
  EXPECT_EQ(plan[1], (MessagePlan{{2, 402, 512}}));
  EXPECT_EQ(plan[2], (MessagePlan{{2, 914, 86}, {3, 0, 3}}));
  ExpectValidPlan(tensors, 4, 2048, plan);
}

TEST(PlanChunksTest, ByteLimitNotAMultipleOfTheElementSize) {
  const std::vector<TensorExtent> tensors = {{1001, 1}};
  const std::vector<MessagePlan> plan = PlanChunks(tensors, 4, 1003).value();  // 250 elements
  ASSERT_EQ(plan.size(), 5u);
  EXPECT_EQ(plan[4], (MessagePlan{{0, 1000, 1}}));
  ExpectValidPlan(tensors, 4, 1003, plan);
}

TEST(PlanChunksTest, ManyTinyTensorsAreBoundedByMetadata) {
  const std::vector<TensorExtent> tensors(5000, TensorExtent{1, 200});
  const std::vector<MessagePlan> plan = PlanChunks(tensors, 4, 1 << 20).value();
  const size_t per_message =
      internal::kMaxChunkMetadataBytes / (200 + internal::kChunkFramingBytes);
  EXPECT_EQ(plan[0].size(), per_message);
  EXPECT_EQ(plan.size(), (5000 + per_message - 1) / per_message);
  ExpectValidPlan(tensors, 4, 1 << 20, plan);
}

TEST(PlanChunksTest, RejectsALimitBelowOneElement) {
  EXPECT_EQ(PlanChunks({{4, 1}}, 4, 3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanChunks({{4, 1}}, 0, 3).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PlanChunksTest, RandomTensorListsAreCoveredExactlyOnce) {
  std::mt19937_64 rng(42);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<TensorExtent> tensors(rng() % 20);
    for (TensorExtent& t : tensors) {
      const int kind = static_cast<int>(rng() % 4);
      t.numel = kind == 0 ? 0 : kind == 1 ? 1 : kind == 2 ? rng() % 100 : rng() % 100'000;
      t.name_bytes = 1 + rng() % 256;
    }
    const size_t element_bytes = rng() % 2 ? 4 : 2;
    const size_t max_chunk_bytes = element_bytes + rng() % 70'000;
    SCOPED_TRACE(absl::StrCat("trial ", trial, ", max_chunk_bytes ", max_chunk_bytes));
    ExpectValidPlan(tensors, element_bytes, max_chunk_bytes,
                    PlanChunks(tensors, element_bytes, max_chunk_bytes).value());
  }
}

TEST(PartitionTensorsTest, EveryIndexOnceInAtMostPartsGroups) {
  const std::vector<uint64_t> numels = {100, 1, 0, 50, 50, 7, 1'000'000, 3};
  for (int parts = 1; parts <= 10; ++parts) {
    const std::vector<std::vector<size_t>> groups = internal::PartitionTensors(numels, parts);
    EXPECT_EQ(groups.size(), std::min<size_t>(parts, numels.size()));
    std::vector<size_t> all;
    for (const std::vector<size_t>& group : groups) {
      ASSERT_FALSE(group.empty());
      EXPECT_TRUE(std::is_sorted(group.begin(), group.end()));
      all.insert(all.end(), group.begin(), group.end());
    }
    std::sort(all.begin(), all.end());
    for (size_t i = 0; i < numels.size(); ++i) EXPECT_EQ(all[i], i);
  }
  EXPECT_TRUE(internal::PartitionTensors({}, 4).empty());
}

TEST(PartitionTensorsTest, BalancesEqualTensors) {
  const std::vector<uint64_t> numels(8, 1000);
  for (const std::vector<size_t>& group : internal::PartitionTensors(numels, 4)) {
    EXPECT_EQ(group.size(), 2u);
  }
}

TEST(NumElementsTest, ShapesToCounts) {
  EXPECT_EQ(internal::NumElements({}).value(), 1u);
  EXPECT_EQ(internal::NumElements({0, 5}).value(), 0u);
  EXPECT_EQ(internal::NumElements({3, 4, 5}).value(), 60u);
  EXPECT_EQ(internal::NumElements({-1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(internal::NumElements({1 << 30, 1 << 30, 1 << 30}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ElementsTest, Float32RoundTripsBitExactly) {
  const std::vector<float> values = {0.0f,       -0.0f, 1.5f,
                                     -3.25e-39f, 1e38f, std::numeric_limits<float>::infinity()};
  std::string data;
  internal::EncodeElements(values, DType::kFloat32, &data);
  ASSERT_EQ(data.size(), values.size() * 4);
  std::vector<float> decoded(values.size());
  internal::DecodeElements(data, DType::kFloat32, absl::MakeSpan(decoded));
  EXPECT_EQ(std::memcmp(decoded.data(), values.data(), data.size()), 0);
}

TEST(ElementsTest, HalfDTypesAreLittleEndianAndRoundToNearestEven) {
  std::string data;
  internal::EncodeElements({1.0f}, DType::kBFloat16, &data);
  EXPECT_EQ(data, std::string("\x80\x3f", 2));
  internal::EncodeElements({1.0f}, DType::kFloat16, &data);
  EXPECT_EQ(data, std::string("\x00\x3c", 2));

  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 100.0f);
  std::vector<float> values(1000);
  for (float& v : values) v = normal(rng);
  values.push_back(std::nanf(""));
  values.push_back(1e6f);  // Beyond fp16's range.
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    internal::EncodeElements(values, dtype, &data);
    ASSERT_EQ(data.size(), values.size() * 2);
    std::vector<float> decoded(values.size());
    internal::DecodeElements(data, dtype, absl::MakeSpan(decoded));
    for (size_t i = 0; i < values.size(); ++i) {
      const float expected = dtype == DType::kBFloat16 ? BFloat16ToFloat(FloatToBFloat16(values[i]))
                                                       : Float16ToFloat(FloatToFloat16(values[i]));
      if (std::isnan(expected)) {
        EXPECT_TRUE(std::isnan(decoded[i]));
      } else {
        EXPECT_EQ(decoded[i], expected) << "element " << i;
      }
    }
  }
}

TEST(StatusTest, GrpcStatusKeepsCodeAndMessage) {
  EXPECT_TRUE(internal::ToAbslStatus(grpc::Status::OK).ok());
  const absl::Status status =
      internal::ToAbslStatus(grpc::Status(grpc::StatusCode::NOT_FOUND, "no tensor named w"));
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(status.message(), "no tensor named w");
  EXPECT_EQ(internal::ToAbslStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE, "")).code(),
            absl::StatusCode::kUnavailable);
}

TEST(HyperparametersTest, OnlySetFieldsTravel) {
  ParamGroupOptions options;
  options.lr = 3e-4;
  options.amsgrad = false;
  options.weight_decay_mode = WeightDecayMode::kL2;
  const v1::Hyperparameters hyper = internal::ToProtoHyperparameters(options);
  EXPECT_TRUE(hyper.has_lr());
  EXPECT_TRUE(hyper.has_amsgrad());
  EXPECT_FALSE(hyper.has_beta1());
  EXPECT_FALSE(hyper.has_maximize());
  EXPECT_EQ(hyper.weight_decay_mode(), v1::WEIGHT_DECAY_MODE_L2);
  const ParamGroupOptions back = internal::FromProtoHyperparameters(hyper);
  EXPECT_EQ(back.lr, options.lr);
  EXPECT_EQ(back.amsgrad, options.amsgrad);
  EXPECT_EQ(back.weight_decay_mode, options.weight_decay_mode);
  EXPECT_FALSE(back.beta1.has_value());
  EXPECT_FALSE(back.eps.has_value());
}

// Every field of the proto, set to a value other than its default, comes back from
// ParamGroupOptions: a field the conversion forgets comes back unset.
TEST(HyperparametersTest, EveryProtoFieldSurvivesTheOptions) {
  v1::Hyperparameters p;
  const google::protobuf::Descriptor* d = v1::Hyperparameters::descriptor();
  const google::protobuf::Reflection* r = v1::Hyperparameters::GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = d->field(i);
    switch (f->cpp_type()) {
      case google::protobuf::FieldDescriptor::CPPTYPE_DOUBLE:
        r->SetDouble(&p, f, 0.125 + i);
        break;
      case google::protobuf::FieldDescriptor::CPPTYPE_BOOL:
        r->SetBool(&p, f, true);
        break;
      case google::protobuf::FieldDescriptor::CPPTYPE_UINT64:
        r->SetUInt64(&p, f, 7 + i);
        break;
      case google::protobuf::FieldDescriptor::CPPTYPE_ENUM:  // BFLOAT16 or L2: value 2.
        r->SetEnumValue(&p, f, 2);
        break;
      default:
        ADD_FAILURE() << "wire_test does not know the type of field " << f->name();
    }
  }
  std::string diff;
  google::protobuf::util::MessageDifferencer differ;
  differ.ReportDifferencesToString(&diff);
  EXPECT_TRUE(
      differ.Compare(p, internal::ToProtoHyperparameters(internal::FromProtoHyperparameters(p))))
      << diff;
}

TEST(HyperparametersTest, StorageFieldsTravelWhenSet) {
  ParamGroupOptions options;
  options.state_dtype = StateDType::kInt8;
  options.params_dtype = DType::kBFloat16;
  options.rounding_seed = 0xfedcba9876543210ull;  // Above 2^63: uint64 on the wire.
  const v1::Hyperparameters hyper = internal::ToProtoHyperparameters(options);
  EXPECT_EQ(hyper.state_dtype(), v1::STATE_DTYPE_INT8);
  EXPECT_EQ(hyper.params_dtype(), v1::DTYPE_BFLOAT16);
  EXPECT_EQ(hyper.rounding_seed(), 0xfedcba9876543210ull);
  const ParamGroupOptions back = internal::FromProtoHyperparameters(hyper);
  EXPECT_EQ(back.state_dtype, StateDType::kInt8);
  EXPECT_EQ(back.params_dtype, DType::kBFloat16);
  EXPECT_EQ(back.rounding_seed, 0xfedcba9876543210ull);

  const v1::Hyperparameters unset = internal::ToProtoHyperparameters(ParamGroupOptions{});
  EXPECT_FALSE(unset.has_state_dtype());
  EXPECT_FALSE(unset.has_params_dtype());
  EXPECT_FALSE(unset.has_rounding_seed());
  v1::Hyperparameters unspecified;  // Set to UNSPECIFIED: fp32, as the proto says.
  unspecified.set_state_dtype(v1::STATE_DTYPE_UNSPECIFIED);
  unspecified.set_params_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(internal::FromProtoHyperparameters(unspecified).state_dtype, StateDType::kFloat32);
  EXPECT_EQ(internal::FromProtoHyperparameters(unspecified).params_dtype, DType::kFloat32);
  EXPECT_STREQ(StateDTypeName(StateDType::kInt8), "int8");
  EXPECT_STREQ(StateDTypeName(StateDType::kBFloat16), "bf16");
}

TEST(TensorInfoTest, LayoutComesFromTheServerAndDefaultsToFp32) {
  v1::TensorInfo info;
  info.set_name("w");
  info.set_params_dtype(v1::DTYPE_BFLOAT16);
  info.set_state_dtype(v1::STATE_DTYPE_INT8);
  const TensorInfo out = internal::FromProtoTensorInfo(info);
  EXPECT_EQ(out.params_dtype, DType::kBFloat16);
  EXPECT_EQ(out.state_dtype, StateDType::kInt8);
  const TensorInfo old = internal::FromProtoTensorInfo(v1::TensorInfo());  // An older server.
  EXPECT_EQ(old.params_dtype, DType::kFloat32);
  EXPECT_EQ(old.state_dtype, StateDType::kFloat32);
}

TEST(PullChunkBytesTest, KeptInTheWireBounds) {
  EXPECT_EQ(internal::PullChunkBytes(4), 16u);
  EXPECT_EQ(internal::PullChunkBytes(4096), 4096u);
  EXPECT_EQ(internal::PullChunkBytes(15 << 20), 4u << 20);
}

TEST(CallTimeoutTest, FloorPlusBytesAtTheMinimumRate) {
  ClientOptions options;  // 30 s plus 10 MB/s.
  EXPECT_EQ(internal::CallTimeout(options, 0), absl::Seconds(30));
  EXPECT_EQ(internal::CallTimeout(options, 248'000'000), absl::Seconds(30 + 24.8));
  options.min_bytes_per_second = 0;
  EXPECT_EQ(internal::CallTimeout(options, 248'000'000), absl::Seconds(30));
  options.min_bytes_per_second = 1;
  EXPECT_EQ(internal::CallTimeout(options, UINT64_MAX), absl::InfiniteDuration());
  options.timeout = absl::InfiniteDuration();
  options.min_bytes_per_second = 10'000'000;
  EXPECT_EQ(internal::CallTimeout(options, 1), absl::InfiniteDuration());
}

// Messages of a pull reply, built for PullAssemblerTest.
v1::TensorInfo Info(const std::string& name, std::vector<int64_t> shape) {
  v1::TensorInfo info;
  info.set_name(name);
  info.mutable_shape()->Add(shape.begin(), shape.end());
  return info;
}

v1::PullParametersResponse Header(uint32_t tensor_count, std::vector<v1::TensorInfo> infos) {
  v1::PullParametersResponse response;
  response.mutable_header()->set_version(7);
  response.mutable_header()->set_dtype(v1::DTYPE_FLOAT32);
  response.mutable_header()->set_tensor_count(tensor_count);
  for (v1::TensorInfo& info : infos) *response.mutable_header()->add_tensors() = std::move(info);
  return response;
}

v1::PullParametersResponse Infos(std::vector<v1::TensorInfo> infos) {
  v1::PullParametersResponse response;
  for (v1::TensorInfo& info : infos) *response.add_tensors() = std::move(info);
  return response;
}

v1::PullParametersResponse Chunk(const std::string& tensor, uint64_t offset,
                                 std::vector<float> values) {
  v1::PullParametersResponse response;
  v1::TensorChunk* chunk = response.add_chunks();
  chunk->set_tensor(tensor);
  chunk->set_offset(offset);
  internal::EncodeElements(values, DType::kFloat32, chunk->mutable_data());
  return response;
}

TEST(PullAssemblerTest, HeaderWithoutTensorCountHoldsThemAll) {
  internal::PullAssembler assembler(DType::kFloat32);
  ASSERT_TRUE(assembler.Add(Header(0, {Info("a", {2}), Info("b", {})})).ok());
  EXPECT_EQ(assembler.announced_bytes(), 12u);
  ASSERT_TRUE(assembler.Add(Chunk("b", 0, {3})).ok());
  ASSERT_TRUE(assembler.Add(Chunk("a", 0, {1, 2})).ok());
  ASSERT_TRUE(assembler.Finish({"a", "b"}).ok());
  const PullResult result = std::move(assembler).result();
  EXPECT_EQ(result.version, 7u);
  EXPECT_EQ(result.tensors.at("a").values, (std::vector<float>{1, 2}));
  EXPECT_EQ(result.tensors.at("b").values, (std::vector<float>{3}));
  EXPECT_TRUE(result.tensors.at("b").shape.empty());
}

TEST(PullAssemblerTest, TensorInfoContinuesPastTheHeader) {
  internal::PullAssembler assembler(DType::kFloat32);
  ASSERT_TRUE(assembler.Add(Header(3, {Info("a", {1})})).ok());
  ASSERT_TRUE(assembler.Add(Infos({Info("b", {1}), Info("c", {2})})).ok());
  EXPECT_EQ(assembler.announced_bytes(), 16u);
  ASSERT_TRUE(assembler.Add(Chunk("c", 0, {5, 6})).ok());
  ASSERT_TRUE(assembler.Add(Chunk("a", 0, {1})).ok());
  ASSERT_TRUE(assembler.Add(Chunk("b", 0, {2})).ok());
  ASSERT_TRUE(assembler.Finish({}).ok());
  EXPECT_EQ(std::move(assembler).result().tensors.at("c").values, (std::vector<float>{5, 6}));
}

TEST(PullAssemblerTest, ChunkInTheSameMessageAfterItsInfoIsAccepted) {
  internal::PullAssembler assembler(DType::kFloat32);
  ASSERT_TRUE(assembler.Add(Header(2, {Info("a", {1})})).ok());
  v1::PullParametersResponse both = Chunk("b", 0, {4});
  *both.add_tensors() = Info("b", {1});
  ASSERT_TRUE(assembler.Add(both).ok());
  ASSERT_TRUE(assembler.Add(Chunk("a", 0, {3})).ok());
  EXPECT_TRUE(assembler.Finish({}).ok());
}

// The reply's messages added in order; the first error, or the one of Finish.
absl::Status Assemble(const std::vector<v1::PullParametersResponse>& messages) {
  internal::PullAssembler assembler(DType::kFloat32);
  for (const v1::PullParametersResponse& message : messages) {
    if (absl::Status status = assembler.Add(message); !status.ok()) return status;
  }
  return assembler.Finish({});
}

TEST(PullAssemblerTest, MalformedRepliesAreInternal) {
  const struct {
    std::vector<v1::PullParametersResponse> messages;
    std::string message;
  } cases[] = {
      {{Header(2, {Info("a", {1})}), Chunk("b", 0, {1}), Infos({Info("b", {1})})},
       "a chunk of b before its TensorInfo"},
      {{Header(2, {Info("a", {1})}), Chunk("a", 0, {1})},
       "1 TensorInfo, not its tensor_count of 2"},
      {{Header(1, {Info("a", {1})}), Infos({Info("b", {1})})},
       "more TensorInfo than its tensor_count of 1"},
      {{Header(0, {Info("a", {1})}), Infos({Info("b", {1})})},
       "TensorInfo past the header, whose tensor_count of 0 says it holds them all"},
      {{Infos({Info("a", {1})})}, "data before its header"},
      {{Header(2, {Info("a", {1})}), Infos({Info("a", {1})})}, "tensor a is described twice"},
      {{Header(0, {}), Header(0, {})}, "a second header"},
      {{}, "no header"},
      {{Header(1, {Info("a", {2})}), Chunk("a", 1, {1, 2})},
       "a chunk of a at offset 1 of 8 bytes, outside its 2 elements"},
      {{Header(1, {Info("a", {2})}), Chunk("a", 1, {1})}, "1 elements of a, not 2"},
  };
  for (const auto& c : cases) {
    const absl::Status status = Assemble(c.messages);
    EXPECT_EQ(status.code(), absl::StatusCode::kInternal) << c.message;
    EXPECT_EQ(status.message(), "malformed pull reply: " + c.message);
  }
}

TEST(PullAssemblerTest, RequestedTensorsMustAllArrive) {
  internal::PullAssembler assembler(DType::kFloat32);
  ASSERT_TRUE(assembler.Add(Header(0, {Info("a", {0})})).ok());
  const absl::Status status = assembler.Finish({"a", "b"});
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(status.message(), "malformed pull reply: requested tensor b is missing");
}

}  // namespace
}  // namespace fusedps::client
