// The caching allocator (Note [Caching allocator]) driven by a counting raw
// backend: reuse without system calls, statistics, rounding, out-of-memory
// retry, and the stream-aware rules that keep a block from being handed out
// while another stream may still use it.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "tandem/runtime/allocator.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/stream.h"
#include "tests/support/test_util.h"

using namespace tandem;
using Catch::Matchers::Contains;
using tandem::test::Gate;

namespace {

// A raw backend that counts system calls and can pretend to have only
// `capacity` bytes. RawMemory takes plain function pointers, hence statics.
struct CountingBackend {
  static inline std::mutex mu;
  static inline int allocs = 0;
  static inline int frees = 0;
  static inline int failed = 0;
  static inline int64_t live_bytes = 0;
  static inline int64_t capacity = -1;  // -1: unlimited
  static inline std::map<void*, size_t> sizes;

  static void* alloc(size_t nbytes, int) {
    std::lock_guard<std::mutex> lock(mu);
    if (capacity >= 0 && live_bytes + static_cast<int64_t>(nbytes) > capacity) {
      ++failed;
      return nullptr;
    }
    void* p = std::malloc(nbytes == 0 ? 1 : nbytes);
    ++allocs;
    live_bytes += static_cast<int64_t>(nbytes);
    sizes[p] = nbytes;
    return p;
  }
  static void free(void* p, int) {
    std::lock_guard<std::mutex> lock(mu);
    ++frees;
    auto it = sizes.find(p);
    if (it != sizes.end()) {
      live_bytes -= static_cast<int64_t>(it->second);
      sizes.erase(it);
    }
    std::free(p);
  }
  static void reset() {
    std::lock_guard<std::mutex> lock(mu);
    allocs = frees = failed = 0;
    live_bytes = 0;
    capacity = -1;
    sizes.clear();
  }
  static RawMemory raw() { return RawMemory{&CountingBackend::alloc, &CountingBackend::free}; }
};

// Resets the backend before a test and checks after it that the allocator
// returned everything it took from the system.
struct BackendScope {
  BackendScope() { CountingBackend::reset(); }
  ~BackendScope() { CountingBackend::reset(); }
};

}  // namespace

TEST_CASE("a freed block is reused without a new system allocation", "[allocator]") {
  BackendScope scope;
  Stream s = Stream::create(Device::cpu(), CpuStreamMode::Inline);
  auto alloc = make_caching_allocator(Device::cpu(), CountingBackend::raw(), false);
  void* p = alloc->allocate(4096, s);
  REQUIRE(p != nullptr);
  REQUIRE(CountingBackend::allocs == 1);
  alloc->deallocate(p);
  REQUIRE(CountingBackend::frees == 0);  // cached, not returned
  void* q = alloc->allocate(4096, s);
  REQUIRE(q == p);
  REQUIRE(CountingBackend::allocs == 1);

  // A second live block of the same size must be a different one.
  void* r = alloc->allocate(4096, s);
  REQUIRE(r != q);
  REQUIRE(CountingBackend::allocs == 2);
  MemoryStats st = alloc->stats();
  REQUIRE(st.num_allocs == 3);
  REQUIRE(st.num_system_allocs == 2);
  alloc->deallocate(q);
  alloc->deallocate(r);
  alloc.reset();  // the destructor empties the cache
  REQUIRE(CountingBackend::frees == 2);
  REQUIRE(CountingBackend::live_bytes == 0);
}

TEST_CASE("a block of another rounded size is not reused", "[allocator]") {
  BackendScope scope;
  Stream s = Stream::create(Device::cpu(), CpuStreamMode::Inline);
  auto alloc = make_caching_allocator(Device::cpu(), CountingBackend::raw(), false);
  void* p = alloc->allocate(1000, s);
  alloc->deallocate(p);
  void* q = alloc->allocate(2000, s);
  REQUIRE(q != p);
  REQUIRE(CountingBackend::allocs == 2);
  alloc->deallocate(q);
}

