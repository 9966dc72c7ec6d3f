// The hyperparameters' one conversion, validation, comparison and JSON form, and that they
// cover every field the proto declares.
#include "server/schema/hyperparameters.h"

#include <string>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "kernels/tensor_layout.h"

namespace fusedps {
namespace {

using google::protobuf::FieldDescriptor;

// Every field of the proto set to a value other than its default (an enum to the last of its
// values that the conversion takes), so that a field the conversion forgets comes back unset or
// different.
v1::Hyperparameters EveryFieldChanged() {
  v1::Hyperparameters p;
  const google::protobuf::Descriptor* d = v1::Hyperparameters::descriptor();
  const google::protobuf::Reflection* r = v1::Hyperparameters::GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_DOUBLE:
        r->SetDouble(&p, f, 0.125 + i);
        break;
      case FieldDescriptor::CPPTYPE_BOOL:
        r->SetBool(&p, f, true);
        break;
      case FieldDescriptor::CPPTYPE_UINT64:
        r->SetUInt64(&p, f, 7 + i);
        break;
      case FieldDescriptor::CPPTYPE_ENUM:
        for (int v = f->enum_type()->value_count() - 1; v > 0; --v) {
          v1::Hyperparameters one;
          r->SetEnum(&one, f, f->enum_type()->value(v));
          if (!HyperparametersFromProto(one).ok()) continue;
          r->SetEnum(&p, f, f->enum_type()->value(v));
          break;
        }
        break;
      default:
        ADD_FAILURE() << "hyperparameters_test does not know the type of field " << f->name();
    }
  }
  return p;
}

TEST(HyperparametersTest, EveryProtoFieldSurvivesTheStructAndTheJson) {
  v1::Hyperparameters p = EveryFieldChanged();
  p.set_amsgrad(true);  // The last enum values (int8 state, bf16 params) are set; no validation.
  absl::StatusOr<AdamWHyperparameters> h = HyperparametersFromProto(p);
  ASSERT_TRUE(h.ok()) << h.status();
  std::string diff;
  google::protobuf::util::MessageDifferencer differ;
  differ.ReportDifferencesToString(&diff);
  EXPECT_TRUE(differ.Compare(p, HyperparametersToProto(*h))) << diff;
}

TEST(HyperparametersTest, TheKernelsTablesNameProtoFieldsOfTheirType) {
  const google::protobuf::Descriptor* d = v1::Hyperparameters::descriptor();
  for (const auto& field : kDoubleHyperparameters) {
    const FieldDescriptor* f = d->FindFieldByName(field.name);
    ASSERT_NE(f, nullptr) << field.name;
    EXPECT_EQ(f->cpp_type(), FieldDescriptor::CPPTYPE_DOUBLE) << field.name;
  }
  for (const auto& field : kBoolHyperparameters) {
    const FieldDescriptor* f = d->FindFieldByName(field.name);
    ASSERT_NE(f, nullptr) << field.name;
    EXPECT_EQ(f->cpp_type(), FieldDescriptor::CPPTYPE_BOOL) << field.name;
  }
}

TEST(HyperparametersTest, UnsetFieldsTakeTorchDefaults) {
  absl::StatusOr<AdamWHyperparameters> h = HyperparametersFromProto(v1::Hyperparameters());
  ASSERT_TRUE(h.ok());
  // torch.optim.AdamW's signature (and fp32 storage, seed 0).
  EXPECT_EQ(h->lr, 1e-3);
  EXPECT_EQ(h->beta1, 0.9);
  EXPECT_EQ(h->beta2, 0.999);
  EXPECT_EQ(h->eps, 1e-8);
  EXPECT_EQ(h->weight_decay, 1e-2);
  EXPECT_FALSE(h->amsgrad);
  EXPECT_FALSE(h->maximize);
  EXPECT_TRUE(h->decoupled_weight_decay);
  EXPECT_EQ(h->state_dtype, StateDType::kFloat32);
  EXPECT_EQ(h->params_dtype, ParamsDType::kFloat32);
  EXPECT_EQ(h->rounding_seed, 0u);
}

