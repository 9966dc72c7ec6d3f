// The CPU backend: flat host arenas (one per stored dtype of each field, tensor_table.h),
// updated by OpenMP threads in fixed-size pieces.
//
// Work runs inside the calls that queue it (Step, Read, SetParamGroup), on the calling thread
// and its OpenMP workers, so every marker is done when it is made; Wait only reports a step's
// wall time.
//
// The step's math is the CUDA kernel's, element for element and in the same order (adamw_math.h,
// quant_math.h), so that the two backends give the same bits (cuda_backend_test checks it).
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/mutex.h"
#include "kernels/backend.h"
#include "kernels/backend_tables.h"
#include "kernels/grad_check.h"
#include "kernels/parallel.h"
#include "kernels/quant_math.h"
#include "kernels/stored_values.h"
#include "kernels/tensor_table.h"

namespace fusedps {
namespace {

// Elements per unit of parallel work: large enough to amortize scheduling, small enough to
// balance many small tensors against a few large ones; whole int8 blocks.
constexpr uint64_t kPieceNumel = 32 * 1024;
static_assert(kPieceNumel % kQuantBlock == 0, "a piece holds whole blocks");

struct Piece {
  uint32_t request_index;  // Index into StepRequest::tensors.
  uint64_t begin;          // Element range within the tensor.
  uint64_t end;
};

// One tensor's step: its scalars, its fields (`at`: the arenas shifted to the tensor's element
// 0 and block 0; null where its layout has none), and its stochastic rounding key.
struct TensorStep {
  AdamWStepScalars s;
  TensorLayout layout;
  uint64_t rounding_key = 0;  // RoundingKey(seed, tensor key, step), for bf16 params.
  Arenas at;
  uint16_t* copy = nullptr;
};

// Elements [begin, end) of one tensor: one AdamW step each, as the CUDA kernel does it.
template <GradDType kDType>
void UpdateRange(const TensorStep& t, const void* grads, uint64_t grad_offset, uint64_t begin,
                 uint64_t end, ParamCopyDType copy_dtype) {
  const bool bf16_params = t.layout.params == ParamsDType::kBFloat16;
  const auto load_param = [&](uint64_t i) {
    return bf16_params ? BFloat16ToFloat(t.at.params16[i]) : t.at.params32[i];
  };
  const auto store_param = [&](uint64_t i, float p) {
    if (bf16_params) {
      t.at.params16[i] = FloatToBFloat16Stochastic(p, RoundingBits(t.rounding_key, i));
    } else {
      t.at.params32[i] = p;
    }
  };
  const auto grad = [&](uint64_t i) { return LoadGrad(grads, kDType, grad_offset + i); };
  switch (t.layout.state) {
    case StateDType::kFloat32:
      for (uint64_t i = begin; i < end; ++i) {
        float p = load_param(i);
        AdamWUpdate(t.s, grad(i), p, t.at.exp_avg32[i], t.at.exp_avg_sq32[i],
                    t.s.amsgrad ? &t.at.max_exp_avg_sq[i] : nullptr);
        store_param(i, p);
      }
      break;
    case StateDType::kBFloat16:
      for (uint64_t i = begin; i < end; ++i) {
        float p = load_param(i);
        AdamWUpdateBFloat16State(t.s, grad(i), p, t.at.exp_avg16[i], t.at.exp_avg_sq16[i]);
        store_param(i, p);
      }
      break;
    case StateDType::kInt8:
      for (uint64_t first = begin; first < end; first += kQuantBlock) {
        const uint64_t block = first / kQuantBlock;
        const int n = static_cast<int>(std::min<uint64_t>(kQuantBlock, end - first));
        const auto update = [&](int j, float& m, float& v) {
          const uint64_t i = first + j;
          float p = load_param(i);
          AdamWUpdate<kInt8StateOrder>(t.s, grad(i), p, m, v, nullptr);
          store_param(i, p);
        };
        Int8BlockStep(DynamicCodebooks(), t.at.exp_avg8 + first, t.at.exp_avg_sq8 + first,
                      t.at.exp_avg_absmax[block], t.at.exp_avg_sq_absmax[block], n, update);
      }
      break;
  }
  if (!bf16_params && copy_dtype == ParamCopyDType::kBFloat16) {
    for (uint64_t i = begin; i < end; ++i) t.copy[i] = FloatToBFloat16(t.at.params32[i]);
  } else if (!bf16_params && copy_dtype == ParamCopyDType::kFloat16) {
    for (uint64_t i = begin; i < end; ++i) t.copy[i] = FloatToFloat16(t.at.params32[i]);
  }
}

// Grows a vector (zero-filled), or RESOURCE_EXHAUSTED naming it.
template <typename T>
absl::Status Grow(std::vector<T>& v, uint64_t n, const char* what) {
  if (v.size() >= n) return absl::OkStatus();
  try {
    v.resize(n, T{});
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("host memory for ", what, " (", n * sizeof(T), " bytes)"));
  }
  return absl::OkStatus();
}

template <typename T>
void ZeroFrom(std::vector<T>& v, uint64_t from) {
  if (v.size() > from) std::fill(v.begin() + from, v.end(), T{});
}

class CpuBackend final : public OptimizerBackend {
 public:
  explicit CpuBackend(const BackendOptions& options)
      : copy_dtype_(options.param_copy_dtype), threads_(OmpThreads(options.threads)) {}

