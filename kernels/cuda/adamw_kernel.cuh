// adamw_kernel.cuh (CUDA backend only): the kernels of an optimizer step as the rest of the
// backend sees them: the chunk list they walk, the units of work AdamWApply's warps take, the
// arenas they update, the grid that fills the GPU, which kernel a launch runs (RunsChunkBlocks:
// AdamWApply, the persistent grid, or AdamWApplyChunks, a block per chunk), the embedding-table
// rows a launch updates with its dense tensors (RowStep), and the launchers that check and count
// every launch. The kernels and their tuning history are in adamw_kernel.cu and
// adamw_chunk_blocks.cu (a round's sum and the state reads in accumulate_read_kernels.cu) (a
// portion's math in adamw_portion.cuh, its loads and stores in adamw_pipeline.cuh); the device
// memory and tables that feed them are the CUDA backend's (cuda_backend_impl.cuh, the step path in
// cuda_backend_step.cu).
//
// Usage:
//   std::vector<Chunk> chunks;
//   AppendChunks(ChunkSource{...}, chunks);
//   const uint64_t portions = PortionsIn(chunks);
//   const uint32_t blocks = ApplyBlocks(grid, portions);
//   const UnitPlan plan = PlanUnits(portions, blocks * kWarpsPerBlock, storage);
//   std::vector<UnitStart> units = WorkUnits(chunks, plan);
//   ... upload both and fill a DeviceArenas (its work counter zero before the first launch) ...
//   RETURN_IF_ERROR(LaunchAdamWApply(launches, blocks, stream, {grad, copy, kinds}, arenas,
//                                    device_chunks, chunks.size(), device_units, plan,
//                                    grad_scale, lr_divisor));
#ifndef FUSEDPS_KERNELS_CUDA_ADAMW_KERNEL_CUH_
#define FUSEDPS_KERNELS_CUDA_ADAMW_KERNEL_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"
#include "kernels/adamw_math.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/quant_math.h"
#include "kernels/tensor_layout.h"

