// Per-group storage over real gRPC (state_dtype, params_dtype, rounding_seed): registration of
// each storage, what GetInfo, ListTensors and pulls report of it (each tensor's own layout), the
// values that are refused and the rule that storage is fixed at registration, 16-bit pulls of
// bf16 params beside fp32 ones, pulls and loads of bf16 and int8 state (dequantized on the way
// out, quantized block by block on the way in), and the memory metric of the int8 scales.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/quant_math.h"
#include "tests/integration/state_dtype_harness.h"

namespace fusedps::integration {
namespace {

// int8 state's fp32 values from its codes and scales (stored bytes): map value x block scale.
std::vector<float> Dequantized(const std::string& codes, const std::string& scales,
                               const QuantCodebook& book) {
  const std::vector<float> absmax = Floats(scales);
  std::vector<float> out(codes.size());
  for (size_t i = 0; i < codes.size(); ++i) {
    out[i] = book.values[static_cast<uint8_t>(codes[i])] * absmax[i / kQuantBlock];
  }
  return out;
}

std::vector<float> Widened(const std::string& bf16) {
  std::vector<float> out(bf16.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    uint16_t bits;
    std::memcpy(&bits, &bf16[i * 2], 2);
    out[i] = BFloat16ToFloat(bits);
  }
  return out;
}

// Groups of every storage, and tensors that show each layout: "q_small" keeps fp32 state in
// an int8 group (under 4096 elements), as does "p_small" beside bf16 params.
class StorageTest : public StateDTypeTest {
 protected:
  void RegisterEveryStorage() {
    ASSERT_NO_FATAL_FAILURE(RegisterStorageGroup("half", Storage(StateDType::kBFloat16)));
    ASSERT_NO_FATAL_FAILURE(RegisterStorageGroup("q8", Storage(StateDType::kInt8)));
    ASSERT_NO_FATAL_FAILURE(
        RegisterStorageGroup("sr", Storage(StateDType::kInt8, ParamsDType::kBFloat16, 42)));
    ASSERT_NO_FATAL_FAILURE(RegisterStorageGroup(
        "sr32", Storage(StateDType::kFloat32, ParamsDType::kBFloat16, 0xfedcba9876543210ull)));
    ASSERT_NO_FATAL_FAILURE(RegisterTensors({{"w", {7, 9}, ""},
                                             {"h", {3000}, "half"},
                                             {"q", {50, 100}, "q8"},
                                             {"q_small", {100}, "q8"},
                                             {"p", {4096}, "sr"},
                                             {"p_small", {10}, "sr"},
                                             {"r", {33}, "sr32"}}));
  }
};

struct Layout {
  const char* name;
  v1::DType params;
  v1::StateDType state;
};
const Layout kLayouts[] = {{"w", v1::DTYPE_FLOAT32, v1::STATE_DTYPE_FLOAT32},
                           {"h", v1::DTYPE_FLOAT32, v1::STATE_DTYPE_BFLOAT16},
                           {"q", v1::DTYPE_FLOAT32, v1::STATE_DTYPE_INT8},
                           {"q_small", v1::DTYPE_FLOAT32, v1::STATE_DTYPE_FLOAT32},
                           {"p", v1::DTYPE_BFLOAT16, v1::STATE_DTYPE_INT8},
                           {"p_small", v1::DTYPE_BFLOAT16, v1::STATE_DTYPE_FLOAT32},
                           {"r", v1::DTYPE_BFLOAT16, v1::STATE_DTYPE_FLOAT32}};

void ExpectLayouts(const google::protobuf::RepeatedPtrField<v1::TensorInfo>& infos,
                   const std::string& where) {
  ASSERT_EQ(static_cast<size_t>(infos.size()), std::size(kLayouts)) << where;
  for (int i = 0; i < infos.size(); ++i) {
    EXPECT_EQ(infos[i].name(), kLayouts[i].name) << where;
    EXPECT_EQ(infos[i].params_dtype(), kLayouts[i].params) << where << " " << infos[i].name();
    EXPECT_EQ(infos[i].state_dtype(), kLayouts[i].state) << where << " " << infos[i].name();
  }
}

TEST_F(StorageTest, EveryStorageRegistersAndEachTensorReportsItsLayout) {
  ASSERT_NO_FATAL_FAILURE(RegisterEveryStorage());
  // The groups as stored, storage included.
  const v1::GetInfoResponse info = GetInfo();
  ASSERT_EQ(info.param_groups_size(), 5);
  const v1::Hyperparameters& def = info.param_groups(0).hyperparameters();
  EXPECT_EQ(def.state_dtype(), v1::STATE_DTYPE_FLOAT32);
  EXPECT_EQ(def.params_dtype(), v1::DTYPE_FLOAT32);
  EXPECT_TRUE(def.has_rounding_seed());
  EXPECT_EQ(def.rounding_seed(), 0u);
  EXPECT_EQ(info.param_groups(1).hyperparameters().state_dtype(), v1::STATE_DTYPE_BFLOAT16);
  EXPECT_EQ(info.param_groups(2).hyperparameters().state_dtype(), v1::STATE_DTYPE_INT8);
  const v1::Hyperparameters& sr = info.param_groups(3).hyperparameters();
  EXPECT_EQ(sr.state_dtype(), v1::STATE_DTYPE_INT8);
  EXPECT_EQ(sr.params_dtype(), v1::DTYPE_BFLOAT16);
  EXPECT_EQ(sr.rounding_seed(), 42u);
  EXPECT_EQ(info.param_groups(4).hyperparameters().rounding_seed(), 0xfedcba9876543210ull);
  EXPECT_EQ(info.param_groups(4).hyperparameters().state_dtype(), v1::STATE_DTYPE_FLOAT32);

  ExpectLayouts(ListTensors().tensors(), "ListTensors");
  const Pulled pulled = Pull({}, v1::DTYPE_FLOAT32, v1::TENSOR_FIELD_EXP_AVG);
  ASSERT_TRUE(pulled.status.ok()) << pulled.status.error_message();
  ExpectLayouts(pulled.header.tensors(), "PullHeader");

  // The same group again (storage included) is a no-op.
  v1::RegisterParamGroupResponse again;
  ASSERT_TRUE(RegisterGroup("sr", ToProto(host_.group("sr")), &again).ok());
  EXPECT_FALSE(again.created());
  EXPECT_EQ(again.param_group().hyperparameters().rounding_seed(), 42u);
}

TEST_F(StorageTest, TheScalesOfInt8StateAreAMemoryKind) {
  ASSERT_NO_FATAL_FAILURE(RegisterEveryStorage());
  const std::string text = server_->metrics().ScrapeText();
  const std::string key = "fusedps_device_memory_bytes{kind=\"state_scales\"} ";
  const size_t at = text.find(key);
  ASSERT_NE(at, std::string::npos) << text;
  // Two fp32 scales per block of 256: q has 20 blocks, p 16.
  EXPECT_GE(std::stod(text.substr(at + key.size())), 2 * 4 * (20 + 16));
}

struct BadGroup {
  const char* name;
  std::function<void(v1::Hyperparameters&)> change;
  std::string message;
};

const BadGroup kBadGroups[] = {
    {"StateDTypeNotAStateDType",
     [](v1::Hyperparameters& h) { h.set_state_dtype(static_cast<v1::StateDType>(7)); },
     "hyperparameters.state_dtype = 7 must be FLOAT32 (1), BFLOAT16 (2) or INT8 (3)"},
    {"Float16Params", [](v1::Hyperparameters& h) { h.set_params_dtype(v1::DTYPE_FLOAT16); },
     "hyperparameters.params_dtype = 3 must be FLOAT32 (1) or BFLOAT16 (2)"},
    {"ParamsDTypeNotADType",
     [](v1::Hyperparameters& h) { h.set_params_dtype(static_cast<v1::DType>(9)); },
     "hyperparameters.params_dtype = 9 must be FLOAT32 (1) or BFLOAT16 (2)"},
    {"AmsgradWithInt8State",
     [](v1::Hyperparameters& h) {
       h.set_amsgrad(true);
       h.set_state_dtype(v1::STATE_DTYPE_INT8);
     },
     "hyperparameters.amsgrad needs state_dtype FLOAT32, not int8"},
    {"AmsgradWithBFloat16State",
     [](v1::Hyperparameters& h) {
       h.set_amsgrad(true);
       h.set_state_dtype(v1::STATE_DTYPE_BFLOAT16);
     },
     "hyperparameters.amsgrad needs state_dtype FLOAT32, not bf16"},
};

TEST_F(StorageTest, BadStorageValuesAreInvalidArgumentAndRegisterNothing) {
  for (const BadGroup& bad : kBadGroups) {
    v1::Hyperparameters hyper = ToProto(Storage(StateDType::kFloat32));
    bad.change(hyper);
    v1::RegisterParamGroupResponse response;
    const grpc::Status status = RegisterGroup("bad", hyper, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad.name;
    EXPECT_EQ(status.error_message(), bad.message) << bad.name;
  }
  EXPECT_EQ(GetInfo().param_groups_size(), 1);  // "default" alone.
  // A change that is not a value at all is refused the same way.
  v1::Hyperparameters change;
  change.set_state_dtype(static_cast<v1::StateDType>(7));
  v1::SetHyperparametersResponse response;
  const grpc::Status status = SetHyperparameters("default", change, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(), kBadGroups[0].message);
}

TEST_F(StorageTest, StorageIsFixedAtRegistration) {
  const AdamWHyperparameters q8 = Storage(StateDType::kInt8, ParamsDType::kBFloat16, 5);
  ASSERT_NO_FATAL_FAILURE(RegisterStorageGroup("q8", q8));
  ASSERT_NO_FATAL_FAILURE(RegisterTensors({{"q", {5000}, "q8"}}));
  const v1::GetInfoResponse before = GetInfo();

  // Repeating the storage (a client that sends every field) changes the rest.
  v1::Hyperparameters repeat;
  repeat.set_lr(0.5);
  repeat.set_state_dtype(v1::STATE_DTYPE_INT8);
  repeat.set_params_dtype(v1::DTYPE_BFLOAT16);
  repeat.set_rounding_seed(5);
  v1::SetHyperparametersResponse set;
  const grpc::Status repeated = SetHyperparameters("q8", repeat, &set);
  ASSERT_TRUE(repeated.ok()) << repeated.error_message();
  EXPECT_EQ(set.param_group().hyperparameters().lr(), 0.5);
  EXPECT_EQ(set.param_group().hyperparameters().state_dtype(), v1::STATE_DTYPE_INT8);

  const std::pair<std::function<void(v1::Hyperparameters&)>, std::string> changes[] = {
      {[](v1::Hyperparameters& h) { h.set_state_dtype(v1::STATE_DTYPE_FLOAT32); },
       "hyperparameters.state_dtype is fixed at registration (the group's state is stored in "
       "int8)"},
      {[](v1::Hyperparameters& h) { h.set_state_dtype(v1::STATE_DTYPE_UNSPECIFIED); },
       "hyperparameters.state_dtype is fixed at registration (the group's state is stored in "
       "int8)"},
      {[](v1::Hyperparameters& h) { h.set_params_dtype(v1::DTYPE_FLOAT32); },
       "hyperparameters.params_dtype is fixed at registration (the group's params are stored in "
       "bf16)"},
      {[](v1::Hyperparameters& h) { h.set_rounding_seed(6); },
       "hyperparameters.rounding_seed is fixed at registration (it is 5; a replay or restore "
       "must round the same)"},
  };
  for (const auto& [change, message] : changes) {
    v1::Hyperparameters hyper;
    hyper.set_lr(0.25);
    change(hyper);
    v1::SetHyperparametersResponse response;
    const grpc::Status status = SetHyperparameters("q8", hyper, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << message;
    EXPECT_EQ(status.error_message(), message);
  }
  // Nothing changed but the lr of the accepted call.
  const v1::Hyperparameters after = GetInfo().param_groups(1).hyperparameters();
  EXPECT_EQ(after.lr(), 0.5);
  EXPECT_EQ(after.state_dtype(), v1::STATE_DTYPE_INT8);
  EXPECT_EQ(after.params_dtype(), v1::DTYPE_BFLOAT16);
  EXPECT_EQ(after.rounding_seed(), 5u);
  EXPECT_EQ(before.param_groups(1).hyperparameters().lr(), q8.lr);

  // Registering the group again with other storage conflicts; with the same, it is a no-op.
  AdamWHyperparameters same = q8;
  same.lr = 0.5;
  for (const auto& other : {Storage(StateDType::kBFloat16, ParamsDType::kBFloat16, 5),
                            Storage(StateDType::kInt8, ParamsDType::kFloat32, 5),
                            Storage(StateDType::kInt8, ParamsDType::kBFloat16, 6)}) {
    AdamWHyperparameters h = other;
    h.lr = 0.5;
    v1::RegisterParamGroupResponse response;
    const grpc::Status status = RegisterGroup("q8", ToProto(h), &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::ALREADY_EXISTS)
        << StateDTypeName(h.state_dtype) << " " << ParamsDTypeName(h.params_dtype) << " "
        << h.rounding_seed;
  }
  v1::RegisterParamGroupResponse response;
  ASSERT_TRUE(RegisterGroup("q8", ToProto(same), &response).ok());
  EXPECT_FALSE(response.created());
}

// The server keeps a bf16 copy of fp32 params only: a 16-bit pull that names bf16 params is
// read as fp32 and rounded (bf16 params: exactly their bits), and one of fp32 params alone
// still comes from the copy.
TEST_F(StorageTest, SixteenBitPullsOfBf16ParamsBesideFp32Ones) {
  ASSERT_NO_FATAL_FAILURE(RegisterEveryStorage());
  ASSERT_NO_FATAL_FAILURE(PushAll(1));
  const Pulled fp32 = Pull({}, v1::DTYPE_FLOAT32);
  ASSERT_TRUE(fp32.status.ok()) << fp32.status.error_message();
  for (v1::DType dtype : {v1::DTYPE_BFLOAT16, v1::DTYPE_FLOAT16}) {
    const Pulled mixed = Pull({"w", "p", "r"}, dtype);
    ASSERT_TRUE(mixed.status.ok()) << v1::DType_Name(dtype) << ": " << mixed.status.error_message();
    EXPECT_EQ(mixed.malformed, "");
    const GradDType wire = static_cast<GradDType>(dtype);
    for (const char* name : {"w", "p", "r"}) {
      ExpectSameBytes(mixed.data.at(name), Encode(wire, Floats(fp32.data.at(name))), 2,
                      std::string(v1::DType_Name(dtype)) + " of " + name);
    }
  }
  // bf16 params pulled as bf16 are their stored bits.
  const Pulled bf16 = Pull({"p", "r"}, v1::DTYPE_BFLOAT16);
  ASSERT_TRUE(bf16.status.ok());
  EXPECT_EQ(bf16.data.at("p"), Stored("p", TensorField::kParam));
  EXPECT_EQ(bf16.data.at("r"), Stored("r", TensorField::kParam));
  const Pulled copy = Pull({"w", "h"}, v1::DTYPE_BFLOAT16);
  ASSERT_TRUE(copy.status.ok()) << copy.status.error_message();
  ExpectSameBytes(copy.data.at("w"), Encode(GradDType::kBFloat16, Floats(fp32.data.at("w"))), 2,
                  "w from the copy");
}

// Pulls of state return fp32 whatever the storage: bf16 widened, int8 dequantized (the map's
// value of each code times its block's scale), close to the fp32 state after one step from
// zero (exp_avg = (1 - beta1) g, exp_avg_sq = (1 - beta2) g^2).
TEST_F(StorageTest, StatePullsAreTheStoredStateDequantized) {
  ASSERT_NO_FATAL_FAILURE(RegisterEveryStorage());
  const std::vector<std::string> names = {"w", "h", "q", "q_small", "p", "p_small", "r"};
  const std::map<std::string, std::vector<float>> grads = RandomGrads(names, 5);
  auto [status, ack] = Push(Messages<v1::PushGradientsRequest>(
      MakePushHeader(v1::DTYPE_FLOAT32), GradChunks(GradDType::kFloat32, grads)));
  ASSERT_TRUE(status.ok()) << status.error_message();
  const Int8Codebooks& books = DynamicCodebooks();
  struct Case {
    v1::TensorField field;
    TensorField stored;
    TensorField scales;
    const QuantCodebook* book;
  };
  for (const Case& c : {Case{v1::TENSOR_FIELD_EXP_AVG, TensorField::kExpAvg,
                             TensorField::kExpAvgAbsmax, &books.exp_avg},
                        Case{v1::TENSOR_FIELD_EXP_AVG_SQ, TensorField::kExpAvgSq,
                             TensorField::kExpAvgSqAbsmax, &books.exp_avg_sq}}) {
    const Pulled pulled = Pull({}, v1::DTYPE_FLOAT32, c.field);
    ASSERT_TRUE(pulled.status.ok()) << pulled.status.error_message();
    const std::string what = v1::TensorField_Name(c.field);
    for (const char* name : {"q", "p"}) {
      const std::vector<float> want =
          Dequantized(Stored(name, c.stored), Stored(name, c.scales), *c.book);
      ExpectSameBytes(pulled.data.at(name), Encode(GradDType::kFloat32, want), 4,
                      what + " of int8 " + name);
    }
    ExpectSameBytes(pulled.data.at("h"),
                    Encode(GradDType::kFloat32, Widened(Stored("h", c.stored))), 4,
                    what + " of bf16 h");
    for (const char* name : {"w", "q_small", "p_small", "r"}) {  // fp32 state: as stored.
      EXPECT_EQ(pulled.data.at(name), Stored(name, c.stored)) << what << " of " << name;
    }
    // Against the fp32 state of one step from zero: within the map's resolution of the block.
    const double beta =
        c.field == v1::TENSOR_FIELD_EXP_AVG ? host_.group("q8").beta1 : host_.group("q8").beta2;
    const std::vector<float> q = Floats(pulled.data.at("q"));
    const std::vector<float> absmax = Floats(Stored("q", c.scales));
    for (size_t i = 0; i < q.size(); ++i) {
      const double g = grads.at("q")[i];
      const double fp32 = c.field == v1::TENSOR_FIELD_EXP_AVG ? (1 - beta) * g : (1 - beta) * g * g;
      ASSERT_LE(std::abs(q[i] - fp32), 0.01 * absmax[i / kQuantBlock] + 1e-12)
          << what << " of q, element " << i;
    }
    // As bf16 on the wire: the fp32 values rounded.
    const Pulled half = Pull({"q", "h"}, v1::DTYPE_BFLOAT16, c.field);
    ASSERT_TRUE(half.status.ok());
    ExpectSameBytes(half.data.at("q"), Encode(GradDType::kBFloat16, q), 2, what + " of q, bf16");
  }
}

std::pair<grpc::Status, v1::LoadStateResponse> LoadState(
    v1::ParameterService::Stub& stub, const v1::LoadStateHeader& header,
    const std::vector<v1::TensorChunk>& chunks) {
  grpc::ClientContext context;
  SetDeadline(context);
  v1::LoadStateResponse response;
  auto writer = stub.LoadState(&context, &response);
  for (const v1::LoadStateRequest& m : Messages<v1::LoadStateRequest>(header, chunks, 1)) {
    if (!writer->Write(m)) break;
  }
  writer->WritesDone();
  return {writer->Finish(), response};
}

// A load writes fp32 values that the storage rounds or quantizes as a step's results are: int8
// state block by block (QuantizeBlock: scale = max |x|, or max x for exp_avg_sq, then the
// nearest code), bf16 state and bf16 params to nearest even. A pull then returns those values.
TEST_F(StorageTest, ALoadIntoLowPrecisionStorageIsQuantizedLikeAStep) {
  ASSERT_NO_FATAL_FAILURE(RegisterStorageGroup("q8", Storage(StateDType::kInt8)));
  ASSERT_NO_FATAL_FAILURE(RegisterStorageGroup("half", Storage(StateDType::kBFloat16)));
  ASSERT_NO_FATAL_FAILURE(
      RegisterStorageGroup("sr32", Storage(StateDType::kFloat32, ParamsDType::kBFloat16, 3)));
  // 5000 elements: 19 whole blocks and a last one of 136.
  ASSERT_NO_FATAL_FAILURE(
      RegisterTensors({{"q", {5000}, "q8"}, {"h", {300}, "half"}, {"r", {77}, "sr32"}}));
  std::vector<float> exp_avg = RandomValues(5000, 70, 0.3f);
  std::vector<float> exp_avg_sq = RandomValues(5000, 71, 1.0f);
  for (float& v : exp_avg_sq) v = v * v * 1e-3f;
  exp_avg_sq[4999] = 0.0f;
  for (int i = 256; i < 512; ++i) exp_avg[i] = 0.0f;  // A block of zeros: scale 0.
  const std::vector<float> h_exp_avg = RandomValues(300, 72), r_param = RandomValues(77, 73);
  v1::LoadStateHeader header;
  v1::TensorState* q = header.add_tensors();
  q->set_name("q");
  q->set_step(4);
  q->add_fields(v1::TENSOR_FIELD_EXP_AVG);
  q->add_fields(v1::TENSOR_FIELD_EXP_AVG_SQ);
  v1::TensorState* h = header.add_tensors();
  h->set_name("h");
  h->set_step(2);
  h->add_fields(v1::TENSOR_FIELD_EXP_AVG);
  v1::TensorState* r = header.add_tensors();
  r->set_name("r");
  r->set_step(1);
  r->add_fields(v1::TENSOR_FIELD_PARAM);
  std::vector<v1::TensorChunk> chunks;
  const auto add = [&](const std::string& name, v1::TensorField field,
                       const std::vector<float>& values) {
    for (v1::TensorChunk& c : SplitIntoChunks(name, Encode(GradDType::kFloat32, values), 4, 999)) {
      c.set_field(field);
      chunks.push_back(std::move(c));
    }
  };
  add("q", v1::TENSOR_FIELD_EXP_AVG, exp_avg);
  add("q", v1::TENSOR_FIELD_EXP_AVG_SQ, exp_avg_sq);
  add("h", v1::TENSOR_FIELD_EXP_AVG, h_exp_avg);
  add("r", v1::TENSOR_FIELD_PARAM, r_param);
  Shuffle(chunks, 9);
  auto [status, response] = LoadState(*stub_, header, chunks);
  ASSERT_TRUE(status.ok()) << status.error_message();

  const Int8Codebooks& books = DynamicCodebooks();
  for (const auto& [field, values, book, is_signed] :
       {std::tuple{v1::TENSOR_FIELD_EXP_AVG, &exp_avg, &books.exp_avg, true},
        std::tuple{v1::TENSOR_FIELD_EXP_AVG_SQ, &exp_avg_sq, &books.exp_avg_sq, false}}) {
    std::vector<float> want(values->size());
    for (size_t first = 0; first < values->size(); first += kQuantBlock) {
      const int n = static_cast<int>(std::min<size_t>(kQuantBlock, values->size() - first));
      uint8_t codes[kQuantBlock];
      float absmax = -1;
      QuantizeBlock(*book, is_signed, values->data() + first, n, codes, &absmax);
      for (int i = 0; i < n; ++i) want[first + i] = book->values[codes[i]] * absmax;
    }
    const Pulled pulled = Pull({"q"}, v1::DTYPE_FLOAT32, field);
    ASSERT_TRUE(pulled.status.ok()) << pulled.status.error_message();
    ExpectSameBytes(pulled.data.at("q"), Encode(GradDType::kFloat32, want), 4,
                    v1::TensorField_Name(field) + " of q");
    EXPECT_NE(want, *values) << "quantized values equal the loaded ones";
  }
  const Pulled h_pulled = Pull({"h"}, v1::DTYPE_FLOAT32, v1::TENSOR_FIELD_EXP_AVG);
  ExpectSameBytes(h_pulled.data.at("h"),
                  Encode(GradDType::kFloat32, RoundTrip(GradDType::kBFloat16, h_exp_avg)), 4,
                  "exp_avg of bf16 h");
  EXPECT_EQ(Stored("r", TensorField::kParam), Encode(GradDType::kBFloat16, r_param));
  const v1::ListTensorsResponse list = ListTensors();
  EXPECT_EQ(list.tensors(0).step(), 4);
  EXPECT_EQ(list.tensors(2).step(), 1);
}

}  // namespace
}  // namespace fusedps::integration
