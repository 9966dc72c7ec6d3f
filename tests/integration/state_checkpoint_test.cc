// Checkpoints of low-precision storage over real gRPC: a shard that mixes fp32, bf16 and int8
// state (with a tensor too small to quantize) and bf16 params comes back from a checkpoint
// with every stored byte as it was (codes, scales, bf16 bits, the param copy), and stochastic
// rounding replays across a restore: 10 steps after the checkpoint give the same bits on the
// original server and on a fresh one restored from it, the bits a host model of the rounding
// (quant_math.h, keyed by the tensor's name) predicts, and not those of round-to-nearest.
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "kernels/quant_math.h"
#include "tests/integration/state_dtype_harness.h"

namespace fusedps::integration {
namespace {

std::string Bits(const std::vector<uint16_t>& bf16) {
  return std::string(reinterpret_cast<const char*>(bf16.data()), bf16.size() * 2);
}

std::string Checkpoint(Server& server) {
  absl::StatusOr<checkpoint::CheckpointResult> result = server.Checkpoint();
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? result->path : "";
}

using CheckpointTest = StateDTypeTest;

TEST_F(CheckpointTest, EveryStorageRestoresBitForBit) {
  AdamWHyperparameters ams = CustomHyperparameters();
  ams.amsgrad = true;
  ASSERT_NO_FATAL_FAILURE(RegisterStorageGroup("ams", ams));
  ASSERT_NO_FATAL_FAILURE(RegisterStorageGroup("half", Storage(StateDType::kBFloat16)));
  ASSERT_NO_FATAL_FAILURE(RegisterStorageGroup("q8", Storage(StateDType::kInt8)));
  ASSERT_NO_FATAL_FAILURE(
      RegisterStorageGroup("sr", Storage(StateDType::kInt8, ParamsDType::kBFloat16, 42)));
  ASSERT_NO_FATAL_FAILURE(
      RegisterStorageGroup("sr32", Storage(StateDType::kFloat32, ParamsDType::kBFloat16, 7)));
  ASSERT_NO_FATAL_FAILURE(RegisterTensors({{"w", {7, 9}, ""},
                                           {"m", {37}, "ams"},
                                           {"h", {3001}, "half"},
                                           {"q", {5000}, "q8"},
                                           {"q_small", {100}, "q8"},
                                           {"p", {4099}, "sr"},
                                           {"p_small", {7}, "sr"},
                                           {"r", {333}, "sr32"}}));
  for (uint32_t s = 1; s <= 3; ++s) ASSERT_NO_FATAL_FAILURE(PushAll(s));
  const std::string path = Checkpoint(*server_);
  ASSERT_FALSE(path.empty());
  const std::map<std::string, std::string> state = StoredState();
  const v1::GetInfoResponse info = GetInfo();
  const v1::ListTensorsResponse list = ListTensors();

  ASSERT_NO_FATAL_FAILURE(Restart(path));
  ExpectSameStored(StoredState(), state);
  const v1::GetInfoResponse restored = GetInfo();
  ASSERT_EQ(restored.param_groups_size(), info.param_groups_size());
  for (int g = 0; g < info.param_groups_size(); ++g) {
    EXPECT_EQ(restored.param_groups(g).DebugString(), info.param_groups(g).DebugString());
  }
  const v1::ListTensorsResponse restored_list = ListTensors();
  ASSERT_EQ(restored_list.tensors_size(), list.tensors_size());
  for (int t = 0; t < list.tensors_size(); ++t) {
    EXPECT_EQ(restored_list.tensors(t).DebugString(), list.tensors(t).DebugString());
  }
  EXPECT_EQ(restored_list.tensors(3).state_dtype(), v1::STATE_DTYPE_INT8);
  EXPECT_EQ(restored_list.tensors(4).state_dtype(), v1::STATE_DTYPE_FLOAT32);  // q_small.
  EXPECT_EQ(restored_list.tensors(5).params_dtype(), v1::DTYPE_BFLOAT16);
}

// The host model of a tensor with bf16 params and fp32 state: each step's fp32 result rounded
// to bf16 stochastically (quant_math.h) or to nearest.
struct Bf16ParamsModel {
  std::vector<float> param, exp_avg, exp_avg_sq;
  int64_t step = 0;
  std::vector<uint16_t> bits;