namespace fusedps {
namespace gpu {

constexpr int kVec = 8;                                      // Elements per lane per portion.
constexpr uint32_t kPortionNumel = 32 * kVec;                // Elements per portion: one warp pass.
constexpr uint32_t kPortions = 8;                            // Portions per full chunk.
constexpr uint32_t kChunkNumel = kPortions * kPortionNumel;  // 2048 elements per chunk.
constexpr int kThreads = 256;                                // Threads per block.
constexpr int kWarpsPerBlock = kThreads / 32;
static_assert(kPortionNumel == kQuantBlock, "an int8 block is one portion: one warp's absmax");

// Chunk::layout bits: the tensor's storage (tensor_layout.h) and whether the chunk is its last.
constexpr uint16_t kLayoutParamsBf16 = 1u << 0;
constexpr uint16_t kLayoutStateShift = 1;  // Two bits: the StateDType value (1, 2, 3).
constexpr uint16_t kLayoutStateMask = 3u << kLayoutStateShift;
constexpr uint16_t kLayoutLastChunk = 1u << 3;

__host__ __device__ inline uint16_t LayoutBits(TensorLayout layout) {
  return static_cast<uint16_t>((layout.params == ParamsDType::kBFloat16 ? kLayoutParamsBf16 : 0) |
                               (static_cast<uint16_t>(layout.state) << kLayoutStateShift));
}
__host__ __device__ inline StateDType StateOf(uint16_t bits) {
  return static_cast<StateDType>((bits & kLayoutStateMask) >> kLayoutStateShift);
}

// One unit of work: up to kChunkNumel elements of one tensor. 64 bytes; the first 32 are what a
// warp needs to start the chunk's copies, the rest what it needs to compute.
struct Chunk {
  uint64_t grad;    // Element of the step's gradients (staging or accumulator) of the first.
  uint64_t param;   // Element of the tensor's param arena (fp32 or bf16) of the first.
  uint64_t state;   // Element of the tensor's state arenas (fp32, bf16 or int8) of the first.
  uint16_t count;   // Elements; 0 only for a tensor of no elements.
  uint16_t layout;  // kLayout* bits.
  uint32_t tensor;
  uint64_t element;       // Canonical element (tensor_table.h) of the first: the accumulator.
  uint64_t first;         // The first element's index within its tensor.
  uint64_t rounding_key;  // The tensor's (bf16 params).
  uint32_t group;
  uint32_t unused;
};
static_assert(sizeof(Chunk) == 64, "two 32-byte halves");

// Portions of a chunk: a tensor of no elements still has one, so that its step advances.
__host__ __device__ inline uint32_t PortionsOf(uint32_t count) {
  return count == 0 ? 1 : (count + kPortionNumel - 1) / kPortionNumel;
}

// A launch's work is cut into units of portions, in chunk-list order. Warp w takes unit w first,
// then grabs the next unit nobody has taken from a counter, until none is left: warps that run
// faster take more, so all of them end together, and all of them work near one front through
// memory. Units of 2 portions did best on an H100 (1, 3 and 4 lost 1-3 points;
// docs/benchmarks.md) where the step is bound by memory, except at the end of a launch: a warp
// holds the unit it computes and the one it has grabbed, so the last warps to end had up to 4
// portions left when the others had none. The plan's last kTailUnitsPerWarp x warps units are
// single portions (tails of 1, 2 and 4 per warp each gained about a point on 10,000 x 1K, 2 the
// most with bf16 grads; the large workloads did not move). A launch of the int8-state kernel
// (ApplyKinds::kInt8State) takes units of kInt8UnitPortions: on GPT-2 small, with fp32 grads, 3
// ran 4% faster than one unit per warp (each warp a contiguous share, which int8 launches took
// while their update had two divisions per element: units were 0.6-4% slower then), 1% faster
// than 2 and 3% faster than 4; with bf16 grads, one unit per warp is still 2% faster than units
// of 3 (docs/benchmarks.md, runs C4 and C6). A launch of the any-storage kernel that holds int8
// state (bf16 params) takes one unit per warp, no grabs: bound by instructions, units cost it
// 6-15% there.
constexpr uint32_t kUnitPortions = 2;
constexpr uint32_t kInt8UnitPortions = 3;
constexpr uint32_t kTailUnitsPerWarp = 2;

// How a launch's portions are cut into units: units [0, head_units()) of unit_portions each (the
// last of them may be shorter), then `tail` units of one portion each.
struct UnitPlan {
  uint32_t portions = 0;  // In all: fewer than kMaxChunks x kPortions (2^32).
  uint32_t unit_portions = kUnitPortions;
  uint32_t tail = 0;  // At most portions.

