// Fibers and the block scheduler of the emulated CUDA device (executor.h).
//
// Each host thread that runs blocks owns a Runner: a pool of fibers (own
// stacks, reused across blocks and launches; Note [Fiber switch]) and the state of the block it is
// running. The scheduler starts a fiber on the block's next thread; the fiber
// runs threads until one waits at a barrier, then hands control back, and the
// scheduler starts another fiber on the next thread. When every thread has
// started, each thread has either exited or waits at a barrier: the scheduler
// releases a barrier whose threads have all arrived and resumes them, on
// alternate rounds in reverse order, so that neither "lower threads first"
// nor "higher threads first" is an order a kernel can silently rely on.
//
// Note [Emulator and ThreadSanitizer]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under TSan every emulated thread runs on its own fiber, registered with
// __tsan_create_fiber, and the scheduler switches into a fiber with
// __tsan_switch_to_fiber_no_sync: the switch itself orders nothing, so two
// emulated threads are concurrent to TSan unless a barrier orders them. A
// barrier is a __tsan_release by every arriving thread and a __tsan_acquire by
// every departing one (two alternating sync addresses, so a fast thread's
// next arrival cannot leak into a slow thread's departure), and a thread's
// start acquires the block's start, released once by the scheduler before
// the block's first thread runs. Creating a fiber orders it after its
// creator's past, so the fibers a block needs are all created before it
// starts. A shared-memory race between the threads of a block is then a
// reported data race. The executor's own bookkeeping
// (scheduler state, indices, exchange words) is touched on the fiber side only
// inside an Unchecked scope, whose accesses TSan ignores, and in functions
// marked TANDEM_EMU_UNCHECKED (not instrumented). Under ASan the
// switches are announced with __sanitizer_start/finish_switch_fiber so that
// ASan knows which stack is live.
#include "tandem/runtime/cuda/emulator/executor.h"

#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "tandem/runtime/error.h"

#if defined(__SANITIZE_THREAD__)
#define TANDEM_EMU_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TANDEM_EMU_TSAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define TANDEM_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TANDEM_EMU_ASAN 1
#endif
#endif

#ifdef TANDEM_EMU_TSAN
#include <sanitizer/tsan_interface.h>
#define TANDEM_EMU_UNCHECKED __attribute__((no_sanitize("thread"), noinline))
// TSan's dynamic annotations (its runtime exports them; no header declares them).
extern "C" void AnnotateIgnoreReadsBegin(const char* file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char* file, int line);
extern "C" void AnnotateIgnoreWritesBegin(const char* file, int line);
extern "C" void AnnotateIgnoreWritesEnd(const char* file, int line);
#else
#define TANDEM_EMU_UNCHECKED
#endif
#ifdef TANDEM_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

// Note [Fiber switch]
// ~~~~~~~~~~~~~~~~~~~
// A block with barriers switches fibers (threads x barriers) times: a scan of
// a 4M-element row is ~10^8 switches. glibc's swapcontext saves and restores
// the signal mask with a system call on every switch, so on x86-64 the
// executor switches with the few instructions below instead: push the
// callee-saved registers and the SSE/x87 control words, swap stack pointers,
// pop. A new fiber's stack is laid out as if it had been switched away from
// just before entering fiber_entry. Elsewhere it falls back to ucontext.
#if defined(__x86_64__)
extern "C" void tandem_emu_switch(void** save_sp, void* to_sp);
asm(R"(
  .text
  .p2align 4
  .globl tandem_emu_switch
  .hidden tandem_emu_switch
  .type tandem_emu_switch, @function
tandem_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size tandem_emu_switch, .-tandem_emu_switch
)");

