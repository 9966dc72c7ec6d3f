// fusedps/client.h: the C++ client of a fusedps parameter server.
//
// A fusedps server keeps named fp32 tensors (the master copy of a model's parameters) and their
// AdamW state, grouped into param groups as in torch.optim. A trainer registers its tensors once,
// then pushes gradients (one AdamW step per push, applied on the server) and pulls parameters.
// This header is the library's whole public API; it hides gRPC and the wire format.
//
// Units: shapes and element counts are in elements; every "*_bytes" field is in bytes. Tensors
// are row-major (C order) arrays of float, like torch.Tensor.contiguous(). A 0-dim tensor has
// shape {} and one element; a tensor with a 0 in its shape has no elements.
//
// Errors: every call returns an absl::Status (or absl::StatusOr), never throws. Errors reported
// by the server or by gRPC keep their code and message (for example UNAVAILABLE when the server
// cannot be reached or stops answering keepalive pings, DEADLINE_EXCEEDED when a call outlives
// its deadline; see ClientOptions). Each call lists the codes that mean something specific for it.
//
// Every call has a finite deadline by default, and the client's connections send keepalive
// pings while calls are in flight, so a dead server or a network partition surfaces as an error
// within about a minute instead of hanging a trainer (see ClientOptions for the values).
//
// Thread safety: a Client may be used by many threads at once.
//
// Usage:
//   auto client = fusedps::client::Client::Create("localhost:50051").value();
//   std::vector<float> w(768 * 768, 0.0f);
//   client->RegisterTensors({{"layer0.weight", {768, 768}, "default", w}}).value();
//   std::vector<float> grad_w = ...;  // 768 * 768 gradients
//   fusedps::client::PushOptions push;  // bf16 on the wire by default
//   auto ack = client->PushGradients(push, {{"layer0.weight", grad_w}}).value();
//   auto pulled = client->PullParameters({}).value();  // every tensor, fp32
//   const std::vector<float>& fresh_w = pulled.tensors.at("layer0.weight").values;
#ifndef FUSEDPS_CLIENT_CLIENT_H_
#define FUSEDPS_CLIENT_CLIENT_H_

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/mutex.h"
#include "fusedps/client_types.h"

namespace grpc {
class Channel;
}  // namespace grpc

namespace fusedps::client {

// A channel to `target` as Client::Create makes one for each stream: a connection of its own
// (not shared with other channels to the same target), TLS as `options` says, and keepalive.
// For tools that create clients with CreateWithChannel. Errors: INVALID_ARGUMENT for an empty
// target, tls_cert_file without tls_key_file (or the reverse), or a file that cannot be read.
absl::StatusOr<std::shared_ptr<grpc::Channel>> CreateChannel(const std::string& target,
                                                             const ClientOptions& options);

namespace internal {
class RawCall;
}  // namespace internal

// A push whose gradients are sent a piece at a time, as they are produced (a backward pass
// that hands out each layer's gradients when they are ready: RemoteAdamW(overlap=True)), and
// whose grad_scale is given at the end (PushHeader.commit_at_end): clipping and loss scaling
// are decided after backward. The server stages each piece as it arrives and applies the
// push as one atomic step once it is committed; a cancelled transaction applies nothing.
// The pieces travel over the client's streams as the parts of one push, in messages of at most
// max_chunk_bytes whose payload is the caller's memory itself (no copy on the client).
//
// Usage:
//   auto push = client->BeginPush(options, {{"w", 4096}, {"b", 64}}).value();
//   push->Write({{0, 0, 4096, w_grads_bf16}}).IgnoreError();  // while backward runs
//   push->Write({{1, 0, 64, b_grads_bf16}}).IgnoreError();
//   auto result = push->Commit(/*grad_scale=*/1.0f / clip_coef);  // one step, or an error
//
// Lifetimes: the memory of every piece stays valid and unchanged until Commit or Cancel has
// returned (gRPC reads it while it sends); the destructor cancels a transaction that was not
// committed. Thread safety: one thread at a time.
class PushTransaction {
 public:
  // Elements [offset, offset + numel) of tensor number `tensor` (an index into BeginPush's
  // tensors) as raw elements of the push's grad_dtype, little-endian, at `data`.
  struct Piece {
    size_t tensor = 0;
    uint64_t offset = 0;
    uint64_t numel = 0;
    const void* data = nullptr;
  };

  PushTransaction(const PushTransaction&) = delete;
  PushTransaction& operator=(const PushTransaction&) = delete;
  ~PushTransaction();

  // Queues pieces for sending and returns without waiting for them. Every element of every
  // tensor must be written exactly once before Commit (the server checks).
  // Errors: INVALID_ARGUMENT for a tensor index out of range or a piece past its tensor's end,
  // FAILED_PRECONDITION after Commit or Cancel, and the status of a part that has failed
  // already (the transaction can then only be cancelled).
  absl::Status Write(absl::Span<const Piece> pieces);