  __host__ __device__ uint32_t head_portions() const { return portions - tail; }
  __host__ __device__ uint32_t head_units() const {
    return (head_portions() + unit_portions - 1) / unit_portions;
  }
  __host__ __device__ uint32_t units() const { return head_units() + tail; }
  // Unit u's first portion, counted over the whole launch, and its portions.
  __host__ __device__ uint32_t first(uint32_t u) const {
    const uint32_t head = head_units();
    return u < head ? u * unit_portions : head_portions() + (u - head);
  }
  __host__ __device__ uint32_t length(uint32_t u) const {
    if (u >= head_units()) return 1;
    const uint32_t left = head_portions() - u * unit_portions;
    return left < unit_portions ? left : unit_portions;
  }
};

// Where a unit starts, as its table holds it: the chunk's index << 3 | the portion within it.
using UnitStart = uint32_t;
constexpr uint32_t kUnitChunkShift = 3;  // kPortions = 8 portions a chunk.
static_assert(kPortions == 1u << kUnitChunkShift, "a unit's portion takes the low 3 bits");
// Chunk lists must hold fewer chunks than this (2^40 elements: more than any device holds).
constexpr uint64_t kMaxChunks = uint64_t{1} << (32 - kUnitChunkShift);

// One tensor, for AppendChunks.
struct ChunkSource {
  uint32_t tensor = 0;
  uint32_t group = 0;
  uint64_t numel = 0;
  TensorLayout layout;
  uint64_t element = 0;  // Canonical offset.
  uint64_t param = 0;    // Param arena offset.
  uint64_t state = 0;    // State arena offset.
  uint64_t grad = 0;     // Where its gradients start.
  uint64_t rounding_key = 0;
};

// Appends a tensor's chunks (at least one) and returns its portions.
uint32_t AppendChunks(const ChunkSource& tensor, std::vector<Chunk>& out);
// The chunks and portions AppendChunks gives a tensor of `numel` elements.
inline uint64_t ChunksOfTensor(uint64_t numel) {
  return (std::max<uint64_t>(numel, 1) + kChunkNumel - 1) / kChunkNumel;
}
inline uint32_t PortionsOfTensor(uint64_t numel) {
  return static_cast<uint32_t>((std::max<uint64_t>(numel, 1) + kPortionNumel - 1) / kPortionNumel);
}
uint64_t PortionsIn(const std::vector<Chunk>& chunks);

// The most units of any plan of `portions` portions in a launch on `grid` (PlanUnits with
// ApplyBlocks' warps, for any storage): what a unit table must hold.
uint64_t MostUnits(uint64_t portions, int grid);

// Each unit's start in the chunk list (plan.units() of them; plan.portions is
// PortionsIn(chunks)). REQUIRES: chunks.size() < kMaxChunks.
std::vector<UnitStart> WorkUnits(const std::vector<Chunk>& chunks, const UnitPlan& plan);

// Which storage kinds a launch's chunks hold, each kind a kernel of its own with only the paths
// it needs: only fp32 params and fp32 state (the common case); fp32 params with fp32 or int8
// state (int8 state is bound by instructions: the any-storage kernel has 194 KB of machine code
// against the fp32 one's 47 KB, and on an H100 an eighth of an int8 launch's warp stalls waited
// for instructions in it; this one has 85 KB, and int8 launches ran 1.5% faster); or any.
// Ordered: each holds the ones before it.
enum class ApplyKinds : uint8_t { kFloat32Only = 0, kInt8State = 1, kAny = 2 };

// The kinds of a launch whose chunks hold `kinds` so far, once a chunk of `layout` joins.
inline ApplyKinds WithLayout(ApplyKinds kinds, TensorLayout layout) {
  ApplyKinds needed = ApplyKinds::kAny;
  if (IsFloat32Layout(layout)) {
    needed = ApplyKinds::kFloat32Only;
  } else if (layout.params == ParamsDType::kFloat32 && layout.state == StateDType::kInt8) {
    needed = ApplyKinds::kInt8State;
  }
  return std::max(kinds, needed);
}

// The storage a launch's chunks hold: the kernel that holds them all (kinds), and whether any
// has int8 state (which the any-storage kernel's plan depends on).
struct LaunchStorage {
  ApplyKinds kinds = ApplyKinds::kFloat32Only;
  bool int8_state = false;

