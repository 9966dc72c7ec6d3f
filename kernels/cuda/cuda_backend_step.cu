// cuda_backend_step.cu: the CUDA backend's step path (cuda_backend_impl.cuh): checking a
// step's grads, preparing and uploading its chunk list, queueing the grads' copy, its embedding
// tables' rows (table_rows_kernel.cuh), the one fused launch that updates both and the events of
// its marker (Step); the gradient accumulator (Accumulate); the
// grad staging that steps read (CopyStagingToDevice, StageGrads); and markers (Mark, Wait).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_backend_impl.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/grad_check.h"

namespace fusedps {
namespace gpu {

absl::StatusOr<StepOutcome> CudaBackend::Step(const StepRequest& request) {
  FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
  // First everything that can fail with an expected error, so that such a failure changes
  // nothing; then the finiteness check; then the queueing.
  // The tables' rows: checked and prepared on the host (duplicates summed, unscaled), first.
  bool rows_finite = true;
  absl::StatusOr<std::vector<PreparedTableRows>> rows =
      PrepareTableRows(table_, arenas_.Pointers(), request, &rows_finite);
  if (!rows.ok()) return rows.status();
  if (request.from_accumulator && accumulator_.capacity() < table_.arena_numel()) {
    return absl::FailedPreconditionError("a step from the accumulator before Accumulate");
  }
  absl::StatusOr<GradSource> source = CheckGrads(request);
  if (!source.ok()) return source.status();
  absl::StatusOr<ChunkList> chunks = PrepareChunks(request);
  if (!chunks.ok()) return chunks.status();
  const bool finite =
      StepGradsFinite(request, &staged_non_finite_, [this](uint32_t t) { return table_.numel(t); });
  if (!finite || !rows_finite) return StepOutcome{true, 0, 0};  // Nothing queued.
  if (chunks->count == 0 && rows->empty()) return StepOutcome{false, 0, 0};
  if (absl::Status s = ReserveTableRows(*rows); !s.ok()) return s;

  // The kernel advances packs' steps, not their members': a partial launch reads members'.
  if (!chunks->full && std::any_of(request.tensors.begin(), request.tensors.end(),
                                   [&](uint32_t t) { return full_.Packed(t); })) {
    if (absl::Status s = full_.SyncMemberSteps(table_, step_dev_, stream_); !s.ok()) return s;
  }
  absl::StatusOr<StepEvents> events = markers_.TakeStepEvents();
  if (!events.ok()) return events.status();
  if (absl::Status s = Queue(request, *chunks, *source, *events, *rows); !s.ok()) {
    markers_.Return(*events);
    return s;
  }
  // The dense tensors and the tables, each stepped once.
  std::vector<uint32_t> stepped(request.tensors.begin(), request.tensors.end());
  for (const PreparedTableRows& r : *rows) stepped.push_back(r.tensor);
  table_.AdvanceSteps(stepped);
  if (chunks->full) {
    full_.Launched();
  } else if (std::any_of(stepped.begin(), stepped.end(),
                         [&](uint32_t t) { return full_.Affects(table_, t); })) {
    full_.MarkStale();
  }
  return StepOutcome{false, static_cast<uint32_t>(stepped.size()), markers_.Add(*events)};
}

absl::Status CudaBackend::ReserveTableRows(const std::vector<PreparedTableRows>& rows) {
  if (rows.empty()) return absl::OkStatus();
  uint64_t keys = 0, grads = 0, init_of_row = 0, init_params = 0;
  for (const PreparedTableRows& r : rows) {
    keys += r.rows.keys.size();
    grads += r.rows.grads.size();
    init_of_row += r.init_of_row.size();
    init_params += r.init_params.size();
  }
  if (absl::Status s = Reserve(row_tables_, rows.size()); !s.ok()) return s;
  if (absl::Status s = Reserve(row_keys_, keys); !s.ok()) return s;
  if (absl::Status s = Reserve(row_init_of_row_, init_of_row); !s.ok()) return s;
  if (absl::Status s = Reserve(row_init_params_, init_params); !s.ok()) return s;
  return Reserve(row_grads_, grads);
}

absl::StatusOr<RowStep> CudaBackend::QueueTableRows(const std::vector<PreparedTableRows>& rows) {
  // RowStep's three lists: pipelined, elementwise and int8 tables. Keys and gradients lie in one
  // buffer, in `rows` order.
  RowStep step;
  step.keys = row_keys_.data();
  step.grads = row_grads_.data();
  std::vector<RowTable> pipelined, elementwise, int8;
  uint64_t first_row = 0, grad_offset = 0, init_rows = 0, init_params = 0;
  for (const PreparedTableRows& r : rows) {
    RowTable t;
    t.params = r.view.params.data();
    t.exp_avg = r.view.exp_avg.data();
    t.exp_avg_sq = r.view.exp_avg_sq.data();
    t.exp_avg16 = r.view.exp_avg16.data();
    t.exp_avg_sq16 = r.view.exp_avg_sq16.data();
    t.exp_avg8 = r.view.exp_avg8.data();
    t.exp_avg_sq8 = r.view.exp_avg_sq8.data();
    t.absmax_m = r.view.exp_avg_absmax.data();
    t.absmax_v = r.view.exp_avg_sq_absmax.data();
    t.books = codebooks_.data();
    t.step = step_dev_.data() + r.tensor;
    t.first_row = first_row;
    t.rows = r.rows.keys.size();
    t.grad_offset = grad_offset;
    t.dim = static_cast<uint64_t>(r.view.dim);
    t.s = r.s;
    if (!r.init_of_row.empty()) {
      t.init_of_row = row_init_of_row_.data() + init_rows;
      t.init_params = row_init_params_.data() + init_params;
      FUSEDPS_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(row_init_of_row_.data() + init_rows, r.init_of_row.data(),
                          r.init_of_row.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
      FUSEDPS_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(row_init_params_.data() + init_params, r.init_params.data(),
                          r.init_params.size() * sizeof(float), cudaMemcpyHostToDevice, stream_));
      init_rows += r.init_of_row.size();
      init_params += r.init_params.size();
    }
    if (t.exp_avg8 == nullptr) t.width = RowUnitWidth(t, row_grads_.data());
    if (t.exp_avg8 != nullptr) {
      t.first_unit = step.int8_units;
      step.int8_units += t.rows * kInt8RowUnits;
      int8.push_back(t);
    } else if (t.exp_avg16 == nullptr && t.width == 4 &&
               t.rows * t.dim <= (uint64_t{1} << 32) - kPortionNumel) {
      t.first_unit = step.portions;
      step.portions += (t.rows * t.dim + kPortionNumel - 1) / kPortionNumel;
      pipelined.push_back(t);
    } else {
      t.first_unit = step.element_units;
      step.element_units += r.rows.grads.size() / t.width;
      elementwise.push_back(t);
    }
    // Pageable sources: cudaMemcpyAsync has read them before it returns (CUDA's API
    // synchronization behavior), so the vectors may go; the device copies are rewritten only by
    // work queued after this step's launch.
    if (!r.rows.keys.empty()) {
      FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(row_keys_.data() + first_row, r.rows.keys.data(),
                                                   r.rows.keys.size() * sizeof(int64_t),
                                                   cudaMemcpyHostToDevice, stream_));
      FUSEDPS_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(row_grads_.data() + grad_offset, r.rows.grads.data(),
                          r.rows.grads.size() * sizeof(float), cudaMemcpyHostToDevice, stream_));
    }
    first_row += r.rows.keys.size();
    grad_offset += r.rows.grads.size();
  }
  step.pipelined = static_cast<uint32_t>(pipelined.size());
  step.elementwise = static_cast<uint32_t>(elementwise.size());
  step.int8 = static_cast<uint32_t>(int8.size());
  std::vector<RowTable> tables = std::move(pipelined);  // The three lists, in RowStep's order.
  tables.insert(tables.end(), elementwise.begin(), elementwise.end());
  tables.insert(tables.end(), int8.begin(), int8.end());
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(row_tables_.data(), tables.data(),
                                               tables.size() * sizeof(RowTable),
                                               cudaMemcpyHostToDevice, stream_));
  step.tables = row_tables_.data();
  return step;
}

