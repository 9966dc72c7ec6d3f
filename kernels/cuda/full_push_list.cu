// full_push_list.cu: see full_push_list.cuh.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/full_push_list.cuh"

namespace fusedps {
namespace gpu {
namespace {

// Uploads `values` to `dst` on `stream`, from pageable memory (read before the call returns).
template <typename T>
absl::Status Upload(T* dst, const std::vector<T>& values, cudaStream_t stream) {
  if (values.empty()) return absl::OkStatus();
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, values.data(), values.size() * sizeof(T),
                                               cudaMemcpyHostToDevice, stream));
  return absl::OkStatus();
}

}  // namespace

ChunkSource SourceOf(const TensorTable& table, uint32_t t, uint64_t grad) {
  ChunkSource source;
  source.tensor = t;
  source.group = table.group_of(t);
  source.numel = table.numel(t);
  source.layout = table.layout(t);
  source.element = table.offset(t);
  source.param = table.param_offset(t);
  source.state = table.state_offset(t);
  source.grad = grad;
  source.rounding_key = table.rounding_key(t);
  return source;
}

std::vector<BufferGrowth> FullPushList::ToHold(uint64_t tensors, uint64_t chunks, uint64_t portions,
                                               int grid, const TensorRows& rows) {
  const uint64_t most_packs = tensors / 2;  // Two tensors or more each.
  return {chunks_.ToHold(chunks), units_.ToHold(MostUnits(portions, grid)),
          rows.step->ToHold(tensors + most_packs), rows.remaining->ToHold(tensors + most_packs),
          rows.portions_of->ToHold(tensors + most_packs)};
}

absl::Status FullPushList::Refresh(const TensorTable& table, int grid, const TensorRows& rows,
                                   cudaStream_t stream) {
  if (!stale_) return absl::OkStatus();
  const uint32_t tensors = table.size();
  const std::vector<TensorPack> packs = table.Packs();
  std::vector<Chunk> chunks;
  std::vector<int64_t> pack_steps;
  std::vector<uint32_t> pack_portions;
  LaunchStorage storage;
  size_t next = 0;  // The next pack.
  for (uint32_t t = 0; t < tensors;) {
    storage.Add(table.layout(t));  // A pack's members all have fp32 layout.
    if (next < packs.size() && packs[next].first == t) {
      const TensorPack& pack = packs[next];
      ChunkSource source = SourceOf(table, t, table.offset(t));
      source.tensor = tensors + static_cast<uint32_t>(next);
      source.numel = 0;
      for (uint32_t m = t; m < t + pack.count; ++m) source.numel += table.numel(m);
      source.rounding_key = 0;
      pack_portions.push_back(AppendChunks(source, chunks));
      pack_steps.push_back(table.step(t));
      t += pack.count;
      ++next;
    } else {
      AppendChunks(SourceOf(table, t, table.offset(t)), chunks);
      ++t;
    }
  }
  const uint64_t portions = PortionsIn(chunks);
  UnitPlan plan;
  std::vector<UnitStart> units;
  if (!chunks.empty()) {
    plan = PlanUnits(portions, ApplyBlocks(grid, portions) * kWarpsPerBlock, storage);
    units = WorkUnits(chunks, plan);
  }
  const uint64_t rows_needed = tensors + packs.size();
  if (chunks.size() > chunks_.capacity() || units.size() > units_.capacity() ||
      rows_needed > rows.step->capacity() || rows_needed > rows.remaining->capacity() ||
      rows_needed > rows.portions_of->capacity()) {
    return absl::InternalError(
        absl::StrCat("the full push's list outgrew its buffers: ", chunks.size(), " chunks, ",
                     units.size(), " units, ", packs.size(), " packs, ", tensors, " tensors"));
  }
  // Tensors that leave a pack read their own rows from now on.
  if (absl::Status s = SyncMemberSteps(table, *rows.step, stream); !s.ok()) return s;
  if (absl::Status s = Upload(chunks_.data(), chunks, stream); !s.ok()) return s;
  if (absl::Status s = Upload(units_.data(), units, stream); !s.ok()) return s;
  if (absl::Status s = Upload(rows.step->data() + tensors, pack_steps, stream); !s.ok()) return s;
  for (DeviceArray<uint32_t>* table_rows : {rows.remaining, rows.portions_of}) {
    if (absl::Status s = Upload(table_rows->data() + tensors, pack_portions, stream); !s.ok()) {
      return s;
    }
  }
  count_ = static_cast<uint32_t>(chunks.size());
  has_packs_ = !packs.empty();
  packed_.assign(tensors, false);
  for (const TensorPack& pack : packs) {
    std::fill(packed_.begin() + pack.first, packed_.begin() + pack.first + pack.count, true);
  }
  portions_ = portions;
  plan_ = plan;
  storage_ = storage;
  stale_ = false;
  return absl::OkStatus();
}

absl::Status FullPushList::SyncMemberSteps(const TensorTable& table, DeviceArray<int64_t>& step,
                                           cudaStream_t stream) {
  if (!member_steps_behind_) return absl::OkStatus();
  if (absl::Status s = Upload(step.data(), table.steps(), stream); !s.ok()) return s;
  member_steps_behind_ = false;
  return absl::OkStatus();
}

}  // namespace gpu
}  // namespace fusedps