TEST_CASE("a thread gets back the block it allocated before one another thread freed later",
          "[allocator]") {
  // Note [Allocator thread affinity].
  BackendScope scope;
  Stream s = Stream::create(Device::cpu(), CpuStreamMode::Inline);
  auto alloc = make_caching_allocator(Device::cpu(), CountingBackend::raw(), false);
  // Runs `fn` on a thread of its own and waits for it.
  auto on_other_thread = [](auto fn) { std::thread(fn).join(); };

  void* mine = alloc->allocate(8192, s);
  void* theirs = nullptr;
  on_other_thread([&] { theirs = alloc->allocate(8192, s); });
  alloc->deallocate(mine);
  alloc->deallocate(theirs);  // freed here, last: the top of the stack

  SECTION("each thread takes its own block, whoever freed it") {
    void* again = alloc->allocate(8192, s);
    CHECK(again == mine);
    alloc->deallocate(again);
  }
  SECTION("a thread with no block of its own takes the most recently freed one") {
    void* stranger = nullptr;
    on_other_thread([&] { stranger = alloc->allocate(8192, s); });
    CHECK(stranger == theirs);
    alloc->deallocate(stranger);
  }
  SECTION("only the top of the stack is searched") {
    REQUIRE(alloc->allocate(8192, s) == mine);
    // Eight blocks of another thread, freed after ours, bury it.
    std::vector<void*> burying(8);
    on_other_thread([&] {
      for (void*& p : burying)
        p = alloc->allocate(8192, s);
    });
    alloc->deallocate(mine);
    for (void* p : burying)
      alloc->deallocate(p);
    void* top = alloc->allocate(8192, s);
    CHECK(top == burying.back());
    alloc->deallocate(top);
  }
  REQUIRE(CountingBackend::allocs == alloc->stats().num_system_allocs);
  alloc.reset();
  REQUIRE(CountingBackend::live_bytes == 0);
}

TEST_CASE("sizes are rounded: 512 B steps below 1 MiB, quarter powers of two above",
          "[allocator]") {
  BackendScope scope;
  Stream s = Stream::create(Device::cpu(), CpuStreamMode::Inline);
  auto alloc = make_caching_allocator(Device::cpu(), CountingBackend::raw(), false);

  SECTION("1000 and 1010 bytes share a 1024-byte block") {
    void* p = alloc->allocate(1000, s);
    REQUIRE(alloc->stats().allocated_bytes == 1024);
    REQUIRE(CountingBackend::sizes.at(p) == 1024);
    alloc->deallocate(p);
    void* q = alloc->allocate(1010, s);
    REQUIRE(q == p);
    REQUIRE(CountingBackend::allocs == 1);
    alloc->deallocate(q);
  }
  SECTION("zero bytes is a valid request") {
    void* p = alloc->allocate(0, s);
    REQUIRE(p != nullptr);
    REQUIRE(alloc->stats().allocated_bytes == 512);
    alloc->deallocate(p);
  }
  SECTION("exact multiples are not rounded further") {
    void* p = alloc->allocate(512, s);
    REQUIRE(alloc->stats().allocated_bytes == 512);
    void* q = alloc->allocate(513, s);
    REQUIRE(alloc->stats().allocated_bytes == 512 + 1024);
    alloc->deallocate(p);
    alloc->deallocate(q);
  }
  SECTION("above 1 MiB the step is a quarter of the power of two") {
    const size_t mib = size_t{1} << 20;
    void* p = alloc->allocate(mib + 1, s);  // -> 1.25 MiB
    REQUIRE(CountingBackend::sizes.at(p) == mib + mib / 4);
    alloc->deallocate(p);
    void* q = alloc->allocate(mib + mib / 4, s);  // same class
    REQUIRE(q == p);
    REQUIRE(CountingBackend::allocs == 1);
    void* r = alloc->allocate(mib + mib / 4 + 1, s);  // -> 1.5 MiB: new block
    REQUIRE(r != q);
    REQUIRE(CountingBackend::sizes.at(r) == mib + mib / 2);
    void* t = alloc->allocate(4 * mib, s);  // a power of two stays as is
    REQUIRE(CountingBackend::sizes.at(t) == 4 * mib);
    alloc->deallocate(q);
    alloc->deallocate(r);
    alloc->deallocate(t);
  }
}

