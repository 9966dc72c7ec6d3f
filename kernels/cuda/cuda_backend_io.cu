// cuda_backend_io.cu: the CUDA backend's reads and writes of tensors (cuda_backend_impl.cuh):
// WriteParams, Write and SetStep for registration, restores and state loads; Read into host
// memory or a snapshot, converting bf16 and int8 storage on the device (ReadConverted); and the
// pull snapshots (AllocateSnapshot, FreeSnapshot, CopyFromSnapshot).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>

#include "kernels/cuda/cuda_backend_impl.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/stored_values.h"

namespace fusedps {
namespace gpu {

absl::Status CudaBackend::WriteParams(uint32_t tensor, uint64_t offset,
                                      absl::Span<const float> values) {
  if (values.empty()) return absl::OkStatus();
  FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
  const uint64_t at = table_.param_offset(tensor) + offset;
  const DeviceArenas a = arenas_.KernelView();
  std::vector<uint16_t> half;
  if (table_.layout(tensor).params == ParamsDType::kBFloat16) {
    half.resize(values.size());
    for (size_t i = 0; i < values.size(); ++i) half[i] = FloatToBFloat16(values[i]);
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(a.params16 + at, half.data(),
                                                 half.size() * sizeof(uint16_t),
                                                 cudaMemcpyHostToDevice, stream_));
  } else {
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(a.params32 + at, values.data(),
                                                 values.size() * sizeof(float),
                                                 cudaMemcpyHostToDevice, stream_));
    if (HasCopy()) {
      half.resize(values.size());
      for (size_t i = 0; i < values.size(); ++i) {
        half[i] = options_.param_copy_dtype == ParamCopyDType::kBFloat16
                      ? FloatToBFloat16(values[i])
                      : FloatToFloat16(values[i]);
      }
      FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(a.copy + at, half.data(),
                                                   half.size() * sizeof(uint16_t),
                                                   cudaMemcpyHostToDevice, stream_));
    }
  }
  // Registration is rare: wait, so that `values` (page-locked or not) may be reused.
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::Write(const WriteRequest& request) {
  if (absl::Status s = table_.CheckWrite(request, options_.param_copy_dtype); !s.ok()) return s;
  if (request.count == 0) return absl::OkStatus();
  FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
  if (request.param_copy) {
    uint16_t* dst =
        arenas_.KernelView().copy + table_.param_offset(request.tensor) + request.offset;
    FUSEDPS_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, request.src, request.count * 2, cudaMemcpyHostToDevice, stream_));
    return absl::OkStatus();
  }
  const StoredField field = table_.FieldOf(arenas_.Pointers(), request.field, request.tensor);
  char* dst = field.data + request.offset * field.element_bytes;
  if (request.stored || field.element_bytes == 4) {
    // The caller keeps src until a later marker (backend.h).
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        dst, request.src, request.count * field.element_bytes, cudaMemcpyHostToDevice, stream_));
    return absl::OkStatus();
  }
  // fp32 into bf16 or int8: converted here (whole blocks for int8: CheckWrite), then uploaded
  // from pageable memory, which cudaMemcpyAsync has read before it returns.
  const TensorLayout layout = table_.layout(request.tensor);
  std::vector<char> stored(request.count * field.element_bytes);
  std::vector<float> scales(ScaleCount(layout, request.count));
  FloatToStored(layout, request.field, static_cast<const float*>(request.src), 0, request.count,
                stored.data(), scales.data());
  FUSEDPS_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, stored.data(), stored.size(), cudaMemcpyHostToDevice, stream_));
  if (layout.state == StateDType::kInt8 && request.field != TensorField::kParam) {
    char* scales_dst =
        table_.FieldOf(arenas_.Pointers(), ScalesField(request.field), request.tensor).data +
        request.offset / layout.scale_block * sizeof(float);
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        scales_dst, scales.data(), scales.size() * sizeof(float), cudaMemcpyHostToDevice, stream_));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::SetStep(uint32_t tensor, int64_t step) {
  if (absl::Status s = table_.CheckStep(tensor, step); !s.ok()) return s;
  FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
  // From pageable memory: staged before cudaMemcpyAsync returns (see cuda_backend_impl.cuh).
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(step_dev_.data() + tensor, &step, sizeof(int64_t),
                                               cudaMemcpyHostToDevice, stream_));
  table_.SetStep(tensor, step);
  full_.MarkStale();  // Its pack's steps, or its neighbours', may differ or agree now.
  return absl::OkStatus();
}

