#include "runtime/allocator.h"

#include <cstdlib>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "runtime/cuda/cuda_api.h"
#include "runtime/error.h"

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

// Note [Caching allocator].
class CachingAllocator final : public Allocator {
 public:
  CachingAllocator(Device device, RawMemory raw, bool stream_aware)
      : device_(device), raw_(raw), stream_aware_(stream_aware) {}
  ~CachingAllocator() override { empty_cache(); }

  void* allocate(size_t nbytes, const Stream& stream) override {
    size_t size = round_size(nbytes);
    uint64_t pool = pool_of(stream);
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.num_allocs;
    process_pending();
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
    live_[ptr] = Block{size, pool, {}};
    stats_.allocated_bytes += static_cast<int64_t>(size);
    stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
    return ptr;
  }

  void deallocate(void* ptr) override {
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(ptr);
    TANDEM_INTERNAL_ASSERT(it != live_.end(), "deallocate of a pointer not from this allocator");
    Block block = std::move(it->second);
    live_.erase(it);
    stats_.allocated_bytes -= static_cast<int64_t>(block.size);
    if (block.users.empty()) {
      pools_[block.pool].emplace(block.size, ptr);
      return;
    }
    Pending pending{ptr, block.size, block.pool, {}};
    for (const Stream& s : block.users) {
      Event e;
      e.record(s);
      pending.events.push_back(std::move(e));
    }
    pending_.push_back(std::move(pending));
  }

  void record_stream(void* ptr, const Stream& stream) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(ptr);
    TANDEM_CHECK(it != live_.end(),
                 "[runtime::record_stream] expected a live block of this allocator, got {}", ptr);
    if (pool_of(stream) == it->second.pool) return;
    for (const Stream& s : it->second.users) {
      if (s == stream) return;
    }
    it->second.users.push_back(stream);
  }

  MemoryStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  void reset_peak() override {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.peak_allocated_bytes = stats_.allocated_bytes;
    stats_.peak_reserved_bytes = stats_.reserved_bytes;
  }

  void empty_cache() override {
    std::lock_guard<std::mutex> lock(mu_);
    process_pending();
    release_cached();
  }

 private:
  struct Block {
    size_t size;
    uint64_t pool;
    std::vector<Stream> users;  // streams other than the allocating one
  };
  struct Pending {
    void* ptr;
    size_t size;
    uint64_t pool;
    std::vector<Event> events;
  };

  uint64_t pool_of(const Stream& stream) const { return stream_aware_ ? stream.id() : 0; }

  void* take_cached(uint64_t pool, size_t size) {
    auto p = pools_.find(pool);
    if (p == pools_.end()) return nullptr;
    auto it = p->second.find(size);
    if (it == p->second.end()) return nullptr;
    void* ptr = it->second;
    p->second.erase(it);
    return ptr;
  }

  void process_pending() {
    for (size_t i = 0; i < pending_.size();) {
      bool done = true;
      for (const Event& e : pending_[i].events)
        done = done && e.query();
      if (done) {
        pools_[pending_[i].pool].emplace(pending_[i].size, pending_[i].ptr);
        pending_[i] = std::move(pending_.back());
        pending_.pop_back();
      } else {
        ++i;
      }
    }
  }

  void release_cached() {
    for (auto& [pool, blocks] : pools_) {
      for (auto& [size, ptr] : blocks) {
        raw_.free(ptr, device_.index());
        stats_.reserved_bytes -= static_cast<int64_t>(size);
      }
      blocks.clear();
    }
  }

  Device device_;
  RawMemory raw_;
  bool stream_aware_;
  mutable std::mutex mu_;
  std::unordered_map<void*, Block> live_;
  std::unordered_map<uint64_t, std::multimap<size_t, void*>> pools_;
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