TEST_CASE("statistics track current, peak and reserved bytes", "[allocator]") {
  BackendScope scope;
  Stream s = Stream::create(Device::cpu(), CpuStreamMode::Inline);
  auto alloc = make_caching_allocator(Device::cpu(), CountingBackend::raw(), false);
  MemoryStats st = alloc->stats();
  REQUIRE(st.allocated_bytes == 0);
  REQUIRE(st.reserved_bytes == 0);
  REQUIRE(st.peak_allocated_bytes == 0);

  void* a = alloc->allocate(1000, s);  // 1024
  void* b = alloc->allocate(5000, s);  // 5120
  st = alloc->stats();
  REQUIRE(st.allocated_bytes == 1024 + 5120);
  REQUIRE(st.peak_allocated_bytes == 1024 + 5120);
  REQUIRE(st.reserved_bytes == 1024 + 5120);
  REQUIRE(st.peak_reserved_bytes == 1024 + 5120);
  REQUIRE(st.num_allocs == 2);
  REQUIRE(st.num_system_allocs == 2);

  alloc->deallocate(b);
  st = alloc->stats();
  REQUIRE(st.allocated_bytes == 1024);
  REQUIRE(st.peak_allocated_bytes == 1024 + 5120);  // peak stays
  REQUIRE(st.reserved_bytes == 1024 + 5120);        // b is cached

  alloc->reset_peak();
  st = alloc->stats();
  REQUIRE(st.peak_allocated_bytes == 1024);
  REQUIRE(st.peak_reserved_bytes == 1024 + 5120);  // reserved is still that much

  void* c = alloc->allocate(5000, s);  // reuses b
  REQUIRE(c == b);
  st = alloc->stats();
  REQUIRE(st.num_system_allocs == 2);
  REQUIRE(st.num_allocs == 3);
  REQUIRE(st.peak_allocated_bytes == 1024 + 5120);
  alloc->deallocate(c);
  alloc->deallocate(a);
  REQUIRE(alloc->stats().allocated_bytes == 0);
  REQUIRE(alloc->stats().reserved_bytes == 1024 + 5120);
}

TEST_CASE("empty_cache returns every free block to the system", "[allocator]") {
  BackendScope scope;
  Stream s = Stream::create(Device::cpu(), CpuStreamMode::Inline);
  auto alloc = make_caching_allocator(Device::cpu(), CountingBackend::raw(), false);
  void* keep = alloc->allocate(2048, s);
  void* a = alloc->allocate(1000, s);
  void* b = alloc->allocate(70000, s);
  alloc->deallocate(a);
  alloc->deallocate(b);
  REQUIRE(CountingBackend::frees == 0);
  alloc->empty_cache();
  REQUIRE(CountingBackend::frees == 2);  // the two cached blocks, not the live one
  MemoryStats st = alloc->stats();
  REQUIRE(st.reserved_bytes == 2048);
  REQUIRE(st.allocated_bytes == 2048);
  REQUIRE(CountingBackend::live_bytes == 2048);
  // The next request of a released size goes to the system again.
  void* c = alloc->allocate(1000, s);
  REQUIRE(CountingBackend::allocs == 4);
  alloc->deallocate(c);
  alloc->deallocate(keep);
}

TEST_CASE("a failing system allocation empties the cache and retries once", "[allocator]") {
  BackendScope scope;
  Stream s = Stream::create(Device::cpu(), CpuStreamMode::Inline);
  auto alloc = make_caching_allocator(Device::cpu(), CountingBackend::raw(), false);
  CountingBackend::capacity = 4096;

  void* a = alloc->allocate(2048, s);
  alloc->deallocate(a);                // cached: 2048 of the 4096 are held
  void* b = alloc->allocate(3072, s);  // fails, frees the cached block, retries
  REQUIRE(b != nullptr);
  REQUIRE(CountingBackend::failed == 1);
  REQUIRE(CountingBackend::frees == 1);
  REQUIRE(alloc->stats().reserved_bytes == 3072);

  // Nothing left to release: a clear out-of-memory error.
  try {
    alloc->allocate(3072, s);
    FAIL("allocation beyond capacity succeeded");
  } catch (const Error& e) {
    std::string msg = e.what();
    REQUIRE_THAT(msg, Contains("out of memory"));
    REQUIRE_THAT(msg, Contains("expected 3072 bytes on cpu"));
    REQUIRE_THAT(msg, Contains("3072 bytes allocated"));
  }
  REQUIRE(CountingBackend::failed == 3);  // first try and retry
  MemoryStats st = alloc->stats();
  REQUIRE(st.allocated_bytes == 3072);  // the failed request left no trace
  REQUIRE(st.num_system_allocs == 2);
  alloc->deallocate(b);
}

TEST_CASE("without stream awareness every stream shares one pool", "[allocator]") {
  BackendScope scope;
  Stream a = Stream::create(Device::cpu(), CpuStreamMode::Async);
  Stream b = Stream::create(Device::cpu(), CpuStreamMode::Async);
  Gate gate;
  auto alloc = make_caching_allocator(Device::cpu(), CountingBackend::raw(), false);
  void* p = alloc->allocate(1000, a);
  b.enqueue(gate.waiter());
  alloc->record_stream(p, b);  // a no-op here: closures keep CPU storage alive
  alloc->deallocate(p);
  void* q = alloc->allocate(1000, b);
  REQUIRE(q == p);
  alloc->deallocate(q);
  gate.open();
  b.synchronize();
}

