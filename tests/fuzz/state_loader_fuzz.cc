// state_loader_fuzz: LoadState's ingest (server/ingest/state_loader.h) as the service runs it:
// the first message's header through StateLoader::Begin, every message's chunks through
// AddChunks, then Commit, on an EngineShard (the CPU backend, a 64 KiB staging pool).
//
// Input (fuzz_input.h): mode (mode % 3 picks the shard of ShardDefs()), slicing (unused), then
// the call's serialized LoadStateRequests; a message that does not parse ends the call, as gRPC
// would.
//
// A model of the checks runs beside them, written from the API's contract
// (proto/fusedps/v1: LoadState), and keeps the values sent. For every input:
//   - Begin refuses a header exactly when the model does, with the model's code (NOT_FOUND,
//     INVALID_ARGUMENT, FAILED_PRECONDITION, RESOURCE_EXHAUSTED);
//   - AddChunks refuses a message exactly where the model refuses its first chunk, with the
//     model's code;
//   - Commit succeeds exactly when every listed (tensor, field) was covered once; the version
//     then advances by 1, each tensor's step is the header's, and every field loaded holds
//     exactly the values sent (read back through the engine);
//   - a load that does not commit changes nothing the view or the version shows.
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fusedps/v1/parameter_service.pb.h"
#include "server/ingest/state_loader.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/fuzz_shards.h"

namespace fusedps::fuzz {
namespace {

constexpr size_t kMaxMessages = 8;
constexpr int kFields = 4;  // TensorField 1..4.

EngineShard& Shard(size_t def) {
  static auto* shards = new std::vector<std::unique_ptr<EngineShard>>(ShardDefs().size());
  if ((*shards)[def] == nullptr) (*shards)[def] = std::make_unique<EngineShard>(ShardDefs()[def]);
  return *(*shards)[def];
}

// One (tensor, field) a header lists: what arrived, and the values.
struct Listed {
  uint32_t tensor;
  int field;  // TensorField value.
  std::vector<bool> received;
  std::vector<float> values;
};

class Model {
 public:
  explicit Model(const ShardView& view) : view_(view) {}

  // The code Begin should return for `header`; records what it lists.
  absl::StatusCode Begin(const v1::LoadStateHeader& header, uint64_t staging_capacity) {
    if (header.plan_hash().size() > kMaxPlanHashBytes) return absl::StatusCode::kInvalidArgument;
    if (header.plan_hash() != view_.plan_hash()) return absl::StatusCode::kFailedPrecondition;
    if (header.tensors().empty()) return absl::StatusCode::kInvalidArgument;
    absl::flat_hash_set<uint32_t> seen;
    uint64_t elements[kFields] = {};
    for (const v1::TensorState& state : header.tensors()) {
      const std::optional<uint32_t> t = view_.FindTensor(state.name());
      if (!t.has_value()) return absl::StatusCode::kNotFound;
      if (!seen.insert(*t).second || state.step() < 0) return absl::StatusCode::kInvalidArgument;
      const TensorMeta& meta = view_.tensor(*t);
      bool fields[kFields] = {};
      for (int value : state.fields()) {
        const int field = value == 0 ? 1 : value;
        if (field < 1 || field > kFields || fields[field - 1]) {
          return absl::StatusCode::kInvalidArgument;
        }
        fields[field - 1] = true;
        if (field == 4 && !view_.groups()[meta.group].hyperparameters.amsgrad) {
          return absl::StatusCode::kFailedPrecondition;
        }
        elements[field - 1] += (meta.numel + 7) / 8 * 8;
        index_.emplace(std::make_pair(state.name(), field), listed_.size());
        listed_.push_back({*t, field, std::vector<bool>(meta.numel, false),
                           std::vector<float>(meta.numel, 0.0f)});
      }
      tensors_.push_back(*t);
      steps_.push_back(state.step());
    }
    uint64_t bytes = 0;
    for (uint64_t e : elements) bytes += e * sizeof(float);
    if (bytes > staging_capacity) return absl::StatusCode::kResourceExhausted;
    return absl::StatusCode::kOk;
  }

