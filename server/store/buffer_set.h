// buffer_set.h: a model's buffers, the module state that is not a parameter
// (torch.nn.Module.register_buffer: BatchNorm's running_mean, running_var and
// num_batches_tracked). A model keeps them so that its checkpoints restore the whole module,
// not only its parameters: the trainer writes their values (WriteBuffers), the checkpoint holds
// them (buffers.safetensors), a trainer that resumes reads them back (PullBuffers). No optimizer
// ever touches them.
//
// A BufferSet is immutable, as a ShardView is: the engine builds a new one for each write
// (Merged), in stream order with the steps, and swaps it in; readers and checkpoint cuts hold a
// std::shared_ptr to the set they saw. Buffers live in host memory (they are small: BatchNorm
// keeps 2 floats per channel) and are shared between sets (a write copies only the pointers of
// the buffers it does not replace).
//
// Usage:
//   std::shared_ptr<const BufferSet> set = BufferSet::Empty();
//   absl::StatusOr<std::shared_ptr<const BufferSet>> next = set->Merged(std::move(writes));
#ifndef FUSEDPS_SERVER_STORE_BUFFER_SET_H_
#define FUSEDPS_SERVER_STORE_BUFFER_SET_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/safetensors.h"

namespace fusedps {

inline constexpr size_t kMaxBufferNameBytes = 256;
// A model's buffers: at most this many, and this many bytes in all (host memory).
inline constexpr size_t kMaxBuffers = 4096;
inline constexpr uint64_t kMaxBufferSetBytes = uint64_t{256} << 20;

// One buffer: a tensor of any safetensors dtype (safetensors::DType: torch's float32, int64,
// bool, ...), its elements little-endian and row-major in `data`.
struct BufferValue {
  std::string name;  // 1..kMaxBufferNameBytes bytes.
  safetensors::DType dtype = safetensors::DType::kF32;
  std::vector<int64_t> shape;  // {} for a 0-dim buffer; each dimension >= 0.
  std::string data;            // Exactly numel x DTypeSize(dtype) bytes.
};

// INVALID_ARGUMENT, naming the buffer and the limit, for a bad name, a negative dimension, or
// data whose size does not match the shape and dtype.
absl::Status CheckBuffer(const BufferValue& buffer);

class BufferSet {
 public:
  static std::shared_ptr<const BufferSet> Empty();
  // A set of `buffers` alone (a restore's). Errors as Merged's.
  static absl::StatusOr<std::shared_ptr<const BufferSet>> Of(std::vector<BufferValue> buffers);

  // This set with `writes` replacing the buffers of their names (a buffer may change its shape
  // or dtype) and adding the others. All or nothing. Errors: INVALID_ARGUMENT for no writes, a
  // name written twice, a bad buffer (CheckBuffer), more than kMaxBuffers buffers or more than
  // kMaxBufferSetBytes bytes afterwards (naming the limit).
  absl::StatusOr<std::shared_ptr<const BufferSet>> Merged(std::vector<BufferValue> writes) const;

  size_t size() const { return buffers_.size(); }
  bool empty() const { return buffers_.empty(); }
  uint64_t bytes() const { return bytes_; }  // Of their data.
  // By name, in name order.
  const std::map<std::string, std::shared_ptr<const BufferValue>>& buffers() const {
    return buffers_;
  }
  const BufferValue* Find(const std::string& name) const;  // nullptr when absent.

 private:
  std::map<std::string, std::shared_ptr<const BufferValue>> buffers_;
  uint64_t bytes_ = 0;
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_STORE_BUFFER_SET_H_
