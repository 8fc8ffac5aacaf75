// File helpers shared by the safetensors code and the checkpoints: an owned
// file descriptor, exact positional reads, the atomic file write and CRC-32C.
// Every failure throws tandem::Error naming the file and errno.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

namespace tandem {

// strerror-like text of an errno value.
std::string errno_text(int err);

// An owned file descriptor (closed on destruction; -1 = none).
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// Reads exactly `nbytes` at `offset` of `fd` (`path` names it in errors); a
// short read means the file shrank: an error saying it is truncated.
void pread_exact(int fd, const std::string& path, uint64_t offset, void* dst, size_t nbytes);

// ---- atomic file writes ----

// Sequential writes into the temporary file of write_file_atomically, plus
// overwrites of bytes already written (a header patched once the data is known).
// Every failure throws tandem::Error naming the file and errno.
class FileWriter {
 public:
  FileWriter(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  // Appends `nbytes` at the end.
  void write(const void* data, size_t nbytes);
  // Overwrites [offset, offset + nbytes), which must lie in what was written.
  void write_at(uint64_t offset, const void* data, size_t nbytes);
  // Bytes written so far.
  uint64_t size() const { return size_; }
  // The temporary file being written (not the final path).
  const std::string& path() const { return path_; }

 private:
  int fd_;  // owned by write_file_atomically
  std::string path_;
  uint64_t size_ = 0;
};

// Writes `path` so that readers see either the old file or the complete new
// one, also across a crash: `write` fills `<path>.tmp.<pid>.<n>` in the same
// directory, which is then fsync'ed, renamed over `path`, and the directory
// fsync'ed. When `write` (or any step) throws, the temporary file is removed,
// `path` is left as it was and the exception propagates.
void write_file_atomically(const std::string& path, const std::function<void(FileWriter&)>& write);

// fsync of directory `dir`, so that what was renamed or created in it
// survives a crash. A file system that cannot sync directories (EINVAL,
// ENOTSUP) is accepted. Errors name `who` ("checkpoint::save").
void sync_directory(const std::string& dir, std::string_view who);

// ---- CRC-32C (Castagnoli, as in iSCSI/ext4: reflected 0x82F63B78) ----

// Extends `crc` (the value of the bytes before, 0 to start) over `data`.
// Uses SSE4.2 when the build targets it, else a table.
uint32_t crc32c(const void* data, size_t nbytes, uint32_t crc = 0);
namespace detail {
uint32_t crc32c_portable(const void* data, size_t nbytes, uint32_t crc);  // the table path
}  // namespace detail

}  // namespace tandem