  // The code of the first chunk the model refuses (OK when it takes them all).
  absl::StatusCode AddChunks(const google::protobuf::RepeatedPtrField<v1::TensorChunk>& chunks) {
    for (const v1::TensorChunk& chunk : chunks) {
      const int value = static_cast<int>(chunk.field());
      const int field = value == 0 ? 1 : value;
      if (field < 1 || field > kFields) return absl::StatusCode::kInvalidArgument;
      auto it = index_.find(std::make_pair(chunk.tensor(), field));
      if (it == index_.end()) {
        return view_.FindTensor(chunk.tensor()).has_value() ? absl::StatusCode::kInvalidArgument
                                                            : absl::StatusCode::kNotFound;
      }
      Listed& l = listed_[it->second];
      const uint64_t bytes = chunk.data().size(), offset = chunk.offset();
      const uint64_t numel = l.received.size();
      if (bytes % sizeof(float) != 0) return absl::StatusCode::kInvalidArgument;
      const uint64_t count = bytes / sizeof(float);
      if (offset > numel || count > numel - offset) return absl::StatusCode::kInvalidArgument;
      for (uint64_t i = offset; i < offset + count; ++i) {
        if (l.received[i]) return absl::StatusCode::kInvalidArgument;
      }
      for (uint64_t i = offset; i < offset + count; ++i) l.received[i] = true;
      if (count > 0) std::memcpy(l.values.data() + offset, chunk.data().data(), bytes);
    }
    return absl::StatusCode::kOk;
  }

  bool Complete() const {
    for (const Listed& l : listed_) {
      for (bool b : l.received) {
        if (!b) return false;
      }
    }
    return true;
  }

  const std::vector<Listed>& listed() const { return listed_; }
  const std::vector<uint32_t>& tensors() const { return tensors_; }
  const std::vector<int64_t>& steps() const { return steps_; }

 private:
  const ShardView& view_;
  absl::flat_hash_map<std::pair<std::string, int>, size_t> index_;
  std::vector<Listed> listed_;
  std::vector<uint32_t> tensors_;
  std::vector<int64_t> steps_;
};

void CheckLoaded(EngineShard& shard, const Model& model, uint64_t version_before,
                 uint64_t version) {
  Require(version == version_before + 1, "a load's version");
  std::vector<int64_t> steps;
  shard.engine().Steps(model.tensors(), &steps);
  Require(steps == model.steps(), "a load's steps are not the header's");
  for (const Listed& l : model.listed()) {
    const std::vector<std::vector<float>> read =
        shard.Read(static_cast<TensorField>(l.field), {l.tensor});
    Require(SameBits(read[0], l.values), "a loaded field does not hold the values sent");
  }
}

void RunLoad(const FuzzInput& input) {
  EngineShard& shard = Shard(input.mode % ShardDefs().size());
  v1::LoadStateRequest message;
  if (!message.ParseFromArray(input.messages[0].data(),
                              static_cast<int>(input.messages[0].size())) ||
      !message.has_header()) {
    return;  // gRPC's error, or the service's INVALID_ARGUMENT.
  }
  const std::shared_ptr<const ShardView> view = shard.engine().view();
  const uint64_t version_before = shard.engine().version();
  Model model(*view);
  const absl::StatusCode want = model.Begin(message.header(), shard.staging().capacity());
  absl::StatusOr<std::unique_ptr<StateLoader>> loader =
      StateLoader::Begin(&shard.engine(), &shard.staging(), message.header(), [] { return false; });
  Require(loader.status().code() == want, "StateLoader::Begin's verdict is not the model's");
  if (!loader.ok()) return;

  bool ended = false;
  for (size_t m = 0; m < input.messages.size() && !ended; ++m) {
    if (m > 0 && (!message.ParseFromArray(input.messages[m].data(),
                                          static_cast<int>(input.messages[m].size())) ||
                  message.has_header())) {
      ended = true;  // gRPC's error, or the stream reader's INVALID_ARGUMENT.
      break;
    }
    const absl::Status added = (*loader)->AddChunks(message.chunks());
    Require(added.code() == model.AddChunks(message.chunks()),
            "AddChunks' verdict is not the model's");
    ended = !added.ok();
  }
  if (!ended) {
    absl::StatusOr<uint64_t> version = (*loader)->Commit();
    Require(version.ok() == model.Complete(), "Commit's verdict is not the model's");
    if (version.ok()) return CheckLoaded(shard, model, version_before, *version);
    RequireCode(version.status(), {absl::StatusCode::kInvalidArgument}, "Commit");
  }
  Require(shard.engine().view() == view && shard.engine().version() == version_before,
          "a load that failed changed the shard");
}

}  // namespace
}  // namespace fusedps::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fusedps::fuzz::QuietProtobufLog();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fusedps::fuzz;
  const FuzzInput input = ParseFuzzInput(data, size, kMaxMessages);
  if (input.messages.empty()) return 0;
  RunLoad(input);
  return 0;
}
