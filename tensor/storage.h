// Releasing the memory under a tensor while its views live on, and restoring
// it: what sharded data parallelism needs to free a gathered parameter after
// the forward although the autograd graph still holds views of it for the
// backward (parallel/fsdp.h), as PyTorch's FSDP2 resizes an unsharded
// parameter's storage to 0 and back.
//
// Note [Released storage]
// ~~~~~~~~~~~~~~~~~~~~~~~
// release_storage() hands the block back to its allocator in stream order:
// on an asynchronous CPU stream after the work already queued on the calling
// thread's stream (which may still read it), elsewhere at once (an inline
// stream has run that work; CUDA's caching allocator reuses a block only in
// its stream's order). The storage object and every view stay; their data
// pointer is null until restore_storage() allocates a new block of the same
// size on the calling thread's current stream, whose contents the caller
// then writes before anything reads them. Reading a released tensor is the
// caller's error; the owner (FSDP) restores before the backward needs it.
#pragma once

#include "tandem/tensor/tensor.h"

namespace tandem {

void release_storage(const Tensor& t);
void restore_storage(const Tensor& t);
bool storage_released(const Tensor& t);

}  // namespace tandem
