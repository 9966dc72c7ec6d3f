// slice_input_stream.h: a serialized protobuf message as the consecutive pieces (gRPC's slices,
// as string views) it arrived in, read through protobuf's CodedInputStream without copying
// them first. The server reads pushes this way (server/ingest/push_message.cc), the client
// pulls (client/pull_into.cc): each tensor chunk's payload is then copied once, from gRPC's
// slices to where it belongs.
//
// Usage:
//   SliceInputStream stream(slices);
//   google::protobuf::io::CodedInputStream in(&stream);
//   for (uint32_t tag = in.ReadTag(); tag != 0; tag = in.ReadTag()) ...
//
// Lifetimes: the slices' memory must outlive the stream.
#ifndef FUSEDPS_COMMON_SLICE_INPUT_STREAM_H_
#define FUSEDPS_COMMON_SLICE_INPUT_STREAM_H_

#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "google/protobuf/io/zero_copy_stream.h"

namespace fusedps {

// A message's bytes as consecutive pieces.
using MessageSlices = absl::Span<const absl::string_view>;

class SliceInputStream final : public google::protobuf::io::ZeroCopyInputStream {
 public:
  explicit SliceInputStream(MessageSlices slices) : slices_(slices) {}

  bool Next(const void** data, int* size) override {
    while (index_ < slices_.size()) {
      const absl::string_view slice = slices_[index_];
      if (position_ < slice.size()) {
        *data = slice.data() + position_;
        *size = static_cast<int>(slice.size() - position_);
        byte_count_ += *size;
        position_ = slice.size();
        return true;
      }
      ++index_;
      position_ = 0;
    }
    return false;
  }
  void BackUp(int count) override {
    position_ -= count;
    byte_count_ -= count;
  }
  bool Skip(int count) override {
    const void* data;
    int size;
    while (count > 0) {
      if (!Next(&data, &size)) return false;
      if (size > count) {
        BackUp(size - count);
        return true;
      }
      count -= size;
    }
    return true;
  }
  int64_t ByteCount() const override { return byte_count_; }

 private:
  const MessageSlices slices_;
  size_t index_ = 0;
  size_t position_ = 0;  // In slices_[index_].
  int64_t byte_count_ = 0;
};

}  // namespace fusedps

#endif  // FUSEDPS_COMMON_SLICE_INPUT_STREAM_H_
