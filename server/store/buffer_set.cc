#include "server/store/buffer_set.h"

#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/store/shard_view.h"

namespace fusedps {

absl::Status CheckBuffer(const BufferValue& buffer) {
  if (absl::Status s = CheckName(buffer.name, kMaxBufferNameBytes, "buffer name"); !s.ok()) {
    return s;
  }
  uint64_t numel = 1;
  for (int64_t d : buffer.shape) {
    if (d < 0 || (d != 0 && numel > (kMaxBufferSetBytes / static_cast<uint64_t>(d)))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "buffer ", QuoteName(buffer.name), ": shape [", absl::StrJoin(buffer.shape, ", "),
          "] has a dimension < 0 or more than ", kMaxBufferSetBytes, " elements"));
    }
    numel *= static_cast<uint64_t>(d);
  }
  const uint64_t bytes = numel * safetensors::DTypeSize(buffer.dtype);
  if (buffer.data.size() != bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("buffer ", QuoteName(buffer.name), ": data has ", buffer.data.size(),
                     " bytes; shape [", absl::StrJoin(buffer.shape, ", "), "] of ",
                     safetensors::DTypeName(buffer.dtype), " needs ", bytes));
  }
  return absl::OkStatus();
}

std::shared_ptr<const BufferSet> BufferSet::Empty() {
  static const std::shared_ptr<const BufferSet> empty = std::make_shared<const BufferSet>();
  return empty;
}

absl::StatusOr<std::shared_ptr<const BufferSet>> BufferSet::Of(std::vector<BufferValue> buffers) {
  if (buffers.empty()) return Empty();
  return Empty()->Merged(std::move(buffers));
}

absl::StatusOr<std::shared_ptr<const BufferSet>> BufferSet::Merged(
    std::vector<BufferValue> writes) const {
  if (writes.empty()) return absl::InvalidArgumentError("buffers: none given");
  std::set<std::string> names;
  for (const BufferValue& b : writes) {
    if (absl::Status s = CheckBuffer(b); !s.ok()) return s;
    if (!names.insert(b.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("buffers: ", QuoteName(b.name), " is written twice"));
    }
  }
  auto next = std::make_shared<BufferSet>(*this);
  for (BufferValue& b : writes) {
    const auto old = next->buffers_.find(b.name);
    if (old != next->buffers_.end()) next->bytes_ -= old->second->data.size();
    next->bytes_ += b.data.size();
    std::string name = b.name;
    next->buffers_[std::move(name)] = std::make_shared<const BufferValue>(std::move(b));
  }
  if (next->buffers_.size() > kMaxBuffers) {
    return absl::InvalidArgumentError(absl::StrCat("buffers: a model holds at most ", kMaxBuffers,
                                                   "; this write makes ", next->buffers_.size()));
  }
  if (next->bytes_ > kMaxBufferSetBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("buffers: a model holds at most ", kMaxBufferSetBytes,
                     " bytes of them; this write makes ", next->bytes_));
  }
  return std::shared_ptr<const BufferSet>(std::move(next));
}

const BufferValue* BufferSet::Find(const std::string& name) const {
  const auto it = buffers_.find(name);
  return it == buffers_.end() ? nullptr : it->second.get();
}

}  // namespace fusedps
