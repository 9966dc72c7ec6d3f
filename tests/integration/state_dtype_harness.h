// state_dtype_harness.h: what the tests of per-group storage (state_dtype, params_dtype,
// rounding_seed) share: a ServiceTest whose server keeps a bf16 param copy and writes
// checkpoints under a directory of its own, can be restarted from one, and reads any field of
// any tensor in its stored form (codes, scales, bf16 bits) through the engine.
//
// Usage:
//   TEST_F(StateDTypeTest, Something) {
//     RegisterStorageGroup("q8", Storage(StateDType::kInt8));
//     RegisterTensors({{"q", {5000}, "q8"}});
//     PushAll(/*seed=*/1);
//     const std::string codes = Stored("q", TensorField::kExpAvg);
//     Restart(server_->Checkpoint()->path);
//   }
#ifndef FUSEDPS_TESTS_INTEGRATION_STATE_DTYPE_HARNESS_H_
#define FUSEDPS_TESTS_INTEGRATION_STATE_DTYPE_HARNESS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "tests/integration/service_harness.h"

namespace fusedps::integration {

// CustomHyperparameters() with this storage.
AdamWHyperparameters Storage(StateDType state, ParamsDType params = ParamsDType::kFloat32,
                             uint64_t seed = 0);

// Bytes as fp32 values (a stored fp32 field, a pull of fp32).
std::vector<float> Floats(const std::string& bytes);

// Compares two StoredState()s, naming each entry that differs (not dumping its bytes).
void ExpectSameStored(const std::map<std::string, std::string>& got,
                      const std::map<std::string, std::string>& want);

class StateDTypeTest : public ServiceTest {
 protected:
  void SetUp() override;
  void TearDown() override;
  ServerOptions Options() const override;

  // Stops the server and starts a fresh one that restores `checkpoint` (a directory).
  void Restart(const std::string& checkpoint);

  grpc::Status RegisterGroup(const std::string& name, const v1::Hyperparameters& hyper,
                             v1::RegisterParamGroupResponse* response);
  grpc::Status SetHyperparameters(const std::string& name, const v1::Hyperparameters& hyper,
                                  v1::SetHyperparametersResponse* response);
  // Registers a group with this storage and mirrors it in host_. Fails the test on an error.
  void RegisterStorageGroup(const std::string& name, const AdamWHyperparameters& h);

  // One push of fp32 gradients (RandomGrads(every tensor, seed)); host_ is not stepped.
  void PushAll(uint32_t seed);

  // A field of a tensor in its stored form (ReadRequest::stored), read through the engine.
  std::string Stored(const std::string& tensor, TensorField field);
  // Every stored field of every tensor ("w.exp_avg"), the param copy of those with fp32 params
  // ("w.copy"), the steps ("w.step") and the version.
  std::map<std::string, std::string> StoredState();

  std::string checkpoint_root_;
  std::string restore_ = "none";
};

}  // namespace fusedps::integration

#endif  // FUSEDPS_TESTS_INTEGRATION_STATE_DTYPE_HARNESS_H_