namespace tandem::emu {
namespace {
struct Context {
  void* sp = nullptr;
};
TANDEM_EMU_UNCHECKED void switch_context(Context& from, Context& to) {
  tandem_emu_switch(&from.sp, to.sp);
}
// `to` starts in `fn` (which never returns) at its first switch.
TANDEM_EMU_UNCHECKED void make_context(Context& to, char* stack, size_t bytes, void (*fn)()) {
  auto top = reinterpret_cast<uintptr_t>(stack + bytes) & ~uintptr_t{15};
  auto* slot = reinterpret_cast<uint64_t*>(top);
  *--slot = 0;                               // fn's return address: none
  *--slot = reinterpret_cast<uint64_t>(fn);  // popped by the switch's ret
  for (int i = 0; i < 6; ++i)
    *--slot = 0;  // rbp, rbx, r12-r15
  uint32_t control[2] = {0, 0};
  asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(control[0]), "=m"(control[1]));
  *--slot = uint64_t{control[0]} | uint64_t{control[1]} << 32;
  to.sp = slot;
}
}  // namespace
}  // namespace tandem::emu
#else
namespace tandem::emu {
namespace {
struct Context {
  ucontext_t uc;
};
TANDEM_EMU_UNCHECKED void switch_context(Context& from, Context& to) {
  swapcontext(&from.uc, &to.uc);
}
TANDEM_EMU_UNCHECKED void make_context(Context& to, char* stack, size_t bytes, void (*fn)()) {
  getcontext(&to.uc);
  to.uc.uc_stack.ss_sp = stack;
  to.uc.uc_stack.ss_size = bytes;
  to.uc.uc_link = nullptr;
  makecontext(&to.uc, fn, 0);
}
}  // namespace
}  // namespace tandem::emu
#endif

namespace tandem::emu {
namespace {

#ifdef TANDEM_EMU_TSAN
constexpr bool kFiberPerThread = true;  // Note [Emulator and ThreadSanitizer]
#else
constexpr bool kFiberPerThread = false;
#endif
#ifdef TANDEM_EMU_ASAN
constexpr size_t kStackBytes = 512 * 1024;  // ASan's redzones make frames larger
#else
constexpr size_t kStackBytes = 256 * 1024;
#endif
constexpr size_t kGuardBytes = 4096;

// While alive, the calling fiber's memory accesses are invisible to TSan: the
// executor's bookkeeping on the fiber side, including what the standard
// library does for it out of line (Note [Emulator and ThreadSanitizer]).
// Never held across a kernel's own code.
struct Unchecked {
#ifdef TANDEM_EMU_TSAN
  Unchecked() {
    AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
    AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
  }
  ~Unchecked() {
    AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
    AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
  }
  Unchecked(const Unchecked&) = delete;
  Unchecked& operator=(const Unchecked&) = delete;
#else
  Unchecked() {}  // user-provided: an unused scope is not a warning
#endif
};

enum class Wait : uint8_t { None, Block, Warp, Exited };

struct Fiber {
  Context context;
  void* mapping = nullptr;  // guard page, then the stack
  void* tsan = nullptr;
  void* asan_fake_stack = nullptr;
  int thread = -1;  // the emulated thread it runs, -1 when idle
  Fiber() = default;
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;
  ~Fiber() {
#ifdef TANDEM_EMU_TSAN
    if (tsan != nullptr) __tsan_destroy_fiber(tsan);
#endif
    if (mapping == nullptr) return;
#ifdef TANDEM_EMU_ASAN
    // GCC's ASan keeps the shadow of memory it sees unmapped: the parked
    // frames' redzones would poison whatever is mapped here next (a new
    // thread's stack and TLS, where they read as stack-use-after-scope).
    __asan_unpoison_memory_region(stack(), kStackBytes);
#endif
    munmap(mapping, kStackBytes + kGuardBytes);
  }
  char* stack() const {
    return static_cast<char*>(mapping) + kGuardBytes;
  }
};

// Per emulated thread of the running block.
struct Slot {
  Wait wait = Wait::None;
  unsigned mask = 0;  // warp waits
  int src_lane = 0;
  uint64_t word = 0;    // deposited
  uint64_t result = 0;  // returned
  unsigned ballot = 0;
  unsigned block_waits = 0, warp_waits = 0;  // generations, for the TSan sync address
  Fiber* fiber = nullptr;
};

struct SharedArray {
  const void* tag;
  void* data;
  size_t bytes;
};

void entry();

class Runner {
 public:
  ~Runner() {
    for (auto& a : shared_)
      std::free(a.data);
    std::free(dynamic_);
  }

  TANDEM_EMU_UNCHECKED void run_blocks(const LaunchShape& shape, const std::function<void()>& body,
                                       const std::function<bool(Dim*)>& next_block) {
    body_ = &body;
    shape_ = shape;
    threads_ = shape.block.x * shape.block.y * shape.block.z;
    slots_.assign(threads_, Slot{});
    dynamic_ = std::malloc(std::max<size_t>(shape.shared_bytes, 1));
    struct Cleanup {
      Runner* r;
      ~Cleanup() { r->end_launch(); }
    } cleanup{this};
    Dim block;
    while (next_block(&block))
      run_block(block);
  }

