#include "tandem/runtime/allocator.h"

#include <atomic>
#include <cstdlib>
#include <iterator>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "tandem/runtime/cuda/cuda_api.h"
#include "tandem/runtime/error.h"

namespace tandem {
namespace {

constexpr size_t kSmall = 1 << 20;
constexpr size_t kSmallRound = 512;

size_t round_size(size_t n) {
  if (n == 0) n = 1;
  if (n <= kSmall) return (n + kSmallRound - 1) / kSmallRound * kSmallRound;
  size_t p = size_t{1} << (63 - __builtin_clzll(n));  // largest power of two <= n
  if (p == n) return n;
  size_t step = p / 4;
  return (n + step - 1) / step * step;
}

// Note [Allocator fast path]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every tensor op allocates its output, so the allocator's bookkeeping is part
// of the per-op overhead that tandem-bench autograd measures against LibTorch
// (it was ~40% of a tiny op: a std::mutex, and a node allocated and freed in
// an unordered_map of live blocks and in a multimap of free blocks per call).
// Here a call touches no heap memory once the cache is warm:
// - live blocks sit in an open-addressing table keyed by pointer (linear
//   probing, backward-shift deletion), so insert and erase never allocate;
// - free blocks sit in per-size stacks (one per 512-byte step up to 1 MiB,
//   and a map of stacks for the few larger sizes), reused LIFO;
// - the lock is a test-and-test-and-set spinlock: every critical section is a
//   few dozen instructions, and a waiter yields after a short spin;
// - the streams a block was recorded on (record_stream, CUDA only) live in a
//   side map that is empty on CPU.
class SpinLock {
 public:
  void lock() {
    for (int spins = 0; flag_.exchange(true, std::memory_order_acquire); ++spins) {
      while (flag_.load(std::memory_order_relaxed)) {
        if (++spins > 64) std::this_thread::yield();
      }
    }
  }
  void unlock() { flag_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> flag_{false};
};

// Live blocks by pointer (Note [Allocator fast path]).
class LiveTable {
 public:
  struct Entry {
    void* ptr = nullptr;
    size_t size = 0;
    uint64_t pool = 0;
    uint32_t thread = 0;  // that allocated it (Note [Allocator thread affinity])
  };

  LiveTable() : slots_(64) {}

  void insert(void* ptr, size_t size, uint64_t pool, uint32_t thread) {
    if (2 * (count_ + 1) > slots_.size()) grow();
    place({ptr, size, pool, thread});
    ++count_;
  }

  Entry* find(void* ptr) {
    for (size_t i = home(ptr);; i = next(i)) {
      if (slots_[i].ptr == ptr) return &slots_[i];
      if (slots_[i].ptr == nullptr) return nullptr;
    }
  }

  // Removes `ptr` into `out`; false when it is not live.
  bool erase(void* ptr, Entry& out) {
    size_t i = home(ptr);
    for (;; i = next(i)) {
      if (slots_[i].ptr == ptr) break;
      if (slots_[i].ptr == nullptr) return false;
    }
    out = slots_[i];
    // Backward-shift: move later entries of the probe run into the hole.
    for (size_t j = next(i);; j = next(j)) {
      if (slots_[j].ptr == nullptr) break;
      const size_t h = home(slots_[j].ptr);
      const bool movable = (j > i) ? (h <= i || h > j) : (h <= i && h > j);
      if (movable) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i] = Entry{};
    --count_;
    return true;
  }

 private:
  size_t home(void* ptr) const {
    const uint64_t h = (reinterpret_cast<uintptr_t>(ptr) >> 6) * 0x9e3779b97f4a7c15ull;
    return static_cast<size_t>(h >> 32) & (slots_.size() - 1);
  }
  size_t next(size_t i) const { return (i + 1) & (slots_.size() - 1); }
  void place(const Entry& e) {
    size_t i = home(e.ptr);
    while (slots_[i].ptr != nullptr)
      i = next(i);
    slots_[i] = e;
  }
  void grow() {
    std::vector<Entry> old(slots_.size() * 2);
    old.swap(slots_);
    for (const Entry& e : old) {
      if (e.ptr != nullptr) place(e);
    }
  }

