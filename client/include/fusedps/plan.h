// fusedps/plan.h: which slice of which tensor lives on which server when a model is sharded.
//
// A model too large for one server, or a job that needs more push bandwidth than one server has,
// is split over S servers ("shards"). A server knows only its own tensors; every client computes
// the same ShardPlan from the model's tensors, S and a slice size, and sends the plan's hash
// with every registration and push, so that a server refuses a client whose plan differs.
// docs/sharding.md is the specification; the Python client's fusedps.plan implements the same
// algorithm and hash, and tests/e2e/test_plan_interop.py checks that the two agree.
//
// The plan: tensors sorted by name (UTF-8 bytes); a tensor of more than slice_elements elements
// cut into contiguous slices of slice_elements (the last shorter), a smaller one kept whole;
// slices dealt largest first to the shard holding the fewest elements so far (ties to the lowest
// index). A whole tensor keeps its name and shape on its server; a slice is a 1-D tensor named
// "NAME[BEGIN:END]". The fullest shard holds at most mean + slice_elements elements.
//
// Usage:
//   std::vector<fusedps::client::PlanTensor> model = {{"wte", {50257, 768}}, {"ln.b", {768}}};
//   fusedps::client::ShardPlan plan = fusedps::client::ShardPlan::Make(model, 4).value();
//   for (const fusedps::client::PlanSlice& slice : plan.ShardSlices(0)) ...
//   std::cout << plan.ToJson() << "\n";  // what `fusedps plan` prints
#ifndef FUSEDPS_CLIENT_PLAN_H_
#define FUSEDPS_CLIENT_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace fusedps::client {

// One tensor of the model, as the plan sees it.
struct PlanTensor {
  std::string name;                     // Unique within the model.
  std::vector<int64_t> shape;           // {} for a 0-dim tensor (one element). Each dim >= 0.
  std::string param_group = "default";  // Empty also means "default".
};

// Elements [begin, end) of a tensor's row-major elements, and where and as what they live.
struct PlanSlice {
  std::string tensor;         // The model's tensor.
  std::string server_tensor;  // Its name on the server: `tensor`, or "tensor[begin:end]".
  // The shape on the server: the tensor's shape for a whole tensor, else {end - begin}.
  std::vector<int64_t> server_shape;
  std::string param_group;  // The tensor's ("default" when it gave none).
  uint64_t begin = 0;
  uint64_t end = 0;
  uint32_t shard = 0;  // Index of the server, in 0..shards-1.

  uint64_t numel() const { return end - begin; }
};

class ShardPlan {
 public:
  // 4 MiB of fp32 per slice: the partition size of BytePS.
  static constexpr uint64_t kDefaultSliceElements = uint64_t{1} << 20;

  // Plans `tensors` over `shards` servers in slices of at most `slice_elements` elements.
  // Errors: INVALID_ARGUMENT naming the field for shards == 0, slice_elements == 0, an empty
  // or duplicate tensor name, a negative dim, or an element count that overflows int64.
  static absl::StatusOr<ShardPlan> Make(absl::Span<const PlanTensor> tensors, uint32_t shards,
                                        uint64_t slice_elements = kDefaultSliceElements);

  // The plan's name: lowercase hex of the first 16 bytes of the SHA-256 of the plan's text
  // (docs/sharding.md), 32 characters.
  const std::string& hash() const { return hash_; }
  uint32_t shards() const { return shards_; }
  uint64_t slice_elements() const { return slice_elements_; }
  // The model's tensors sorted by name (UTF-8 bytes), each with its param group set.
  const std::vector<PlanTensor>& tensors() const { return tensors_; }
  // Every slice, in tensor order (as tensors()), then by increasing offset.
  const std::vector<PlanSlice>& slices() const { return slices_; }
  // The slices of shard `shard`, in the order of slices(): the order a server registers them.
  // Empty for a shard beyond shards().
  std::vector<PlanSlice> ShardSlices(uint32_t shard) const;
  // Elements held by each shard, shards() entries.
  const std::vector<uint64_t>& loads() const { return loads_; }

  // The text whose SHA-256 gives hash() (docs/sharding.md, "The plan's hash"), for comparing
  // plans line by line.
  std::string HashText() const;

  // One line of JSON: {"hash": "...", "shards": S, "slice_elements": C, "slices": [[tensor,
  // begin, end, shard], ...]}, slices in the order of slices(), with no trailing newline. The
  // same bytes as fusedps.plan.ShardPlan.to_json() in Python (names in UTF-8, unescaped).
  std::string ToJson() const;

 private:
  ShardPlan() = default;

  std::string hash_;
  uint32_t shards_ = 0;
  uint64_t slice_elements_ = 0;
  std::vector<PlanTensor> tensors_;
  std::vector<PlanSlice> slices_;
  std::vector<uint64_t> loads_;
};

}  // namespace fusedps::client

#endif  // FUSEDPS_CLIENT_PLAN_H_
