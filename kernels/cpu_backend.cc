// The CPU backend: flat host arenas, updated by OpenMP threads in fixed-size pieces.
//
// Work runs inside the calls that queue it (Step, Read, SetParamGroup), on the calling thread
// and its OpenMP workers, so every marker is done when it is made; Wait only reports a step's
// wall time.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/grad_check.h"
#include "kernels/parallel.h"
#include "kernels/tensor_table.h"

namespace fusedps {
namespace {

// Elements per unit of parallel work: large enough to amortize scheduling, small enough to
// balance many small tensors against a few large ones.
constexpr uint64_t kPieceNumel = 32 * 1024;

struct Piece {
  uint32_t request_index;  // Index into StepRequest::tensors.
  uint64_t begin;          // Element range within the tensor.
  uint64_t end;
};

template <GradDType kDType>
void UpdateRange(const AdamWStepScalars& s, const void* grads, uint64_t grad_offset,
                 uint64_t begin, uint64_t end, float* params, float* exp_avg, float* exp_avg_sq,
                 float* max_exp_avg_sq, uint16_t* copy, ParamCopyDType copy_dtype) {
  for (uint64_t i = begin; i < end; ++i) {
    const float g = LoadGrad(grads, kDType, grad_offset + i);
    AdamWUpdate(s, g, params[i], exp_avg[i], exp_avg_sq[i],
                s.amsgrad ? &max_exp_avg_sq[i] : nullptr);
  }
  if (copy_dtype == ParamCopyDType::kBFloat16) {
    for (uint64_t i = begin; i < end; ++i) copy[i] = FloatToBFloat16(params[i]);
  } else if (copy_dtype == ParamCopyDType::kFloat16) {
    for (uint64_t i = begin; i < end; ++i) copy[i] = FloatToFloat16(params[i]);
  }
}

class CpuBackend final : public OptimizerBackend {
 public:
  explicit CpuBackend(const BackendOptions& options)
      : copy_dtype_(options.param_copy_dtype),
        threads_(OmpThreads(options.threads)) {}

  std::string name() const override { return "cpu"; }
  std::string device() const override { return absl::StrCat("cpu (", threads_, " threads)"); }
  ParamCopyDType param_copy_dtype() const override { return copy_dtype_; }

  absl::Status SetParamGroup(uint32_t group, const AdamWHyperparameters& hyper) override {
    // max_exp_avg_sq first: when its memory cannot be had, the group stays as it was.
    if (hyper.amsgrad) {
      if (absl::Status s = Resize(params_.size(), /*amsgrad=*/true); !s.ok()) return s;
    }
    return table_.SetGroup(group, hyper);
  }

  absl::StatusOr<uint32_t> AddTensors(absl::Span<const NewTensor> tensors) override {
    absl::StatusOr<uint64_t> total = table_.ArenaNumelWith(tensors);
    if (!total.ok()) return total.status();
    if (absl::Status s = Resize(*total); !s.ok()) return s;
    const uint32_t first = table_.size();
    table_.Append(tensors);
    return first;
  }

  absl::Status TruncateTensors(uint32_t count) override {
    if (count > table_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot truncate ", table_.size(), " tensors to ", count));
    }
    // Zero what the removed tensors held, so that tensors added later start from zero.
    const uint64_t from = count < table_.size() ? table_.offset(count) : table_.arena_numel();
    for (std::vector<float>* arena : {&params_, &exp_avg_, &exp_avg_sq_, &max_exp_avg_sq_}) {
      if (arena->size() > from) std::fill(arena->begin() + from, arena->end(), 0.0f);
    }
    if (copy_.size() > from) std::fill(copy_.begin() + from, copy_.end(), 0);
    table_.Truncate(count);
    return absl::OkStatus();
  }

  absl::Status WriteParams(uint32_t tensor, uint64_t offset,
                           absl::Span<const float> values) override {
    float* dst = params_.data() + table_.offset(tensor) + offset;
    std::copy(values.begin(), values.end(), dst);
    WriteCopy(table_.offset(tensor) + offset, values.size());
    return absl::OkStatus();
  }

  absl::Status Write(const WriteRequest& request) override {
    if (absl::Status s = table_.CheckWrite(request, copy_dtype_); !s.ok()) return s;
    if (request.param_copy) {
      std::copy_n(static_cast<const uint16_t*>(request.src), request.count,
                  copy_.data() + table_.offset(request.tensor) + request.offset);
      return absl::OkStatus();
    }
    absl::StatusOr<const float*> field_start = table_.FieldOf(
        {params_.data(), exp_avg_.data(), exp_avg_sq_.data(), max_exp_avg_sq_.data()},
        request.field, request.tensor);
    if (!field_start.ok()) return field_start.status();
    std::copy_n(static_cast<const float*>(request.src), request.count,
                const_cast<float*>(*field_start) + request.offset);
    return absl::OkStatus();
  }