absl::Status CudaBackend::Read(const ReadRequest& request) {
  // Check every tensor before queuing any copy.
  bool convert = false;  // fp32 from bf16 or int8 storage: through StateRead.
  for (uint32_t t : request.tensors) {
    if (absl::Status s = table_.CheckRead(request, t, options_.param_copy_dtype); !s.ok()) {
      return s;
    }
    convert |= !request.stored && !request.param_copy &&
               StoredElementBytes(table_.layout(t), request.field) != 4;
  }
  FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
  uint64_t end = 0;  // Of the destination's bytes.
  std::vector<const char*> sources(request.tensors.size());
  std::vector<uint64_t> bytes(request.tensors.size());
  for (size_t i = 0; i < request.tensors.size(); ++i) {
    const uint32_t t = request.tensors[i];
    if (request.param_copy) {
      sources[i] =
          reinterpret_cast<const char*>(arenas_.KernelView().copy + table_.param_offset(t));
      bytes[i] = table_.numel(t) * 2;
    } else {
      const StoredField field = table_.FieldOf(arenas_.Pointers(), request.field, t);
      sources[i] = field.data;
      bytes[i] = field.count * (convert ? 4 : field.element_bytes);
    }
    end = std::max(end, request.dst_offsets[i] + bytes[i]);
  }
  if (request.dst_is_snapshot) {
    if (absl::Status s = snapshots_.CheckRange(request.dst, end); !s.ok()) return s;
  }
  const cudaMemcpyKind kind = request.dst_is_snapshot || request.dst_on_device
                                  ? cudaMemcpyDeviceToDevice
                                  : cudaMemcpyDeviceToHost;
  char* dst = static_cast<char*>(request.dst);
  if (convert) return ReadConverted(request, end, kind);
  // One copy per run of tensors that are adjacent both in their arena and in dst, with the
  // same gap between them: the copy then also moves the arena's padding (zero, never
  // written) into a gap of dst that no tensor uses.
  for (size_t i = 0; i < request.tensors.size();) {
    size_t last = i;
    while (last + 1 < request.tensors.size()) {
      const uint64_t gap = request.dst_offsets[last + 1] - request.dst_offsets[last];
      if (request.dst_offsets[last + 1] < request.dst_offsets[last] + bytes[last] ||
          sources[last + 1] != sources[last] + gap) {
        break;
      }
      ++last;
    }
    const uint64_t run = request.dst_offsets[last] - request.dst_offsets[i] + bytes[last];
    if (run > 0) {
      FUSEDPS_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(dst + request.dst_offsets[i], sources[i], run, kind, stream_));
    }
    i = last + 1;
  }
  return absl::OkStatus();
}

const float* CudaBackend::CodebookValues(bool signed_map) const {
  // An address in the device's codebooks, computed, not read.
  return reinterpret_cast<const float*>(
      reinterpret_cast<const char*>(codebooks_.data()) + offsetof(QuantCodebook, values) +
      (signed_map ? offsetof(Int8Codebooks, exp_avg) : offsetof(Int8Codebooks, exp_avg_sq)));
}

