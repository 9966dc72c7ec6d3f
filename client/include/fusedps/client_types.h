// fusedps/client_types.h: the values that the C++ client's calls (fusedps/client.h) take and
// return: the wire's dtypes and enums, ClientOptions, and each call's options and results.
// Include fusedps/client.h, which includes this header; units and errors are as it says.
//
// Usage:
//   fusedps::client::ClientOptions options;
//   options.streams = 4;
//   fusedps::client::PushOptions push;
//   push.grad_dtype = fusedps::client::DType::kFloat32;
#ifndef FUSEDPS_CLIENT_CLIENT_TYPES_H_
#define FUSEDPS_CLIENT_CLIENT_TYPES_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

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

// Parses "fp32"/"float32", "bf16"/"bfloat16" or "fp16"/"float16", in any case (the spellings of the
// fusedps CLI's and fusedps-bench's --dtype). Errors: INVALID_ARGUMENT "must be fp32, bf16 or fp16,
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

namespace internal {
// ParamGroupOptions' doubles and bools by the name of their field in proto
// fusedps.v1.Hyperparameters, which client/wire.cc converts in one loop each way (its test fails
// for a proto field that converts nowhere). A double or bool added above is added here too.
template <typename T>
struct ParamGroupField {
  const char* name;
  std::optional<T> ParamGroupOptions::*member;
};
inline constexpr ParamGroupField<double> kParamGroupDoubleFields[] = {
    {"lr", &ParamGroupOptions::lr},
    {"beta1", &ParamGroupOptions::beta1},
    {"beta2", &ParamGroupOptions::beta2},
    {"eps", &ParamGroupOptions::eps},
    {"weight_decay", &ParamGroupOptions::weight_decay}};
inline constexpr ParamGroupField<bool> kParamGroupBoolFields[] = {
    {"amsgrad", &ParamGroupOptions::amsgrad}, {"maximize", &ParamGroupOptions::maximize}};
}  // namespace internal

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
  // The most calls (parts) the push travels as: 0 (the default), one per connection
  // (ClientOptions::streams); above streams, streams. PushGradients sends fewer when its
  // chunks are fewer. A push whose pieces all lie in a device workspace moves no bytes through
  // its calls (only their places), so one part is enough there, and each part costs a call's
  // start and end on both sides (docs/python.md, "One call for a device workspace's push").
  uint32_t max_parts = 0;
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
  // The version the commit's pull read (PushTransaction::Commit's `then_pull`); 0 when it
  // carried none, or when the server answered from its retry table (pull again then).
  uint64_t pulled_version = 0;
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

}  // namespace fusedps::client

#endif  // FUSEDPS_CLIENT_CLIENT_TYPES_H_