  absl::Status SetStep(uint32_t tensor, int64_t step) override {
    if (absl::Status s = table_.CheckStep(tensor, step); !s.ok()) return s;
    table_.SetStep(tensor, step);
    return absl::OkStatus();
  }

  absl::StatusOr<void*> AllocateHostBuffer(uint64_t bytes) override {
    void* buffer = std::aligned_alloc(64, (std::max<uint64_t>(bytes, 1) + 63) / 64 * 64);
    if (buffer == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("host buffer of ", bytes, " bytes"));
    }
    return buffer;
  }

  void FreeHostBuffer(void* buffer) override { std::free(buffer); }

  absl::Status Read(const ReadRequest& request) override {
    char* dst = static_cast<char*>(request.dst);
    for (size_t i = 0; i < request.tensors.size(); ++i) {
      const uint32_t t = request.tensors[i];
      char* out = dst + request.dst_offsets[i];
      if (request.param_copy) {
        if (request.field != TensorField::kParam || copy_dtype_ == ParamCopyDType::kNone) {
          return absl::FailedPreconditionError("this backend keeps no param copy");
        }
        std::copy_n(copy_.data() + table_.offset(t), table_.numel(t),
                    reinterpret_cast<uint16_t*>(out));
        continue;
      }
      absl::StatusOr<const float*> field_start = table_.FieldOf(
          {params_.data(), exp_avg_.data(), exp_avg_sq_.data(), max_exp_avg_sq_.data()},
          request.field, t);
      if (!field_start.ok()) return field_start.status();
      // A tensor of no elements may have no destination at all (a pull of only such tensors).
      if (table_.numel(t) > 0) std::memcpy(out, *field_start, table_.numel(t) * sizeof(float));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<void*> AllocateSnapshot(uint64_t bytes) override {
    void* snapshot = std::aligned_alloc(64, (std::max<uint64_t>(bytes, 1) + 63) / 64 * 64);
    if (snapshot == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("pull snapshot of ", bytes, " bytes"));
    }
    std::lock_guard<std::mutex> lock(mu_);
    snapshots_[snapshot] = bytes;
    snapshot_bytes_ += bytes;
    return snapshot;
  }

  absl::Status FreeSnapshot(void* snapshot) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = snapshots_.find(snapshot);
      if (it == snapshots_.end()) return absl::InvalidArgumentError("not a snapshot");
      snapshot_bytes_ -= it->second;
      snapshots_.erase(it);
    }
    std::free(snapshot);
    return absl::OkStatus();
  }

  absl::Status CopyFromSnapshot(const void* snapshot, uint64_t offset, uint64_t bytes,
                                void* dst) override {
    std::memcpy(dst, static_cast<const char*>(snapshot) + offset, bytes);
    return absl::OkStatus();
  }

  absl::StatusOr<Marker> Mark() override {
    std::lock_guard<std::mutex> lock(mu_);
    return ++last_marker_;
  }

  absl::StatusOr<WorkDone> Wait(Marker marker) override {
    std::lock_guard<std::mutex> lock(mu_);
    WorkDone done;
    if (auto it = step_seconds_.find(marker); it != step_seconds_.end()) {
      done.device_seconds = it->second;
      step_seconds_.erase(it);
    }
    return done;
  }

