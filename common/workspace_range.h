// workspace_range.h: the bounds check of a byte range in a same-host workspace (proto
// OpenWorkspace; server/workspace/workspace.h), shared by the chunk reader (a push's chunk
// naming its bytes there) and the pull reactor (a pull's offsets there).
#ifndef FUSEDPS_COMMON_WORKSPACE_RANGE_H_
#define FUSEDPS_COMMON_WORKSPACE_RANGE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace fusedps {

// OK when [offset, offset + bytes) lies in a workspace of `size` bytes (no overflow past
// 2^64); else INVALID_ARGUMENT naming `field` and the workspace's size.
inline absl::Status CheckWorkspaceRange(uint64_t offset, uint64_t bytes, uint64_t size,
                                        absl::string_view field) {
  if (offset > size || bytes > size - offset) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": bytes [", offset, ", ", offset, " + ",
                                                   bytes, ") pass the end of the workspace (", size,
                                                   " bytes)"));
  }
  return absl::OkStatus();
}

}  // namespace fusedps

#endif  // FUSEDPS_COMMON_WORKSPACE_RANGE_H_
