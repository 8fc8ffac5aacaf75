// CUDA indexing kernels: index_select, gather, scatter_add and one_hot
// (tensor/kernels.h). Tensors are contiguous (outer, n, inner) views; one
// thread per output (or source) element. index_select and gather only move
// elements, so they are instantiated per element width, not per dtype.
// scatter_add gives each thread one (outer, inner) column, whose k sources it
// adds in index order, rounding after every addition: the CPU kernel's order
// and bits, the same on every run (no atomics: Note [Deterministic
// scatter_add]).
//
// Note [Deterministic scatter_add]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// scatter_add is the backward of index_select, gather and the embedding, and
// of the experts' combine. With atomics its sums came in whatever order the
// threads ran, so two runs of one training step could differ in the last bits
// (the dual-pipe schedule against the sequential one, a resumed run against
// an uninterrupted one). Two sources of one column may land on one output
// element, and only the column's own thread touches that column's outputs, so
// a thread per column adds without atomics in a fixed order. The price is
// parallelism: outer x inner threads, each walking k sources (the embedding's
// backward: d threads over the batch's tokens).
//
// Index values are data. The CPU kernels check them and throw; a CUDA kernel
// cannot report without a host synchronisation, and an out-of-bounds access
// would poison the CUDA context for the whole process. So an index outside
// [0, n) is never dereferenced: index_select and gather write 0 there,
// scatter_add skips it, one_hot leaves the row zero.
#include "tandem/tensor/cuda/cuda_common.cuh"

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

// One thread per (o, t) column of `columns` = outer * inner; sources j in
// order (Note [Deterministic scatter_add]).
template <class T, class I>
__global__ void scatter_add_kernel(T* out, int64_t n, int64_t inner, const I* index, int64_t k,
                                   const T* src, int64_t columns) {
  using A = acc_t<T>;
  for (int64_t c = detail::grid_start(); c < columns; c += detail::grid_step()) {
    const int64_t t = c % inner;
    const int64_t o = c / inner;
    T* out_o = out + o * n * inner + t;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t i = (o * k + j) * inner + t;
      const int64_t dst = static_cast<int64_t>(index[i]);
      if (dst < 0 || dst >= n) continue;
      T& d = out_o[dst * inner];
      if constexpr (std::is_same_v<T, bool>) {
        d = d || src[i];
      } else {
        d = static_cast<T>(static_cast<A>(d) + static_cast<A>(src[i]));
      }
    }
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
  const int64_t columns = outer * inner;
  if (columns == 0 || k == 0) return;
  detail::StreamDeviceGuard guard(stream);
  detail::dispatch_index(index.dtype, "scatter_add", [&](auto index_tag) {
    using I = typename decltype(index_tag)::type;
    dispatch_dtype(out.dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      detail::launch(scatter_add_kernel<T, I>, detail::blocks_for(columns), detail::kThreads, 0,
                     stream, static_cast<T*>(out.data), n, inner, static_cast<const I*>(index.data),
                     k, static_cast<const T*>(src.data), columns);
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