TEST_CASE("stream-aware pools: a block freed on stream A is not handed to stream B",
          "[allocator]") {
  BackendScope scope;
  Stream a = Stream::create(Device::cpu(), CpuStreamMode::Async, "A");
  Stream b = Stream::create(Device::cpu(), CpuStreamMode::Async, "B");
  auto alloc = make_caching_allocator(Device::cpu(), CountingBackend::raw(), true);
  void* p = alloc->allocate(1000, a);
  alloc->deallocate(p);
  void* q = alloc->allocate(1000, b);
  REQUIRE(q != p);
  REQUIRE(CountingBackend::allocs == 2);
  // A gets its own block back.
  void* r = alloc->allocate(1000, a);
  REQUIRE(r == p);
  REQUIRE(CountingBackend::allocs == 2);
  alloc->deallocate(q);
  alloc->deallocate(r);
}

TEST_CASE("record_stream holds a block until the other stream's pending work completes",
          "[allocator]") {
  BackendScope scope;
  Stream a = Stream::create(Device::cpu(), CpuStreamMode::Async, "A");
  Stream b = Stream::create(Device::cpu(), CpuStreamMode::Async, "B");
  Stream c = Stream::create(Device::cpu(), CpuStreamMode::Async, "C");
  Gate gate;  // after the streams: opened before they are joined
  auto alloc = make_caching_allocator(Device::cpu(), CountingBackend::raw(), true);

  SECTION("B is blocked by a task") {
    b.enqueue(gate.waiter());
  }
  SECTION("B is blocked by an event wait on a stalled stream") {
    c.enqueue(gate.waiter());
    Event e;
    e.record(c);
    e.wait(b);
  }

  void* p = alloc->allocate(1000, a);
  alloc->record_stream(p, b);
  alloc->record_stream(p, b);  // recording twice is harmless
  alloc->record_stream(p, a);  // the allocating stream needs no record
  alloc->deallocate(p);
  REQUIRE(alloc->stats().allocated_bytes == 0);

  void* q = alloc->allocate(1000, a);
  REQUIRE(q != p);  // B may still be using p
  alloc->empty_cache();
  REQUIRE(CountingBackend::frees == 0);  // a pending block is not released either

  gate.open();
  b.synchronize();
  void* r = alloc->allocate(1000, a);
  REQUIRE(r == p);  // B's work is done: the block is back in A's pool
  REQUIRE(CountingBackend::allocs == 2);
  alloc->deallocate(q);
  alloc->deallocate(r);
}

TEST_CASE("record_stream of an unknown pointer is an error", "[allocator]") {
  BackendScope scope;
  Stream s = Stream::create(Device::cpu(), CpuStreamMode::Inline);
  auto alloc = make_caching_allocator(Device::cpu(), CountingBackend::raw(), true);
  int local = 0;
  REQUIRE_THROWS_WITH(alloc->record_stream(&local, s), Contains("expected a live block"));
}

TEST_CASE("the process-wide CPU allocator keeps statistics", "[allocator]") {
  Allocator& cpu = allocator_for(Device::cpu());
  REQUIRE(&cpu == &allocator_for(Device::cpu()));
  const Stream& s = current_stream(Device::cpu());
  const int64_t nbytes = int64_t{4} << 20;
  MemoryStats before = memory_stats(Device::cpu());
  void* p = cpu.allocate(static_cast<size_t>(nbytes), s);
  REQUIRE(reinterpret_cast<uintptr_t>(p) % 64 == 0);
  MemoryStats during = memory_stats(Device::cpu());
  REQUIRE(during.allocated_bytes - before.allocated_bytes >= nbytes);
  REQUIRE(during.peak_allocated_bytes >= during.allocated_bytes);
  REQUIRE(during.reserved_bytes >= during.allocated_bytes);
  cpu.deallocate(p);
  MemoryStats after = memory_stats(Device::cpu());
  REQUIRE(after.allocated_bytes == before.allocated_bytes);
  reset_peak_memory(Device::cpu());
  REQUIRE(memory_stats(Device::cpu()).peak_allocated_bytes == after.allocated_bytes);
  empty_cache(Device::cpu());
  REQUIRE(memory_stats(Device::cpu()).reserved_bytes == after.allocated_bytes);
}
