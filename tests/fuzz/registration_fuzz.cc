// registration_fuzz: RegisterTensors' ingest (server/ingest/registration.h) as the service runs
// it: the first message's specs and plan_hash through Registration::Begin, every message's
// chunks through AddChunks, then Commit, on an EngineShard (the CPU backend, its staging pool).
//
// Input (fuzz_input.h): mode (mode % 3 picks the shard of ShardDefs(); (mode >> 2) % 4 the
// staging window: 4 bytes, 100 bytes, 4 KiB, 1 MiB, which the pool rounds up to 64 bytes),
// slicing (unused), then the call's serialized RegisterTensorsRequests; a message that does not
// parse ends the call, as gRPC would.
//
// A model of the chunk checks runs beside them (a chunk's tensor is among the specs, its data
// whole float32 elements, its range inside the tensor, no element twice) and keeps the values
// of the new tensors. For every input:
//   - Begin's errors are INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION or
//     RESOURCE_EXHAUSTED;
//   - AddChunks refuses a message exactly where the model refuses its first chunk, with the
//     model's code (NOT_FOUND for a tensor the shard does not have, else INVALID_ARGUMENT);
//   - Commit succeeds exactly when every element of every new tensor arrived; the tensors it
//     creates then hold exactly the values sent (read back through the engine), with the
//     specs' shapes and groups, and an empty shard takes the plan_hash;
//   - a registration that does not commit new tensors leaves the shard's view as it was.
// Specs of more than kMaxNewElements new elements (up to 2^36 per tensor) are only checked
// (ShardView::CheckTensorSpecs), not begun: their memory would be real.
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fusedps/v1/parameter_service.pb.h"
#include "server/ingest/registration.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/fuzz_shards.h"

namespace fusedps::fuzz {
namespace {

constexpr size_t kMaxMessages = 8;
constexpr uint64_t kMaxNewElements = uint64_t{1} << 18;
constexpr uint64_t kWindows[] = {4, 100, 4 << 10, 1 << 20};

// The shards, made when first used and again after a registration changed one.
std::unique_ptr<EngineShard>& ShardSlot(size_t def) {
  static auto* slots = new std::vector<std::unique_ptr<EngineShard>>(ShardDefs().size());
  return (*slots)[def];
}

// The chunk checks of a registration, written from the API's contract.
class Model {
 public:
  Model(const std::vector<TensorSpec>& specs, const std::vector<bool>& is_new,
        const ShardView& view)
      : view_(view), is_new_(is_new) {
    for (size_t i = 0; i < specs.size(); ++i) {
      const uint64_t numel = *NumelOf(specs[i].shape);
      index_.emplace(specs[i].name, i);
      numel_.push_back(numel);
      received_.emplace_back(numel, false);
      values_.emplace_back(is_new[i] ? numel : 0, 0.0f);
    }
  }

  // The code of the first chunk the model refuses (OK when it takes them all); records the
  // chunks before it.
  absl::StatusCode AddChunks(const google::protobuf::RepeatedPtrField<v1::TensorChunk>& chunks) {
    for (const v1::TensorChunk& chunk : chunks) {
      auto it = index_.find(chunk.tensor());
      if (it == index_.end()) {
        return view_.FindTensor(chunk.tensor()).has_value() ? absl::StatusCode::kInvalidArgument
                                                            : absl::StatusCode::kNotFound;
      }
      const size_t t = it->second;
      const uint64_t bytes = chunk.data().size(), offset = chunk.offset();
      if (bytes % sizeof(float) != 0) return absl::StatusCode::kInvalidArgument;
      const uint64_t count = bytes / sizeof(float);
      if (offset > numel_[t] || count > numel_[t] - offset) {
        return absl::StatusCode::kInvalidArgument;
      }
      for (uint64_t i = offset; i < offset + count; ++i) {
        if (received_[t][i]) return absl::StatusCode::kInvalidArgument;
      }
      for (uint64_t i = offset; i < offset + count; ++i) received_[t][i] = true;
      if (is_new_[t] && count > 0) {
        std::memcpy(values_[t].data() + offset, chunk.data().data(), bytes);
      }
    }
    return absl::StatusCode::kOk;
  }

  bool Complete() const {
    for (size_t t = 0; t < received_.size(); ++t) {
      if (!is_new_[t]) continue;
      for (bool b : received_[t]) {
        if (!b) return false;
      }
    }
    return true;
  }

  const std::vector<float>& values(size_t spec) const { return values_[spec]; }

