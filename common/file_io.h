// file_io.h: the few POSIX file operations durable files need (write all, read all, fsync,
// close), with errors as absl statuses carrying errno's code and the path: ENOSPC is
// RESOURCE_EXHAUSTED, ENOENT NOT_FOUND, EACCES PERMISSION_DENIED. Used by common/safetensors
// and server/checkpoint.
#ifndef FUSEDPS_COMMON_FILE_IO_H_
#define FUSEDPS_COMMON_FILE_IO_H_

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
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

// Reads exactly `bytes` into dst (retrying short reads and EINTR). Errors: the errno's status;
// DATA_LOSS when the file ends first.
inline absl::Status ReadAll(int fd, void* dst, size_t bytes, const std::string& path) {
  char* p = static_cast<char*>(dst);
  while (bytes > 0) {
    const ssize_t n = read(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Errno("cannot read", path);
    if (n == 0) return absl::DataLossError(absl::StrCat(path, " ends ", bytes, " bytes early"));
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// A whole file's bytes. Errors: the errno's status.
inline absl::StatusOr<std::string> ReadFile(const std::string& path) {
  Fd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return Errno("cannot open", path);
  const off_t size = lseek(fd.get(), 0, SEEK_END);
  if (size < 0 || lseek(fd.get(), 0, SEEK_SET) != 0) return Errno("cannot seek", path);
  std::string bytes(static_cast<size_t>(size), '\0');
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = read(fd.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Errno("cannot read", path);
    if (n == 0) break;  // Shrunk meanwhile: the caller sees fewer bytes.
    done += static_cast<size_t>(n);
  }
  bytes.resize(done);
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