  // Fiber side (called from the kernel through executor.h).
  TANDEM_EMU_UNCHECKED ThreadIndex index() const {
    Unchecked unchecked;
    return index_;
  }
  // The Unchecked scopes end before the fiber yields: an abandoned fiber
  // (after an error) must not die inside one.
  TANDEM_EMU_UNCHECKED void wait_block() {
    char* sync;
    {
      Unchecked unchecked;
      Slot& s = slots_[current_->thread];
      s.wait = Wait::Block;
      sync = &block_sync_[s.block_waits++ & 1];
    }
    arrive_and_wait(sync);
  }
  TANDEM_EMU_UNCHECKED uint64_t wait_warp(unsigned mask, uint64_t word, int src_lane,
                                          unsigned* ballot) {
    char* sync;
    {
      Unchecked unchecked;
      Slot& s = slots_[current_->thread];
      s.wait = Wait::Warp;
      s.mask = mask;
      s.word = word;
      s.src_lane = src_lane;
      int warp = current_->thread / kWarpSize;
      sync = &warp_sync_[warp * 2 + (s.warp_waits++ & 1)];
    }
    arrive_and_wait(sync);
    Unchecked unchecked;
    const Slot& s = slots_[current_->thread];
    if (ballot != nullptr) *ballot = s.ballot;
    return s.result;
  }
  TANDEM_EMU_UNCHECKED int lane() const {
    Unchecked unchecked;
    return current_->thread % kWarpSize;
  }
  TANDEM_EMU_UNCHECKED void* shared(const void* tag, size_t bytes) {
    Unchecked unchecked;
    for (auto& a : shared_) {
      if (a.tag == tag) return a.data;
    }
    void* data = std::malloc(std::max<size_t>(bytes, 1));  // one malloc each: ASan sees overruns
    TANDEM_CHECK(data != nullptr, "[cuda::emulator] expected {} bytes of shared memory", bytes);
    poison(data, bytes);
    shared_.push_back({tag, data, bytes});
    return data;
  }
  TANDEM_EMU_UNCHECKED void* dynamic() const {
    Unchecked unchecked;
    return dynamic_;
  }

  // The fiber loop: claims threads of the running block until one waits at a
  // barrier (the fiber then stays with it) or none is left.
  TANDEM_EMU_UNCHECKED void fiber_loop(Fiber* self) {
    for (;;) {
      for (;;) {
        int t = claim(self);
        if (t < 0) break;
#ifdef TANDEM_EMU_TSAN
        __tsan_acquire(&block_start_);
#endif
        try {
          (*body_)();
        } catch (...) {
          Unchecked unchecked;
          if (error_ == nullptr) error_ = std::current_exception();
        }
        {
          Unchecked unchecked;
          slots_[t].wait = Wait::Exited;
          self->thread = -1;
        }
        if (kFiberPerThread) break;
      }
      yield(self);
    }
  }
  // The block's next thread for `self`, or -1 when none is left.
  TANDEM_EMU_UNCHECKED int claim(Fiber* self) {
    Unchecked unchecked;
    if (next_thread_ >= threads_ || error_ != nullptr) return -1;
    int t = static_cast<int>(next_thread_++);
    self->thread = t;
    slots_[t].fiber = self;
    set_index(t);
    return t;
  }
  TANDEM_EMU_UNCHECKED void first_entry(Fiber* self) {
#ifdef TANDEM_EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &scheduler_stack_, &scheduler_stack_size_);
#endif
    fiber_loop(self);
  }

  static Runner& local() {
    thread_local Runner runner;
    return runner;
  }
  Fiber* starting() const {
    return starting_;
  }

 private:
  static constexpr int kWarpSyncs = 2 * (kMaxBlockThreads / kWarpSize);

  static void poison(void* data, size_t bytes) {
    std::memset(data, 0xff, bytes);
  }

  TANDEM_EMU_UNCHECKED void set_index(int t) {
    const Dim& b = shape_.block;
    index_.thread = {t % b.x, (t / b.x) % b.y, t / (b.x * b.y)};
    current_ = slots_[t].fiber;
  }

  TANDEM_EMU_UNCHECKED void arrive_and_wait(char* sync) {
#ifdef TANDEM_EMU_TSAN
    __tsan_release(sync);
#endif
    yield(current_);
#ifdef TANDEM_EMU_TSAN
    __tsan_acquire(sync);
#endif
    (void)sync;
    Unchecked unchecked;
    slots_[current_->thread].wait = Wait::None;
  }

