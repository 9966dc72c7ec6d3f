#include "common/dtype_names.h"

#include "gtest/gtest.h"

namespace fusedps::dtypes {
namespace {

// The names and sizes as the docs (docs/api.md, docs/checkpoints.md) and the Python client
// spell them: what the table must derive from the enums.
TEST(DTypeNamesTest, WireDTypes) {
  EXPECT_STREQ(Name(v1::DTYPE_FLOAT32), "float32");
  EXPECT_STREQ(Name(v1::DTYPE_BFLOAT16), "bfloat16");
  EXPECT_STREQ(Name(v1::DTYPE_FLOAT16), "float16");
  EXPECT_STREQ(ShortName(v1::DTYPE_FLOAT32), "fp32");
  EXPECT_STREQ(ShortName(v1::DTYPE_BFLOAT16), "bf16");
  EXPECT_STREQ(ShortName(v1::DTYPE_FLOAT16), "fp16");
  EXPECT_EQ(ElementBytes(v1::DTYPE_FLOAT32), 4);
  EXPECT_EQ(ElementBytes(v1::DTYPE_BFLOAT16), 2);
  EXPECT_EQ(ElementBytes(v1::DTYPE_FLOAT16), 2);
}

TEST(DTypeNamesTest, StateDTypes) {
  EXPECT_STREQ(ShortName(v1::STATE_DTYPE_FLOAT32), "fp32");
  EXPECT_STREQ(ShortName(v1::STATE_DTYPE_BFLOAT16), "bf16");
  EXPECT_STREQ(ShortName(v1::STATE_DTYPE_INT8), "int8");
  EXPECT_STREQ(Name(v1::STATE_DTYPE_INT8), "int8");
  EXPECT_EQ(ElementBytes(v1::STATE_DTYPE_FLOAT32), 4);
  EXPECT_EQ(ElementBytes(v1::STATE_DTYPE_BFLOAT16), 2);
  EXPECT_EQ(ElementBytes(v1::STATE_DTYPE_INT8), 1);
}

TEST(DTypeNamesTest, UnspecifiedAndUnknownCodesAreNoDType) {
  EXPECT_STREQ(ShortName(v1::DTYPE_UNSPECIFIED), "?");
  EXPECT_STREQ(Name(v1::STATE_DTYPE_UNSPECIFIED), "?");
  EXPECT_EQ(ElementBytes(v1::DTYPE_UNSPECIFIED), 0);
  EXPECT_STREQ(ShortName(static_cast<v1::DType>(99)), "?");
  EXPECT_EQ(ElementBytes(static_cast<v1::StateDType>(99)), 0);
}

TEST(DTypeNamesTest, ParseTakesBothSpellingsInAnyCase) {
  EXPECT_EQ(*ParseDType("fp32"), v1::DTYPE_FLOAT32);
  EXPECT_EQ(*ParseDType("BFloat16"), v1::DTYPE_BFLOAT16);
  EXPECT_EQ(*ParseDType("FP16"), v1::DTYPE_FLOAT16);
  EXPECT_EQ(*ParseStateDType("int8"), v1::STATE_DTYPE_INT8);
  EXPECT_EQ(*ParseStateDType("bfloat16"), v1::STATE_DTYPE_BFLOAT16);
}

TEST(DTypeNamesTest, ParseRefusesOthersNamingTheChoices) {
  absl::StatusOr<v1::DType> wire = ParseDType("int8");
  ASSERT_FALSE(wire.ok());
  EXPECT_EQ(wire.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(wire.status().message(), "must be fp32, bf16 or fp16, not int8");
  absl::StatusOr<v1::StateDType> state = ParseStateDType("unspecified");
  ASSERT_FALSE(state.ok());
  EXPECT_EQ(state.status().message(), "must be fp32, bf16 or int8, not unspecified");
}

// Every member of both enums but UNSPECIFIED has a size and parses back from both names: a
// member added to the proto is in the table.
TEST(DTypeNamesTest, EveryMemberIsInTheTable) {
  for (int i = 0; i < v1::DType_descriptor()->value_count(); ++i) {
    const auto code = static_cast<v1::DType>(v1::DType_descriptor()->value(i)->number());
    if (code == v1::DTYPE_UNSPECIFIED) continue;
    EXPECT_GT(ElementBytes(code), 0) << code;
    EXPECT_EQ(*ParseDType(Name(code)), code);
    EXPECT_EQ(*ParseDType(ShortName(code)), code);
  }
  for (int i = 0; i < v1::StateDType_descriptor()->value_count(); ++i) {
    const auto code = static_cast<v1::StateDType>(v1::StateDType_descriptor()->value(i)->number());
    if (code == v1::STATE_DTYPE_UNSPECIFIED) continue;
    EXPECT_GT(ElementBytes(code), 0) << code;
    EXPECT_EQ(*ParseStateDType(Name(code)), code);
    EXPECT_EQ(*ParseStateDType(ShortName(code)), code);
  }
}

TEST(DTypeNamesTest, TensorFields) {
  EXPECT_STREQ(TensorFieldName(v1::TENSOR_FIELD_PARAM), "param");
  EXPECT_STREQ(TensorFieldName(v1::TENSOR_FIELD_EXP_AVG), "exp_avg");
  EXPECT_STREQ(TensorFieldName(v1::TENSOR_FIELD_EXP_AVG_SQ), "exp_avg_sq");
  EXPECT_STREQ(TensorFieldName(v1::TENSOR_FIELD_MAX_EXP_AVG_SQ), "max_exp_avg_sq");
  EXPECT_STREQ(TensorFieldName(v1::TENSOR_FIELD_UNSPECIFIED), "?");
  EXPECT_EQ(*ParseTensorField("max_exp_avg_sq"), v1::TENSOR_FIELD_MAX_EXP_AVG_SQ);
  EXPECT_EQ(ParseTensorField("params").status().message(),
            "must be param, exp_avg, exp_avg_sq or max_exp_avg_sq, not params");
}

}  // namespace
}  // namespace fusedps::dtypes
