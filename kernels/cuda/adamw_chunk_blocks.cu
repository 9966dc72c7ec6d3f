// adamw_chunk_blocks.cu: AdamWApplyChunks, the step kernel of large launches whose tensors all
// have fp32 params and fp32 state and no group has amsgrad: one block per chunk of the launch's
// chunk list. RunsChunkBlocks (adamw_kernel.cuh) says which launches run it; the others run
// AdamWApply, the persistent grid (adamw_kernel.cu).
//
// Block b computes chunk b. Its warp w computes the chunk's portion w (256 elements: lane l's
// elements [4l, 4l + 4) and [128 + 4l, 128 + 4l + 4), as in AdamWApply, adamw_portion.cuh), with
// vector loads straight into registers (16 bytes; 8 for 16-bit grads), and the same per-portion
// update and stores
// (UpdateAndStore), so both kernels give the same bits. There is no pipeline and no unit
// counter: the hardware's block scheduler is the queue. A block whose chunk has fewer portions
// has idle warps, which is why small or ragged launches stay on the persistent grid.
//
// Why a second kernel: on an H100, 1 x 100M fp32 moved 2,960 GB/s in AdamWApply (warps that
// grab units from a counter and stage them through shared memory) and 3,005 GB/s here, where
// torch.compile's step (a block per 1,024 elements) took 0.9336 ms against our 0.9319-0.9326
// (docs/benchmarks.md, run F6). Large launches are bound by the DRAM's steady rate, and many
// short-lived blocks with their loads in registers reached a higher one than the persistent grid.
//
// Steps: thread 0 reads the chunk's tensor's step (as read before this launch advanced it) and
// computes the step's scalars (MakeStepScalars, float64) into shared memory while warps 1 to 7
// have their loads in flight; a barrier publishes them. After its warp's stores (no thread of
// the block reads the step after the barrier), thread 0 writes the step + 1
// if the chunk is its tensor's only one, else counts the chunk's portions down from
// remaining[t]; the block that takes the count to zero writes the step + 1 and re-arms the
// count from portions_of[t], as AdamWApply's last reader does. So both kernels leave the same
// tables behind, and either may run the next step. A pack of small tensors (full_push_list.cuh)
// is one tensor here as there.
#include "kernels/cuda/adamw_kernel.cuh"
#include "kernels/cuda/adamw_portion.cuh"

