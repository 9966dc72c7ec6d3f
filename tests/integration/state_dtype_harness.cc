#include "tests/integration/state_dtype_harness.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"

namespace fusedps::integration {

AdamWHyperparameters Storage(StateDType state, ParamsDType params, uint64_t seed) {
  AdamWHyperparameters h = CustomHyperparameters();
  h.state_dtype = state;
  h.params_dtype = params;
  h.rounding_seed = seed;
  return h;
}

void StateDTypeTest::SetUp() {
  checkpoint_root_ =
      absl::StrCat(std::filesystem::temp_directory_path().string(), "/state_dtype_test_", getpid(),
                   "_", ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::remove_all(checkpoint_root_);
  ServiceTest::SetUp();
}

void StateDTypeTest::TearDown() {
  ServiceTest::TearDown();
  std::filesystem::remove_all(checkpoint_root_);
}

ServerOptions StateDTypeTest::Options() const {
  ServerOptions options = ServiceTest::Options();
  options.backend.param_copy_dtype = ParamCopyDType::kBFloat16;
  options.checkpoint.root = checkpoint_root_;
  options.restore = restore_;
  return options;
}

void StateDTypeTest::Restart(const std::string& checkpoint) {
  ServiceTest::TearDown();
  restore_ = checkpoint;
  ServiceTest::SetUp();
}

grpc::Status StateDTypeTest::RegisterGroup(const std::string& name,
                                           const v1::Hyperparameters& hyper,
                                           v1::RegisterParamGroupResponse* response) {
  grpc::ClientContext context;
  SetDeadline(context);
  v1::RegisterParamGroupRequest request;
  request.mutable_param_group()->set_name(name);
  *request.mutable_param_group()->mutable_hyperparameters() = hyper;
  return stub_->RegisterParamGroup(&context, request, response);
}

grpc::Status StateDTypeTest::SetHyperparameters(const std::string& name,
                                                const v1::Hyperparameters& hyper,
                                                v1::SetHyperparametersResponse* response) {
  grpc::ClientContext context;
  SetDeadline(context);
  v1::SetHyperparametersRequest request;
  request.set_param_group(name);
  *request.mutable_hyperparameters() = hyper;
  return stub_->SetHyperparameters(&context, request, response);
}

void StateDTypeTest::RegisterStorageGroup(const std::string& name, const AdamWHyperparameters& h) {
  v1::RegisterParamGroupResponse response;
  const grpc::Status status = RegisterGroup(name, ToProto(h), &response);
  ASSERT_TRUE(status.ok()) << name << ": " << status.error_message();
  EXPECT_TRUE(response.created());
  host_.SetGroup(name, h);
}

void StateDTypeTest::PushAll(uint32_t seed) {
  std::vector<std::string> names;
  for (const HostModel::Tensor& t : host_.tensors()) names.push_back(t.def.name);
  const v1::PushHeader header = MakePushHeader(v1::DTYPE_FLOAT32);
  auto [status, ack] = Push(Messages<v1::PushGradientsRequest>(
      header, GradChunks(GradDType::kFloat32, RandomGrads(names, seed))));
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_FALSE(ack.step_skipped());
}

std::string StateDTypeTest::Stored(const std::string& tensor, TensorField field) {
  const std::shared_ptr<const ShardView> view = server_->engine().view();
  const std::optional<uint32_t> t = view->FindTensor(tensor);
  if (!t.has_value()) {
    ADD_FAILURE() << "no tensor " << tensor;
    return "";
  }
  const TensorLayout layout = view->layout(*t);
  std::string bytes(StoredCount(layout, field, view->tensor(*t).numel) *
                        static_cast<uint64_t>(StoredElementBytes(layout, field)),
                    '\0');
  ReadJob job;
  job.field = field;
  job.stored = true;
  job.tensors = {*t};
  job.dst_offsets = {0};
  job.dst = bytes.data();
  absl::StatusOr<ReadResult> read = UpdateEngine::Wait<ReadResult>(
      [&](UpdateEngine::Done<ReadResult> done) { server_->engine().Read(job, done); });
  EXPECT_TRUE(read.ok()) << tensor << " " << TensorFieldName(field) << ": " << read.status();
  return bytes;
}

std::map<std::string, std::string> StateDTypeTest::StoredState() {
  std::map<std::string, std::string> state;
  const std::shared_ptr<const ShardView> view = server_->engine().view();
  const v1::ListTensorsResponse list = ListTensors();
  for (const v1::TensorInfo& info : list.tensors()) {
    const uint32_t t = *view->FindTensor(info.name());
    const TensorLayout layout = view->layout(t);
    state[info.name() + ".step"] = std::to_string(info.step());
    for (TensorField field :
         {TensorField::kParam, TensorField::kExpAvg, TensorField::kExpAvgSq,
          TensorField::kMaxExpAvgSq, TensorField::kExpAvgAbsmax, TensorField::kExpAvgSqAbsmax}) {
      if (field == TensorField::kMaxExpAvgSq &&
          !view->groups()[view->tensor(t).group].hyperparameters.amsgrad) {
        continue;
      }
      const bool scales =
          field == TensorField::kExpAvgAbsmax || field == TensorField::kExpAvgSqAbsmax;
      if (scales && layout.state != StateDType::kInt8) continue;
      state[absl::StrCat(info.name(), ".", TensorFieldName(field))] = Stored(info.name(), field);
    }
    if (layout.params == ParamsDType::kFloat32) {
      const Pulled copy = Pull({info.name()}, v1::DTYPE_BFLOAT16);  // From the copy.
      EXPECT_TRUE(copy.status.ok()) << copy.status.error_message();
      state[info.name() + ".copy"] = copy.data.at(info.name());
    }
  }
  state["version"] = std::to_string(list.version());
  return state;
}

std::vector<float> Floats(const std::string& bytes) {
  std::vector<float> out(bytes.size() / 4);
  std::memcpy(out.data(), bytes.data(), out.size() * 4);
  return out;
}

void ExpectSameStored(const std::map<std::string, std::string>& got,
                      const std::map<std::string, std::string>& want) {
  for (const auto& [key, bytes] : want) {
    const auto it = got.find(key);
    if (it == got.end()) {
      ADD_FAILURE() << key << " is missing";
    } else if (it->second != bytes) {
      ADD_FAILURE() << key << " differs"
                    << (bytes.size() < 32 ? ": " + it->second + " vs " + bytes : "");
    }
  }
  for (const auto& [key, bytes] : got) {
    if (want.count(key) == 0) ADD_FAILURE() << key << " is new";
  }
}

}  // namespace fusedps::integration
