// File helpers shared by the safetensors code and the checkpoints
// (tensor/io/file_io.h): exact reads, the atomic file write and CRC-32C.
#include "tandem/tensor/io/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "tandem/runtime/error.h"

#if defined(__SSE4_2__)
#include <nmmintrin.h>
#endif

namespace tandem {

std::string errno_text(int err) {
  return std::generic_category().message(err);
}

void pread_exact(int fd, const std::string& path, uint64_t offset, void* dst, size_t nbytes) {
  auto* p = static_cast<char*>(dst);
  size_t done = 0;
  while (done < nbytes) {
    ssize_t n = ::pread(fd, p + done, nbytes - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    TANDEM_CHECK(n >= 0, "[tensor::pread_exact] {}: expected to read {} bytes at offset {}, got {}",
                 path, nbytes, offset + done, errno_text(errno));
    TANDEM_CHECK(n > 0,
                 "[tensor::pread_exact] {}: expected {} bytes at offset {}, got end of file "
                 "(the file is truncated)",
                 path, nbytes - done, offset + done);
    done += static_cast<size_t>(n);
  }
}

namespace {

void write_all(int fd, const std::string& path, uint64_t offset, const void* data, size_t nbytes) {
  const auto* p = static_cast<const char*>(data);
  size_t done = 0;
  while (done < nbytes) {
    ssize_t n = ::pwrite(fd, p + done, nbytes - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    TANDEM_CHECK(n > 0,
                 "[tensor::FileWriter] expected to write {} bytes to {} at offset {}, got {}",
                 nbytes - done, path, offset + done, n < 0 ? errno_text(errno) : "no progress");
    done += static_cast<size_t>(n);
  }
}

}  // namespace

void sync_directory(const std::string& dir, std::string_view who) {
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  TANDEM_CHECK(fd.get() >= 0,
               "[{}] expected to open directory {} to sync it, got {} (what was renamed or "
               "created in it may not survive a crash)",
               who, dir, errno_text(errno));
  if (::fsync(fd.get()) != 0 && errno != EINVAL && errno != ENOTSUP) {
    TANDEM_FAIL(
        "[{}] expected fsync of directory {} to succeed, got {} (what was renamed or created "
        "in it may not survive a crash)",
        who, dir, errno_text(errno));
  }
}

namespace {

// fsync of the directory holding a renamed file, so the rename itself survives a crash.
void fsync_directory(const std::string& path) {
  std::filesystem::path parent = std::filesystem::path(path).parent_path();
  sync_directory(parent.empty() ? std::string(".") : parent.string(),
                 "tensor::write_file_atomically");
}

// ---- CRC-32C tables (slicing by 8) ----

constexpr uint32_t kCrc32cPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Crc32cTables {
  std::array<std::array<uint32_t, 256>, 8> t{};
};

constexpr Crc32cTables make_crc32c_tables() {
  Crc32cTables tables;
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k)
      c = (c & 1) ? (c >> 1) ^ kCrc32cPoly : c >> 1;
    tables.t[0][i] = c;
  }
  // t[k][i]: the CRC of byte i followed by k zero bytes.
  for (int k = 1; k < 8; ++k) {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t prev = tables.t[k - 1][i];
      tables.t[k][i] = (prev >> 8) ^ tables.t[0][prev & 0xff];
    }
  }
  return tables;
}

constexpr Crc32cTables kCrc32c = make_crc32c_tables();

}  // namespace

// ---- FileWriter and write_file_atomically ----

void FileWriter::write(const void* data, size_t nbytes) {
  write_all(fd_, path_, size_, data, nbytes);
  size_ += nbytes;
}

void FileWriter::write_at(uint64_t offset, const void* data, size_t nbytes) {
  TANDEM_CHECK(offset <= size_ && nbytes <= size_ - offset,
               "[tensor::FileWriter] expected write_at inside the {} bytes written to {}, got "
               "[{}, {})",
               size_, path_, offset, offset + nbytes);
  write_all(fd_, path_, offset, data, nbytes);
}

void write_file_atomically(const std::string& path, const std::function<void(FileWriter&)>& write) {
  // Unique per call, so two threads writing the same path never share a temporary.
  static std::atomic<uint64_t> counter{0};
  const std::string tmp =
      fmt::format("{}.tmp.{}.{}", path, static_cast<long>(::getpid()), counter.fetch_add(1));
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  TANDEM_CHECK(fd >= 0,
               "[tensor::write_file_atomically] expected to create the temporary file {} for {}, "
               "got {}",
               tmp, path, errno_text(errno));
  try {
    FileWriter writer(fd, tmp);
    write(writer);
    TANDEM_CHECK(::fsync(fd) == 0,
                 "[tensor::write_file_atomically] expected fsync of {} to succeed, got {}", tmp,
                 errno_text(errno));
    int rc = ::close(fd);
    fd = -1;
    TANDEM_CHECK(rc == 0, "[tensor::write_file_atomically] expected close of {} to succeed, got {}",
                 tmp, errno_text(errno));
    TANDEM_CHECK(::rename(tmp.c_str(), path.c_str()) == 0,
                 "[tensor::write_file_atomically] expected to rename {} to {}, got {}", tmp, path,
                 errno_text(errno));
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_directory(path);
}

// ---- CRC-32C ----

namespace detail {
uint32_t crc32c_portable(const void* data, size_t nbytes, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  const auto& t = kCrc32c.t;
  crc = ~crc;
  for (; nbytes >= 8; nbytes -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    word ^= crc;
    crc = t[7][word & 0xff] ^ t[6][(word >> 8) & 0xff] ^ t[5][(word >> 16) & 0xff] ^
          t[4][(word >> 24) & 0xff] ^ t[3][(word >> 32) & 0xff] ^ t[2][(word >> 40) & 0xff] ^
          t[1][(word >> 48) & 0xff] ^ t[0][word >> 56];
  }
  for (; nbytes > 0; --nbytes, ++p)
    crc = t[0][(crc ^ *p) & 0xff] ^ (crc >> 8);
  return ~crc;
}
}  // namespace detail

#if defined(__SSE4_2__)
uint32_t crc32c(const void* data, size_t nbytes, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t c = ~crc;
  for (; nbytes >= 8; nbytes -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
  }
  for (; nbytes > 0; --nbytes, ++p)
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p);
  return ~static_cast<uint32_t>(c);
}
#else
uint32_t crc32c(const void* data, size_t nbytes, uint32_t crc) {
  return detail::crc32c_portable(data, nbytes, crc);
}
#endif

}  // namespace tandem