 private:
  const ShardView& view_;
  const std::vector<bool> is_new_;
  absl::flat_hash_map<std::string, size_t> index_;
  std::vector<uint64_t> numel_;
  std::vector<std::vector<bool>> received_;
  std::vector<std::vector<float>> values_;
};

// The new tensors are in the shard, with their shapes, groups and the values sent.
void CheckCreated(EngineShard& shard, const std::vector<TensorSpec>& specs,
                  const std::vector<bool>& is_new, const Model& model) {
  std::shared_ptr<const ShardView> view = shard.engine().view();
  std::vector<uint32_t> tensors;
  std::vector<size_t> spec_of;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (!is_new[i]) continue;
    const std::optional<uint32_t> t = view->FindTensor(specs[i].name);
    Require(t.has_value(), "a created tensor is not in the view");
    const TensorMeta& meta = view->tensor(*t);
    const std::string& group =
        specs[i].param_group.empty() ? std::string(kDefaultParamGroup) : specs[i].param_group;
    Require(meta.shape == specs[i].shape && view->groups()[meta.group].name == group,
            "a created tensor's shape or group is not its spec's");
    tensors.push_back(*t);
    spec_of.push_back(i);
  }
  const std::vector<std::vector<float>> params = shard.Read(TensorField::kParam, tensors);
  for (size_t k = 0; k < tensors.size(); ++k) {
    const std::vector<float>& want = model.values(spec_of[k]);
    Require(SameBits(params[k], want), "a created tensor's params are not the values sent");
  }
}

void RunRegistration(const FuzzInput& input) {
  const size_t def = input.mode % ShardDefs().size();
  const uint64_t window = kWindows[(input.mode >> 2) % 4];
  std::unique_ptr<EngineShard>& slot = ShardSlot(def);
  if (slot == nullptr) slot = std::make_unique<EngineShard>(ShardDefs()[def]);
  EngineShard& shard = *slot;

  v1::RegisterTensorsRequest message;
  if (!message.ParseFromArray(input.messages[0].data(),
                              static_cast<int>(input.messages[0].size())) ||
      !message.has_header()) {
    return;  // gRPC's error, or the service's INVALID_ARGUMENT.
  }
  const std::string plan_hash = message.header().plan_hash();
  std::vector<TensorSpec> specs;  // As the service converts them.
  for (const v1::TensorSpec& p : message.header().tensors()) {
    specs.push_back({p.name(), {p.shape().begin(), p.shape().end()}, p.param_group()});
  }
  const std::shared_ptr<const ShardView> before = shard.engine().view();
  std::vector<bool> is_new;
  const absl::Status specs_ok = before->CheckTensorSpecs(specs, &is_new);
  uint64_t new_elements = 0;
  if (specs_ok.ok()) {
    for (size_t i = 0; i < specs.size(); ++i) {
      if (is_new[i]) new_elements += *NumelOf(specs[i].shape);
    }
  }
  if (new_elements > kMaxNewElements) return;  // Checked above; too large to begin.

  std::optional<RegistrationOutcome> outcome;
  {
    absl::StatusOr<std::unique_ptr<Registration>> registration = Registration::Begin(
        &shard.engine(), &shard.staging(), &shard.registration_gate(), specs, window,
        [] { return false; }, plan_hash);
    if (!registration.ok()) {
      RequireCode(registration.status(),
                  {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound,
                   absl::StatusCode::kAlreadyExists, absl::StatusCode::kFailedPrecondition,
                   absl::StatusCode::kResourceExhausted},
                  "Registration::Begin");
      Require(shard.engine().view() == before, "a registration that failed changed the view");
      return;
    }
    Require(specs_ok.ok(), "Begin took specs CheckTensorSpecs refuses");
    Model model(specs, is_new, *before);
    bool ended = false;
    for (size_t m = 0; m < input.messages.size() && !ended; ++m) {
      if (m > 0 && (!message.ParseFromArray(input.messages[m].data(),
                                            static_cast<int>(input.messages[m].size())) ||
                    message.has_header())) {
        ended = true;  // gRPC's error, or the stream reader's INVALID_ARGUMENT.
        break;
      }
      const absl::Status added = (*registration)->AddChunks(message.chunks());
      const absl::StatusCode want = model.AddChunks(message.chunks());
      Require(added.code() == want, "AddChunks' verdict is not the model's");
      ended = !added.ok();
    }
    if (!ended) {
      absl::StatusOr<RegistrationOutcome> committed = (*registration)->Commit();
      Require(committed.ok() == model.Complete(), "Commit's verdict is not the model's");
      if (committed.ok()) {
        outcome = *committed;
        uint32_t created = 0;
        for (bool b : is_new) created += b ? 1 : 0;
        Require(outcome->created == created && outcome->existing == specs.size() - created,
                "Commit's counts");
        if (created > 0) CheckCreated(shard, specs, is_new, model);
      } else {
        RequireCode(committed.status(), {absl::StatusCode::kInvalidArgument}, "Commit");
      }
    }
  }  // The registration ends here: aborted unless committed.
  if (outcome.has_value() && outcome->created > 0) {
    std::shared_ptr<const ShardView> after = shard.engine().view();
    Require(after->tensor_count() == before->tensor_count() + outcome->created,
            "the view after a commit");
    if (before->plan_hash().empty() && before->tensor_count() == 0) {
      Require(after->plan_hash() == plan_hash, "the plan_hash taken");
    }
    slot.reset();  // The next input starts from the shard as defined.
  } else {
    Require(shard.engine().view() == before, "a registration that created nothing changed it");
  }
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
  RunRegistration(input);
  return 0;
}