  std::vector<Entry> slots_;  // a power of two
  size_t count_ = 0;
};

// Note [Allocator thread affinity]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A block remembers the thread that allocated it, and an allocation takes
// the most recently freed block its own thread allocated among the top
// kAffinityDepth of its size's stack, else the top one. A plain LIFO hands a
// thread whatever block was freed last, by anyone: with the rank threads of
// the threads backend, each allocating a collective's output while the others
// still hold theirs, a synchronous loop of 4 ranks cycled through 6-7 output
// blocks instead of 4, and the working set of a 4 MiB all_gather or
// all_to_all (inputs, outputs) outgrew the 32 MiB L3 (README, benchmark
// figures of `tandem-bench comm`). With affinity a thread
// gets back the block it wrote last, still in the cache (in its own core's L2
// when small), much as glibc's per-thread arenas give malloc. It keys on the
// allocating thread, not the freeing one, because a Work's last reference may
// go on another thread (the threads backend's retirer lets go of every Work
// before it releases the ranks, Note [Threads jobs], but other owners exist).
// The choice is only among free blocks of one rounded size and pool, so
// nothing else changes.
constexpr size_t kAffinityDepth = 8;

// A small number naming the calling thread (Note [Allocator thread
// affinity]); never reused, so a dead thread's blocks match nobody.
uint32_t thread_tag() {
  static std::atomic<uint32_t> next{1};
  thread_local const uint32_t tag = next.fetch_add(1, std::memory_order_relaxed);
  return tag;
}

struct FreeBlock {
  void* ptr = nullptr;
  uint32_t thread = 0;  // that allocated it
};

// Free blocks of one pool by rounded size (Note [Allocator fast path]).
struct FreeLists {
  std::vector<std::vector<FreeBlock>> small{kSmall / kSmallRound + 1};
  std::map<size_t, std::vector<FreeBlock>> large;
  std::vector<FreeBlock>& at(size_t size) {
    return size <= kSmall ? small[size / kSmallRound] : large[size];
  }
  template <class F>
  void for_each(F&& f) {
    for (auto& list : small)
      f(list);
    for (auto& [size, list] : large)
      f(list);
  }
};

// Note [Caching allocator].
class CachingAllocator final : public Allocator {
 public:
  CachingAllocator(Device device, RawMemory raw, bool stream_aware)
      : device_(device), raw_(raw), stream_aware_(stream_aware) {}
  ~CachingAllocator() override { empty_cache(); }

  void* allocate(size_t nbytes, const Stream& stream) override {
    size_t size = round_size(nbytes);
    uint64_t pool = pool_of(stream);
    std::lock_guard<SpinLock> lock(mu_);
    ++stats_.num_allocs;
    if (!pending_.empty()) process_pending();
    void* ptr = take_cached(pool, size);
    if (ptr == nullptr) {
      ptr = raw_.alloc(size, device_.index());
      if (ptr == nullptr) {
        release_cached();
        ptr = raw_.alloc(size, device_.index());
      }
      TANDEM_CHECK(ptr != nullptr,
                   "[runtime::allocate] expected {} bytes on {}, got out of memory ({} bytes "
                   "allocated, {} reserved)",
                   size, device_.str(), stats_.allocated_bytes, stats_.reserved_bytes);
      ++stats_.num_system_allocs;
      stats_.reserved_bytes += static_cast<int64_t>(size);
      stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
    }
    live_.insert(ptr, size, pool, thread_tag());
    stats_.allocated_bytes += static_cast<int64_t>(size);
    stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
    return ptr;
  }

  void deallocate(void* ptr) override {
    if (ptr == nullptr) return;
    std::lock_guard<SpinLock> lock(mu_);
    LiveTable::Entry block;
    TANDEM_INTERNAL_ASSERT(live_.erase(ptr, block),
                           "deallocate of a pointer not from this allocator");
    stats_.allocated_bytes -= static_cast<int64_t>(block.size);
    auto users = users_.empty() ? users_.end() : users_.find(ptr);
    if (users == users_.end()) {
      lists(block.pool).at(block.size).push_back({ptr, block.thread});
      return;
    }
    Pending pending{ptr, block.size, block.pool, block.thread, {}};
    for (const Stream& s : users->second) {
      Event e;
      e.record(s);
      pending.events.push_back(std::move(e));
    }
    users_.erase(users);
    pending_.push_back(std::move(pending));
  }

  void record_stream(void* ptr, const Stream& stream) override {
    std::lock_guard<SpinLock> lock(mu_);
    LiveTable::Entry* block = live_.find(ptr);
    TANDEM_CHECK(block != nullptr,
                 "[runtime::record_stream] expected a live block of this allocator, got {}", ptr);
    if (pool_of(stream) == block->pool) return;
    std::vector<Stream>& users = users_[ptr];
    for (const Stream& s : users) {
      if (s == stream) return;
    }
    users.push_back(stream);
  }

  MemoryStats stats() const override {
    std::lock_guard<SpinLock> lock(mu_);
    return stats_;
  }

  void reset_peak() override {
    std::lock_guard<SpinLock> lock(mu_);
    stats_.peak_allocated_bytes = stats_.allocated_bytes;
    stats_.peak_reserved_bytes = stats_.reserved_bytes;
  }