  TANDEM_EMU_UNCHECKED void yield(Fiber* self) {
#ifdef TANDEM_EMU_ASAN
    __sanitizer_start_switch_fiber(&self->asan_fake_stack, scheduler_stack_, scheduler_stack_size_);
#endif
#ifdef TANDEM_EMU_TSAN
    __tsan_switch_to_fiber(scheduler_tsan_, 0);  // synchronising: the scheduler sees all
#endif
    switch_context(self->context, scheduler_);
#ifdef TANDEM_EMU_ASAN
    __sanitizer_finish_switch_fiber(self->asan_fake_stack, &scheduler_stack_,
                                    &scheduler_stack_size_);
#endif
  }

  TANDEM_EMU_UNCHECKED void resume(Fiber* f) {
    if (f->thread >= 0) set_index(f->thread);
    current_ = f;
#ifdef TANDEM_EMU_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, f->stack(), kStackBytes);
#endif
#ifdef TANDEM_EMU_TSAN
    __tsan_switch_to_fiber(f->tsan, __tsan_switch_to_fiber_no_sync);
#endif
    switch_context(scheduler_, f->context);
#ifdef TANDEM_EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  }

  // An idle fiber from idle_ (a new one when none is left). Under TSan a
  // fiber goes back to idle_ only when the next block starts, so that no two
  // emulated threads of a block share a fiber's program order.
  TANDEM_EMU_UNCHECKED Fiber* idle_fiber() {
    if (idle_.empty()) return add_fiber();
    Fiber* f = idle_.back();
    idle_.pop_back();
    return f;
  }
  // After a fiber has handed control back: an idle one is free again.
  TANDEM_EMU_UNCHECKED void returned(Fiber* f) {
    if (f->thread < 0 && !kFiberPerThread) idle_.push_back(f);
  }

  TANDEM_EMU_UNCHECKED Fiber* add_fiber() {
    auto f = std::make_unique<Fiber>();
    f->mapping = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    TANDEM_CHECK(f->mapping != MAP_FAILED, "[cuda::emulator] expected a {} KiB fiber stack",
                 kStackBytes / 1024);
    mprotect(f->mapping, kGuardBytes, PROT_NONE);  // an overflow faults instead of corrupting
    reset(f.get());
    fibers_.push_back(std::move(f));
    return fibers_.back().get();
  }

  // A fresh context at the fiber's entry (also after an error abandoned it).
  TANDEM_EMU_UNCHECKED void reset(Fiber* f) {
#ifdef TANDEM_EMU_ASAN
    // The stack may hold an abandoned thread's frames, or be a mapping an
    // exited thread's fiber stack had: clear their redzones from ASan's shadow.
    __asan_unpoison_memory_region(f->stack(), kStackBytes);
#endif
    make_context(f->context, f->stack(), kStackBytes, entry);
#ifdef TANDEM_EMU_TSAN
    if (f->tsan != nullptr) __tsan_destroy_fiber(f->tsan);
    f->tsan = __tsan_create_fiber(0);
#endif
    f->thread = -1;
    starting_ = f;  // entry() finds its fiber here on the first switch
  }

  TANDEM_EMU_UNCHECKED void run_block(Dim block) {
    index_.block = block;
    index_.block_dim = shape_.block;
    index_.grid_dim = shape_.grid;
    next_thread_ = 0;
    for (auto& s : slots_)
      s = Slot{};
    // Under TSan every thread of the block gets its own fiber, created now:
    // creating a fiber orders it after everything its creator has seen, so
    // one created mid-block would be ordered after the threads that ran
    // before it (Note [Emulator and ThreadSanitizer]).
    while (kFiberPerThread && fibers_.size() < threads_)
      add_fiber();
    idle_.clear();
    for (auto& f : fibers_)
      idle_.push_back(f.get());
    for (auto& a : shared_)
      poison(a.data, a.bytes);
    poison(dynamic_, shape_.shared_bytes);
#ifdef TANDEM_EMU_TSAN
    scheduler_tsan_ = __tsan_get_current_fiber();
    __tsan_release(&block_start_);
#endif
    for (unsigned round = 0;; ++round) {
      while (next_thread_ < threads_ && error_ == nullptr) {
        Fiber* f = idle_fiber();
        starting_ = f;
        resume(f);
        returned(f);
      }
      if (error_ != nullptr) break;
      std::vector<int> ready;
      try {
        ready = release();
      } catch (...) {
        error_ = std::current_exception();
        break;
      }
      if (ready.empty()) break;
      if (round % 2 == 1) std::reverse(ready.begin(), ready.end());
      for (int t : ready) {
        Fiber* f = slots_[t].fiber;
        resume(f);
        returned(f);
        if (error_ != nullptr) break;
      }
      if (error_ != nullptr) break;
    }
    if (error_ != nullptr) {
      for (auto& f : fibers_) {
        if (f->thread >= 0) reset(f.get());  // abandon the threads still waiting
      }
      std::exception_ptr e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }

  // The threads whose barrier every participant has reached; empty when all
  // have exited. Throws when threads wait but none can go on.
  TANDEM_EMU_UNCHECKED std::vector<int> release() {
    std::vector<int> ready;
    int live = 0, at_block = 0, at_warp = 0;
    for (unsigned t = 0; t < threads_; ++t) {
      live += slots_[t].wait != Wait::Exited;
      at_block += slots_[t].wait == Wait::Block;
      at_warp += slots_[t].wait == Wait::Warp;
    }
    if (live == 0) return ready;
    if (at_block == live) {
      for (unsigned t = 0; t < threads_; ++t) {
        if (slots_[t].wait == Wait::Block) ready.push_back(static_cast<int>(t));
      }
      return ready;
    }
    for (unsigned w0 = 0; w0 < threads_; w0 += kWarpSize) {
      unsigned w1 = std::min<unsigned>(w0 + kWarpSize, threads_);
      unsigned want = 0, waiting = 0;
      for (unsigned t = w0; t < w1; ++t) {
        if (slots_[t].wait == Wait::Warp) {
          want |= slots_[t].mask;
          waiting |= 1u << (t - w0);
        }
      }
      unsigned alive = 0;
      for (unsigned t = w0; t < w1; ++t) {
        if (slots_[t].wait != Wait::Exited) alive |= 1u << (t - w0);
      }
      if (waiting == 0 || (want & alive & ~waiting) != 0) continue;
      unsigned nonzero = 0;
      for (unsigned t = w0; t < w1; ++t) {
        if ((waiting >> (t - w0) & 1u) && slots_[t].word != 0) nonzero |= 1u << (t - w0);
      }
      for (unsigned t = w0; t < w1; ++t) {
        if (!(waiting >> (t - w0) & 1u)) continue;
        Slot& s = slots_[t];
        unsigned src = w0 + static_cast<unsigned>(s.src_lane);
        bool from_peer = src < w1 && (waiting >> (src - w0) & 1u);
        s.result = from_peer ? slots_[src].word : s.word;
        s.ballot = nonzero & s.mask;
        ready.push_back(static_cast<int>(t));
      }
    }
    TANDEM_CHECK(!ready.empty(),
                 "[cuda::emulator] expected the threads of block ({}, {}, {}) to wait at one "
                 "barrier, got {} of {} live threads at __syncthreads and {} at a warp operation "
                 "(a divergent barrier hangs or misbehaves on a GPU)",
                 index_.block.x, index_.block.y, index_.block.z, at_block, live, at_warp);
    return ready;
  }

  TANDEM_EMU_UNCHECKED void end_launch() {
    for (auto& a : shared_)
      std::free(a.data);
    shared_.clear();
    std::free(dynamic_);
    dynamic_ = nullptr;
    body_ = nullptr;
  }

  Context scheduler_;
  void* scheduler_tsan_ = nullptr;
  const void* scheduler_stack_ = nullptr;
  size_t scheduler_stack_size_ = 0;
  std::vector<std::unique_ptr<Fiber>> fibers_;
  std::vector<Fiber*> idle_;  // fibers free to start a thread of the running block
  Fiber* current_ = nullptr;
  Fiber* starting_ = nullptr;

  const std::function<void()>* body_ = nullptr;
  LaunchShape shape_;
  unsigned threads_ = 0;
  unsigned next_thread_ = 0;
  std::vector<Slot> slots_;
  ThreadIndex index_;
  std::vector<SharedArray> shared_;
  void* dynamic_ = nullptr;
  std::exception_ptr error_;
  char block_start_ = 0;
  char block_sync_[2] = {};
  char warp_sync_[kWarpSyncs] = {};
};

TANDEM_EMU_UNCHECKED void entry() {
  Runner& r = Runner::local();
  r.first_entry(r.starting());
}

// Host threads that help run the blocks of a grid (the launching thread runs
// blocks too, so a grid finishes even when every helper is busy).
class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // process lifetime; its threads never exit
    return *pool;
  }
  int helpers() const { return static_cast<int>(threads_.size()); }
  void post(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_one();
  }