absl::Status CudaBackend::ReadConverted(const ReadRequest& request, uint64_t end,
                                        cudaMemcpyKind kind) {
  std::vector<Chunk> chunks;
  std::vector<size_t> row_scaled;  // Moments of tables with int8 state: a scale per row.
  for (size_t i = 0; i < request.tensors.size(); ++i) {
    if (request.dst_offsets[i] % sizeof(float) != 0) {
      return absl::InvalidArgumentError("an fp32 read needs 4-byte aligned destinations");
    }
    const uint32_t t = request.tensors[i];
    if (table_.table_dim(t) > 0 && table_.layout(t).state == StateDType::kInt8 &&
        request.field != TensorField::kParam) {
      row_scaled.push_back(i);
      continue;
    }
    AppendChunks(SourceOf(table_, t, request.dst_offsets[i] / sizeof(float)), chunks);
  }
  float* out = static_cast<float*>(request.dst);
  if (kind == cudaMemcpyDeviceToHost) {
    if (absl::Status s = Reserve(read_scratch_, end / sizeof(float)); !s.ok()) return s;
    out = read_scratch_.data();
  }
  if (!chunks.empty()) {  // (A launch of no blocks would fail.)
    if (absl::Status s = GrowBuffers(
            {read_chunks_.ToHold(std::max<uint64_t>(chunks.size(), read_chunks_.capacity()))},
            stream_);
        !s.ok()) {
      return s;
    }
    absl::StatusOr<PinnedRing::Slot*> slot = chunk_ring_.Acquire(chunks.size() * sizeof(Chunk));
    if (!slot.ok()) return slot.status();
    std::memcpy((*slot)->host, chunks.data(), chunks.size() * sizeof(Chunk));
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(read_chunks_.data(), (*slot)->host,
                                                 chunks.size() * sizeof(Chunk),
                                                 cudaMemcpyHostToDevice, stream_));
    if (absl::Status s = chunk_ring_.Release(*slot, stream_); !s.ok()) return s;
    DeviceArenas arenas = arenas_.KernelView();
    arenas.codebooks = codebooks_.data();
    if (absl::Status s =
            LaunchStateRead(launches_, apply_grid_, stream_, request.field, arenas,
                            read_chunks_.data(), static_cast<uint32_t>(chunks.size()), out);
        !s.ok()) {
      return s;
    }
  }
  for (size_t i : row_scaled) {  // Every row, in order: a gather without keys.
    const uint32_t t = request.tensors[i];
    RowSource source;
    source.int8 =
        reinterpret_cast<const uint8_t*>(table_.FieldOf(arenas_.Pointers(), request.field, t).data);
    source.scales = reinterpret_cast<const float*>(
        table_.FieldOf(arenas_.Pointers(), ScalesField(request.field), t).data);
    source.values = CodebookValues(request.field == TensorField::kExpAvg);
    const uint64_t dim = table_.table_dim(t);
    if (absl::Status s = LaunchTableRowsGather(launches_, apply_grid_, stream_, source, dim,
                                               nullptr, table_.numel(t) / dim,
                                               out + request.dst_offsets[i] / sizeof(float));
        !s.ok()) {
      return s;
    }
  }
  if (kind == cudaMemcpyDeviceToHost) {
    uint64_t begin = end;
    for (uint64_t o : request.dst_offsets) begin = std::min(begin, o);
    FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<char*>(request.dst) + begin,
                                                 reinterpret_cast<const char*>(out) + begin,
                                                 end - begin, kind, stream_));
  }
  return absl::OkStatus();
}

absl::StatusOr<void*> CudaBackend::AllocateSnapshot(uint64_t bytes) {
  FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
  // Stream-ordered: ready for the reads queued after it, freed after them (FreeSnapshot).
  return snapshots_.Allocate(bytes, stream_);
}

absl::Status CudaBackend::FreeSnapshot(void* snapshot) {
  FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
  return snapshots_.Release(snapshot, stream_);
}

absl::Status CudaBackend::CopyFromSnapshot(const void* snapshot, uint64_t offset, uint64_t bytes,
                                           void* dst) {
  FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
  return snapshots_.CopyOut(snapshot, offset, bytes, dst);  // On its own stream.
}

absl::Status CudaBackend::ReadRows(const ReadRowsRequest& request) {
  FUSEDPS_CUDA_RETURN_IF_ERROR(UseDevice(options_.device_ordinal));
  absl::StatusOr<TableField> field = CheckReadRows(table_, arenas_.Pointers(), request);
  if (!field.ok()) return field.status();
  const uint64_t count = request.keys.size();
  if (count == 0) return absl::OkStatus();
  const uint64_t values = count * request.dim;
  if (absl::Status s = Reserve(row_keys_, count); !s.ok()) return s;
  if (absl::Status s = Reserve(read_scratch_, values); !s.ok()) return s;
  // After the steps queued before (stream order); the keys' pageable source is read before
  // cudaMemcpyAsync returns, and the copy into pageable dst returns once it is done.
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(row_keys_.data(), request.keys.data(),
                                               count * sizeof(int64_t), cudaMemcpyHostToDevice,
                                               stream_));
  RowSource source;
  source.f32 = field->f32;
  source.bf16 = field->bf16;
  source.int8 = field->int8;
  source.scales = field->scales;
  source.values = CodebookValues(field->signed_map);
  if (absl::Status s = LaunchTableRowsGather(launches_, apply_grid_, stream_, source, request.dim,
                                             row_keys_.data(), count, read_scratch_.data());
      !s.ok()) {
    return s;
  }
  FUSEDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
      request.dst, read_scratch_.data(), values * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  return absl::OkStatus();
}

}  // namespace gpu
}  // namespace fusedps