  // Once a chunk of `layout` joins.
  void Add(TensorLayout layout) {
    kinds = WithLayout(kinds, layout);
    int8_state = int8_state || layout.state == StateDType::kInt8;
  }
};

// The plan of a launch over `portions` portions (fewer than 2^32) with `warps` warps
// (ApplyBlocks' blocks times kWarpsPerBlock) of chunks of `storage`: units of kUnitPortions
// (kInt8UnitPortions in the kInt8State kernel) with a tail of kTailUnitsPerWarp x warps single
// portions; or, in the kAny kernel with int8 state, one unit per warp.
UnitPlan PlanUnits(uint64_t portions, uint32_t warps, const LaunchStorage& storage);

struct ApplyConfig {
  GradDType grad = GradDType::kFloat32;
  ParamCopyDType copy = ParamCopyDType::kNone;
  ApplyKinds kinds = ApplyKinds::kFloat32Only;
  bool amsgrad = false;  // Whether any group of the hyperparameter table the launch reads has.
  StepKernel kernel = StepKernel::kAuto;
};

// Launches with fewer chunks than this run the persistent kernel under StepKernel::kAuto.
constexpr uint32_t kChunkBlocksMinChunks = 8192;  // 16.8M elements.
// Whether a launch of `chunk_count` chunks holding `portions` portions runs AdamWApplyChunks (a
// block per chunk, adamw_chunk_blocks.cu) rather than AdamWApply (the persistent grid). It can
// only where every chunk has fp32 params and fp32 state and no group has amsgrad. Under kAuto it
// does where, besides, the launch has kChunkBlocksMinChunks chunks or more, and 7 of every 8 of
// their portions hold elements (a block per chunk idles a warp per empty portion). On an H100
// (docs/benchmarks.md, runs F1 to F6) a block per chunk moved 1 x 100M at 3,005 GB/s where the
// persistent grid moved 2,960, and 1 x 100M, GPT-2 small and 1000 x 100K 1.0-2.0% faster (F6), with
// fp32 grads and with bf16 grads and a bf16 copy. At 10M elements (1 x 10M, 10000 x 1K in
// packs) it was 1.0-1.5% faster with fp32 grads and 0.3-0.8% slower with bf16 grads (F2). With
// 10,000 tensors of 1,001 elements (half of each chunk's portions empty), F1's version took
// 15-53% longer than the persistent grid, and F4's (64 registers, 4 blocks per SM) 10% longer
// with bf16 grads and a bf16 copy, 4% less with fp32 grads; the kept build was not timed there.
bool RunsChunkBlocks(const ApplyConfig& config, uint32_t chunk_count, uint64_t portions);

// Device pointers of a step, passed by value to the kernel (tensor_table.h's arenas).
struct DeviceArenas {
  float* params32;
  uint16_t* params16;
  uint16_t* copy;  // Null without a param copy; laid out as params32.
  float* exp_avg32;
  float* exp_avg_sq32;
  float* max_exp_avg_sq;  // Null until a group has amsgrad; laid out as exp_avg32.
  uint16_t* exp_avg16;
  uint16_t* exp_avg_sq16;
  uint8_t* exp_avg8;
  uint8_t* exp_avg_sq8;
  float* absmax_m;  // Block b of an int8 tensor at state offset s: [s / kQuantBlock + b].
  float* absmax_v;
  const void* grads;  // The step's gradients on the device, in the wire dtype.
  int64_t* step;
  const AdamWHyperparameters* hyper;
  uint32_t* remaining;          // Per tensor: portions of this step still to read its step.
  const uint32_t* portions_of;  // Per tensor: its portions.
  const Int8Codebooks* codebooks;
  // Units grabbed past the first of each warp; zero between launches (the warp that makes a
  // launch's last grab resets it).
  uint32_t* work;
};

struct RowTable;  // table_rows_kernel.cuh

// A step's embedding-table rows, updated in the step's one launch, by each warp once its dense
// portions are done (the row phase: table_rows_update.cuh says how). Device memory, unchanged
// until the launch is done. The tables come in three lists, one after another in `tables`:
// `pipelined` ones (fp32 state, RowUnitWidth 4, at most 2^32 - 256 elements in the step's rows:
// a portion's last element index fits 32 bits),
// then `elementwise` ones (the other tables with fp32 or bf16 state), then `int8` ones (int8
// state); in each list in order of first_unit, the first's 0, each
// table's units before the next's. Row r of the launch is key keys[r] (in [0, its table's rows),
// unique within the table) of the table with first_row <= r < first_row + rows; its gradient
// row is grads[grad_offset + (r - first_row) * dim, ... + dim) (already unscaled). The launch
// advances every listed table's step by one, rows or none.
struct RowStep {
  const RowTable* tables = nullptr;
  uint32_t pipelined = 0, elementwise = 0, int8 = 0;
  const int64_t* keys = nullptr;
  const float* grads = nullptr;
  uint64_t portions = 0;       // Of the pipelined tables: each table's ceil(rows * dim / 256).
  uint64_t element_units = 0;  // Of the elementwise tables: each's rows * dim / width.
  uint64_t int8_units = 0;     // Of the int8 tables: each's rows * kInt8RowUnits.

  __host__ __device__ uint32_t table_count() const { return pipelined + elementwise + int8; }
  // Dense portions that would move about as many bytes: what the launch's grid is sized by.
  uint64_t PortionsWorth() const {
    return portions + (element_units + kPortionNumel - 1) / kPortionNumel + int8_units / 32;
  }
};

// Every launch goes through here: one place checks it and counts it by kernel name. The counts
// are thread-safe.
class LaunchCounter {
 public:
  template <typename... KernelArgs, typename... Args>
  absl::Status Launch(const char* name, void (*kernel)(KernelArgs...), int grid, size_t smem,
                      cudaStream_t stream, Args&&... args) {
    kernel<<<grid, kThreads, smem, stream>>>(std::forward<Args>(args)...);
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    MutexLock lock(&mu_);
    ++counts_[name];
    ++total_;
    return absl::OkStatus();
  }
  uint64_t total() const ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    return total_;
  }
  std::map<std::string, uint64_t> counts() const ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    return counts_;
  }

