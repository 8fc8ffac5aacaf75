// CUDA indexing kernels: index_select, gather, scatter_add and one_hot
// (tensor/kernels.h). Tensors are contiguous (outer, n, inner) views; one
// thread per output (or source) element. index_select and gather only move
// elements, so they are instantiated per element width, not per dtype.
// scatter_add accumulates with atomics, so its summation order is arbitrary:
// integer results are exact, float results agree with the CPU to rounding.
//
// Index values are data. The CPU kernels check them and throw; a CUDA kernel
// cannot report without a host synchronisation, and an out-of-bounds access
// would poison the CUDA context for the whole process. So an index outside
// [0, n) is never dereferenced: index_select and gather write 0 there,
// scatter_add skips it, one_hot leaves the row zero.
#include "tensor/cuda/cuda_common.cuh"

namespace tandem::TANDEM_KERNEL_SET {
namespace {

template <class U, class I>
__global__ void index_select_kernel(const U* in, int64_t n, int64_t inner, const I* index,
                                    int64_t index_stride, int64_t k, U* out, int64_t total) {
  for (int64_t i = detail::grid_start(); i < total; i += detail::grid_step()) {
    int64_t t = i % inner;
    int64_t j = (i / inner) % k;
    int64_t o = i / (inner * k);
    int64_t src = static_cast<int64_t>(index[j * index_stride]);
    out[i] = src >= 0 && src < n ? in[(o * n + src) * inner + t] : U(0);
  }
}

template <class U, class I>
__global__ void gather_kernel(const U* in, int64_t n, int64_t inner, const I* index, int64_t k,
                              U* out, int64_t total) {
  for (int64_t i = detail::grid_start(); i < total; i += detail::grid_step()) {
    int64_t t = i % inner;
    int64_t o = i / (inner * k);
    int64_t src = static_cast<int64_t>(index[i]);
    out[i] = src >= 0 && src < n ? in[(o * n + src) * inner + t] : U(0);
  }
}

// Atomic out[0] += v with the CPU's rounding for each single addition. CUDA has
// no atomics on 1- and 2-byte words, so those update their aligned 32-bit word
// by compare-and-swap (little-endian: the lower address is the low half).
template <class T>
__device__ void atomic_add(T* address, T v) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double> ||
                std::is_same_v<T, int32_t>) {
    atomicAdd(address, v);
  } else if constexpr (std::is_same_v<T, int64_t>) {
    // Two's complement addition is the same for signed and unsigned words.
    atomicAdd(reinterpret_cast<unsigned long long*>(address), static_cast<unsigned long long>(v));
  } else if constexpr (std::is_same_v<T, bool>) {
    auto addr = reinterpret_cast<uintptr_t>(address);
    auto* word = reinterpret_cast<unsigned int*>(addr & ~uintptr_t{3});
    if (v) atomicOr(word, 1u << ((addr & 3u) * 8u));  // a sum cast to bool is an or
  } else {                                            // BFloat16, Half
    auto addr = reinterpret_cast<uintptr_t>(address);
    auto* word = reinterpret_cast<unsigned int*>(addr & ~uintptr_t{3});
    unsigned shift = (addr & 2u) ? 16u : 0u;
    // Read atomically: a plain load would race with other threads' CAS on the
    // word (a data race, reported by TSan on the emulated device).
    unsigned old = atomicAdd(word, 0u);
    unsigned assumed;
    do {
      assumed = old;
      T current;
      current.bits = static_cast<uint16_t>(assumed >> shift);
      T sum(static_cast<float>(current) + static_cast<float>(v));
      unsigned updated =
          (assumed & ~(0xffffu << shift)) | (static_cast<unsigned>(sum.bits) << shift);
      old = atomicCAS(word, assumed, updated);
    } while (old != assumed);
  }
}

