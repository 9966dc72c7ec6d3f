// full_push_list.cuh (CUDA backend only): the resident chunk list of a full push (every tensor,
// its grads at their canonical offsets), its units of work and its packs, rebuilt on the
// apply stream only when what it depends on changed.
//
// Packs. A run of small fp32 tensors with one step (TensorTable::Packs) lies end to end in
// every arena, so the kernel can step it as one tensor: its chunks are cut over the whole run,
// every portion full but the run's last, where each tensor on its own ends in a partial portion
// (on an H100, 10,000 tensors of 1,000 elements stepped 3.4 us slower than one tensor of the
// same elements, and as one pack as fast: docs/benchmarks.md, issue 16, runs E1 and E7). A pack
// has no limit on its tensors: a warp whose next unit is in the same pack counts nothing down in
// between (packs of at most 256 tensors were 0.9-1.3% slower, E6). Pack p is the kernel's tensor
// table.size() + p, with rows of its own in the step, remaining and portions_of tables
// (uploaded here: its members' step, its portions). The kernel knows nothing of packs, so it
// advances only the pack's step: its members' rows fall behind, and the host (whose table
// counts every step) uploads the steps of every tensor before a launch reads one of them: a
// partial push of a packed tensor, or a full push after a Refresh that took a tensor out of its
// pack (SyncMemberSteps). Partial pushes keep one tensor per chunk list entry.
//
// Staleness. The list is rebuilt (Refresh) on the first full push (a step, or a sync round's
// Accumulate) after a registration, a truncation, a restored step (SetStep), or a partial push
// of a tensor that is or could be in a pack (its step then differs from the pack's, or may now
// equal a neighbour's). A workload that mixes full pushes with partial pushes of small tensors
// therefore rebuilds the list (host work and an upload, in proportion to the shard's chunks)
// once per full push that follows a partial one; not measured. Refresh
// uploads from pageable memory, which cudaMemcpyAsync has read before it returns, on the apply
// stream: launches queued before it read the old list, launches queued after it the new one.
//
// Capacity. The device buffers are grown at registration (ToHold) for the list without packs,
// which has at least as many chunks and portions as any packed one, and the tensor rows for as
// many pack rows as there can be packs (half the tensors), so that Refresh never grows a
// buffer.
//
// One thread at a time (the engine's), like the rest of the backend's host tables.
#ifndef FUSEDPS_KERNELS_CUDA_FULL_PUSH_LIST_CUH_
#define FUSEDPS_KERNELS_CUDA_FULL_PUSH_LIST_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cuda/adamw_kernel.cuh"
#include "kernels/cuda/device_memory.cuh"
#include "kernels/tensor_table.h"

namespace fusedps {
namespace gpu {

// Tensor t of `table` as AppendChunks takes it, its gradients at `grad`.
ChunkSource SourceOf(const TensorTable& table, uint32_t t, uint64_t grad);

// The per-tensor device tables a pack has rows in (DeviceArenas' step, remaining, portions_of).
struct TensorRows {
  DeviceArray<int64_t>* step;
  DeviceArray<uint32_t>* remaining;
  DeviceArray<uint32_t>* portions_of;
};

class FullPushList {
 public:
  // The growths that let a table of `tensors` tensors, whose lists without packs have
  // `chunks` chunks and `portions` portions, be refreshed on a grid of `grid` blocks; `rows`
  // grow to hold the pack rows after the tensors' own.
  std::vector<BufferGrowth> ToHold(uint64_t tensors, uint64_t chunks, uint64_t portions, int grid,
                                   const TensorRows& rows);

  // The tensors, their steps or their packs may have changed: the next Refresh rebuilds.
  void MarkStale() { stale_ = true; }
  // Whether a partial push of tensor t makes the list stale: t is in a pack, or could join one.
  bool Affects(const TensorTable& table, uint32_t t) const {
    return Packable(table.layout(t), table.numel(t));
  }
  // Whether tensor t is in a pack of the list as last refreshed.
  bool Packed(uint32_t t) const { return t < packed_.size() && packed_[t]; }

  // A launch of the list was queued: if it has packs, their members' step rows are behind.
  void Launched() { member_steps_behind_ = member_steps_behind_ || has_packs_; }
  // Uploads the table's steps of every tensor on `stream` if a launch left members' rows
  // behind: before a partial launch that reads a packed tensor's step. Errors: INTERNAL with
  // CUDA's message.
  absl::Status SyncMemberSteps(const TensorTable& table, DeviceArray<int64_t>& step,
                               cudaStream_t stream);

  // Rebuilds the list from `table` if stale, queued on `stream`. Errors: INTERNAL with CUDA's
  // message, or when a buffer is smaller than ToHold promised.
  absl::Status Refresh(const TensorTable& table, int grid, const TensorRows& rows,
                       cudaStream_t stream);

  // The list as last refreshed. REQUIRES: Refresh succeeded since the last MarkStale.
  uint32_t count() const { return count_; }
  uint64_t portions() const { return portions_; }
  const UnitPlan& plan() const { return plan_; }
  const LaunchStorage& storage() const { return storage_; }
  const Chunk* chunks() const { return chunks_.data(); }
  const UnitStart* units() const { return units_.data(); }

  uint64_t bytes() const { return chunks_.bytes() + units_.bytes(); }
  std::vector<DeviceBuffer*> Buffers() { return {&chunks_, &units_}; }

 private:
  bool stale_ = true;
  bool member_steps_behind_ = false;
  bool has_packs_ = false;
  std::vector<bool> packed_;  // Per tensor, as last refreshed.
  uint32_t count_ = 0;        // Chunks.
  uint64_t portions_ = 0;
  UnitPlan plan_;
  LaunchStorage storage_;
  DeviceArray<Chunk> chunks_;
  DeviceArray<UnitStart> units_;
};

}  // namespace gpu
}  // namespace fusedps

#endif  // FUSEDPS_KERNELS_CUDA_FULL_PUSH_LIST_CUH_
