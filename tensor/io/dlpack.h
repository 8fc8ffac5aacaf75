// DLPack (v0.6, Debian's libdlpack-dev): zero-copy exchange of tensors with
// other frameworks (PyTorch, JAX, CuPy, NumPy) through DLManagedTensor.
//
// Note [DLPack ownership]
// ~~~~~~~~~~~~~~~~~~~~~~~
// to_dlpack: the DLManagedTensor shares the tensor's storage and keeps it alive
// until the consumer calls its deleter (exactly once). `data` is the address of
// element 0 and byte_offset is 0 (the convention of PyTorch and CuPy, whose
// importers do not all honour byte_offset); shape and strides are in elements.
// Bool goes out as type code 6, bits 8 (kDLBool of DLPack >= 0.8; 0.6 has no
// bool).
//
// from_dlpack: on success the returned Tensor (and every view of it) owns
// `src`; its deleter runs exactly once, when the last view dies, on whichever
// thread drops it. On error nothing is taken: the exception leaves `src`
// untouched and its deleter is still the caller's to call. byte_offset is
// honoured, null strides mean row-major contiguous. Importing a tensor that
// to_dlpack made returns a view of the original storage (the managed tensor
// is released at once), so the caching allocator keeps tracking it.
//
// Synchronisation (DLPack 0.6 has no stream handshake): to_dlpack synchronises
// the calling thread's current stream of the tensor's device, so the data is
// complete when the consumer sees it. from_dlpack trusts the producer to have
// finished writing. Memory imported on CUDA is released by its deleter as soon
// as the last view dies: work that tandem queued on it must have completed by
// then (synchronise before dropping the last view), as with PyTorch.
#pragma once

#include <dlpack/dlpack.h>

#include "tandem/tensor/tensor.h"

namespace tandem {

// Exports `t` (CPU or CUDA, any dtype, any strides) without copying. The
// caller owns the result and releases it through result->deleter(result).
DLManagedTensor* to_dlpack(const Tensor& t);

// Imports `src` without copying. Supported: devices kDLCPU, kDLCUDAHost (as
// CPU) and kDLCUDA; dtypes float 16/32/64, bfloat 16, int 32/64 and bool
// (code 6, 8 bits), one lane; up to kMaxDims dims; non-negative strides; element
// 0 aligned to the element size. Anything else is a tandem::Error naming it.
Tensor from_dlpack(DLManagedTensor* src);

}  // namespace tandem