template <class T, class I>
__global__ void scatter_add_kernel(T* out, int64_t n, int64_t inner, const I* index, int64_t k,
                                   const T* src, int64_t total) {
  for (int64_t i = detail::grid_start(); i < total; i += detail::grid_step()) {
    int64_t t = i % inner;
    int64_t o = i / (inner * k);
    int64_t dst = static_cast<int64_t>(index[i]);
    if (dst >= 0 && dst < n) atomic_add(out + (o * n + dst) * inner + t, src[i]);
  }
}

template <class I>
__global__ void one_hot_kernel(const I* indices, int64_t classes, int64_t* out, int64_t total) {
  for (int64_t i = detail::grid_start(); i < total; i += detail::grid_step()) {
    out[i] = static_cast<int64_t>(indices[i / classes]) == i % classes ? 1 : 0;
  }
}

}  // namespace

void index_select(const TensorArg& in, int64_t outer, int64_t n, int64_t inner,
                  const TensorArg& index, const TensorArg& out, void* stream) {
  int64_t k = index.numel;
  int64_t total = outer * k * inner;
  if (total == 0) return;
  detail::StreamDeviceGuard guard(stream);
  // The index is 1-D; a strided view of one is read in place.
  int64_t index_stride = index.contiguous || index.ndim == 0 ? 1 : index.strides[index.ndim - 1];
  detail::dispatch_index(index.dtype, "index_select", [&](auto index_tag) {
    using I = typename decltype(index_tag)::type;
    detail::dispatch_width(in.dtype, [&](auto tag) {
      using U = typename decltype(tag)::type;
      detail::launch(index_select_kernel<U, I>, detail::blocks_for(total), detail::kThreads, 0,
                     stream, static_cast<const U*>(in.data), n, inner,
                     static_cast<const I*>(index.data), index_stride, k, static_cast<U*>(out.data),
                     total);
    });
  });
}

void gather(const TensorArg& in, int64_t outer, int64_t n, int64_t inner, const TensorArg& index,
            int64_t k, const TensorArg& out, void* stream) {
  int64_t total = outer * k * inner;
  if (total == 0) return;
  detail::StreamDeviceGuard guard(stream);
  detail::dispatch_index(index.dtype, "gather", [&](auto index_tag) {
    using I = typename decltype(index_tag)::type;
    detail::dispatch_width(in.dtype, [&](auto tag) {
      using U = typename decltype(tag)::type;
      detail::launch(gather_kernel<U, I>, detail::blocks_for(total), detail::kThreads, 0, stream,
                     static_cast<const U*>(in.data), n, inner, static_cast<const I*>(index.data), k,
                     static_cast<U*>(out.data), total);
    });
  });
}

void scatter_add(const TensorArg& out, int64_t outer, int64_t n, int64_t inner,
                 const TensorArg& index, int64_t k, const TensorArg& src, void* stream) {
  int64_t total = outer * k * inner;
  if (total == 0) return;
  detail::StreamDeviceGuard guard(stream);
  detail::dispatch_index(index.dtype, "scatter_add", [&](auto index_tag) {
    using I = typename decltype(index_tag)::type;
    dispatch_dtype(out.dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      detail::launch(scatter_add_kernel<T, I>, detail::blocks_for(total), detail::kThreads, 0,
                     stream, static_cast<T*>(out.data), n, inner, static_cast<const I*>(index.data),
                     k, static_cast<const T*>(src.data), total);
    });
  });
}

void one_hot(const TensorArg& indices, int64_t n, int64_t classes, const TensorArg& out,
             void* stream) {
  int64_t total = n * classes;
  if (total == 0) return;
  detail::StreamDeviceGuard guard(stream);
  detail::dispatch_index(indices.dtype, "one_hot", [&](auto index_tag) {
    using I = typename decltype(index_tag)::type;
    detail::launch(one_hot_kernel<I>, detail::blocks_for(total), detail::kThreads, 0, stream,
                   static_cast<const I*>(indices.data), classes, static_cast<int64_t*>(out.data),
                   total);
  });
}

}  // namespace tandem::TANDEM_KERNEL_SET