  // Sends the commit (grad_scale: the server divides the gradients by it; unset: none), ends
  // every part, and waits for the push's reply, at most the client's timeout plus the push's
  // bytes at min_bytes_per_second from now (then DEADLINE_EXCEEDED).
  // Errors: as Client::PushGradients (the root cause when a part fails; the server's
  // INVALID_ARGUMENT when pieces are missing, overlap or run past a tensor); FAILED_PRECONDITION
  // when committed or cancelled already. Nothing is applied unless it returns OK.
  absl::StatusOr<PushResult> Commit(std::optional<float> grad_scale);
  // Commit, carrying a pull (PushCommit.pull): once the step is applied the server writes
  // each target's values, `dtype` elements (kFloat32, or kBFloat16 when the server keeps a bf16
  // param copy), at the target's place in the push's workspace, before it replies; the reply's
  // pulled_version is the version read (0: answered from the retry table, nothing written:
  // pull again). For a trainer that wants its next parameters the moment the step is done,
  // without a PullParameters call. Errors: Commit's; INVALID_ARGUMENT for a push begun
  // without a workspace, no targets, or a target outside the workspace (nothing sent: the push
  // can still be cancelled);
  // the server's (PushCommit.pull), nothing applied. The targets' memory is written by the
  // server until the call returns.
  absl::StatusOr<PushResult> Commit(std::optional<float> grad_scale, DType dtype,
                                    absl::Span<const PullTarget> then_pull);

  // Cancels every part: the server applies nothing and frees the push's staging. Waits until
  // gRPC no longer reads the pieces' memory. Does nothing after Commit has returned.
  void Cancel();

  // Payload bytes queued by Write so far.
  uint64_t bytes_written() const { return bytes_written_; }

 private:
  friend class Client;
  struct SliceTracker;  // Counts the slices of the caller's memory that gRPC still holds.

  PushTransaction(const ClientOptions& options, std::vector<TensorSize> tensors, DType dtype,
                  Workspace workspace);
  // Write's pieces that lie in the workspace: their places, in one message per part, each
  // naming about an equal share of their bytes (the server copies each part's on a thread).
  void WriteReferences(absl::Span<const Piece> pieces);
  // Opens part `index` of `count` on `channel` and queues its header message.
  void OpenPart(const std::shared_ptr<grpc::Channel>& channel, std::string header_message);
  // The part with the fewest bytes queued.
  internal::RawCall& LightestPart();
  // Sends `commit` (a serialized PushGradientsRequest of a PushCommit), ends every part and
  // waits for the reply: Commit's body.
  absl::StatusOr<PushResult> SendCommit(const std::string& commit);
  // Waits until gRPC has released every slice of the caller's memory.
  void AwaitSlicesReleased();

  const ClientOptions options_;
  const std::vector<TensorSize> tensors_;
  const DType dtype_;
  const Workspace workspace_;  // Empty id: none.
  uint64_t total_bytes_ = 0;   // The push's payload: every tensor in dtype.
  std::vector<std::unique_ptr<internal::RawCall>> parts_;
  std::vector<std::string> replies_;  // Each part's serialized PushGradientsResponse.
  std::shared_ptr<SliceTracker> tracker_;
  uint64_t bytes_written_ = 0;
  uint64_t next_reference_part_ = 0;  // WriteReferences' round robin over the parts.
  bool ended_ = false;                // Committed or cancelled.
};

class Client {
 public:
  // Connects (lazily, on the first call) to target, e.g. "localhost:50051", over channels made
  // by CreateChannel (plaintext, or TLS as options say) whose max send and receive message
  // sizes are 16 MiB, with keepalive as in options. Errors: INVALID_ARGUMENT for an empty
  // target, options outside their REQUIRES, or TLS files that cannot be read.
  static absl::StatusOr<std::unique_ptr<Client>> Create(const std::string& target,
                                                        ClientOptions options = {});

  // Uses an existing channel for every call (for example an in-process server's channel in
  // tests). streams > 1 then runs concurrent calls on that one channel.
  // Errors: INVALID_ARGUMENT for a null channel or options outside their REQUIRES.
  static absl::StatusOr<std::unique_ptr<Client>> CreateWithChannel(
      std::shared_ptr<grpc::Channel> channel, ClientOptions options = {});

  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;
  ~Client();

  // Connects every stream's channel, waiting at most `timeout` in all: gRPC retries a failed
  // connection attempt meanwhile, so that the first calls do not meet a channel still
  // connecting or one whose first attempt failed (calls fail at once there unless
  // ClientOptions::wait_for_ready). Errors: DEADLINE_EXCEEDED naming how many of the channels
  // connected.
  absl::Status WaitForReady(absl::Duration timeout);

