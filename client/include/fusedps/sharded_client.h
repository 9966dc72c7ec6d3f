// fusedps/sharded_client.h: a client of a model sharded over several fusedps servers.
//
// A ShardedClient holds one Client (fusedps/client.h) per server and a ShardPlan
// (fusedps/plan.h) that says which slice of which tensor lives on which server. Its calls take
// and return whole tensors: it cuts them into the plan's slices, calls every server at once
// (one thread per server), and gathers what the servers return. Every registration and push
// carries the plan's hash, so a server refuses a client that computed another plan.
//
// Each server is a shard with its own model version: a push is one optimizer step on each
// shard it reaches, and the shards' versions are reported one per shard, in the order of the
// targets. The plan depends on the order of the targets: every trainer must list the same
// servers in the same order.
//
// Errors: as Client's, the first failed shard's (by shard index), its message prefixed with
// the shard ("shard 1 (host:50052): ..."). The shards that succeeded keep what they did, as
// with a failed Client call over several streams: repeating a push with the same client_id and
// sequence_number is safe (a shard that took it answers duplicate), as is repeating a
// registration.
//
// Thread safety: a ShardedClient may be used by many threads at once.
//
// Usage:
//   auto client = fusedps::client::ShardedClient::Create({"ps0:50051", "ps1:50051"}).value();
//   std::vector<float> wte(50257 * 768), ln(768);
//   client->Register({{"wte", {50257, 768}, "default", wte}, {"ln.b", {768}, "", ln}}).value();
//   fusedps::client::PushOptions push;
//   push.client_id = "trainer-0";
//   push.sequence_number = 1;
//   client->PushGradients(push, {{"wte", grad_wte}, {"ln.b", grad_ln}}).value();
//   auto pulled = client->PullParameters({}).value();  // whole tensors, and each shard's version
#ifndef FUSEDPS_CLIENT_SHARDED_CLIENT_H_
#define FUSEDPS_CLIENT_SHARDED_CLIENT_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/mutex.h"
#include "fusedps/client.h"
#include "fusedps/plan.h"

namespace grpc {
class Channel;
}  // namespace grpc

namespace fusedps::client {

struct ShardedPullResult {
  // Each shard's model version its values were read at, in shard order. A shard the pull did
  // not need (it holds none of the tensors asked for) is not called: its entry is versions().
  std::vector<uint64_t> versions;
  // Whole tensors, gathered from their slices: shape and param group as registered; step the
  // smallest of the slices' steps.
  std::map<std::string, PulledTensor> tensors;
};

class ShardedClient {
 public:
  // One Client per target (Client::Create(target, options)), shard i being targets[i].
  // Errors: INVALID_ARGUMENT for no target, an empty target, or options outside their REQUIRES.
  static absl::StatusOr<std::unique_ptr<ShardedClient>> Create(
      const std::vector<std::string>& targets, ClientOptions options = {});

  // One Client per channel (Client::CreateWithChannel), shard i on channels[i].
  // Errors: INVALID_ARGUMENT for no channel, a null one, or options outside their REQUIRES.
  static absl::StatusOr<std::unique_ptr<ShardedClient>> CreateWithChannels(
      std::vector<std::shared_ptr<grpc::Channel>> channels, ClientOptions options = {});

  ShardedClient(const ShardedClient&) = delete;
  ShardedClient& operator=(const ShardedClient&) = delete;
  ~ShardedClient();

  size_t shard_count() const { return shards_.size(); }
  // The client of shard i, for calls that concern one server (GetInfo, Checkpoint, ...).
  // REQUIRES: i < shard_count().
  Client& shard(size_t i) { return *shards_[i].client; }

  // Registers a param group on every shard (Client::RegisterParamGroup); groups other than
  // "default" must be registered before tensors use them.
  absl::Status RegisterParamGroup(const std::string& name, const ParamGroupOptions& options);

  // Plans the model `tensors` (whole tensors, with their initial values) over the shards in
  // slices of slice_elements, makes that plan this client's (SetPlan), and registers every
  // shard's slices under the plan's hash (RegisterTensors). Returns each shard's result; a
  // shard that the plan gives no slice is not called (its result is all zero).
  // Errors: INVALID_ARGUMENT as ShardPlan::Make, for an empty list, or values of the wrong
  // size; then RegisterTensors' errors.
  absl::StatusOr<std::vector<RegisterTensorsResult>> Register(
      absl::Span<const TensorInit> tensors,
      uint64_t slice_elements = ShardPlan::kDefaultSliceElements);