TEST(HyperparametersTest, EnumsOutsideTheProtoAreRefusedNamingTheField) {
  v1::Hyperparameters p;
  p.set_weight_decay_mode(static_cast<v1::WeightDecayMode>(9));
  EXPECT_EQ(HyperparametersFromProto(p).status().message(),
            "hyperparameters.weight_decay_mode = 9 must be DECOUPLED (1) or L2 (2)");
  p = v1::Hyperparameters();
  p.set_state_dtype(static_cast<v1::StateDType>(4));
  EXPECT_EQ(HyperparametersFromProto(p).status().message(),
            "hyperparameters.state_dtype = 4 must be FLOAT32 (1), BFLOAT16 (2) or INT8 (3)");
  p = v1::Hyperparameters();
  p.set_params_dtype(v1::DTYPE_FLOAT16);
  EXPECT_EQ(HyperparametersFromProto(p).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(HyperparametersTest, ValidatedAndAmsgradIsFixed) {
  AdamWHyperparameters h;
  h.beta1 = 1.0;
  EXPECT_EQ(ValidateHyperparameters(h).code(), absl::StatusCode::kInvalidArgument);
  h.beta1 = 0.9;
  h.amsgrad = true;
  v1::Hyperparameters update;
  update.set_lr(0.25);
  absl::StatusOr<AdamWHyperparameters> changed = UpdatedHyperparameters(h, update);
  ASSERT_TRUE(changed.ok());
  EXPECT_EQ(changed->lr, 0.25);
  EXPECT_TRUE(changed->amsgrad);
  EXPECT_FALSE(SameHyperparameters(h, *changed));
  update.set_amsgrad(false);
  EXPECT_EQ(UpdatedHyperparameters(h, update).status().code(), absl::StatusCode::kInvalidArgument);
  update = v1::Hyperparameters();
  update.set_eps(-1);
  EXPECT_EQ(UpdatedHyperparameters(h, update).status().code(), absl::StatusCode::kInvalidArgument);
}

// The storage is fixed at registration: an update may repeat it (as clients that resend every
// field do) but not change it, and amsgrad needs fp32 state.
TEST(HyperparametersTest, StorageIsFixedAtRegistration) {
  AdamWHyperparameters h;
  h.state_dtype = StateDType::kInt8;
  h.params_dtype = ParamsDType::kBFloat16;
  h.rounding_seed = 7;
  ASSERT_TRUE(ValidateHyperparameters(h).ok());
  v1::Hyperparameters same;
  same.set_state_dtype(v1::STATE_DTYPE_INT8);
  same.set_params_dtype(v1::DTYPE_BFLOAT16);
  same.set_rounding_seed(7);
  same.set_lr(0.5);
  absl::StatusOr<AdamWHyperparameters> changed = UpdatedHyperparameters(h, same);
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_EQ(changed->lr, 0.5);
  EXPECT_EQ(changed->state_dtype, StateDType::kInt8);
  EXPECT_EQ(changed->params_dtype, ParamsDType::kBFloat16);
  EXPECT_EQ(changed->rounding_seed, 7u);

  const auto expect_refused = [&](const v1::Hyperparameters& update, const std::string& message) {
    const absl::Status s = UpdatedHyperparameters(h, update).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(s.message(), message);
  };
  v1::Hyperparameters update;
  update.set_state_dtype(v1::STATE_DTYPE_BFLOAT16);
  expect_refused(update,
                 "hyperparameters.state_dtype is fixed at registration (the group's state is "
                 "stored in int8)");
  update = v1::Hyperparameters();
  update.set_params_dtype(v1::DTYPE_FLOAT32);
  expect_refused(update,
                 "hyperparameters.params_dtype is fixed at registration (the group's params are "
                 "stored in bf16)");
  update = v1::Hyperparameters();
  update.set_rounding_seed(8);
  expect_refused(update,
                 "hyperparameters.rounding_seed is fixed at registration (it is 7; a replay or "
                 "restore must round the same)");

  for (StateDType state : {StateDType::kBFloat16, StateDType::kInt8}) {
    AdamWHyperparameters ams;
    ams.amsgrad = true;
    ams.state_dtype = state;
    const absl::Status s = ValidateHyperparameters(ams);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(s.message(), std::string("hyperparameters.amsgrad needs state_dtype FLOAT32, not ") +
                               StateDTypeName(state));
  }
}

}  // namespace
}  // namespace fusedps
