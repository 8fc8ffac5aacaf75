// Allocators: a caching allocator per device with statistics (DESIGN §2).
//
// Note [Caching allocator]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Freed blocks are kept in per-stream pools keyed by a rounded size and handed
// out again to allocations of the same size on the same stream, so steady-state
// training does no system allocation (on CPU this avoids the page-fault cost of
// fresh large buffers; on CUDA it avoids cudaMalloc's device synchronisation).
// Reuse on the *same* stream is safe without events because the stream orders
// the old work before the new. A block that another stream used must be
// announced with record_stream(); when it is freed, an Event is recorded on each
// such stream and the block returns to its pool only once they have all
// completed, so it is never handed out early. CPU storages need no such care
// because closures hold them alive (Note [Stream ordering]); they all use pool 0.
//
// Sizes: below 1 MiB rounded up to 512 B; above, to one of four steps per power
// of two (at most 25% waste). When the system allocation fails the cache is
// emptied and the allocation retried once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "tandem/runtime/device.h"
#include "tandem/runtime/stream.h"

namespace tandem {

struct MemoryStats {
  int64_t allocated_bytes = 0;       // handed out to tensors now
  int64_t peak_allocated_bytes = 0;  // max of the above since the last reset
  int64_t reserved_bytes = 0;        // held from the system (allocated + cached)
  int64_t peak_reserved_bytes = 0;
  int64_t num_allocs = 0;         // allocate() calls
  int64_t num_system_allocs = 0;  // cache misses
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  // Returns a block of at least `nbytes` usable on `stream` (64-byte aligned on
  // CPU). `nbytes` may be 0.
  virtual void* allocate(size_t nbytes, const Stream& stream) = 0;
  virtual void deallocate(void* ptr) = 0;
  // Announces that `stream` (not the allocating one) uses the block at `ptr`.
  virtual void record_stream(void* ptr, const Stream& stream) = 0;
  virtual MemoryStats stats() const = 0;
  virtual void reset_peak() = 0;
  // Returns every cached (free) block to the system.
  virtual void empty_cache() = 0;
};

// The process-wide allocator of a device (lives until exit; tensors in static
// storage may outlive any other owner).
Allocator& allocator_for(Device device);

MemoryStats memory_stats(Device device);
void reset_peak_memory(Device device);
void empty_cache(Device device);

// A caching allocator over raw system calls; exposed for tests, which drive it
// with a counting backend. `stream_aware` keeps one pool per stream and honours
// record_stream (CUDA); without it there is one pool and record_stream is a
// no-op (CPU, where closures keep storages alive).
struct RawMemory {
  void* (*alloc)(size_t nbytes, int device);  // nullptr on out-of-memory
  void (*free)(void* ptr, int device);
};
std::unique_ptr<Allocator> make_caching_allocator(Device device, RawMemory raw, bool stream_aware);

}  // namespace tandem
