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

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace grpc {
class Channel;
}  // namespace grpc

namespace fusedps::client {

// Element type of tensor data on the wire. Values match proto fusedps.v1.DType.
enum class DType : uint8_t {
  kFloat32 = 1,   // IEEE binary32.
  kBFloat16 = 2,  // bfloat16 (the high half of a binary32, rounded to nearest even).
  kFloat16 = 3,   // IEEE binary16 (rounded to nearest even; beyond +-65504 becomes inf).
};

// Bytes per element of a dtype on the wire: 4 for kFloat32, 2 for the others.
size_t ElementBytes(DType dtype);

// "fp32", "bf16" or "fp16".
const char* DTypeName(DType dtype);

// Parses "fp32"/"float32", "bf16"/"bfloat16" or "fp16"/"float16" (the spellings of the fusedps
// CLI's and fusedps-bench's --dtype). Errors: INVALID_ARGUMENT "must be fp32, bf16 or fp16,
// not NAME".
absl::StatusOr<DType> ParseDType(absl::string_view name);

// Which stored array of a tensor a pull reads. Values match proto fusedps.v1.TensorField.
enum class TensorField : uint8_t {
  kParam = 1,
  kExpAvg = 2,
  kExpAvgSq = 3,
  kMaxExpAvgSq = 4,  // Only tensors whose group has amsgrad.
};

// How a param group stores exp_avg and exp_avg_sq. Values match proto fusedps.v1.StateDType.
// The update's math is fp32 whatever the storage; pulls of state return fp32 values.
enum class StateDType : uint8_t {
  kFloat32 = 1,   // 4 + 4 bytes per parameter (the default).
  kBFloat16 = 2,  // 2 + 2 bytes, rounded to nearest even.
  // 1 + 1 byte plus an fp32 scale per block of 256 elements (block-wise dynamic quantization,
  // as bitsandbytes' 8-bit AdamW); tensors under 4096 elements keep fp32 state.
  kInt8 = 3,
};

// "fp32", "bf16" or "int8".
const char* StateDTypeName(StateDType dtype);

// How weight_decay is applied. Values match proto fusedps.v1.WeightDecayMode.
enum class WeightDecayMode : uint8_t {
  kDecoupled = 1,  // param -= lr * weight_decay * param (torch.optim.AdamW).
  kL2 = 2,         // grad += weight_decay * param (torch.optim.Adam).
};

struct ClientOptions {
  // The model (a server namespace, docs/api.md "Models") every call of this client is about;
  // empty: "default", the model every server has. It must exist on the server (CreateModel),
  // else calls fail with NOT_FOUND naming it.
  std::string model;
  // Payload bytes of tensor data per request message. Tensors larger than this are split across
  // messages; small tensors share one. A message adds at most 64 KiB of tensor names and framing
  // to its payload, and the first message of a call may also carry the call's header when that
  // is under 64 KiB (a larger header, such as a push naming 10,000 tensors, travels alone).
  // Keep max_chunk_bytes + 128 KiB under the server's max_message_bytes.
  // Pulls ask the server for the same chunk size, capped at 4 MiB.
  // REQUIRES: 4 <= max_chunk_bytes <= 15 MiB.
  size_t max_chunk_bytes = 1 << 20;
  // Concurrent gRPC calls, each on its own connection. RegisterTensors and PullParameters split
  // their tensors across them; PushGradients sends one push as that many parts at once
  // (PushHeader.part_index/part_count), which the server still applies as one atomic step.
  // REQUIRES: 1 <= streams <= 64.
  int streams = 1;
  // Deadlines. Each call must finish within `timeout` plus its payload bytes at
  // `min_bytes_per_second`, counted from its start, or it fails with DEADLINE_EXCEEDED. The
  // payload is the tensor data the call moves: the values or gradients it sends (each part's
  // own share with streams > 1), or for a pull the data the server announces in its reply,
  // so a pull's deadline grows as the reply describes its tensors. Other calls (GetInfo, each
  // page of ListTensors, ...) get `timeout` alone.
  //
  // The defaults, 30 s plus 10 MB/s: a healthy server answers a small call in milliseconds;
  // 30 s leaves room for connecting, for a push waiting its turn for the server's staging
  // memory, and for applying a step to a large shard on the CPU backend, and it is about the
  // time keepalive takes to find a dead connection (below). 10 MB/s is under a hundredth of
  // what one connection moves on a healthy link (1.6 GB/s, docs/benchmarks.md) and under a
  // tenth of 1 Gb/s Ethernet, so a call that is merely slow is not cut short, while one that
  // has stopped moving fails: a bf16 push of GPT-2 small (248 MB) gets 30 + 25 s.
  //
  // timeout = absl::InfiniteDuration() gives calls no deadline at all (the old default);
  // min_bytes_per_second = 0 gives every call `timeout` whatever its size.
  // REQUIRES: timeout > 0.
  absl::Duration timeout = absl::Seconds(30);
  uint64_t min_bytes_per_second = 10'000'000;
  // Keepalive: while a call is in flight, a connection sends an HTTP/2 ping every
  // keepalive_time, and it is closed (its calls fail with UNAVAILABLE) when a ping is not
  // answered within keepalive_timeout. A server that died without closing its sockets, or
  // a network partition, is so found within about 40 s; TCP alone would take about two hours.
  // Idle connections (no call in flight) send no pings. fusedps-server permits a ping every
  // 10 s; a server that permits fewer may close connections that ping more often than it
  // allows. absl::InfiniteDuration() as keepalive_time turns keepalive off. Applies to the
  // channels Create makes, not to a channel given to CreateWithChannel.
  // REQUIRES: keepalive_time > 0, keepalive_timeout > 0.
  absl::Duration keepalive_time = absl::Seconds(30);
  absl::Duration keepalive_timeout = absl::Seconds(10);
  // When true, a call made while the server is unreachable waits for it (up to its deadline)
  // instead of failing at once with UNAVAILABLE.
  bool wait_for_ready = false;
  // Transport security (the server's --tls-cert; docs/operations.md, "Security"). With `tls`,
  // or any tls_* file, the channels Create makes use TLS: the server's certificate must chain
  // to the PEM roots in tls_ca_file (gRPC's default roots when it is empty) and name the
  // target's host. tls_cert_file and tls_key_file (PEM, both or neither) present a client
  // certificate, for a server with --tls-client-ca (mutual TLS). Create reads the files once.
  bool tls = false;
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  // A bearer token (the server's --auth-tokens), sent on every call as
  // `authorization: Bearer TOKEN`, also on channels given to CreateWithChannel; empty: none.
  // The server then requires each push's PushOptions::client_id to be the token's principal.
  std::string token;
  // A file holding the token (surrounding whitespace ignored), read once by Create and
  // CreateWithChannel: a Kubernetes Secret mounted as a file, say. Exclusive with `token`.
  std::string token_file;
};

// A channel to `target` as Client::Create makes one for each stream: a connection of its own
// (not shared with other channels to the same target), TLS as `options` says, and keepalive.
// For tools that create clients with CreateWithChannel. Errors: INVALID_ARGUMENT for an empty
// target, tls_cert_file without tls_key_file (or the reverse), or a file that cannot be read.
absl::StatusOr<std::shared_ptr<grpc::Channel>> CreateChannel(const std::string& target,
                                                             const ClientOptions& options);

// AdamW hyperparameters of a param group, named as in torch.optim.AdamW (betas = (beta1, beta2)).
// An unset field means: at registration, torch's default (lr 1e-3, betas (0.9, 0.999), eps 1e-8,
// weight_decay 1e-2, amsgrad false, maximize false, decoupled decay); in SetHyperparameters,
// keep the current value. When returned by the server, every field is set.
struct ParamGroupOptions {
  std::optional<double> lr;            // >= 0 and finite.
  std::optional<double> beta1;         // In [0, 1).
  std::optional<double> beta2;         // In [0, 1).
  std::optional<double> eps;           // >= 0.
  std::optional<double> weight_decay;  // >= 0.
  std::optional<bool> amsgrad;         // Fixed at registration.
  std::optional<bool> maximize;
  std::optional<WeightDecayMode> weight_decay_mode;
  // Storage, fixed at registration as amsgrad is (SetHyperparameters may repeat a value, not
  // change it; a change is INVALID_ARGUMENT). Unset at registration: fp32 state, fp32 params,
  // seed 0. amsgrad needs kFloat32 state.
  std::optional<StateDType> state_dtype;
  // kFloat32 (an fp32 master copy) or kBFloat16: bf16 params and no fp32 master, 2 bytes per
  // parameter instead of 4; each step rounds its fp32 result stochastically, with bits that
  // depend only on (rounding_seed, the tensor's name, its step, the element), so a replay or a
  // restore from a checkpoint gives the same bits. kFloat16 is INVALID_ARGUMENT.
  std::optional<DType> params_dtype;
  std::optional<uint64_t> rounding_seed;
};

// A param group as the server stores it.
struct ParamGroup {
  std::string name;
  ParamGroupOptions hyperparameters;
};

struct RegisterParamGroupResult {
  bool created = false;  // False when an identical group already existed (a no-op).
  ParamGroup param_group;
};

// One tensor to register, with its initial values.
struct TensorInit {
  std::string name;                // 1..256 bytes of UTF-8, unique on the server.
  std::vector<int64_t> shape;      // {} for a 0-dim tensor. Each dim >= 0.
  std::string param_group;         // A registered group; empty means "default".
  absl::Span<const float> values;  // Product of shape elements, row-major.
};

struct RegisterTensorsResult {
  uint32_t tensors_created = 0;
  uint32_t tensors_existing = 0;  // Identical specs that were already registered (no-ops).
  uint64_t version = 0;           // The server's model version afterwards.
};

// The header of a push.
// A same-host workspace this process has mapped (proto OpenWorkspace; the caller opens it and
// holds its call, e.g. fusedps._workspace in Python): its id and where its `bytes` bytes are
// mapped here. With one set (Client::SetWorkspace), a push's pieces and a PullInto's targets
// that lie inside it travel as their places in it, not as bytes.
struct Workspace {
  std::string id;
  const char* data = nullptr;
  uint64_t bytes = 0;
  // The byte offset of [p, p + n) in the workspace, or -1 when it is not inside.
  int64_t OffsetOf(const void* p, uint64_t n) const {
    const char* c = static_cast<const char*>(p);
    if (data == nullptr || c < data || n > bytes || static_cast<uint64_t>(c - data) > bytes - n) {
      return -1;
    }
    return c - data;
  }
};

struct PushOptions {
  // Identifies the trainer for retry detection, at most 256 bytes; empty disables it.
  std::string client_id;
  // Per client_id, increasing. A push whose sequence_number is not above the highest the
  // server has taken for its client_id is never applied: a retry of a push the server still
  // remembers gets that push's result again with duplicate = true, any other fails with
  // ABORTED. 0 disables retry detection.
  uint64_t sequence_number = 0;
  // The dtype gradients travel in; fp32 gradients are rounded to it (nearest even) on the
  // client, and the server computes in fp32. bf16 by default: half the bytes of fp32 on the
  // wire, the same exponent range (nothing overflows), and the 8-bit mantissa that
  // torch.autocast's bf16 training computes gradients in anyway. A model whose gradients need
  // more precision than that sets kFloat32; fp16 overflows beyond +-65504 (the step is then
  // skipped as non-finite).
  DType grad_dtype = DType::kBFloat16;
  // When set, the server divides the gradients by it (loss scaling). > 0 and finite.
  std::optional<float> grad_scale;
  // The model version the gradients were computed from: the version of the pull they start
  // from. A server in sync mode takes a push only when it is the version of the round it is
  // gathering, one in bounded mode only when it is at most max_staleness behind (see
  // Consistency); either answers ABORTED, naming its version, to a push it refuses for it.
  uint64_t base_version = 0;
  // The hash of the sharding plan of the server's shard (ShardPlan::hash() in fusedps/plan.h),
  // as given to RegisterTensors; empty for a server that is not a shard of a plan.
  std::string plan_hash;
};

// The gradients of one tensor.
struct TensorGrad {
  std::string name;
  absl::Span<const float> grads;  // One per element of the tensor, row-major.
};

struct PushResult {
  uint64_t version = 0;       // The server's version after the push (unchanged if skipped).
  bool step_skipped = false;  // True when no tensor was updated (see skip_reason).
  std::string skip_reason;    // "non_finite_grad" when step_skipped.
  uint32_t tensors_updated = 0;
  uint64_t grad_bytes = 0;  // Gradient payload bytes the server received.
  bool duplicate = false;   // A retry of a push the server took; nothing more was applied.
  // sync mode: how many pushes (distinct client_ids) the round's step averaged; 0 elsewhere.
  uint32_t round_workers = 0;
  // sync mode: the round closed by its timeout, and the client_ids it waited for in vain
  // (PushGradientsResponse.missing_replicas).
  bool round_timed_out = false;
  std::vector<std::string> missing_replicas;
};

struct PullOptions {
  std::vector<std::string> tensors;  // Empty means every tensor on the server.
  DType dtype = DType::kFloat32;     // kFloat32 or kBFloat16 (halves the bytes moved).
  TensorField field = TensorField::kParam;
};

struct PulledTensor {
  std::vector<int64_t> shape;
  std::string param_group;
  int64_t step = 0;           // Optimizer steps applied to this tensor.
  std::vector<float> values;  // Row-major; bf16 data is widened to float exactly.
};

struct PullResult {
  uint64_t version = 0;  // Every value was read at this model version.
  std::map<std::string, PulledTensor> tensors;
};

struct TensorInfo {
  std::string name;
  std::vector<int64_t> shape;
  std::string param_group;
  int64_t step = 0;
  uint64_t numel = 0;
  // How the server stores this tensor: its group's params_dtype and state_dtype, but kFloat32
  // state for a tensor under 4096 elements in a kInt8 group (kFloat32 from servers that do not
  // say).
  DType params_dtype = DType::kFloat32;
  StateDType state_dtype = StateDType::kFloat32;
};

struct TensorList {
  // The server's version when it read the first page. A large shard is listed a page at a
  // time, and a push applied between pages shows in the steps of the later pages.
  uint64_t version = 0;
  std::vector<TensorInfo> tensors;  // In registration order.
};

// How a server turns pushes into optimizer steps (its --mode; docs/consistency.md).
struct Consistency {
  // "async": every push is its own step, whatever its base_version.
  // "sync": K of N; a round at version v averages the gradients of the first K pushes from
  //   distinct client_ids whose base_version is v into one step; other pushes get ABORTED.
  // "bounded": a push is its own step when version - base_version <= max_staleness.
  // Empty from a server that predates consistency modes (they all were async); "mode N" for a
  // mode this client does not know.
  std::string mode;
  uint32_t replicas_to_aggregate = 0;  // sync: K, the pushes averaged per round.
  uint32_t total_replicas = 0;         // sync: N, the trainers (N - K are backups).
  // sync: a round that has some pushes but not K this long after its first is applied with the
  // pushes it has; zero waits for ever.
  absl::Duration round_timeout = absl::ZeroDuration();
  uint64_t max_staleness = 0;         // bounded: the most versions a push may be behind.
  bool staleness_lr_scaling = false;  // bounded: a push tau versions behind uses lr / (1 + tau).
};

struct ServerInfo {
  uint64_t version = 0;  // Pushes applied so far.
  std::string backend;   // "cpu" or "cuda".
  std::string device;    // e.g. "cuda:0 NVIDIA H100".
  uint32_t tensor_count = 0;
  uint64_t parameter_count = 0;  // Elements over all tensors.
  std::vector<ParamGroup> param_groups;
  std::string server_version;
  uint64_t max_message_bytes = 0;         // The server's max receive message size.
  std::optional<DType> param_copy_dtype;  // The low-precision copy kept for pulls, if any.
  Consistency consistency;
  std::string plan_hash;  // The plan hash of the server's shard; empty when it has none.
  // The fields above but the server's (backend, device, server_version, max_message_bytes,
  // param_copy_dtype) are the client's model's.
  std::string model;
  uint64_t memory_bytes = 0;         // Device memory the model holds.
  uint64_t server_memory_bytes = 0;  // Device memory the whole server holds.
  uint32_t model_count = 0;          // Models on the server.
};

// A model on a server (ListModels, CreateModel).
struct ModelInfo {
  std::string name;
  uint64_t version = 0;
  uint32_t tensor_count = 0;
  uint64_t parameter_count = 0;
  Consistency consistency;
  uint64_t memory_bytes = 0;  // Device memory it holds.
  std::string plan_hash;
};

struct CreateModelResult {
  bool created = false;  // False: it existed with the same consistency (a no-op).
  ModelInfo model;
};

struct DeleteModelResult {
  uint64_t freed_bytes = 0;   // The device memory the model held.
  bool memory_freed = false;  // False: calls in flight still held it; freed once they are done.
};

// The size of a tensor that a PushTransaction sends.
struct TensorSize {
  std::string name;
  uint64_t numel = 0;
};

// Where a pull writes one tensor (Client::PullInto): numel elements of the pull's dtype, raw
// (little-endian fp32 or bf16 bits, as on the wire), at data.
struct PullTarget {
  std::string name;
  void* data = nullptr;
  uint64_t numel = 0;
};

struct PullIntoResult {
  uint64_t version = 0;        // Every element was read at this model version.
  std::vector<int64_t> steps;  // Each target's optimizer steps, in the targets' order.
};

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
  // A copy of the workspace SetWorkspace gave (an empty id: none).
  Workspace workspace() const;

  const ClientOptions options_;
  const std::vector<std::unique_ptr<Connection>> connections_;
  // Names a push in parts when the caller gave no client id or sequence number: a random id
  // per Client, and sequence numbers from the clock at creation on.
  const std::string default_client_id_;
  std::atomic<uint64_t> last_sequence_number_;
  mutable std::mutex workspace_mu_;
  Workspace workspace_ ABSL_GUARDED_BY(workspace_mu_);
};

}  // namespace fusedps::client

#endif  // FUSEDPS_CLIENT_CLIENT_H_