absl::StatusOr<Marker> CudaBackend::Accumulate(const StepRequest& request, bool first) {
  FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
  if (absl::Status s = Reserve(accumulator_, table_.arena_numel()); !s.ok()) return s;
  absl::StatusOr<GradSource> source = CheckGrads(request);
  if (!source.ok()) return source.status();
  absl::StatusOr<ChunkList> chunks = PrepareChunks(request);
  if (!chunks.ok()) return chunks.status();
  if (chunks->count > 0) {
    absl::StatusOr<DeviceList> device_chunks = QueueChunks(*chunks);
    if (!device_chunks.ok()) return device_chunks.status();
    absl::StatusOr<const void*> device_grads = QueueGrads(request, *source);
    if (!device_grads.ok()) return device_grads.status();
    if (absl::Status s = LaunchGradAccumulate(
            launches_, apply_grid_, stream_, request.grad_dtype, accumulator_.data(), *device_grads,
            device_chunks->chunks, chunks->count, request.grad_scale, first);
        !s.ok()) {
      return s;
    }
  }
  return markers_.Mark(stream_);
}

absl::StatusOr<Marker> CudaBackend::Mark() {
  FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
  return markers_.Mark(stream_);
}

absl::StatusOr<WorkDone> CudaBackend::Wait(Marker marker) {
  if (marker == 0) return WorkDone{};
  FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
  return markers_.Wait(marker);
}