namespace fusedps {
namespace gpu {

namespace {

// What the block needs of its chunk's entry: the first 32 bytes and the group (every lane of a
// block reads the same bytes: L1 serves all but the first warp).
__device__ __forceinline__ Chunk LoadChunk(const Chunk* chunk) {
  const IssueFields f = LoadIssue(chunk);
  Chunk c{};
  c.grad = f.grad;
  c.param = f.param;
  c.state = f.state;
  c.count = static_cast<uint16_t>(f.count);
  c.layout = static_cast<uint16_t>(f.layout);
  c.tensor = f.tensor;
  c.first = chunk->first;
  c.group = chunk->group;
  return c;
}

// Each run of this lane's that holds a valid element, whole, with one vector load, as
// AdamWApply's StageRuns copies it: runs are aligned to their size, and every device buffer is
// a whole number of 16-byte units, so the load stays inside the buffer. Its elements past the
// tensor (padding, or the next tensor's grads) are computed on, never stored.
template <typename T>
__device__ __forceinline__ void LoadValidRuns(const T* chunk_base, const LaneElements& e,
                                              T (&out)[kVec]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (e.valid[r] > 0) Load4(chunk_base + e.at[r], out + 4 * r);
  }
}

// This lane's elements of the portion, from global memory into fp32 registers (a partial
// portion's others are never stored).
template <GradDType kGrad>
__device__ __forceinline__ void LoadPortion(const DeviceArenas& a, const Chunk& c,
                                            const LaneElements& e, PortionValues& x) {
  if constexpr (kGrad == GradDType::kFloat32) {
    LoadValidRuns(static_cast<const float*>(a.grads) + c.grad, e, x.g);
  } else {
    uint16_t h[kVec] = {};
    LoadValidRuns(static_cast<const uint16_t*>(a.grads) + c.grad, e, h);
#pragma unroll
    for (int k = 0; k < kVec; ++k) x.g[k] = Widen(kGrad, h[k]);
  }
  LoadValidRuns(a.params32 + c.param, e, x.p);
  LoadValidRuns(a.exp_avg32 + c.state, e, x.m);
  LoadValidRuns(a.exp_avg_sq32 + c.state, e, x.v);
}

// Bounded to 3 blocks per SM, the fp32-grads kernel takes 69 registers and runs 3 blocks of 8
// warps per SM. Bounded to 4 (60 registers), 1 x 100M ran 0.2-0.3% slower (runs F2 and F3);
// a variant with 64 registers and 4 blocks 0.4% slower (F4), and the same variant held to 3
// blocks by reserving shared memory 2-5% slower (F5).
template <GradDType kGrad, ParamCopyDType kCopy>
__global__ void __launch_bounds__(kThreads, 3)
    AdamWApplyChunks(DeviceArenas a, const Chunk* chunks, float grad_scale, double lr_divisor) {
  __shared__ AdamWStepScalars scalars;
  __shared__ int64_t step_read;
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t portion = threadIdx.x / 32;
  const Chunk c = LoadChunk(chunks + blockIdx.x);
  if (threadIdx.x == 0) {
    step_read = a.step[c.tensor];
    scalars = MakeStepScalars(a.hyper[c.group], step_read + 1, grad_scale, lr_divisor);
  }
  const uint32_t portions = PortionsOf(c.count);
  const bool active = portion < portions;
  const LaneElements e = ElementsOf(c.count, portion, lane);
  PortionValues x;
  if (active) LoadPortion<kGrad>(a, c, e, x);
  __syncthreads();  // The scalars are in.
  if (active) {
    WarpState w;
    w.s = scalars;
    // The launcher's condition: no group has amsgrad. Known here, the kernel has no amsgrad
    // path: with it (F1), the kernel took 76 registers at 3 blocks per SM and spilled at 4.
    w.s.amsgrad = false;
    UpdateAndStore<kGrad, kCopy, ParamsDType::kFloat32, StateDType::kFloat32>(a, c, portion, e, w,
                                                                              nullptr, lane, x);
  }
  if (threadIdx.x != 0) return;
  const int64_t step = step_read;
  if (c.first == 0 && (c.layout & kLayoutLastChunk)) {  // The tensor's only chunk.
    a.step[c.tensor] = step + 1;
    return;
  }
  if (atomicSub(&a.remaining[c.tensor], portions) == portions) {  // Its last chunk to end.
    a.step[c.tensor] = step + 1;
    a.remaining[c.tensor] = a.portions_of[c.tensor];
  }
}

using ChunksKernelFn = void (*)(DeviceArenas, const Chunk*, float, double);

template <GradDType kGrad>
ChunksKernelFn ChunksKernelFor(ParamCopyDType copy) {
  switch (copy) {
    case ParamCopyDType::kBFloat16:
      return AdamWApplyChunks<kGrad, ParamCopyDType::kBFloat16>;
    case ParamCopyDType::kFloat16:
      return AdamWApplyChunks<kGrad, ParamCopyDType::kFloat16>;
    case ParamCopyDType::kNone:
    default:
      return AdamWApplyChunks<kGrad, ParamCopyDType::kNone>;
  }
}

ChunksKernelFn ChunksKernel(GradDType grad, ParamCopyDType copy) {
  switch (grad) {
    case GradDType::kBFloat16:
      return ChunksKernelFor<GradDType::kBFloat16>(copy);
    case GradDType::kFloat16:
      return ChunksKernelFor<GradDType::kFloat16>(copy);
    case GradDType::kFloat32:
    default:
      return ChunksKernelFor<GradDType::kFloat32>(copy);
  }
}

}  // namespace

absl::Status LaunchAdamWApplyChunks(LaunchCounter& launches, cudaStream_t stream, GradDType grad,
                                    ParamCopyDType copy, const DeviceArenas& arenas,
                                    const Chunk* chunks, uint32_t chunk_count, float grad_scale,
                                    double lr_divisor) {
  if (chunk_count == 0) return absl::OkStatus();
  return launches.Launch("fusedps_adamw_apply", ChunksKernel(grad, copy),
                         static_cast<int>(chunk_count), 0, stream, arenas, chunks, grad_scale,
                         lr_divisor);
}

}  // namespace gpu
}  // namespace fusedps