 private:
  mutable Mutex mu_;
  std::map<std::string, uint64_t> counts_ ABSL_GUARDED_BY(mu_);
  uint64_t total_ ABSL_GUARDED_BY(mu_) = 0;
};

// Prepares every instantiation of AdamWApply for the current device (its shared memory limit)
// and returns the grid that fills it: its SMs times the fewest blocks of any instantiation that
// fit on one. Errors: INTERNAL with CUDA's message (also when not one block fits).
absl::StatusOr<int> AdamWApplyGrid();

// The blocks of a launch over `portions` portions: the grid, or fewer when there is not a unit of
// kUnitPortions for every warp.
uint32_t ApplyBlocks(int grid, uint64_t portions);

// Launches one step over the chunks' plan.portions portions (none: chunk_count 0) and the
// tables of `rows` (none: an empty RowStep) on `stream`, checks the launch and counts it in
// `launches` as "fusedps_adamw_apply": AdamWApplyChunks, a block per chunk, where the step has no
// rows and RunsChunkBlocks(config, chunk_count, plan.portions) (`blocks`, `units` and `plan` are
// then unused); else AdamWApply (`units`: WorkUnits with `plan`) in `blocks` blocks
// (ApplyBlocks over the dense portions and rows.PortionsWorth()). Each dense step's lr is its
// group's lr / lr_divisor (float64, MakeStepScalars); each table's scalars are its RowTable's.
// REQUIRES: the stream's device is current; AdamWApplyGrid ran on it; config.kinds is
// kInt8State or kAny when rows.int8 > 0 (the int8 rows read the kernel's codebooks).
absl::Status LaunchAdamWApply(LaunchCounter& launches, uint32_t blocks, cudaStream_t stream,
                              ApplyConfig config, const DeviceArenas& arenas, const Chunk* chunks,
                              uint32_t chunk_count, const UnitStart* units, const UnitPlan& plan,
                              float grad_scale, double lr_divisor, const RowStep& rows = {});

// Launches AdamWApplyChunks (adamw_chunk_blocks.cu): one block per chunk. REQUIRES: every chunk
// has fp32 params and fp32 state, and no group of the hyperparameter table the launch reads has
// amsgrad (the kernel has no amsgrad path: it would step such a group without it).
absl::Status LaunchAdamWApplyChunks(LaunchCounter& launches, cudaStream_t stream, GradDType grad,
                                    ParamCopyDType copy, const DeviceArenas& arenas,
                                    const Chunk* chunks, uint32_t chunk_count, float grad_scale,
                                    double lr_divisor);
// Launches GradAccumulate over `chunk_count` chunks: for each element of each chunk,
// accumulator[element + i] = (first ? 0 : itself) + grads[grad + i] / grad_scale
// (grad_scale <= 0: none), in fp32; counted as "fusedps_grad_accumulate".
// REQUIRES: as LaunchAdamWApply's.
absl::Status LaunchGradAccumulate(LaunchCounter& launches, int grid, cudaStream_t stream,
                                  GradDType grad_dtype, float* accumulator, const void* grads,
                                  const Chunk* chunks, uint32_t chunk_count, float grad_scale,
                                  bool first);

// Launches StateRead over `chunk_count` chunks: `field` (params, exp_avg or exp_avg_sq) of each
// chunk as fp32 into out[grad + i] (the chunks' grad offsets name the destination), bf16
// widened and int8 dequantized; counted as "fusedps_state_read".
absl::Status LaunchStateRead(LaunchCounter& launches, int grid, cudaStream_t stream,
                             TensorField field, const DeviceArenas& arenas, const Chunk* chunks,
                             uint32_t chunk_count, float* out);

}  // namespace gpu
}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_CUDA_ADAMW_KERNEL_CUH_
