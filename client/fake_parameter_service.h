// fake_parameter_service.h: a small in-memory ParameterService for the client's tests.
//
// It keeps fp32 tensors, applies pushes as "SGD with lr 1" (param -= grad), checks every chunk
// strictly, speaks the current wire API (ListTensors in pages, a pull's TensorInfo continued past
// its header), and has knobs to misbehave. Element conversions use common/half_float.h, as the
// server's kernels do. Test-only; the real server's tests live in tests/.
//
// Usage:
//   FakeParameterService service;
//   grpc::ServerBuilder builder;
//   builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
//   builder.RegisterService(&service);
//   service.legacy_pull();  // a server from before tensor_count
#ifndef FUSEDPS_CLIENT_FAKE_PARAMETER_SERVICE_H_
#define FUSEDPS_CLIENT_FAKE_PARAMETER_SERVICE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "fusedps/v1/parameter_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace fusedps::client::testing {

class FakeParameterService final : public v1::ParameterService::Service {
 public:
  struct Tensor {
    std::vector<int64_t> shape;
    std::string param_group;
    std::vector<float> values;
    int64_t step = 0;
  };

  // A ListTensors page holds at most this many tensors (page_size 0 asks for "as many as fit").
  static constexpr size_t kListPageSize = 3;
  // A pull's header holds at most this many TensorInfo, and so does each message after it.
  static constexpr int kPullInfosPerMessage = 2;

  grpc::Status RegisterParamGroup(grpc::ServerContext* context,
                                  const v1::RegisterParamGroupRequest* request,
                                  v1::RegisterParamGroupResponse* response) override;
  grpc::Status RegisterTensors(grpc::ServerContext* context,
                               grpc::ServerReader<v1::RegisterTensorsRequest>* reader,
                               v1::RegisterTensorsResponse* response) override;
  grpc::Status PushGradients(grpc::ServerContext* context,
                             grpc::ServerReader<v1::PushGradientsRequest>* reader,
                             v1::PushGradientsResponse* response) override;
  // Chunks come last chunk first within each tensor: the client must not depend on order.
  grpc::Status PullParameters(grpc::ServerContext* context,
                              const v1::PullParametersRequest* request,
                              grpc::ServerWriter<v1::PullParametersResponse>* writer) override;
  grpc::Status GetInfo(grpc::ServerContext* context, const v1::GetInfoRequest* request,
                       v1::GetInfoResponse* response) override;
  grpc::Status ListTensors(grpc::ServerContext* context, const v1::ListTensorsRequest* request,
                           v1::ListTensorsResponse* response) override;
  grpc::Status SetHyperparameters(grpc::ServerContext* context,
                                  const v1::SetHyperparametersRequest* request,
                                  v1::SetHyperparametersResponse* response) override;

  std::map<std::string, Tensor> tensors();
  size_t max_request_bytes();
  size_t peer_count();
  int push_messages() { return push_messages_; }
  int list_calls() { return list_calls_; }
  int max_pull_infos_per_message() { return max_pull_infos_per_message_; }
  v1::PushHeader last_push_header();
  // The plan_hash of each RegisterTensors call, in order.
  std::vector<std::string> register_plan_hashes();

  // Knobs, each for the calls that start after it is set.
  // Pulls lose the first chunk of every tensor.
  void drop_first_pull_chunk() { drop_first_pull_chunk_ = true; }
  // Pulls put every TensorInfo in the header and leave tensor_count 0, as servers did before.
  void legacy_pull() { legacy_pull_ = true; }
  // Pulls send the last tensor's first chunk before the message that holds its TensorInfo.
  void pull_chunk_before_info() { pull_chunk_before_info_ = true; }
  // Pulls announce this many more tensors in tensor_count than they describe.
  void pull_tensor_count_surplus(int surplus) { pull_tensor_count_surplus_ = surplus; }
  // Pulls wait this long before each message after the header.
  void pull_message_delay(absl::Duration delay) {
    pull_message_delay_nanos_ = absl::ToInt64Nanoseconds(delay);
  }
  // Pulls send their header, then nothing, until the call is cancelled.
  void hang_pull_after_header() { hang_pull_after_header_ = true; }
  // GetInfo answers nothing until the call is cancelled.
  void hang_get_info() { hang_get_info_ = true; }
  // GetInfo reports this consistency (and the plan_hash of the first registration).
  void set_consistency(const v1::Consistency& consistency);
  // Pushes answer with this round_workers.
  void set_round_workers(uint32_t workers) { round_workers_ = workers; }

 private:
  Mutex mu_;
  Mutex request_mu_ ABSL_ACQUIRED_AFTER(mu_);
  std::map<std::string, Tensor> tensors_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> registration_order_ ABSL_GUARDED_BY(mu_);
  uint64_t version_ ABSL_GUARDED_BY(mu_) = 0;
  size_t max_request_bytes_ ABSL_GUARDED_BY(request_mu_) = 0;
  std::set<std::string> peers_ ABSL_GUARDED_BY(request_mu_);
  std::atomic<int> push_messages_{0};
  std::atomic<int> list_calls_{0};
  std::atomic<int> max_pull_infos_per_message_{0};
  v1::PushHeader last_push_header_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> register_plan_hashes_ ABSL_GUARDED_BY(mu_);
  v1::Consistency consistency_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint32_t> round_workers_{0};
  std::atomic<bool> drop_first_pull_chunk_{false};
  std::atomic<bool> legacy_pull_{false};
  std::atomic<bool> pull_chunk_before_info_{false};
  std::atomic<int> pull_tensor_count_surplus_{0};
  std::atomic<bool> hang_pull_after_header_{false};
  std::atomic<bool> hang_get_info_{false};
  std::atomic<int64_t> pull_message_delay_nanos_{0};

  void NoteRequest(size_t bytes) ABSL_LOCKS_EXCLUDED(request_mu_);
  void NotePeer(grpc::ServerContext* context) ABSL_LOCKS_EXCLUDED(request_mu_);
};

}  // namespace fusedps::client::testing

#endif  // FUSEDPS_CLIENT_FAKE_PARAMETER_SERVICE_H_