  // Asks the server's grpc.health.v1 service about `service` ("" means the whole server,
  // "fusedps.v1.ParameterService" the parameter service). Returns true when it is SERVING,
  // false for NOT_SERVING or UNKNOWN. Errors: the call's status, e.g. NOT_FOUND for a service
  // the server does not know, UNAVAILABLE when the server cannot be reached.
  absl::StatusOr<bool> CheckHealth(const std::string& service = "");

  // Registers a param group under name (1..128 bytes). Registering an identical group
  // again is a no-op (created is false).
  // Errors: ALREADY_EXISTS when a group of that name has other hyperparameters;
  // INVALID_ARGUMENT for a bad name or a hyperparameter out of range.
  absl::StatusOr<RegisterParamGroupResult> RegisterParamGroup(const std::string& name,
                                                              const ParamGroupOptions& options);

  // Registers tensors with their initial values; their optimizer state starts at zero and their
  // step at 0. Tensors identical to registered ones (same name, shape and group) are no-ops and
  // keep their current values. Values travel as fp32 in chunks of max_chunk_bytes. With
  // streams > 1 the tensors are split across concurrent calls; a failed call may then leave the
  // tensors of the other calls registered, and repeating the whole call is safe.
  // Errors: INVALID_ARGUMENT when values.size() is not the product of shape, for a negative dim,
  // a bad or duplicate name, or an empty list; ALREADY_EXISTS when a name is registered with
  // another shape or group; NOT_FOUND for an unknown param group.
  absl::StatusOr<RegisterTensorsResult> RegisterTensors(absl::Span<const TensorInit> tensors);

  // The same, for a server that is one shard of a sharding plan: registers tensors under the
  // plan's hash (ShardPlan::hash() in fusedps/plan.h; fusedps/sharded_client.h does this for
  // every shard). A server takes the hash of its first registration; every later registration
  // and push must carry the same hash.
  // Errors: as above; FAILED_PRECONDITION when the server holds tensors under another plan
  // hash, or under none. The overload without a hash registers under none.
  absl::StatusOr<RegisterTensorsResult> RegisterTensors(absl::Span<const TensorInit> tensors,
                                                        const std::string& plan_hash);

  // Pushes gradients for the named tensors, which the server applies as one AdamW step of those
  // tensors: all of them or none. Gradients are rounded to options.grad_dtype and sent in chunks
  // of max_chunk_bytes over one call. A step with a non-finite gradient is skipped, which is not
  // an error: the result says step_skipped.
  // Errors: INVALID_ARGUMENT for an empty list, a tensor named twice, a grads size that is not
  // the tensor's numel, or a bad grad_scale; NOT_FOUND for an unknown tensor; ABORTED for a
  // sequence_number not above the client's highest that is not a remembered retry, and for a
  // base_version the server's consistency mode refuses (pull, then push again);
  // FAILED_PRECONDITION when options.plan_hash is not the server's.
  absl::StatusOr<PushResult> PushGradients(const PushOptions& options,
                                           absl::Span<const TensorGrad> grads);

  // Reads a field of some or all tensors, all at one model version. With streams > 1 (and more
  // than one tensor) the client first lists the tensors, then splits them across concurrent
  // calls; if a push lands between those calls, the pull is repeated over one call so that the
  // result is still one version.
  // Errors: NOT_FOUND for an unknown tensor; INVALID_ARGUMENT for an unsupported dtype;
  // FAILED_PRECONDITION for kMaxExpAvgSq of a tensor without amsgrad; INTERNAL when the server's
  // reply is malformed (chunks that do not cover each tensor exactly, a chunk before its
  // tensor's TensorInfo, fewer or more TensorInfo than the reply's tensor count).
  absl::StatusOr<PullResult> PullParameters(const PullOptions& options);

  // Begins a push of these tensors' gradients, sent a piece at a time and committed at the end
  // (PushTransaction). It travels as `streams` parts, one per connection, named by
  // options.client_id and options.sequence_number (this client's own when they are empty or
  // 0); options.grad_scale must be unset (the commit carries it). Opens the parts' calls now, so
  // that the server reserves the push's staging at once.
  // Errors: INVALID_ARGUMENT for no tensors or options.grad_scale set; the server's errors
  // (NOT_FOUND for an unknown tensor, ABORTED for a stale sequence number, ...) come from
  // Write or Commit.
  absl::StatusOr<std::unique_ptr<PushTransaction>> BeginPush(const PushOptions& options,
                                                             absl::Span<const TensorSize> tensors);

