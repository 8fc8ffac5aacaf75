// The fingerprint board (Note [MPI fingerprint board] in mpi_board.h).
#include "tandem/comm/mpi/mpi_board.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

namespace tandem::mpi {
namespace {

// The board lives in memory other processes write: every access to a
// sequence word or read counter is atomic (lock-free 64-bit atomics are
// address-free, so they order across processes too).
uint64_t load(const uint64_t& word) {
  return std::atomic_ref<uint64_t>(const_cast<uint64_t&>(word)).load(std::memory_order_acquire);
}
void store(uint64_t& word, uint64_t value) {
  std::atomic_ref<uint64_t>(word).store(value, std::memory_order_release);
}

}  // namespace

std::unique_ptr<Board> Board::open(const std::string& name, int n, int me, std::string& why) {
  static_assert(std::atomic_ref<uint64_t>::is_always_lock_free);
  const size_t bytes = sizeof(Area) * static_cast<size_t>(n);
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    why = fmt::format("shm_open({}) failed: {}", name, std::strerror(errno));
    return nullptr;
  }
  // Every rank sets the same size; the first one zero-fills the object.
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    why = fmt::format("ftruncate({}, {}) failed: {}", name, bytes, std::strerror(errno));
    ::close(fd);
    return nullptr;
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (base == MAP_FAILED) {
    why = fmt::format("mmap of {} ({} bytes) failed: {}", name, bytes, std::strerror(err));
    return nullptr;
  }
  return std::unique_ptr<Board>(new Board(base, bytes, n, me));
}

void Board::unlink(const std::string& name) {
  ::shm_unlink(name.c_str());
}

Board::~Board() {
  ::munmap(base_, bytes_);
}

bool Board::slot_free(uint64_t h) const {
  if (h < kSlots) return true;
  for (int r = 0; r < n_; ++r) {
    if (load(area(r).read) < h - kSlots + 1) return false;
  }
  return true;
}

void Board::write(uint64_t h, const Hello& hello) {
  Slot& slot = area(me_).slots[h % kSlots];
  slot.hello = hello;  // read by peers only after they see seq (below)
  store(slot.seq, h + 1);
}

bool Board::complete(uint64_t h) const {
  for (int r = 0; r < n_; ++r) {
    if (load(area(r).slots[h % kSlots].seq) != h + 1) return false;
  }
  return true;
}

void Board::read(uint64_t h, std::vector<Hello>& out) {
  out.resize(static_cast<size_t>(n_));
  for (int r = 0; r < n_; ++r)
    out[r] = area(r).slots[h % kSlots].hello;
  store(area(me_).read, h + 1);
}

std::vector<int> Board::not_written(uint64_t h) const {
  std::vector<int> ranks;
  for (int r = 0; r < n_; ++r) {
    if (load(area(r).slots[h % kSlots].seq) != h + 1) ranks.push_back(r);
  }
  return ranks;
}

std::vector<int> Board::not_read(uint64_t h) const {
  std::vector<int> ranks;
  for (int r = 0; r < n_; ++r) {
    if (h >= kSlots && load(area(r).read) < h - kSlots + 1) ranks.push_back(r);
  }
  return ranks;
}

}  // namespace tandem::mpi