  // Makes `plan` the one this client's calls follow, for a trainer that does not register the
  // model itself (it must compute the same plan as the one that did).
  // Errors: INVALID_ARGUMENT when plan.shards() is not shard_count().
  absl::Status SetPlan(ShardPlan plan);
  // The plan set by Register or SetPlan; null before.
  std::shared_ptr<const ShardPlan> plan() const;

  // Registers the slices of `tensors`, whole tensors of the plan, each shard's slices in plan
  // order under the plan's hash, every shard at once. Any subset of the plan's tensors may be
  // registered in each call (a large model a batch at a time).
  // Errors: FAILED_PRECONDITION before a plan is set; NOT_FOUND for a tensor not in the plan;
  // INVALID_ARGUMENT for a shape or group that differs from the plan's, values of the wrong
  // size, or a tensor listed twice; then Client::RegisterTensors' errors.
  absl::StatusOr<std::vector<RegisterTensorsResult>> RegisterTensors(
      absl::Span<const TensorInit> tensors);

  // Pushes gradients of whole tensors: each shard gets one push of its slices of them, all
  // shards at once, each applied as Client::PushGradients applies one (as options.streams
  // parts when streams > 1). options.base_version and options.plan_hash are not used: shard i
  // is sent base_versions[i], or when base_versions is empty versions()[i] (the version this
  // client last saw of it: after a pull, the version the pulled values are of), and the plan's
  // hash. A shard holding no slice of these tensors is not called; its result has versions()[i]
  // as version and nothing else. Returns each shard's result, in shard order.
  // Errors: FAILED_PRECONDITION before a plan is set; NOT_FOUND for a tensor not in the plan;
  // INVALID_ARGUMENT for an empty list, a tensor listed twice, grads of the wrong size, or
  // base_versions neither empty nor one per shard; then Client::PushGradients' errors (ABORTED
  // from a shard in sync or bounded mode whose version has moved on: pull, then push again).
  absl::StatusOr<std::vector<PushResult>> PushGradients(
      const PushOptions& options, absl::Span<const TensorGrad> grads,
      absl::Span<const uint64_t> base_versions = {});

  // Pulls options.tensors (whole tensors; empty: every tensor of the plan) from the shards
  // that hold them, all at once, and gathers their slices. Each shard's values are of one
  // version of that shard; the shards' versions may differ (a push may land on one shard
  // before another).
  // Errors: FAILED_PRECONDITION before a plan is set; NOT_FOUND for a tensor not in the plan;
  // INTERNAL when a shard returns a slice of the wrong size; then Client::PullParameters'.
  absl::StatusOr<ShardedPullResult> PullParameters(const PullOptions& options);

  // Each shard's model version as this client last saw it (from a registration, a push or a
  // pull), in shard order; 0 before any.
  std::vector<uint64_t> versions() const;

 private:
  struct Shard {
    std::string name;  // "shard i (target)" for error messages.
    std::unique_ptr<Client> client;
  };
  struct Layout;  // The plan with indexes by tensor name.

  explicit ShardedClient(std::vector<Shard> shards);
  absl::StatusOr<std::shared_ptr<const Layout>> layout() const ABSL_LOCKS_EXCLUDED(mu_);
  void SetVersion(size_t shard, uint64_t version) ABSL_LOCKS_EXCLUDED(mu_);
  // The first failed shard's status, its message prefixed with the shard; OK when none failed.
  absl::Status FirstError(const std::vector<absl::Status>& statuses) const;
  // Runs call(i) (an absl::StatusOr<T>, T with a version) for each of `shards` at once, each on
  // a thread of its own; keeps each result in (*results)[i] and the shard's version. Returns
  // FirstError of the calls.
  template <typename T, typename Call>
  absl::Status CallShards(const std::vector<size_t>& shards, std::vector<T>* results, Call call);

  const std::vector<Shard> shards_;
  mutable Mutex mu_;
  std::shared_ptr<const Layout> layout_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> versions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fusedps::client

#endif  // FUSEDPS_CLIENT_SHARDED_CLIENT_H_