  // Pulls one field of the targets' tensors, all at one version, over one call on stream
  // `stream` (modulo streams), writing each chunk's raw elements of options.dtype (kFloat32 or
  // kBFloat16) straight from gRPC's buffers into its target: no conversion, one copy.
  // options.tensors is ignored (the targets name the tensors).
  // Errors: as PullParameters; INVALID_ARGUMENT for no targets, a null data pointer, or a target
  // whose numel differs from the server's (naming it; the targets may then be partly written);
  // INTERNAL for a malformed reply.
  absl::StatusOr<PullIntoResult> PullInto(const PullOptions& options,
                                          absl::Span<const PullTarget> targets, int stream = 0);

  // Pushes begun and PullInto calls made from now on go through `workspace` (Workspace above):
  // pieces inside it travel as places, and a PullInto whose targets all lie inside it has the
  // server write them there. An empty id stops that. The caller keeps the workspace open and
  // mapped while pushes and pulls that use it run. Thread-safe.
  void SetWorkspace(Workspace workspace);

  // Describes the server and this client's model: version, backend, device, sizes and param
  // groups.
  absl::StatusOr<ServerInfo> GetInfo();

  // Models (server namespaces; the proto's CreateModel, ListModels, DeleteModel). These name
  // their model; the client's own (ClientOptions::model) is not implied.
  // Creates an empty model, with `consistency` (its mode empty: the server's flags). Idempotent
  // for a model of the same consistency. Errors: INVALID_ARGUMENT for a bad name or
  // consistency; ALREADY_EXISTS for a model of another consistency; PERMISSION_DENIED unless
  // admin (of that model).
  absl::StatusOr<CreateModelResult> CreateModel(const std::string& name,
                                                const Consistency& consistency = {});
  // The models the caller may reach, by name.
  absl::StatusOr<std::vector<ModelInfo>> ListModels();
  // Deletes a model, its device memory and its checkpoints (deleting "default" empties it).
  // Errors: NOT_FOUND; PERMISSION_DENIED unless admin (of that model).
  absl::StatusOr<DeleteModelResult> DeleteModel(const std::string& name);

  // Lists every tensor with its shape, group and step. The server returns a large shard in
  // pages (as many tensors as fit in one reply each); this asks for page after page, each a
  // call of its own with its own deadline, and returns them all.
  // Errors: INTERNAL when the server repeats a page token (a reply that would never end).
  absl::StatusOr<TensorList> ListTensors();

  // Changes the set fields of a group's hyperparameters (an lr schedule, for example); unset
  // fields keep their values. Returns the group after the change.
  // Errors: NOT_FOUND for an unknown group; INVALID_ARGUMENT for a value out of range or a
  // change of amsgrad.
  absl::StatusOr<ParamGroup> SetHyperparameters(const std::string& param_group,
                                                const ParamGroupOptions& changes);

  // What Checkpoint wrote: the shard version it holds, and its directory on the server.
  struct CheckpointWritten {
    uint64_t version = 0;
    std::string path;
  };
  // Has the server write a checkpoint holding every push acknowledged before the call
  // (docs/checkpoints.md), and waits until it is durable, at most `timeout` (a large shard
  // takes a while; the client's usual deadline does not apply). Errors: FAILED_PRECONDITION
  // when the server has no --checkpoint-dir; RESOURCE_EXHAUSTED when its disk is full;
  // DEADLINE_EXCEEDED; UNAVAILABLE.
  absl::StatusOr<CheckpointWritten> Checkpoint(absl::Duration timeout = absl::Minutes(10));

 private:
  struct Connection;  // A gRPC stub over one channel.

  Client(ClientOptions options, std::vector<std::unique_ptr<Connection>> connections);

  absl::StatusOr<RegisterTensorsResult> RegisterTensorsOnce(Connection& connection,
                                                            absl::Span<const TensorInit> tensors,
                                                            absl::Span<const size_t> indices,
                                                            const std::string& plan_hash);
  absl::StatusOr<PullResult> PullOnce(Connection& connection, const PullOptions& options);
  Connection& connection(size_t i) { return *connections_[i % connections_.size()]; }
  // How many parts a push with `options` travels as at most: one per connection, or fewer
  // with options.max_parts.
  size_t PartsOf(const PushOptions& options) const {
    return options.max_parts == 0 ? connections_.size()
                                  : std::min<size_t>(options.max_parts, connections_.size());
  }
  // A copy of the workspace SetWorkspace gave (an empty id: none).
  Workspace workspace() const;

  const ClientOptions options_;
  const std::vector<std::unique_ptr<Connection>> connections_;
  // Names a push in parts when the caller gave no client id or sequence number: a random id
  // per Client, and sequence numbers from the clock at creation on.
  const std::string default_client_id_;
  std::atomic<uint64_t> last_sequence_number_;
  mutable Mutex workspace_mu_;
  Workspace workspace_ ABSL_GUARDED_BY(workspace_mu_);
};

}  // namespace fusedps::client

#endif  // FUSEDPS_CLIENT_CLIENT_H_