  void empty_cache() override {
    std::lock_guard<SpinLock> lock(mu_);
    process_pending();
    release_cached();
  }

 private:
  struct Pending {
    void* ptr;
    size_t size;
    uint64_t pool;
    uint32_t thread;  // that allocated it
    std::vector<Event> events;
  };

  uint64_t pool_of(const Stream& stream) const { return stream_aware_ ? stream.id() : 0; }

  FreeLists& lists(uint64_t pool) {
    if (pool == 0) return pool0_;
    return pools_[pool];
  }

  void* take_cached(uint64_t pool, size_t size) {
    if (pool != 0 && pools_.find(pool) == pools_.end()) return nullptr;
    std::vector<FreeBlock>& list = lists(pool).at(size);
    if (list.empty()) return nullptr;
    // Note [Allocator thread affinity].
    const uint32_t me = thread_tag();
    size_t pick = list.size() - 1;
    for (size_t i = list.size(); i-- > 0 && list.size() - i <= kAffinityDepth;) {
      if (list[i].thread == me) {
        pick = i;
        break;
      }
    }
    void* ptr = list[pick].ptr;
    list.erase(list.begin() + static_cast<std::ptrdiff_t>(pick));
    return ptr;
  }

  void process_pending() {
    for (size_t i = 0; i < pending_.size();) {
      bool done = true;
      for (const Event& e : pending_[i].events)
        done = done && e.query();
      if (done) {
        lists(pending_[i].pool)
            .at(pending_[i].size)
            .push_back({pending_[i].ptr, pending_[i].thread});
        pending_[i] = std::move(pending_.back());
        pending_.pop_back();
      } else {
        ++i;
      }
    }
  }

  void release_cached() {
    auto release = [&](FreeLists& lists) {
      lists.for_each([&](std::vector<FreeBlock>& list) {
        for (const FreeBlock& block : list) {
          raw_.free(block.ptr, device_.index());
        }
        list.clear();
      });
      for (auto it = lists.large.begin(); it != lists.large.end();)
        it = it->second.empty() ? lists.large.erase(it) : std::next(it);
    };
    // The reserved bytes of a free block are its rounded size: recount them.
    auto freed_bytes = [](FreeLists& lists) {
      int64_t bytes = 0;
      for (size_t i = 0; i < lists.small.size(); ++i)
        bytes += static_cast<int64_t>(i * kSmallRound * lists.small[i].size());
      for (auto& [size, list] : lists.large)
        bytes += static_cast<int64_t>(size * list.size());
      return bytes;
    };
    stats_.reserved_bytes -= freed_bytes(pool0_);
    release(pool0_);
    for (auto& [pool, lists] : pools_) {
      stats_.reserved_bytes -= freed_bytes(lists);
      release(lists);
    }
  }

  Device device_;
  RawMemory raw_;
  bool stream_aware_;
  mutable SpinLock mu_;
  LiveTable live_;
  FreeLists pool0_;                                       // the only pool without stream awareness
  std::unordered_map<uint64_t, FreeLists> pools_;         // other streams' pools (CUDA)
  std::unordered_map<void*, std::vector<Stream>> users_;  // record_stream; empty on CPU
  std::vector<Pending> pending_;
  MemoryStats stats_;
};

void* cpu_alloc(size_t nbytes, int) {
  return std::aligned_alloc(64, (nbytes + 63) / 64 * 64);
}
void cpu_free(void* ptr, int) {
  std::free(ptr);
}

constexpr int kMaxDevices = 16;

}  // namespace

std::unique_ptr<Allocator> make_caching_allocator(Device device, RawMemory raw, bool stream_aware) {
  return std::make_unique<CachingAllocator>(device, raw, stream_aware);
}

Allocator& allocator_for(Device device) {
  // Intentionally leaked: tensors with static storage duration may be destroyed
  // after any other static, and must still find their allocator.
  static Allocator* const cpu =
      make_caching_allocator(Device::cpu(), {cpu_alloc, cpu_free}, false).release();
  if (device.is_cpu()) return *cpu;
  static std::once_flag once[kMaxDevices];
  static Allocator* cuda[kMaxDevices] = {};
  TANDEM_CHECK(device.index() < kMaxDevices, "[runtime::allocator_for] expected index < {}, got {}",
               kMaxDevices, device.index());
  std::call_once(once[device.index()], [&] {
    cuda[device.index()] =
        make_caching_allocator(device, {cuda_api::malloc, cuda_api::free}, true).release();
  });
  return *cuda[device.index()];
}

MemoryStats memory_stats(Device device) {
  return allocator_for(device).stats();
}
void reset_peak_memory(Device device) {
  allocator_for(device).reset_peak();
}
void empty_cache(Device device) {
  allocator_for(device).empty_cache();
}

}  // namespace tandem
