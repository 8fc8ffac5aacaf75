// Kernel dispatch for the front ends: run the CPU kernel on the current CPU
// stream or launch the CUDA kernel on the current CUDA stream.
//
// Note [Kernel closures keep storage alive]
// On an async CPU stream the kernel runs later on the stream's thread, so the
// closure captures the tensors it touches (`keep`): their storage cannot return
// to the allocator before the kernel has run. On CUDA the launch is already
// asynchronous; a tensor allocated on another stream is announced to the
// caching allocator (record_stream) so its block is not reused early.
#pragma once

#include <utility>

#include "tandem/runtime/stream.h"
#include "tandem/tensor/kernels.h"
#include "tandem/tensor/tensor.h"

namespace tandem::detail {

void record_streams_for(const Stream& stream, std::initializer_list<const Tensor*> tensors);

template <class CpuFn, class CudaFn, class... Keep>
void dispatch(Device device, CpuFn&& cpu_fn, CudaFn&& cuda_fn, const Keep&... keep) {
  const Stream& stream = current_stream(device);
  if (device.is_cpu()) {
    if (stream.is_inline()) {
      cpu_fn();
    } else {
      stream.enqueue_async([fn = std::forward<CpuFn>(cpu_fn), keep...] { fn(); }, false);
    }
  } else {
    record_streams_for(stream, {&keep...});
    cuda_fn(stream.native_handle());
  }
}

}  // namespace tandem::detail