absl::Status CudaBackend::CopyStagingToDevice(uint64_t offset, uint64_t bytes) {
  if (arena_ == nullptr || offset + bytes > arena_bytes_) {
    return absl::InvalidArgumentError("the range is not in the staging arena");
  }
  FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(arena_device_ + offset, arena_ + offset, bytes,
                                               cudaMemcpyHostToDevice, copy_stream_));
  return absl::OkStatus();
}

absl::StatusOr<GradCheck> CudaBackend::CopyDeviceToStaging(
    absl::Span<const DeviceStagingCopy> copies, GradDType dtype) {
  const uint64_t size = DTypeSize(dtype);
  for (size_t i = 0; i < copies.size(); ++i) {
    const DeviceStagingCopy& c = copies[i];
    if (arena_ == nullptr || c.offset > arena_bytes_ || c.bytes > arena_bytes_ - c.offset) {
      return absl::InvalidArgumentError(absl::StrCat("copy ", i, " (", c.bytes, " bytes at ",
                                                     c.offset, ") is not in the staging arena"));
    }
    if (c.bytes % size != 0 || (c.bytes > 0 && c.src == nullptr) ||
        reinterpret_cast<uintptr_t>(c.src) % size != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("copy ", i, ": ", c.bytes, " bytes are not whole elements of ", size,
                       " bytes, at an "
                       "address aligned to them (a misaligned read would be a device fault)"));
    }
  }
  FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
  // On the copy stream, which the next Step waits for; done when this returns anyway.
  return device_copier_.Copy(launches_, apply_grid_, copy_stream_, arena_device_, copies, dtype);
}

