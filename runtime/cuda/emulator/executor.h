// The executor of the emulated CUDA device (Note [Emulated CUDA device] in
// runtime/cuda/emulator/kernel_api.h): runs a grid of emulated threads, one
// fiber per thread of a block, and the per-thread state the CUDA names of
// kernel_api.h read.
//
// A grid's blocks are spread over the calling thread and a small pool of host
// threads; a block runs entirely on one host thread, its threads interleaved
// on fibers that switch only at barriers (__syncthreads, warp operations). So
// the threads of a block really run interleaved rather than one after another
// in program order, and a missing barrier reads a value its producer has not
// written yet: a wrong result, and under ThreadSanitizer a reported race
// (Note [Emulator and ThreadSanitizer] in executor.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace tandem::emu {

struct Dim {
  unsigned x = 1, y = 1, z = 1;
};

struct LaunchShape {
  Dim grid, block;
  size_t shared_bytes = 0;  // dynamic shared memory per block
};

// Most threads per block, as on every CUDA GPU since compute capability 2.0.
constexpr unsigned kMaxBlockThreads = 1024;
constexpr int kWarpSize = 32;

// Throws tandem::Error unless `shape` is a valid launch (what cudaGetLastError
// reports right after a bad launch on a GPU).
void check_shape(const LaunchShape& shape);

// Runs `thread_body` once for every thread of the grid and returns when all
// have finished. Throws tandem::Error for an invalid shape, for threads that
// wait at different barriers (a deadlock on a GPU) and for an exception thrown
// by a thread (the first one, rethrown here).
void run_grid(const LaunchShape& shape, const std::function<void()>& thread_body);

// The indices of the calling emulated thread (valid inside run_grid's body),
// returned by value: the executor's copy is rewritten at every fiber switch.
struct ThreadIndex {
  Dim thread, block, block_dim, grid_dim;
};
Dim thread_idx();
Dim block_idx();
Dim block_dim();
Dim grid_dim();

// __syncthreads: waits until every thread of the block that has not exited
// arrives.
void sync_block();
// __syncwarp and the warp operations: the threads of the calling warp in
// `mask` exchange one 64-bit word each; returns the word of lane `src_lane`
// (its own when that lane is not in the mask or has exited) and, in
// `ballot`, the lanes whose word is non-zero.
uint64_t warp_exchange(unsigned mask, uint64_t word, int src_lane, unsigned* ballot);
// The calling thread's lane in its warp.
int lane_id();

// Static shared memory: the block's array for the declaration identified by
// `tag` (a static object of that declaration), `bytes` long, allocated on the
// block's first use. Filled with 0xff bytes at each block's start: a read
// before any write gives NaN or -1, never a plausible zero.
void* static_shared(const void* tag, size_t bytes);
// Dynamic shared memory: the launch's shared_bytes, one array per block.
void* dynamic_shared();

}  // namespace tandem::emu
