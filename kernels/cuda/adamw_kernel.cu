// adamw_kernel.cu: AdamWApply, the persistent kernel of an optimizer step, fused multi-tensor
// AdamW over flat device arenas, one launch per step whatever the tensor count and storage; the
// launchers; and which launches run AdamWApplyChunks (adamw_chunk_blocks.cu) instead.
//
// Storage (per shard, device memory, cuda_backend.cu; tensor_table.h says where each tensor
// lies): params in fp32 or bf16; exp_avg and exp_avg_sq in fp32, bf16 or int8 codes with a
// scale per 256-element block; max_exp_avg_sq beside fp32 state (amsgrad); an optional
// bf16/fp16 copy beside fp32 params; the step's gradients in the wire dtype. Offsets are
// multiples of 8 elements (of 256 for int8 state, and for any tensor of 256 elements or more in
// the params and state arenas but small fp32 ones, which lie end to end in runs that start on
// a multiple of 256), so 16-byte vector accesses are always legal, and a portion's 256 elements
// never straddle a 1 KB boundary of fp32 params or state, except a portion of a small fp32
// tensor stepped on its own (a partial push; a full push steps its run as one pack).
//
// Resident tables (device memory): the chunk list of a full push, which cuts every tensor into
// chunks of at most kChunkNumel elements, each entry carrying its offsets, layout, tensor and
// group, and steps each pack of small fp32 tensors as one tensor (full_push_list.cuh: rebuilt
// when tensors are registered, or their steps or packs change); the units of work in it
// (WorkUnits); per tensor (and per pack) its step and the countdown below; per group its
// hyperparameters; the int8 codebooks. A push that names only some tensors uploads a compact
// chunk list and units of its own in the same stream.
//
// A step is one launch on the backend's stream. Large launches of fp32 storage without amsgrad
// run AdamWApplyChunks, a block per chunk (adamw_chunk_blocks.cu; RunsChunkBlocks in
// adamw_kernel.cuh says which); the others AdamWApply, over a grid that fills the GPU
// (SMs x resident blocks). Work is split among warps, not blocks: every chunk has one 256-
// element portion per 256 elements (a 1000-element tensor has 4, not 8), and the portions are
// cut into units of 2 (adamw_kernel.cuh). Warp w takes unit w, then grabs the next unit nobody
// has taken from a counter (UnitCursor below), so warps never wait for each other, they end
// together, and they all work near one front through memory: on an H100 this took the large
// workloads from 93% to 99-100% of a device copy, where each warp's static share of the
// portions (the previous split) left some warps working after others had ended and spread the
// warps over the whole arenas. The last units of a launch are single portions (UnitPlan), so
// that the warps that end last have less left when the others are done. A launch of the
// int8-state kernel takes units of 3 portions; one of the any-storage kernel with int8 state, one
// unit per warp (adamw_kernel.cuh). Each launch runs the narrowest instantiation that holds its
// chunks' storage (ApplyKinds): fp32 only, fp32 params with fp32 or int8 state, or any.
//
// Each warp runs a pipeline of kStages portions: it issues asynchronous copies (cp.async) of a
// portion's gradients, params and state, with its chunk entry, its tensor's step and its int8
// scales, into a stage of shared memory of its own, kStages - 1 portions ahead of the one it
// computes. Bytes in flight therefore no longer depend on registers: a warp keeps two portions
// in flight while it computes a third. Lane l's elements are [4l, 4l + 4) and [128 + 4l,
// 128 + 4l + 4) of the portion, so each warp-wide copy, load and store covers one contiguous
// span (the first version gave each lane 8 adjacent elements, two 16-byte halves at a 32-byte
// stride, and every sector crossed L2 twice: 70% of copy). Lanes copy and read back their own
// pieces, so only the stage header needs the warp to synchronize. In the int8-state kernel, lane
// 0 instead copies each array's span of the portion with one bulk copy (cp.async.bulk), and the
// warp waits on the stage's transaction barrier (mbarrier) as well: that kernel is bound by
// instructions, and the bulk copies took 2.4-2.5% off its step (kBulkCopies). The per-portion
// device code is in adamw_pipeline.cuh (moving portions) and adamw_portion.cuh (computing them).
//
// Computing a portion: a warp reads a tensor's step once, when it reaches the tensor, computes
// the step's scalars (bias corrections in float64, as torch does) only when the (group, step)
// pair changes, and updates 8 elements per lane with kernels/adamw_math.h and quant_math.h,
// storing with 16-byte stores and writing the param copy in the same pass. int8 state: the
// portion is one block; its new scale is a warp's max-reduction. lr, betas and the step are
// read on the device, so a schedule change relaunches nothing and a step could be captured in a
// CUDA graph. This file is compiled with --fmad=false, as the CPU backend with
// -ffp-contract=off: both round every operation of the same source alike, bit for bit.
//
// Step counters advance inside the same launch without a race. A warp that computes every
// portion of a tensor writes its new step. Otherwise each warp counts its portions down from
// remaining[t] once it has read the step, and the warp that takes the count to zero (the last
// reader) advances step[t] and re-arms the count; lanes 0-3 take a warp's countdowns in turn,
// and each looks at the count's old value only when its next turn comes (or the warp ends), so
// the atomic's round trip is off the warp's path.
//
// Embedding-table rows pushed with the dense tensors are updated in the same launch: each warp,
// once it has no dense portion left, runs the row phase (UpdateStepRows below, its pieces in
// table_rows_update.cuh), through the same pipeline. Such a launch always runs AdamWApply.
//
// Non-finite gradients are caught on the host where they are staged (kernels/grad_check.h):
// a skipped step launches nothing and writes nothing.
//
// Tuning history (docs/benchmarks.md): the first kernel, one block per chunk with a barrier per
// chunk, reached ~55% of copy bandwidth; contiguous chunk ranges per block with scalars cached ~90%
// on large tensors; independent warps lifted 10,000 x 1K from ~53% to ~75%; dtype template
// parameters lifted the bf16 path by 2-5 points; issue 16 (the variants table): portions without
// empty ones, the deferred countdown and the cp.async pipeline kept the large workloads where they
// were (92-93% on an H100) and gained about a point on 10,000 x 1K; units grabbed from a counter
// lifted them to 98-100% and 10,000 x 1K from 84% to 88%; a tail of single-portion units gained
// 0.6-1.6 points on 10,000 x 1K, and a kernel of its own for int8 state (85 KB of machine code
// where the any-storage kernel has 194 KB) 1.5% on int8 launches; int8 state's update with one
// division per element (quant_math.h's kInt8StateOrder) and units of 3 took GPT-2 small's int8 step
// 4% faster (1.54x to 1.61x fp32's); no load on a warp's path when a tensor's last portion is
// counted (Settle) and packs of small tensors (full_push_list.cuh) took 10,000 x 1K from 89.5% to
// 93.3% of copy, 88.0% to 92.4% with bf16 grads and a bf16 copy (runs E1 to E7); a block per chunk
// for large fp32 launches took 1 x 100M, GPT-2 small and 1000 x 100K 1.0-2.0% faster, past
// torch.compile's step (runs F1 to F6).
#include <algorithm>