absl::Status CudaBackend::StageGrads(uint64_t byte_offset, const void* data, uint64_t count,
                                     GradDType dtype, float grad_scale) {
  FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
  const uint64_t bytes = count * DTypeSize(dtype);
  const uint64_t words = (byte_offset + bytes + 15) / 16;
  if (absl::Status s = Reserve(grads_, words); !s.ok()) return s;
  staged_non_finite_ |= !GradsAllFinite(data, dtype, count, grad_scale);
  if (bytes == 0) return absl::OkStatus();
  // After the steps queued so far, which may still read the staging.
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(reinterpret_cast<char*>(grads_.data()) + byte_offset,
                                               data, bytes, cudaMemcpyHostToDevice, stream_));
  staged_bytes_ = std::max(staged_bytes_, byte_offset + bytes);
  // Returns once `data` may be reused, page-locked or not (a benchmark's setup, not a path).
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::StatusOr<CudaBackend::GradSource> CudaBackend::CheckGrads(const StepRequest& request) {
  GradSource source;
  if (request.from_accumulator) return source;
  const char* host = static_cast<const char*>(request.grads);
  source.in_arena = arena_ != nullptr && host >= arena_ && host < arena_ + arena_bytes_;
  for (size_t r = 0; r < request.tensors.size(); ++r) {
    source.grad_bytes =
        std::max(source.grad_bytes, (request.grad_offsets[r] + table_.numel(request.tensors[r])) *
                                        DTypeSize(request.grad_dtype));
  }
  if (source.in_arena && source.grad_bytes > static_cast<uint64_t>(arena_ + arena_bytes_ - host)) {
    return absl::InvalidArgumentError("the step's grads run past the staging arena");
  }
  if (host == nullptr && source.grad_bytes > staged_bytes_) {
    return absl::FailedPreconditionError(absl::StrCat("the step reads ", source.grad_bytes,
                                                      " bytes of staged grads; ", staged_bytes_,
                                                      " are staged"));
  }
  if (host != nullptr && !source.in_arena) {
    if (absl::Status s = Reserve(grads_, (source.grad_bytes + 15) / 16); !s.ok()) return s;
  }
  return source;
}

absl::StatusOr<CudaBackend::ChunkList> CudaBackend::PrepareChunks(const StepRequest& request) {
  ChunkList list;
  list.full = IsFullPush(request);
  if (list.full) {
    if (absl::Status s = full_.Refresh(table_, apply_grid_, Rows(), stream_); !s.ok()) return s;
    list.count = full_.count();
    list.blocks = ApplyBlocks(apply_grid_, full_.portions());
    list.plan = full_.plan();
    list.storage = full_.storage();
    return list;
  }
  push_chunks_host_.clear();
  for (size_t r = 0; r < request.tensors.size(); ++r) {
    const uint32_t t = request.tensors[r];
    AppendChunks(
        SourceOf(table_, t, request.from_accumulator ? table_.offset(t) : request.grad_offsets[r]),
        push_chunks_host_);
    list.storage.Add(table_.layout(t));
  }
  list.count = static_cast<uint32_t>(push_chunks_host_.size());
  const uint64_t portions = PortionsIn(push_chunks_host_);
  list.blocks = ApplyBlocks(apply_grid_, portions);
  list.plan = PlanUnits(portions, list.blocks * kWarpsPerBlock, list.storage);
  push_units_host_ = WorkUnits(push_chunks_host_, list.plan);
  if (absl::Status s =
          GrowBuffers({push_chunks_.ToHold(std::max<uint64_t>(list.count, push_chunks_.capacity())),
                       push_units_.ToHold(push_units_host_.size())},
                      stream_);
      !s.ok()) {
    return s;
  }
  absl::StatusOr<PinnedRing::Slot*> slot =
      chunk_ring_.Acquire(list.count * sizeof(Chunk) + push_units_host_.size() * sizeof(UnitStart));
  if (!slot.ok()) return slot.status();
  list.slot = *slot;
  return list;
}

absl::StatusOr<CudaBackend::DeviceList> CudaBackend::QueueChunks(const ChunkList& list) {
  if (list.full) return DeviceList{full_.chunks(), full_.units()};
  // From a page-locked slot that stays untouched until this copy is done; the device list
  // is rewritten only by the next partial launch's copy, queued after this one's kernel.
  const uint64_t chunk_bytes = list.count * sizeof(Chunk);
  const uint64_t unit_bytes = push_units_host_.size() * sizeof(UnitStart);
  char* host = static_cast<char*>(list.slot->host);
  std::memcpy(host, push_chunks_host_.data(), chunk_bytes);
  std::memcpy(host + chunk_bytes, push_units_host_.data(), unit_bytes);
  FUSEDPS_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(push_chunks_.data(), host, chunk_bytes, cudaMemcpyHostToDevice, stream_));
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(push_units_.data(), host + chunk_bytes, unit_bytes,
                                               cudaMemcpyHostToDevice, stream_));
  if (absl::Status s = chunk_ring_.Release(list.slot, stream_); !s.ok()) return s;
  return DeviceList{push_chunks_.data(), push_units_.data()};
}