 private:
  Pool() {
    unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    unsigned n = std::clamp(cores, 2u, 4u) - 1;
    for (unsigned i = 0; i < n; ++i) {
      threads_.emplace_back([this] { loop(); });
      threads_.back().detach();
    }
  }
  void loop() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return !jobs_.empty(); });
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  std::vector<std::thread> threads_;
};

// One grid's shared progress: blocks are claimed in order by every host
// thread that works on it.
struct GridJob {
  LaunchShape shape;
  const std::function<void()>* body;
  uint64_t blocks = 0;
  std::mutex mu;
  std::condition_variable cv;
  uint64_t next = 0;
  int working = 0;
  std::exception_ptr error;

  bool claim(Dim* block) {
    std::lock_guard<std::mutex> lock(mu);
    if (next >= blocks || error != nullptr) return false;
    uint64_t b = next++;
    const Dim& g = shape.grid;
    *block = {static_cast<unsigned>(b % g.x), static_cast<unsigned>((b / g.x) % g.y),
              static_cast<unsigned>(b / (uint64_t{g.x} * g.y))};
    return true;
  }
  void work() {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (next >= blocks || error != nullptr) return;  // nothing left: never touch body
      ++working;
    }
    std::exception_ptr failure;
    try {
      Runner::local().run_blocks(shape, *body, [this](Dim* b) { return claim(b); });
    } catch (...) {
      failure = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mu);
    if (failure != nullptr && error == nullptr) error = failure;
    --working;
    cv.notify_all();
  }
};

}  // namespace