  std::string name() const override { return "cpu"; }
  std::string device() const override { return absl::StrCat("cpu (", threads_, " threads)"); }
  ParamCopyDType param_copy_dtype() const override { return copy_dtype_; }

  absl::Status SetParamGroup(uint32_t group, const AdamWHyperparameters& hyper) override {
    if (absl::Status s = table_.CheckGroup(group, hyper); !s.ok()) return s;
    // max_exp_avg_sq first: when its memory cannot be had, the group stays as it was.
    if (hyper.amsgrad) {
      if (absl::Status s = Resize(table_.sizes(), /*amsgrad=*/true); !s.ok()) return s;
    }
    return table_.SetGroup(group, hyper);
  }

  absl::StatusOr<uint32_t> AddTensors(absl::Span<const NewTensor> tensors) override {
    absl::StatusOr<ArenaSizes> sizes = table_.ArenaSizesWith(tensors);
    if (!sizes.ok()) return sizes.status();
    if (absl::Status s = Resize(*sizes); !s.ok()) return s;
    const uint32_t first = table_.size();
    table_.Append(tensors);
    return first;
  }

  absl::Status TruncateTensors(uint32_t count) override {
    if (count > table_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot truncate ", table_.size(), " tensors to ", count));
    }
    table_.Truncate(count);
    // Zero what the removed tensors held, so that tensors added later start from zero.
    const ArenaSizes& n = table_.sizes();
    ZeroFrom(params32_, n.params32);
    ZeroFrom(copy_, n.params32);
    ZeroFrom(params16_, n.params16);
    for (auto* v : {&exp_avg32_, &exp_avg_sq32_, &max_exp_avg_sq_}) ZeroFrom(*v, n.state32);
    for (auto* v : {&exp_avg16_, &exp_avg_sq16_}) ZeroFrom(*v, n.state16);
    for (auto* v : {&exp_avg8_, &exp_avg_sq8_}) ZeroFrom(*v, n.state8);
    for (auto* v : {&absmax_m_, &absmax_v_}) ZeroFrom(*v, n.scales());
    return absl::OkStatus();
  }

  absl::Status WriteParams(uint32_t tensor, uint64_t offset,
                           absl::Span<const float> values) override {
    const uint64_t at = table_.param_offset(tensor) + offset;
    if (table_.layout(tensor).params == ParamsDType::kBFloat16) {
      for (size_t i = 0; i < values.size(); ++i) params16_[at + i] = FloatToBFloat16(values[i]);
      return absl::OkStatus();
    }
    std::copy(values.begin(), values.end(), params32_.data() + at);
    WriteCopy(at, values.size());
    return absl::OkStatus();
  }

