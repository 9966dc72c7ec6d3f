// file_io.h: the few POSIX file operations durable files need (write all, read all, fsync,
// close), with
// errors as absl statuses carrying errno's code and the path: ENOSPC is RESOURCE_EXHAUSTED,
// ENOENT NOT_FOUND, EACCES PERMISSION_DENIED. Used by common/safetensors and server/checkpoint.
#ifndef FUSEDPS_COMMON_FILE_IO_H_
#define FUSEDPS_COMMON_FILE_IO_H_

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <functional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace fusedps::file_io {

// errno's status, the message "<what> <path>: <strerror>".
inline absl::Status Errno(const std::string& what, const std::string& path) {
  return absl::ErrnoToStatus(errno, absl::StrCat(what, " ", path));
}

// A file descriptor, closed on every path that does not Close() it.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  void Reset(int fd) {
    if (fd_ >= 0) close(fd_);
    fd_ = fd;
  }
  // close(2), reporting its error (NFS and full disks report write errors there).
  absl::Status Close(const std::string& path) {
    return close(std::exchange(fd_, -1)) == 0 ? absl::OkStatus() : Errno("cannot close", path);
  }

 private:
  int fd_;
};

// Writes all `bytes` (retrying short writes and EINTR).
inline absl::Status WriteAll(int fd, const void* data, size_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = write(fd, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("cannot write", path);
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// Hears of a read's progress: the first `done` bytes of the output are read.
using ReadProgress = std::function<void(size_t done)>;

// Reads a whole file into *bytes (resized to the file; retrying short reads and EINTR). With
// `progress`, the file is read in pieces of at most 8 MiB and `progress` runs after each; the
// bytes read so far may be used meanwhile (*bytes is not moved until this returns).
// Errors: the errno's status.
inline absl::Status ReadFileInto(const std::string& path, std::string* bytes,
                                 const ReadProgress& progress = nullptr) {
  Fd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return Errno("cannot open", path);
  const off_t size = lseek(fd.get(), 0, SEEK_END);
  if (size < 0 || lseek(fd.get(), 0, SEEK_SET) != 0) return Errno("cannot seek", path);
  posix_fadvise(fd.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
  bytes->assign(static_cast<size_t>(size), '\0');
  const size_t piece = progress ? size_t{8} << 20 : bytes->size();
  size_t done = 0;
  while (done < bytes->size()) {
    const ssize_t n = read(fd.get(), bytes->data() + done, std::min(piece, bytes->size() - done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Errno("cannot read", path);
    if (n == 0) break;  // Shrunk meanwhile: the caller sees fewer bytes.
    done += static_cast<size_t>(n);
    if (progress) progress(done);
  }
  bytes->resize(done);
  return absl::OkStatus();
}

// A whole file's bytes (ReadFileInto).
inline absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::string bytes;
  if (absl::Status s = ReadFileInto(path, &bytes); !s.ok()) return s;
  return bytes;
}

// fsync(2) of a file or a directory (a directory's fsync makes its entries durable).
inline absl::Status SyncPath(const std::string& path) {
  Fd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return Errno("cannot open", path);
  if (fsync(fd.get()) != 0) return Errno("cannot fsync", path);
  return fd.Close(path);
}

}  // namespace fusedps::file_io

#endif  // FUSEDPS_COMMON_FILE_IO_H_