void check_shape(const LaunchShape& shape) {
  const Dim& g = shape.grid;
  const Dim& b = shape.block;
  uint64_t threads = uint64_t{b.x} * b.y * b.z;
  TANDEM_CHECK(threads >= 1 && threads <= kMaxBlockThreads && b.z <= 64,
               "[cuda::emulator] expected a block of 1 to {} threads (z <= 64), got ({}, {}, {})",
               kMaxBlockThreads, b.x, b.y, b.z);
  TANDEM_CHECK(g.x >= 1 && g.y >= 1 && g.z >= 1 && g.y <= 65535 && g.z <= 65535,
               "[cuda::emulator] expected a grid of at least one block (y, z <= 65535), got ({}, "
               "{}, {})",
               g.x, g.y, g.z);
}

void run_grid(const LaunchShape& shape, const std::function<void()>& thread_body) {
  check_shape(shape);
  const Dim& g = shape.grid;
  auto job = std::make_shared<GridJob>();
  job->shape = shape;
  job->body = &thread_body;
  job->blocks = uint64_t{g.x} * g.y * g.z;
  Pool& pool = Pool::get();
  int helpers = static_cast<int>(std::min<uint64_t>(pool.helpers(), job->blocks - 1));
  for (int i = 0; i < helpers; ++i)
    pool.post([job] { job->work(); });
  job->work();
  std::unique_lock<std::mutex> lock(job->mu);
  // Helpers that have not started yet find no block left and never touch the body.
  job->cv.wait(lock, [&] { return job->working == 0; });
  job->next = job->blocks;
  if (job->error != nullptr) std::rethrow_exception(job->error);
}

TANDEM_EMU_UNCHECKED Dim thread_idx() {
  return Runner::local().index().thread;
}
TANDEM_EMU_UNCHECKED Dim block_idx() {
  return Runner::local().index().block;
}
TANDEM_EMU_UNCHECKED Dim block_dim() {
  return Runner::local().index().block_dim;
}
TANDEM_EMU_UNCHECKED Dim grid_dim() {
  return Runner::local().index().grid_dim;
}
void sync_block() {
  Runner::local().wait_block();
}
uint64_t warp_exchange(unsigned mask, uint64_t word, int src_lane, unsigned* ballot) {
  return Runner::local().wait_warp(mask, word, src_lane, ballot);
}
int lane_id() {
  return Runner::local().lane();
}
void* static_shared(const void* tag, size_t bytes) {
  return Runner::local().shared(tag, bytes);
}
void* dynamic_shared() {
  return Runner::local().dynamic();
}

}  // namespace tandem::emu
