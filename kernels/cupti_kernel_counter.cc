#include "kernels/cupti_kernel_counter.h"

#include <cupti.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "common/mutex.h"

namespace fusedps {
namespace {

constexpr size_t kBufferBytes = 8 << 20;

// The kernels that ran, by name: CUPTI's buffer callback adds to them on its own thread.
struct KernelCounts {
  Mutex mu;
  std::map<std::string, uint64_t> by_name ABSL_GUARDED_BY(mu);
};
KernelCounts& Counts() {
  static auto* counts = new KernelCounts;
  return *counts;
}

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI BufferCompleted(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid_size) {
  CUpti_Activity* record = nullptr;
  KernelCounts& counts = Counts();
  MutexLock lock(&counts.mu);
  while (cuptiActivityGetNextRecord(buffer, valid_size, &record) == CUPTI_SUCCESS) {
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL ||
        record->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const auto* kernel = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      ++counts.by_name[kernel->name != nullptr ? kernel->name : "?"];
    }
  }
  std::free(buffer);
}

absl::Status Check(CUptiResult result, const char* what) {
  if (result == CUPTI_SUCCESS) return absl::OkStatus();
  const char* message = nullptr;
  cuptiGetResultString(result, &message);
  return absl::InternalError(absl::StrCat(what, ": ", message != nullptr ? message : "?"));
}

}  // namespace

absl::Status CuptiKernelCounter::Start() {
  {
    KernelCounts& counts = Counts();
    MutexLock lock(&counts.mu);
    counts.by_name.clear();
  }
  if (absl::Status s = Check(cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted),
                             "cuptiActivityRegisterCallbacks");
      !s.ok()) {
    return s;
  }
  return Check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable");
}

absl::StatusOr<std::map<std::string, uint64_t>> CuptiKernelCounter::Stop() {
  if (absl::Status s = Check(cuptiActivityFlushAll(1), "cuptiActivityFlushAll"); !s.ok()) return s;
  if (absl::Status s = Check(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL),
                             "cuptiActivityDisable");
      !s.ok()) {
    return s;
  }
  KernelCounts& counts = Counts();
  MutexLock lock(&counts.mu);
  return counts.by_name;
}

uint64_t CuptiKernelCounter::CountMatching(const std::map<std::string, uint64_t>& kernels,
                                           const std::string& substring) {
  uint64_t total = 0;
  for (const auto& [name, count] : kernels) {
    if (name.find(substring) != std::string::npos) total += count;
  }
  return total;
}

}  // namespace fusedps
