// byte_buffer_view.h: a gRPC ByteBuffer's slices as string views, without copying, for readers
// that parse messages from gRPC's slices (common/slice_input_stream.h): the server's push
// reader (server/ingest/push_message.h) and the client's pull reader (client/pull_into.cc).
#ifndef FUSEDPS_COMMON_BYTE_BUFFER_VIEW_H_
#define FUSEDPS_COMMON_BYTE_BUFFER_VIEW_H_

#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace fusedps {

// Holds references to the buffer's slices while it lives; the views stay valid until then, even
// if the buffer is cleared.
class ByteBufferView {
 public:
  explicit ByteBufferView(const grpc::ByteBuffer& buffer) {
    ok_ = buffer.Dump(&slices_).ok();
    views_.reserve(slices_.size());
    for (const grpc::Slice& s : slices_) {
      views_.emplace_back(reinterpret_cast<const char*>(s.begin()), s.size());
    }
  }
  ByteBufferView(const ByteBufferView&) = delete;
  ByteBufferView& operator=(const ByteBufferView&) = delete;

  bool ok() const { return ok_; }  // False when gRPC could not hand out the slices.
  absl::Span<const absl::string_view> views() const { return views_; }

 private:
  bool ok_ = false;
  std::vector<grpc::Slice> slices_;
  std::vector<absl::string_view> views_;
};

}  // namespace fusedps

#endif  // FUSEDPS_COMMON_BYTE_BUFFER_VIEW_H_