  absl::Status Write(const WriteRequest& request) override {
    if (absl::Status s = table_.CheckWrite(request, copy_dtype_); !s.ok()) return s;
    if (request.count == 0) return absl::OkStatus();  // src may be null then.
    if (request.param_copy) {
      std::copy_n(static_cast<const uint16_t*>(request.src), request.count,
                  copy_.data() + table_.param_offset(request.tensor) + request.offset);
      return absl::OkStatus();
    }
    const StoredField field = table_.FieldOf(arenas(), request.field, request.tensor);
    if (request.stored) {
      std::memcpy(field.data + request.offset * field.element_bytes, request.src,
                  request.count * field.element_bytes);
      return absl::OkStatus();
    }
    FloatToStored(table_.layout(request.tensor), request.field,
                  static_cast<const float*>(request.src), request.offset, request.count, field.data,
                  ScalesOf(request.field, request.tensor));
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
    if (request.dst_on_device) {
      return absl::FailedPreconditionError("the cpu backend reads into host memory only");
    }
    for (uint32_t t : request.tensors) {
      if (absl::Status s = table_.CheckRead(request, t, copy_dtype_); !s.ok()) return s;
    }
    char* dst = static_cast<char*>(request.dst);
    for (size_t i = 0; i < request.tensors.size(); ++i) {
      const uint32_t t = request.tensors[i];
      char* out = dst + request.dst_offsets[i];
      if (request.param_copy) {
        std::copy_n(copy_.data() + table_.param_offset(t), table_.numel(t),
                    reinterpret_cast<uint16_t*>(out));
        continue;
      }
      const StoredField field = table_.FieldOf(arenas(), request.field, t);
      // A tensor of no elements may have no destination at all (a pull of only such tensors).
      if (field.count == 0) continue;
      if (request.stored) {
        std::memcpy(out, field.data, field.count * field.element_bytes);
      } else {
        StoredToFloat(table_.layout(t), request.field, field.data, ScalesOf(request.field, t),
                      field.count, reinterpret_cast<float*>(out));
      }
    }
    return absl::OkStatus();
  }

  absl::Status ReadRows(const ReadRowsRequest& request) override {
    return ReadTableRows(table_, arenas(), request);
  }

  absl::StatusOr<void*> AllocateSnapshot(uint64_t bytes) override {
    void* snapshot = std::aligned_alloc(64, (std::max<uint64_t>(bytes, 1) + 63) / 64 * 64);
    if (snapshot == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("pull snapshot of ", bytes, " bytes"));
    }
    MutexLock lock(&mu_);
    snapshots_[snapshot] = bytes;
    snapshot_bytes_ += bytes;
    return snapshot;
  }