  void Step(const AdamWHyperparameters& h, uint64_t tensor_key, const std::vector<float>& grads,
            bool stochastic) {
    ++step;
    const AdamWStepScalars s = MakeStepScalars(h, step, 0.0f);
    const uint64_t key = RoundingKey(h.rounding_seed, tensor_key, step);
    bits.resize(param.size());
    for (size_t i = 0; i < param.size(); ++i) {
      float p = param[i];
      AdamWUpdate(s, grads[i], p, exp_avg[i], exp_avg_sq[i], nullptr);
      bits[i] =
          stochastic ? FloatToBFloat16Stochastic(p, RoundingBits(key, i)) : FloatToBFloat16(p);
      param[i] = BFloat16ToFloat(bits[i]);
    }
  }
};

TEST_F(CheckpointTest, StochasticRoundingReplaysFromACheckpoint) {
  const AdamWHyperparameters sr32 = Storage(StateDType::kFloat32, ParamsDType::kBFloat16, 1234);
  ASSERT_NO_FATAL_FAILURE(RegisterStorageGroup("sr32", sr32));
  ASSERT_NO_FATAL_FAILURE(
      RegisterStorageGroup("sr8", Storage(StateDType::kInt8, ParamsDType::kBFloat16, 99)));
  ASSERT_NO_FATAL_FAILURE(RegisterTensors({{"r", {1000}, "sr32"}, {"p", {5000}, "sr8"}}));
  const auto push = [&](uint32_t seed) {
    const std::map<std::string, std::vector<float>> grads = RandomGrads({"r", "p"}, seed);
    auto [status, ack] = Push(Messages<v1::PushGradientsRequest>(
        MakePushHeader(v1::DTYPE_FLOAT32), GradChunks(GradDType::kFloat32, grads)));
    EXPECT_TRUE(status.ok()) << status.error_message();
    return grads.at("r");
  };
  for (uint32_t s = 1; s <= 3; ++s) push(s);
  const std::string path = Checkpoint(*server_);
  ASSERT_FALSE(path.empty());
  Bf16ParamsModel sr;
  sr.param = Floats(Pull({"r"}, v1::DTYPE_FLOAT32).data.at("r"));  // bf16 widened: exact.
  sr.exp_avg = Floats(Stored("r", TensorField::kExpAvg));
  sr.exp_avg_sq = Floats(Stored("r", TensorField::kExpAvgSq));
  sr.step = 3;
  Bf16ParamsModel nearest = sr;

  const uint64_t key = TensorRoundingKey("r", 1);
  for (uint32_t s = 100; s < 110; ++s) {
    const std::vector<float> grads = push(s);
    sr.Step(sr32, key, grads, /*stochastic=*/true);
    nearest.Step(sr32, key, grads, /*stochastic=*/false);
  }
  const std::map<std::string, std::string> after = StoredState();
  // The server rounded as the model does, keyed by the tensor's name, the seed and the step.
  ExpectSameBytes(Stored("r", TensorField::kParam), Bits(sr.bits), 2, "params of r");
  ExpectSameBytes(Stored("r", TensorField::kExpAvg), Encode(GradDType::kFloat32, sr.exp_avg), 4,
                  "exp_avg of r");
  size_t differ = 0;
  for (size_t i = 0; i < sr.bits.size(); ++i) differ += sr.bits[i] != nearest.bits[i];
  EXPECT_GT(differ, sr.bits.size() / 10) << "stochastic rounding looks like round-to-nearest";

  // The same 10 steps on a fresh server restored from the checkpoint: the same bits, every
  // field of both tensors (p's int8 codes and scales too).
  ASSERT_NO_FATAL_FAILURE(Restart(path));
  for (uint32_t s = 100; s < 110; ++s) push(s);
  ExpectSameStored(StoredState(), after);
}

}  // namespace
}  // namespace fusedps::integration