#include "kernels/cuda/adamw_kernel.cuh"
#include "kernels/cuda/adamw_portion.cuh"
#include "kernels/cuda/table_rows_update.cuh"

namespace fusedps {
namespace gpu {

namespace {

size_t ApplySmemBytes(ApplyKinds kinds) {
  return (kinds != ApplyKinds::kFloat32Only ? sizeof(Int8Codebooks) : 0) +
         static_cast<size_t>(kWarpsPerBlock) * kStages * kStageBytes;
}

__device__ __forceinline__ uint32_t LaneId() {
  uint32_t lane;
  asm("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}

// Brings the line at p into L1, not into registers: a later load of it is short.
__device__ __forceinline__ void PrefetchL1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

// A warp's issue side: the portion it copies next. It takes unit `warp` first, then each unit
// that lane 0 grabs from the launch's counter (a.work), in increasing order. The next unit is
// grabbed as soon as one starts, and each issue takes one step towards having it ready (its
// table entry, then its first chunk's entry, into registers), so no round trip to memory is on
// the warp's path at a unit's start. A chunk that starts inside a unit has its entry brought
// into L1 (not registers: the kernel has none to spare) when the chunk before it starts.
//
// Every warp grabs until a grab comes back past the last unit, so a launch of U units and W
// warps (U > W) makes exactly U grabs, numbered 0 to U - 1; the warp whose grab is U - 1 makes
// the launch's last access to the counter, and resets it for the next launch.
class UnitCursor {
 public:
  __device__ UnitCursor(const DeviceArenas& a, const Chunk* chunks, uint32_t chunk_count,
                        const UnitStart* units, const UnitPlan& plan, uint32_t warps, uint32_t warp)
      : counter_(a.work),
        chunks_(chunks),
        chunk_count_(chunk_count),
        units_(units),
        unit_count_(plan.units()),
        head_units_(plan.head_units()),
        unit_portions_(plan.unit_portions),
        warps_(warps) {
    last_head_portions_ = head_units_ == 0 ? 0 : plan.length(head_units_ - 1);
    if (warp >= unit_count_) return;
    Start(warp);
    if (warps_ < unit_count_) Grab();
  }

  __device__ bool HasWork() const { return left_ > 0; }
  __device__ const Chunk* chunk() const { return chunks_ + chunk_; }
  __device__ const IssueFields& fields() const { return current_; }
  __device__ uint32_t portion() const { return portion_; }

  // Moves past the portion just issued.
  __device__ void Advance() {
    if (--left_ == 0) {
      NextUnit();
      return;
    }
    if (++portion_ == PortionsOf(current_.count)) {
      ++chunk_;
      portion_ = 0;
      current_ = LoadIssue(chunks_ + chunk_);
      if (chunk_ + 1 < chunk_count_) PrefetchL1(chunks_ + chunk_ + 1);
    }
    if (coming_ < kReady) StepComing();
  }

 private:
  enum : int { kGrabbing = 0, kKnown = 1, kReady = 2, kNone = 3 };

  __device__ void Start(uint32_t unit) {
    Start(unit, units_[unit]);
    current_ = LoadIssue(chunks_ + chunk_);
  }
  __device__ void Start(uint32_t unit, UnitStart start) {
    chunk_ = start >> kUnitChunkShift;
    portion_ = start & (kPortions - 1);
    // UnitPlan::length, without its division.
    left_ = unit >= head_units_       ? 1
            : unit + 1 == head_units_ ? last_head_portions_
                                      : unit_portions_;
    if (chunk_ + 1 < chunk_count_) PrefetchL1(chunks_ + chunk_ + 1);
  }
  // Moves to the unit grabbed (waiting for what is not back yet), if there is one.
  __device__ void NextUnit() {
    while (coming_ < kReady) StepComing();
    if (coming_ == kNone) return;
    Start(coming_unit_, coming_start_);
    current_ = coming_fields_;
    Grab();
  }
  __device__ void Grab() {
    if (LaneId() == 0) coming_unit_ = atomicAdd(counter_, 1u);
    coming_ = kGrabbing;
  }
  // One step towards the next unit: its table entry once the grab is back, then its chunk's.
  __device__ void StepComing() {
    if (coming_ == kGrabbing) {
      const uint32_t grab = __shfl_sync(0xffffffffu, coming_unit_, 0);
      if (grab + 1 == unit_count_ && LaneId() == 0) *counter_ = 0;  // The launch's last grab.
      coming_unit_ = warps_ + grab;
      if (coming_unit_ >= unit_count_) {
        coming_ = kNone;
        return;
      }
      coming_start_ = units_[coming_unit_];
      coming_ = kKnown;
    } else if (coming_ == kKnown) {
      coming_fields_ = LoadIssue(chunks_ + (coming_start_ >> kUnitChunkShift));
      coming_ = kReady;
    }
  }

  uint32_t* counter_;
  const Chunk* chunks_;
  uint32_t chunk_count_;
  const UnitStart* units_;
  uint32_t unit_count_, head_units_, unit_portions_, last_head_portions_ = 0, warps_;
  uint32_t chunk_ = 0, portion_ = 0, left_ = 0;  // left_: portions of the unit not issued.
  IssueFields current_{};
  int coming_ = kNone;
  uint32_t coming_unit_ = 0;  // Lane 0's grab, then (every lane) the unit.
  UnitStart coming_start_ = 0;
  IssueFields coming_fields_{};
};

// The row phase of one warp (warp `warp` of `warps`), after its dense portions: its pipelined
// portions through `pipeline` (its kStages stages, idle by now), then its elementwise units,
// then its int8 rows (UpdateInt8Rows). `books`: the kernel's codebooks in shared memory, or null
// when the step has no int8 table. Compiled once, called by every instantiation of AdamWApply.
__device__ __noinline__ void UpdateStepRows(const RowStep& step, char* pipeline,
                                            const Int8Codebooks* books, uint32_t warp,
                                            uint32_t warps, uint32_t lane) {
  const RowTable* pipelined = step.tables;
  // Portions w, w + W, ...: `next` is the next to issue, `at` the next to compute; each stage
  // computed is the one issued kStages - 1 issues before.
  // Each issue starts loading the keys of the next portion to issue, and brings into L2 those
  // of the one after it.
  uint64_t next = warp, at = warp;
  const auto pipelined_table = [&](uint64_t portion) -> const RowTable& {
    return pipelined[row_phase::TableOf(pipelined, step.pipelined, portion)];
  };
  row_phase::PortionRows rows;  // Of portion `next`.
  if (next < step.portions)
    rows = row_phase::LoadPortionRows(pipelined_table(next), step, next, lane);
  const auto issue = [&](int stage) {
    if (next < step.portions) {
      row_phase::IssueRowPortion(pipelined_table(next), step, rows, pipeline + stage * kStageBytes,
                                 lane);
      next += warps;
      if (next < step.portions)
        rows = row_phase::LoadPortionRows(pipelined_table(next), step, next, lane);
      if (next + warps < step.portions) {
        row_phase::PrefetchPortionKeys(pipelined_table(next + warps), step, next + warps, lane);
      }
    }
    CommitAsync();  // Empty groups too: each iteration waits for the group kStages - 1 back.
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue(s);
  int compute_stage = 0;
  while (at < step.portions) {
    issue(compute_stage == 0 ? kStages - 1 : compute_stage - 1);
    WaitAsync<kStages - 1>();
    __syncwarp();
    row_phase::ComputeRowPortion(pipelined_table(at), step, at,
                                 pipeline + compute_stage * kStageBytes, lane);
    at += warps;
    __syncwarp();  // Before the stage is written again.
    compute_stage = compute_stage + 1 == kStages ? 0 : compute_stage + 1;
  }
  WaitAsync<0>();

  const RowTable* elementwise = step.tables + step.pipelined;
  for (uint64_t u = uint64_t{warp} * 32 + lane; u < step.element_units; u += uint64_t{warps} * 32) {
    row_phase::UpdateElements(elementwise[row_phase::TableOf(elementwise, step.elementwise, u)],
                              step.keys, step.grads, u);
  }
  if (step.int8 > 0) {
    row_phase::UpdateInt8Rows(step, *books, uint64_t{warp} * 32 + lane, uint64_t{warps} * 32, lane);
  }
}

// The one launch of a step. See the file comment. The dtypes and kinds are template
// parameters, so that each combination gets a loop with no branches it does not need.
template <GradDType kGrad, ParamCopyDType kCopy, ApplyKinds kKinds>
__global__ void __launch_bounds__(kThreads, 2)
    AdamWApply(DeviceArenas a, const Chunk* chunks, uint32_t chunk_count, const UnitStart* units,
               UnitPlan plan, float grad_scale, double lr_divisor, RowStep rows) {
  extern __shared__ __align__(16) char smem[];
  if (blockIdx.x == 0) {  // Each table steps once, rows or none (its scalars came computed).
    for (uint32_t t = threadIdx.x; t < rows.table_count(); t += kThreads) {
      *rows.tables[t].step += 1;
    }
  }
  const Int8Codebooks* books = nullptr;
  char* stages = smem;
  if constexpr (kKinds != ApplyKinds::kFloat32Only) {
    const uint4* src = reinterpret_cast<const uint4*>(a.codebooks);
    uint4* dst = reinterpret_cast<uint4*>(smem);
    for (uint32_t i = threadIdx.x; i < sizeof(Int8Codebooks) / 16; i += kThreads) dst[i] = src[i];
    __syncthreads();
    books = reinterpret_cast<const Int8Codebooks*>(smem);
    stages = smem + sizeof(Int8Codebooks);
  }
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t warps = gridDim.x * kWarpsPerBlock;
  const uint32_t warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  char* pipeline = stages + (threadIdx.x / 32) * kStages * kStageBytes;

  uint32_t phases = 0;  // Bulk copies: bit s is the parity of stage s's next barrier phase.
  if constexpr (kBulkCopies<kKinds>) {
    if (lane == 0) {
#pragma unroll
      for (int s = 0; s < kStages; ++s) BarrierInit(pipeline + s * kStageBytes + kBarrierAt);
      BarrierInitFence();
    }
    __syncwarp();
  }
  UnitCursor cursor(a, chunks, chunk_count, units, plan, warps, warp);
  uint64_t issued = 0, computed = 0;
  const auto issue = [&](int stage) {
    if (cursor.HasWork()) {
      IssuePortion<kGrad, kKinds>(a, cursor.chunk(), cursor.fields(), cursor.portion(),
                                  pipeline + stage * kStageBytes, lane);
      ++issued;
      cursor.Advance();
    }
    CommitAsync();  // Empty groups too: each iteration waits for the group kStages - 1 back.
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue(s);

  WarpState w;
  int compute_stage = 0;
  while (computed < issued) {
    issue(compute_stage == 0 ? kStages - 1 : compute_stage - 1);
    WaitAsync<kStages - 1>();
    if constexpr (kBulkCopies<kKinds>) {
      BarrierWait(pipeline + compute_stage * kStageBytes + kBarrierAt,
                  (phases >> compute_stage) & 1);
      phases ^= 1u << compute_stage;
    }
    __syncwarp();
    ComputeStage<kGrad, kCopy, kKinds>(a, pipeline + compute_stage * kStageBytes, w, books, lane,
                                       grad_scale, lr_divisor);
    ++computed;
    __syncwarp();  // Before the stage's header is rewritten.
    compute_stage = compute_stage + 1 == kStages ? 0 : compute_stage + 1;
  }
  Leave(a, w, lane);
  Settle(a, w);  // Every lane's countdown left.
  if (rows.table_count() > 0) UpdateStepRows(rows, pipeline, books, warp, warps, lane);
}

using ApplyKernelFn = void (*)(DeviceArenas, const Chunk*, uint32_t, const UnitStart*, UnitPlan,
                               float, double, RowStep);

template <GradDType kGrad, ApplyKinds kKinds>
ApplyKernelFn ApplyKernelFor(ParamCopyDType copy) {
  switch (copy) {
    case ParamCopyDType::kBFloat16:
      return AdamWApply<kGrad, ParamCopyDType::kBFloat16, kKinds>;
    case ParamCopyDType::kFloat16:
      return AdamWApply<kGrad, ParamCopyDType::kFloat16, kKinds>;
    case ParamCopyDType::kNone:
    default:
      return AdamWApply<kGrad, ParamCopyDType::kNone, kKinds>;
  }
}

template <ApplyKinds kKinds>
ApplyKernelFn ApplyKernelOf(GradDType grad, ParamCopyDType copy) {
  switch (grad) {
    case GradDType::kBFloat16:
      return ApplyKernelFor<GradDType::kBFloat16, kKinds>(copy);
    case GradDType::kFloat16:
      return ApplyKernelFor<GradDType::kFloat16, kKinds>(copy);
    case GradDType::kFloat32:
    default:
      return ApplyKernelFor<GradDType::kFloat32, kKinds>(copy);
  }
}

// The instantiation of AdamWApply for a configuration.
ApplyKernelFn ApplyKernel(ApplyConfig config) {
  switch (config.kinds) {
    case ApplyKinds::kAny:
      return ApplyKernelOf<ApplyKinds::kAny>(config.grad, config.copy);
    case ApplyKinds::kInt8State:
      return ApplyKernelOf<ApplyKinds::kInt8State>(config.grad, config.copy);
    case ApplyKinds::kFloat32Only:
    default:
      return ApplyKernelOf<ApplyKinds::kFloat32Only>(config.grad, config.copy);
  }
}

}  // namespace

uint32_t AppendChunks(const ChunkSource& t, std::vector<Chunk>& out) {
  const uint16_t bits = LayoutBits(t.layout);
  uint32_t portions = 0;
  uint64_t begin = 0;
  do {
    const uint32_t count = static_cast<uint32_t>(std::min<uint64_t>(kChunkNumel, t.numel - begin));
    Chunk c{};
    c.grad = t.grad + begin;
    c.param = t.param + begin;
    c.state = t.state + begin;
    c.count = static_cast<uint16_t>(count);
    c.layout = static_cast<uint16_t>(bits | (begin + count >= t.numel ? kLayoutLastChunk : 0));
    c.tensor = t.tensor;
    c.element = t.element + begin;
    c.first = begin;
    c.rounding_key = t.rounding_key;
    c.group = t.group;
    out.push_back(c);
    portions += PortionsOf(count);
    begin += kChunkNumel;
  } while (begin < t.numel);
  return portions;
}

uint64_t PortionsIn(const std::vector<Chunk>& chunks) {
  uint64_t portions = 0;
  for (const Chunk& c : chunks) portions += PortionsOf(c.count);
  return portions;
}

UnitPlan PlanUnits(uint64_t portions, uint32_t warps, const LaunchStorage& storage) {
  UnitPlan plan;
  plan.portions = static_cast<uint32_t>(portions);
  if (storage.int8_state && storage.kinds == ApplyKinds::kAny) {
    plan.unit_portions =
        static_cast<uint32_t>(std::max<uint64_t>(1, (portions + warps - 1) / warps));
    return plan;
  }
  plan.unit_portions = storage.kinds == ApplyKinds::kInt8State ? kInt8UnitPortions : kUnitPortions;
  plan.tail = static_cast<uint32_t>(
      std::min<uint64_t>(portions, static_cast<uint64_t>(kTailUnitsPerWarp) * warps));
  return plan;
}

uint64_t MostUnits(uint64_t portions, int grid) {
  // The int8 plans have no more units: longer units with the same tail, or one per warp.
  return PlanUnits(portions, ApplyBlocks(grid, portions) * kWarpsPerBlock, LaunchStorage{}).units();
}

std::vector<UnitStart> WorkUnits(const std::vector<Chunk>& chunks, const UnitPlan& plan) {
  std::vector<UnitStart> units;
  units.reserve(plan.units());
  uint32_t u = 0;
  uint64_t chunk_first = 0;  // The first portion of chunk c, counted over the whole list.
  for (uint32_t c = 0; c < chunks.size() && u < plan.units(); ++c) {
    const uint64_t chunk_end = chunk_first + PortionsOf(chunks[c].count);
    for (; u < plan.units() && plan.first(u) < chunk_end; ++u) {
      units.push_back(c << kUnitChunkShift | static_cast<uint32_t>(plan.first(u) - chunk_first));
    }
    chunk_first = chunk_end;
  }
  return units;
}

absl::StatusOr<int> AdamWApplyGrid() {
  int device = 0;
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  int sms = 0;
  FUSEDPS_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // The grid fills the GPU: the most blocks of the heaviest instantiation that fit per SM.
  int apply_blocks = 1 << 30;
  for (ApplyKinds kinds : {ApplyKinds::kFloat32Only, ApplyKinds::kInt8State, ApplyKinds::kAny}) {
    for (GradDType grad : {GradDType::kFloat32, GradDType::kBFloat16, GradDType::kFloat16}) {
      for (ParamCopyDType copy :
           {ParamCopyDType::kNone, ParamCopyDType::kBFloat16, ParamCopyDType::kFloat16}) {
        const ApplyKernelFn kernel = ApplyKernel({grad, copy, kinds});
        const size_t smem = ApplySmemBytes(kinds);
        FUSEDPS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
            kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
        int blocks = 0;
        FUSEDPS_CUDA_RETURN_IF_ERROR(
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, smem));
        apply_blocks = std::min(apply_blocks, blocks);
      }
    }
  }
  if (apply_blocks < 1) {
    return absl::InternalError("no block of AdamWApply fits on a multiprocessor of this device");
  }
  return sms * apply_blocks;
}

uint32_t ApplyBlocks(int grid, uint64_t portions) {
  const uint64_t units = (portions + kUnitPortions - 1) / kUnitPortions;
  const uint64_t wanted = (units + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return static_cast<uint32_t>(std::max<uint64_t>(1, std::min<uint64_t>(grid, wanted)));
}

bool RunsChunkBlocks(const ApplyConfig& config, uint32_t chunk_count, uint64_t portions) {
  if (config.kinds != ApplyKinds::kFloat32Only || config.amsgrad) return false;
  switch (config.kernel) {
    case StepKernel::kPersistent:
      return false;
    case StepKernel::kChunkBlocks:
      return true;
    case StepKernel::kAuto:
    default:
      return chunk_count >= kChunkBlocksMinChunks &&
             8 * portions >= 7 * static_cast<uint64_t>(kPortions) * chunk_count;
  }
}

absl::Status LaunchAdamWApply(LaunchCounter& launches, uint32_t blocks, cudaStream_t stream,
                              ApplyConfig config, const DeviceArenas& arenas, const Chunk* chunks,
                              uint32_t chunk_count, const UnitStart* units, const UnitPlan& plan,
                              float grad_scale, double lr_divisor, const RowStep& rows) {
  if (rows.table_count() == 0 && RunsChunkBlocks(config, chunk_count, plan.portions)) {
    return LaunchAdamWApplyChunks(launches, stream, config.grad, config.copy, arenas, chunks,
                                  chunk_count, grad_scale, lr_divisor);
  }
  if (rows.int8 > 0 && config.kinds == ApplyKinds::kFloat32Only) {
    return absl::InternalError("a launch with int8 table rows needs a kernel with codebooks");
  }
  return launches.Launch("fusedps_adamw_apply", ApplyKernel(config), static_cast<int>(blocks),
                         ApplySmemBytes(config.kinds), stream, arenas, chunks, chunk_count, units,
                         plan, grad_scale, lr_divisor, rows);
}

}  // namespace gpu
}  // namespace fusedps