  int64_t step(uint32_t tensor) const override { return table_.step(tensor); }
  uint32_t tensor_count() const override { return table_.size(); }
  uint64_t numel(uint32_t tensor) const override { return table_.numel(tensor); }
  uint64_t launches_total() const override { return launches_.load(std::memory_order_relaxed); }
  std::map<std::string, uint64_t> launch_counts() const override {
    const uint64_t accumulates = accumulate_launches_.load(std::memory_order_relaxed);
    std::map<std::string, uint64_t> counts = {{"cpu_adamw_apply", launches_total() - accumulates}};
    if (accumulates > 0) counts["cpu_grad_accumulate"] = accumulates;
    return counts;
  }
  std::map<std::string, uint64_t> memory_bytes() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return {{"params", params_.capacity() * sizeof(float)},
            {"exp_avg", exp_avg_.capacity() * sizeof(float)},
            {"exp_avg_sq", exp_avg_sq_.capacity() * sizeof(float)},
            {"max_exp_avg_sq", max_exp_avg_sq_.capacity() * sizeof(float)},
            {"param_copy", copy_.capacity() * sizeof(uint16_t)},
            {"grad_staging", staging_.capacity() * sizeof(uint64_t)},
            {"grad_accumulator", accumulator_.capacity() * sizeof(float)},
            {"pull_snapshots", snapshot_bytes_}};
  }

  absl::StatusOr<char*> AllocateStagingArena(uint64_t bytes) override {
    // Plain memory: untouched pages are not committed, so a large pool costs what it holds.
    arena_.reset(static_cast<char*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)));
    if (arena_ == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("host staging arena of ", bytes, " bytes"));
    }
    return arena_.get();
  }

  absl::Status CopyStagingToDevice(uint64_t, uint64_t) override { return absl::OkStatus(); }

  absl::Status StageGrads(uint64_t byte_offset, const void* data, uint64_t count,
                          GradDType dtype, float grad_scale) override {
    const uint64_t bytes = count * DTypeSize(dtype);
    staged_non_finite_ |= !GradsAllFinite(data, dtype, count, grad_scale);
    try {
      std::lock_guard<std::mutex> lock(mu_);  // memory_bytes() reads the capacity.
      if (staging_.size() * 8 < byte_offset + bytes) staging_.resize((byte_offset + bytes + 7) / 8);
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError(absl::StrCat("host staging of ", byte_offset + bytes,
                                                       " bytes"));
    }
    std::memcpy(reinterpret_cast<char*>(staging_.data()) + byte_offset, data, bytes);
    return absl::OkStatus();
  }

  absl::StatusOr<StepOutcome> Step(const StepRequest& given) override {
    const auto start = std::chrono::steady_clock::now();
    StepRequest request = given;
    const bool finite = StepGradsFinite(request, &staged_non_finite_,
                                        [this](uint32_t t) { return table_.numel(t); });
    if (!finite) return StepOutcome{.skipped = true, .tensors_updated = 0, .marker = 0};
    std::vector<uint64_t> offsets;
    if (request.from_accumulator) {
      if (accumulator_.size() < table_.arena_numel()) {
        return absl::FailedPreconditionError("a step from the accumulator before Accumulate");
      }
      for (uint32_t t : request.tensors) offsets.push_back(table_.offset(t));
      request.grads = accumulator_.data();
      request.grad_offsets = offsets;
      request.grad_dtype = GradDType::kFloat32;
    }
    if (request.grads == nullptr) request.grads = staging_.data();
    absl::StatusOr<StepOutcome> outcome = StepOn(request);
    if (!outcome.ok()) return outcome;
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::lock_guard<std::mutex> lock(mu_);
    outcome->marker = ++last_marker_;
    step_seconds_[outcome->marker] = seconds;
    return outcome;
  }

  absl::StatusOr<Marker> Accumulate(const StepRequest& request, bool first) override {
    const auto start = std::chrono::steady_clock::now();
    if (accumulator_.size() < table_.arena_numel()) {
      std::lock_guard<std::mutex> lock(mu_);  // memory_bytes() reads the capacity.
      try {
        accumulator_.resize(table_.arena_numel(), 0.0f);
      } catch (const std::bad_alloc&) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "host memory for the gradient accumulator (", table_.arena_numel() * 4, " bytes)"));
      }
    }
    const void* grads = request.grads == nullptr ? staging_.data() : request.grads;
    const std::vector<Piece> pieces = PiecesOf(request);
    const float scale = request.grad_scale > 0.0f ? request.grad_scale : 1.0f;
    const bool divide = request.grad_scale > 0.0f;
    launches_.fetch_add(1, std::memory_order_relaxed);
    accumulate_launches_.fetch_add(1, std::memory_order_relaxed);
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1)
    for (int64_t k = 0; k < static_cast<int64_t>(pieces.size()); ++k) {
      const Piece& p = pieces[k];
      float* acc = accumulator_.data() + table_.offset(request.tensors[p.request_index]);
      const uint64_t g = request.grad_offsets[p.request_index];
      for (uint64_t i = p.begin; i < p.end; ++i) {
        const float grad = LoadGrad(grads, request.grad_dtype, g + i);
        const float value = divide ? grad / scale : grad;
        acc[i] = first ? value : acc[i] + value;
      }
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::lock_guard<std::mutex> lock(mu_);
    step_seconds_[++last_marker_] = seconds;
    return last_marker_;
  }

 private:
  // The request's tensors cut into pieces of at most kPieceNumel elements.
  std::vector<Piece> PiecesOf(const StepRequest& request) const {
    std::vector<Piece> pieces;
    for (uint32_t r = 0; r < request.tensors.size(); ++r) {
      const uint64_t n = table_.numel(request.tensors[r]);
      for (uint64_t begin = 0; begin < n; begin += kPieceNumel) {
        pieces.push_back({r, begin, std::min(n, begin + kPieceNumel)});
      }
    }
    return pieces;
  }

  absl::StatusOr<StepOutcome> StepOn(const StepRequest& request) {
    const std::vector<Piece> pieces = PiecesOf(request);
    const int64_t piece_count = static_cast<int64_t>(pieces.size());

    std::vector<AdamWStepScalars> scalars(request.tensors.size());
    for (size_t r = 0; r < request.tensors.size(); ++r) {
      const uint32_t t = request.tensors[r];
      scalars[r] = MakeStepScalars(table_.hyper_of(t), table_.step(t) + 1, request.grad_scale,
                                   request.lr_divisor);
    }
    launches_.fetch_add(1, std::memory_order_relaxed);
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1)
    for (int64_t k = 0; k < piece_count; ++k) {
      const Piece& p = pieces[k];
      const uint32_t t = request.tensors[p.request_index];
      // Shift the arenas so that element 0 of the tensor is at index 0, as in its grads.
      const uint64_t o = table_.offset(t);
      const uint64_t g = request.grad_offsets[p.request_index];
      float* max_sq = max_exp_avg_sq_.empty() ? nullptr : max_exp_avg_sq_.data() + o;
      uint16_t* copy = copy_.empty() ? nullptr : copy_.data() + o;
      switch (request.grad_dtype) {
        case GradDType::kFloat32:
          UpdateRange<GradDType::kFloat32>(scalars[p.request_index], request.grads, g, p.begin,
                                           p.end, params_.data() + o, exp_avg_.data() + o,
                                           exp_avg_sq_.data() + o, max_sq, copy, copy_dtype_);
          break;
        case GradDType::kBFloat16:
          UpdateRange<GradDType::kBFloat16>(scalars[p.request_index], request.grads, g, p.begin,
                                            p.end, params_.data() + o, exp_avg_.data() + o,
                                            exp_avg_sq_.data() + o, max_sq, copy, copy_dtype_);
          break;
        case GradDType::kFloat16:
          UpdateRange<GradDType::kFloat16>(scalars[p.request_index], request.grads, g, p.begin,
                                           p.end, params_.data() + o, exp_avg_.data() + o,
                                           exp_avg_sq_.data() + o, max_sq, copy, copy_dtype_);
          break;
      }
    }
    table_.AdvanceSteps(request.tensors);
    return StepOutcome{.skipped = false,
                       .tensors_updated = static_cast<uint32_t>(request.tensors.size())};
  }

  // Sizes every arena for `numel` parameters; max_exp_avg_sq too when a group uses amsgrad or
  // `amsgrad` says one is about to.
  absl::Status Resize(uint64_t numel, bool amsgrad = false) {
    std::lock_guard<std::mutex> lock(mu_);  // memory_bytes() reads the capacities.
    try {
      params_.resize(numel, 0.0f);
      exp_avg_.resize(numel, 0.0f);
      exp_avg_sq_.resize(numel, 0.0f);
      if (amsgrad || table_.any_amsgrad()) max_exp_avg_sq_.resize(numel, 0.0f);
      if (copy_dtype_ != ParamCopyDType::kNone) copy_.resize(numel, 0);
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError(
          absl::StrCat("host memory for ", numel, " parameters (", numel * 16, " bytes)"));
    }
    return absl::OkStatus();
  }

  void WriteCopy(uint64_t start, uint64_t count) {
    for (uint64_t i = start; i < start + count; ++i) {
      if (copy_dtype_ == ParamCopyDType::kBFloat16) copy_[i] = FloatToBFloat16(params_[i]);
      if (copy_dtype_ == ParamCopyDType::kFloat16) copy_[i] = FloatToFloat16(params_[i]);
    }
  }

  const ParamCopyDType copy_dtype_;
  const int threads_;
  TensorTable table_;
  std::vector<float> params_, exp_avg_, exp_avg_sq_, max_exp_avg_sq_;
  std::vector<uint16_t> copy_;  // bf16 or fp16 copy of params_.
  std::atomic<uint64_t> launches_{0};
  std::vector<uint64_t> staging_;  // StageGrads' buffer, 8-byte words.
  std::vector<float> accumulator_;  // Accumulate's sums, laid out as params_.
  std::atomic<uint64_t> accumulate_launches_{0};
  // Guards what the thread-safe methods read (Mark, Wait, memory_bytes, the snapshots).
  mutable std::mutex mu_;
  Marker last_marker_ = 0;
  std::unordered_map<Marker, double> step_seconds_;  // Steps' wall time, until waited for.
  std::unordered_map<void*, uint64_t> snapshots_;    // AllocateSnapshot's, by address.
  uint64_t snapshot_bytes_ = 0;
  bool staged_non_finite_ = false;
  struct FreeDeleter {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char, FreeDeleter> arena_;  // AllocateStagingArena's.
};

}  // namespace

std::unique_ptr<OptimizerBackend> MakeCpuBackend(const BackendOptions& options) {
  return std::make_unique<CpuBackend>(options);
}

}  // namespace fusedps