absl::StatusOr<const void*> CudaBackend::QueueGrads(const StepRequest& request,
                                                    const GradSource& source) {
  if (request.from_accumulator) return accumulator_.data();
  const char* host = static_cast<const char*>(request.grads);
  if (source.in_arena) {
    // In the staging arena: its ranges are on their way on the copy stream; wait for them.
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventRecord(copies_done_, copy_stream_));
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, copies_done_, 0));
    return static_cast<const char*>(arena_device_ + (host - arena_));
  }
  if (host != nullptr) {
    // The caller keeps the grads valid until the marker (backend.h's StepRequest).
    FUSEDPS_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(grads_.data(), host, source.grad_bytes, cudaMemcpyHostToDevice, stream_));
  }
  return grads_.data();
}

absl::Status CudaBackend::Queue(const StepRequest& request, const ChunkList& list,
                                const GradSource& source, const StepEvents& events,
                                const std::vector<PreparedTableRows>& rows) {
  DeviceList chunks{};
  if (list.count > 0) {
    absl::StatusOr<DeviceList> queued = QueueChunks(list);
    if (!queued.ok()) return queued.status();
    chunks = *queued;
  }
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventRecord(events.reached, stream_));
  DeviceArenas arenas = arenas_.KernelView();
  if (list.count > 0) {
    absl::StatusOr<const void*> grads = QueueGrads(request, source);
    if (!grads.ok()) return grads.status();
    arenas.grads = *grads;
  }
  RowStep row_step;
  if (!rows.empty()) {
    absl::StatusOr<RowStep> queued = QueueTableRows(rows);
    if (!queued.ok()) return queued.status();
    row_step = *queued;
  }
  arenas.step = step_dev_.data();
  arenas.hyper = hyper_.data();
  arenas.remaining = remaining_.data();
  arenas.portions_of = portions_of_dev_.data();
  arenas.codebooks = codebooks_.data();
  arenas.work = work_.data();
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventRecord(events.begin, stream_));
  if (list.count == 0 && RunsAlone(row_step)) {  // Tables alone: their own kernel's launch.
    if (absl::Status s = LaunchTableRowsUpdate(launches_, stream_, row_step, sm_count_); !s.ok()) {
      return s;
    }
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventRecord(events.done, stream_));
    return absl::OkStatus();
  }
  ApplyConfig config{request.from_accumulator ? GradDType::kFloat32 : request.grad_dtype,
                     options_.param_copy_dtype, list.storage.kinds, table_.any_amsgrad(),
                     options_.step_kernel};
  // int8 rows read the codebooks the int8-capable kernels keep in shared memory.
  if (row_step.int8 > 0) config.kinds = std::max(config.kinds, ApplyKinds::kInt8State);
  // With rows, the grid is sized for them too (the dense plan holds for any number of warps).
  const uint32_t blocks =
      row_step.table_count() == 0
          ? list.blocks
          : ApplyBlocks(apply_grid_, list.plan.portions + row_step.PortionsWorth());
  if (absl::Status s = LaunchAdamWApply(launches_, blocks, stream_, config, arenas, chunks.chunks,
                                        list.count, chunks.units, list.plan, request.grad_scale,
                                        request.lr_divisor, row_step);
      !s.ok()) {
    return s;
  }
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaEventRecord(events.done, stream_));
  return absl::OkStatus();
}

bool CudaBackend::IsFullPush(const StepRequest& request) const {
  if (request.tensors.size() != table_.size()) return false;
  for (size_t r = 0; r < request.tensors.size(); ++r) {
    if (request.tensors[r] != r) return false;
    if (!request.from_accumulator && request.grad_offsets[r] != table_.offset(r)) return false;
  }
  return true;
}

}  // namespace gpu
}  // namespace fusedps
