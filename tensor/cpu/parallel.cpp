// The CPU kernels' thread pool (Note [CPU kernel threads] in parallel.h).
//
// One region at a time (the thread that runs it holds busy_). A region is
// published in plain fields and opened by one store to `state_`, a word that
// packs the region's generation (high 32 bits) with the index of the next
// unclaimed chunk (low 32 bits; kClosed once the region is over). Every
// participant, the caller included, claims chunks by compare-and-swap on that
// word, so a chunk is run exactly once and a late worker can only claim from
// the region it reads. A worker counts itself in `running_` before it looks at
// the word; the caller, once every chunk is claimed, closes the word and waits
// for `running_` to drop to zero, after which no worker can still be reading
// the region's fields. All of these atomics are sequentially consistent: the
// argument needs a worker's increment of running_ to be ordered before its
// claim, and the caller's close before its read of running_.
#include "tandem/tensor/cpu/parallel.h"
#include "tandem/tensor/cpu/simd.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "tandem/runtime/error.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TANDEM_CPU_RELAX() _mm_pause()
#else
#define TANDEM_CPU_RELAX() std::this_thread::yield()
#endif

namespace tandem::cpu {
namespace {

using Clock = std::chrono::steady_clock;

// How an idle worker waits for the next region. Kernels of one step follow
// each other within microseconds, so it first spins (kPause), then keeps
// polling between sched_yield calls (kYield), which hands the core to any
// other runnable thread, e.g. the caller's own serial work on a machine whose
// cores other users' processes share, and only then sleeps on a futex (one
// wake-up costs several microseconds).
constexpr auto kPause = std::chrono::microseconds(5);
constexpr auto kYield = std::chrono::microseconds(200);
// Chunks per thread: more than one, so that a thread that another process
// preempts delays only its current chunk while the others take the rest.
constexpr int64_t kChunksPerThread = 4;
constexpr uint64_t kClosed = 0xffffffffu;

thread_local bool in_chunk = false;  // nested parallel_for runs inline

void run_chunk(detail::ChunkFn fn, void* ctx, int64_t begin, int64_t end) {
  in_chunk = true;
  try {
    fn(ctx, begin, end);
  } catch (...) {
    in_chunk = false;
    throw;
  }
  in_chunk = false;
}

class Pool {
 public:
  int threads() const { return threads_.load(std::memory_order_relaxed); }

  void resize(int n) {
    std::lock_guard<std::mutex> lock(busy_);
    if (n == threads()) return;
    stop_workers();
    threads_.store(n, std::memory_order_relaxed);
    // Workers start on the next region that needs them.
  }

  void run(int64_t n, int64_t grain, detail::ChunkFn fn, void* ctx) {
    const int threads = this->threads();
    const int64_t chunk = std::max(
        {grain, int64_t{1}, (n + threads * kChunksPerThread - 1) / (threads * kChunksPerThread)});
    const int64_t chunks = (n + chunk - 1) / chunk;
    std::unique_lock<std::mutex> lock(busy_, std::defer_lock);
    if (chunks <= 1 || !lock.try_lock()) {
      // Another thread holds the pool: the same chunks, one after the other.
      for (int64_t c = 0; c < chunks; ++c)
        run_chunk(fn, ctx, c * chunk, std::min(n, (c + 1) * chunk));
      return;
    }
    start_workers(threads - 1);
    fn_ = fn;
    ctx_ = ctx;
    n_ = n;
    chunk_ = chunk;
    chunks_ = static_cast<uint64_t>(chunks);
    error_ = nullptr;
    const uint64_t gen = (state_.load() >> 32) + 1;
    state_.store(gen << 32);  // open: chunk 0 is next
    wake_.fetch_add(1);
    wake_.notify_all();
    claim_and_run();
    state_.store((gen << 32) | kClosed);
    for (int spins = 0; running_.load() != 0; ++spins) {
      if (spins < 4096) {
        TANDEM_CPU_RELAX();
      } else {
        std::this_thread::yield();  // a worker was preempted inside a chunk
      }
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  // Claims and runs chunks of the open region until none is left.
  void claim_and_run() {
    uint64_t s = state_.load();
    for (;;) {
      const uint64_t next = s & kClosed;
      if (next == kClosed || next >= chunks_) return;
      if (!state_.compare_exchange_weak(s, s + 1)) continue;  // s reloaded
      const int64_t c = static_cast<int64_t>(next);
      try {
        run_chunk(fn_, ctx_, c * chunk_, std::min(n_, (c + 1) * chunk_));
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu_);
        if (!error_) error_ = std::current_exception();
      }
      s = state_.load();
    }
  }

  void start_workers(int count) {
    if (static_cast<int>(workers_.size()) == count) return;
    stop_ = false;
    for (int i = static_cast<int>(workers_.size()); i < count; ++i)
      workers_.emplace_back([this, seen = wake_.load()] { worker_loop(seen); });
  }

  void stop_workers() {
    if (workers_.empty()) return;
    stop_ = true;
    wake_.fetch_add(1);
    wake_.notify_all();
    for (std::thread& t : workers_)
      t.join();
    workers_.clear();
  }

  void worker_loop(uint32_t seen) {
    for (;;) {
      uint32_t w = wake_.load();
      const auto spin_start = Clock::now();
      for (int i = 0; w == seen; ++i) {
        if ((i & 63) != 63) {
          TANDEM_CPU_RELAX();
        } else {
          const auto waited = Clock::now() - spin_start;
          if (waited > kYield) {
            wake_.wait(seen);
          } else if (waited > kPause) {
            std::this_thread::yield();
          }
        }
        w = wake_.load();
      }
      seen = w;
      if (stop_.load()) return;
      running_.fetch_add(1);
      claim_and_run();
      running_.fetch_sub(1);
    }
  }

  std::mutex busy_;  // held by the thread running a region (or resizing)
  std::atomic<int> threads_{1};
  std::vector<std::thread> workers_;
  std::atomic<uint32_t> wake_{0};   // bumped once per region: wakes the workers
  std::atomic<uint64_t> state_{0};  // [generation:32][next chunk or kClosed:32]
  std::atomic<int> running_{0};     // workers inside claim_and_run
  std::atomic<bool> stop_{false};
  // The current region: written while no worker is inside, before state_ opens it.
  detail::ChunkFn fn_ = nullptr;
  void* ctx_ = nullptr;
  int64_t n_ = 0, chunk_ = 1;
  uint64_t chunks_ = 0;
  std::mutex error_mu_;
  std::exception_ptr error_;
};

// Intentionally leaked (like the allocators): kernels may run during static
// destruction, and joining threads there could deadlock.
Pool& pool() {
  static Pool* const p = new Pool();
  return *p;
}

}  // namespace

void set_num_threads(int n) {
  TANDEM_CHECK(n >= 1, "[cpu::set_num_threads] expected n >= 1, got {}", n);
  pool().resize(n);
}

int num_threads() {
  return in_chunk ? 1 : pool().threads();
}

const char* vector_isa() {
  if constexpr (simd::kVectorBytes == 64) return "avx512";
#if defined(__AVX2__)
  if constexpr (simd::kVectorBytes == 32) return "avx2";
#endif
  if constexpr (simd::kVectorBytes == 32) return "avx";
  return "sse2";
}

namespace detail {
void run_parallel(int64_t n, int64_t grain, ChunkFn fn, void* ctx) {
  pool().run(n, grain, fn, ctx);
}
}  // namespace detail

}  // namespace tandem::cpu
