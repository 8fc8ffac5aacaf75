// Intra-op parallelism of the CPU kernels: one small pool of worker threads
// shared by every kernel (GEMM, attention, normalisation, large elementwise).
//
// Note [CPU kernel threads]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// ops::set_num_threads(n) sizes this pool (n - 1 workers plus the thread that
// runs the kernel); the default is 1, i.e. no worker at all. BLAS always runs
// single-threaded *inside* our chunks (a GEMM is split into row or column
// panels here), so there is exactly one set of threads: on the 2-core machines
// this project runs on, OpenBLAS's own workers, which spin with sched_yield for
// ~0.1 s after every product, used to steal a tenth of the step from whatever
// ran next.
//
// - parallel_for splits [0, n) into at most num_threads() contiguous chunks of
//   at least `grain` items; chunk 0 runs on the caller. Small ranges, a pool of
//   one and a call from inside a chunk (nesting) run inline on the caller.
// - Chunking depends only on n, grain and the thread count, never on timing:
//   a call while another thread holds the pool (the dual-pipe workers both run
//   kernels) runs the same chunks one after the other on the caller, so a
//   kernel whose arithmetic follows its chunks (GEMM panels) gives the same
//   bits whether or not the pool was free. Kernels that reduce across chunks
//   (norm weight gradients) use fixed-size blocks of their own so that their
//   sums do not change with the thread count either.
// - A worker spins briefly after each chunk (the next kernel usually follows
//   within microseconds), then sleeps on an atomic wait.
// - An exception thrown in a worker's chunk is rethrown on the caller.
#pragma once

#include <cstdint>
#include <memory>
#include <type_traits>

namespace tandem::cpu {

// Threads of the pool, the caller included (>= 1).
void set_num_threads(int n);
int num_threads();
// Note [SIMD width] in simd.h: "avx512", "avx2", "avx" or "sse2".
const char* vector_isa();

namespace detail {
using ChunkFn = void (*)(void* ctx, int64_t begin, int64_t end);
void run_parallel(int64_t n, int64_t grain, ChunkFn fn, void* ctx);
}  // namespace detail

// Calls fn(begin, end) on disjoint chunks that cover [0, n).
template <class F>
void parallel_for(int64_t n, int64_t grain, F&& fn) {
  if (n <= 0) return;
  if (n <= grain || num_threads() == 1) {
    fn(int64_t{0}, n);
    return;
  }
  using Fn = std::remove_reference_t<F>;
  auto call = [](void* ctx, int64_t begin, int64_t end) { (*static_cast<Fn*>(ctx))(begin, end); };
  detail::run_parallel(n, grain, call,
                       const_cast<void*>(static_cast<const void*>(std::addressof(fn))));
}

}  // namespace tandem::cpu