  absl::Status FreeSnapshot(void* snapshot) override {
    {
      MutexLock lock(&mu_);
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
    MutexLock lock(&mu_);
    return ++last_marker_;
  }

  absl::StatusOr<WorkDone> Wait(Marker marker) override {
    MutexLock lock(&mu_);
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
  TensorLayout layout(uint32_t tensor) const override { return table_.layout(tensor); }
  uint64_t launches_total() const override { return launches_.load(std::memory_order_relaxed); }
  std::map<std::string, uint64_t> launch_counts() const override {
    const uint64_t accumulates = accumulate_launches_.load(std::memory_order_relaxed);
    std::map<std::string, uint64_t> counts = {{"cpu_adamw_apply", launches_total() - accumulates}};
    if (accumulates > 0) counts["cpu_grad_accumulate"] = accumulates;
    return counts;
  }
  std::map<std::string, uint64_t> memory_bytes() const override {
    MutexLock lock(&mu_);
    const auto bytes = [](const auto& v) { return v.capacity() * sizeof(v[0]); };
    return {{"params", bytes(params32_) + bytes(params16_)},
            {"exp_avg", bytes(exp_avg32_) + bytes(exp_avg16_) + bytes(exp_avg8_)},
            {"exp_avg_sq", bytes(exp_avg_sq32_) + bytes(exp_avg_sq16_) + bytes(exp_avg_sq8_)},
            {"max_exp_avg_sq", bytes(max_exp_avg_sq_)},
            {"state_scales", bytes(absmax_m_) + bytes(absmax_v_)},
            {"param_copy", bytes(copy_)},
            {"grad_staging", bytes(staging_)},
            {"grad_accumulator", bytes(accumulator_)},
            {"pull_snapshots", snapshot_bytes_}};
  }

  absl::StatusOr<char*> AllocateStagingArena(uint64_t bytes) override {
    MutexLock lock(&arena_mu_);
    if (arena_view_.host != nullptr) {
      return absl::FailedPreconditionError("the backend has a staging arena already");
    }
    // Plain memory: untouched pages are not committed, so a large pool costs what it holds.
    arena_.reset(static_cast<char*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)));
    if (arena_ == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("host staging arena of ", bytes, " bytes"));
    }
    arena_view_ = {arena_.get(), nullptr, bytes};
    return arena_.get();
  }

  StagingArena staging_arena() const override {
    MutexLock lock(&arena_mu_);
    return arena_view_;
  }
  absl::Status ShareStagingArena(const StagingArena& arena) override {
    if (arena.host == nullptr || arena.bytes == 0) {
      return absl::InvalidArgumentError("the staging arena to share is empty");
    }
    MutexLock lock(&arena_mu_);
    if (arena_view_.host != nullptr) {
      return absl::FailedPreconditionError("the backend has a staging arena already");
    }
    arena_view_ = arena;  // Steps read host grads wherever they lie: nothing else to do.
    return absl::OkStatus();
  }

  absl::Status CopyStagingToDevice(uint64_t, uint64_t) override { return absl::OkStatus(); }

  absl::Status StageGrads(uint64_t byte_offset, const void* data, uint64_t count, GradDType dtype,
                          float grad_scale) override {
    const uint64_t bytes = count * DTypeSize(dtype);
    staged_non_finite_ |= !GradsAllFinite(data, dtype, count, grad_scale);
    try {
      MutexLock lock(&mu_);  // memory_bytes() reads the capacity.
      if (staging_.size() * 8 < byte_offset + bytes) staging_.resize((byte_offset + bytes + 7) / 8);
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError(
          absl::StrCat("host staging of ", byte_offset + bytes, " bytes"));
    }
    std::memcpy(reinterpret_cast<char*>(staging_.data()) + byte_offset, data, bytes);
    return absl::OkStatus();
  }

  absl::StatusOr<StepOutcome> Step(const StepRequest& given) override {
    const auto start = std::chrono::steady_clock::now();
    StepRequest request = given;
    // The tables' rows are checked (an error changes nothing) and summed first.
    bool rows_finite = true;
    absl::StatusOr<std::vector<PreparedTableRows>> rows =
        PrepareTableRows(table_, arenas(), request, &rows_finite);
    if (!rows.ok()) return rows.status();
    const bool finite = StepGradsFinite(request, &staged_non_finite_,
                                        [this](uint32_t t) { return table_.numel(t); });
    if (!finite || !rows_finite) {
      return StepOutcome{.skipped = true, .tensors_updated = 0, .marker = 0};
    }
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
    if (!rows->empty()) {
      ApplyTableRows(*rows);
      std::vector<uint32_t> tables;
      for (const PreparedTableRows& p : *rows) tables.push_back(p.tensor);
      table_.AdvanceSteps(tables);
      outcome->tensors_updated += static_cast<uint32_t>(tables.size());
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    MutexLock lock(&mu_);
    outcome->marker = ++last_marker_;
    step_seconds_[outcome->marker] = seconds;
    return outcome;
  }

  absl::StatusOr<Marker> Accumulate(const StepRequest& request, bool first) override {
    const auto start = std::chrono::steady_clock::now();
    if (accumulator_.size() < table_.arena_numel()) {
      MutexLock lock(&mu_);  // memory_bytes() reads the capacity.
      if (absl::Status s = Grow(accumulator_, table_.arena_numel(), "the gradient accumulator");
          !s.ok()) {
        return s;
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
    MutexLock lock(&mu_);
    step_seconds_[++last_marker_] = seconds;
    return last_marker_;
  }

 private:
  Arenas arenas() {
    return {params32_.data(),       params16_.data(),  exp_avg32_.data(),    exp_avg_sq32_.data(),
            max_exp_avg_sq_.data(), exp_avg16_.data(), exp_avg_sq16_.data(), exp_avg8_.data(),
            exp_avg_sq8_.data(),    absmax_m_.data(),  absmax_v_.data()};
  }

  // The int8 scales of exp_avg or exp_avg_sq of a tensor (block 0's), or null.
  float* ScalesOf(TensorField field, uint32_t tensor) {
    if (table_.layout(tensor).state != StateDType::kInt8) return nullptr;
    return reinterpret_cast<float*>(table_.FieldOf(arenas(), ScalesField(field), tensor).data);
  }

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

  // Tensor t's step: its scalars and fields.
  TensorStep StepOf(uint32_t t, const StepRequest& request) {
    TensorStep ts;
    const AdamWHyperparameters& h = table_.hyper_of(t);
    const int64_t step = table_.step(t) + 1;
    ts.s = MakeStepScalars(h, step, request.grad_scale, request.lr_divisor);
    ts.layout = table_.layout(t);
    ts.rounding_key = RoundingKey(h.rounding_seed, table_.rounding_key(t), step);
    const uint64_t p = table_.param_offset(t), s = table_.state_offset(t);
    const auto at = [](auto& arena, uint64_t offset) {
      return arena.empty() ? nullptr : arena.data() + offset;
    };
    if (ts.layout.params == ParamsDType::kFloat32) {
      ts.at.params32 = at(params32_, p);
      ts.copy = at(copy_, p);
    } else {
      ts.at.params16 = at(params16_, p);
    }
    switch (ts.layout.state) {
      case StateDType::kFloat32:
        ts.at.exp_avg32 = at(exp_avg32_, s);
        ts.at.exp_avg_sq32 = at(exp_avg_sq32_, s);
        ts.at.max_exp_avg_sq = at(max_exp_avg_sq_, s);
        break;
      case StateDType::kBFloat16:
        ts.at.exp_avg16 = at(exp_avg16_, s);
        ts.at.exp_avg_sq16 = at(exp_avg_sq16_, s);
        break;
      case StateDType::kInt8:
        ts.at.exp_avg8 = at(exp_avg8_, s);
        ts.at.exp_avg_sq8 = at(exp_avg_sq8_, s);
        ts.at.exp_avg_absmax = at(absmax_m_, s / kQuantBlock);
        ts.at.exp_avg_sq_absmax = at(absmax_v_, s / kQuantBlock);
        break;
    }
    return ts;
  }

  absl::StatusOr<StepOutcome> StepOn(const StepRequest& request) {
    const std::vector<Piece> pieces = PiecesOf(request);
    const int64_t piece_count = static_cast<int64_t>(pieces.size());
    std::vector<TensorStep> steps;
    steps.reserve(request.tensors.size());
    for (uint32_t t : request.tensors) steps.push_back(StepOf(t, request));
    launches_.fetch_add(1, std::memory_order_relaxed);
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1)
    for (int64_t k = 0; k < piece_count; ++k) {
      const Piece& p = pieces[k];
      const TensorStep& t = steps[p.request_index];
      const uint64_t g = request.grad_offsets[p.request_index];
      switch (request.grad_dtype) {
        case GradDType::kFloat32:
          UpdateRange<GradDType::kFloat32>(t, request.grads, g, p.begin, p.end, copy_dtype_);
          break;
        case GradDType::kBFloat16:
          UpdateRange<GradDType::kBFloat16>(t, request.grads, g, p.begin, p.end, copy_dtype_);
          break;
        case GradDType::kFloat16:
          UpdateRange<GradDType::kFloat16>(t, request.grads, g, p.begin, p.end, copy_dtype_);
          break;
      }
    }
    table_.AdvanceSteps(request.tensors);
    return StepOutcome{.skipped = false,
                       .tensors_updated = static_cast<uint32_t>(request.tensors.size())};
  }

  // Sizes every arena for `sizes`; max_exp_avg_sq too when a group uses amsgrad or `amsgrad`
  // says one is about to. All or nothing: on RESOURCE_EXHAUSTED the arenas keep their sizes
  // (what grew stays allocated, zero, and unused).
  absl::Status Resize(const ArenaSizes& n, bool amsgrad = false) {
    MutexLock lock(&mu_);  // memory_bytes() reads the capacities.
    absl::Status s = Grow(params32_, n.params32, "fp32 params");
    if (s.ok()) s = Grow(params16_, n.params16, "bf16 params");
    for (auto* v : {&exp_avg32_, &exp_avg_sq32_}) {
      if (s.ok()) s = Grow(*v, n.state32, "fp32 state");
    }
    if (s.ok() && (amsgrad || table_.any_amsgrad())) {
      s = Grow(max_exp_avg_sq_, n.state32, "max_exp_avg_sq");
    }
    for (auto* v : {&exp_avg16_, &exp_avg_sq16_}) {
      if (s.ok()) s = Grow(*v, n.state16, "bf16 state");
    }
    for (auto* v : {&exp_avg8_, &exp_avg_sq8_}) {
      if (s.ok()) s = Grow(*v, n.state8, "int8 state");
    }
    for (auto* v : {&absmax_m_, &absmax_v_}) {
      if (s.ok()) s = Grow(*v, n.scales(), "int8 state scales");
    }
    if (s.ok() && copy_dtype_ != ParamCopyDType::kNone) s = Grow(copy_, n.params32, "param copy");
    return s;
  }

  void WriteCopy(uint64_t start, uint64_t count) {
    for (uint64_t i = start; i < start + count; ++i) {
      if (copy_dtype_ == ParamCopyDType::kBFloat16) copy_[i] = FloatToBFloat16(params32_[i]);
      if (copy_dtype_ == ParamCopyDType::kFloat16) copy_[i] = FloatToFloat16(params32_[i]);
    }
  }

  const ParamCopyDType copy_dtype_;
  const int threads_;
  TensorTable table_;
  // The arenas (tensor_table.h); max_exp_avg_sq once a group has amsgrad.
  std::vector<float> params32_;
  std::vector<uint16_t> params16_;
  std::vector<uint16_t> copy_;  // bf16 or fp16 copy of params32_.
  std::vector<float> exp_avg32_, exp_avg_sq32_, max_exp_avg_sq_;
  std::vector<uint16_t> exp_avg16_, exp_avg_sq16_;
  std::vector<uint8_t> exp_avg8_, exp_avg_sq8_;
  std::vector<float> absmax_m_, absmax_v_;
  std::atomic<uint64_t> launches_{0};
  std::vector<uint64_t> staging_;   // StageGrads' buffer, 8-byte words.
  std::vector<float> accumulator_;  // Accumulate's sums, laid out canonically.
  std::atomic<uint64_t> accumulate_launches_{0};
  // Guards what the thread-safe methods read (Mark, Wait, memory_bytes, the snapshots).
  mutable Mutex mu_;
  Marker last_marker_ ABSL_GUARDED_BY(mu_) = 0;
  // Steps' wall time, until waited for.
  std::unordered_map<Marker, double> step_seconds_ ABSL_GUARDED_BY(mu_);
  // AllocateSnapshot's, by address.
  std::unordered_map<void*, uint64_t> snapshots_ ABSL_GUARDED_BY(mu_);
  uint64_t snapshot_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool staged_non_finite_ = false;
  struct FreeDeleter {
    void operator()(char* p) const { std::free(p); }
  };
  mutable Mutex arena_mu_;
  std::unique_ptr<char, FreeDeleter> arena_ ABSL_GUARDED_BY(arena_mu_);  // AllocateStagingArena's.
  StagingArena arena_view_ ABSL_GUARDED_BY(arena_mu_);  // arena_'s, or a shared one.
};

}  // namespace

std::unique_ptr<OptimizerBackend> MakeCpuBackend(const BackendOptions& options) {
  return std::make_unique<CpuBackend>(options);
}

}  // namespace fusedps
