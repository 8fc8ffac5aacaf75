// CUDA reductions along one axis: reduce (sum, mean, max, min, argmax,
// argmin), softmax / log_softmax and cumsum (tensor/kernels.h). The input is a
// contiguous (outer, r, inner) view, the output (outer, inner).
//
// Two layouts, chosen per call:
// - block per output: the threads of a block stride over r and combine in
//   shared memory. Used when inner == 1 (rows are contiguous: coalesced) and
//   when there are too few outputs to fill the GPU with one thread each.
// - thread per output: each thread walks r with stride inner; neighbouring
//   threads read neighbouring addresses, so the loads coalesce.
// Float sums accumulate in acc_t (f32 for the 16-bit types), integers in i64,
// each thread in a CascadeSum and the threads of a block by a tree
// (Note [Cascade summation]), so the error grows like log r; the order
// differs from the CPU's, so float results agree to rounding, integer results
// exactly.
#include <limits>

#include "tandem/tensor/cuda/cuda_common.cuh"

namespace tandem::TANDEM_KERNEL_SET {
namespace {

using detail::compute_t;
using detail::load_as;
using detail::sum_t;

// Below this many outputs a block per output beats a thread per output.
constexpr int64_t kFewOutputs = 2048;

template <class V>
struct ValueIndex {
  V v;
  int64_t i;  // -1: nothing seen yet
};

// Reducers: a thread folds its elements into a partial P (start(),
// add(partial, x, k) for element k of the axis, finish(partial) -> S), the
// threads' states are combined by combine(a, b) (associative), and
// store(out, dtype, o, state, r) writes the result.
template <class T>
struct SumReducer {
  using S = sum_t<T>;
  using P = detail::CascadeSum<S>;
  bool mean;
  __device__ P start() const { return P{}; }
  __device__ void add(P& p, T x, int64_t) const { p.add(load_as<S>(x)); }
  __device__ S finish(const P& p) const { return p.total(); }
  __device__ S combine(S a, S b) const { return a + b; }
  __device__ void store(void* out, DType dtype, int64_t o, S s, int64_t r) const {
    // Mean multiplies by 1/r, as the CPU does (the front end sends only
    // floating inputs here; integers are converted to f32 first).
    S scale = mean && r > 0 ? S(1) / static_cast<S>(r) : S(1);
    detail::store_dyn(out, dtype, o, mean ? s * scale : s);
  }
};

// Max/min and argmax/argmin share one ordering: NaN wins (it propagates, as in
// PyTorch), and among equal values the lower index wins (first occurrence).
template <class T>
struct ExtremumReducer {
  using V = compute_t<T>;
  using S = ValueIndex<V>;
  using P = S;
  bool is_max;
  bool want_index;
  __device__ P start() const { return S{V(0), -1}; }
  __device__ S finish(const P& p) const { return p; }
  __device__ bool better(V a, V b) const {
    if (detail::is_nan(a)) return !detail::is_nan(b);
    if (detail::is_nan(b)) return false;
    return is_max ? a > b : a < b;
  }
  __device__ S combine(S a, S b) const {
    if (a.i < 0) return b;
    if (b.i < 0) return a;
    if (better(a.v, b.v)) return a;
    if (better(b.v, a.v)) return b;
    return a.i < b.i ? a : b;
  }
  __device__ void add(P& p, T x, int64_t k) const { p = combine(p, S{load_as<V>(x), k}); }
  __device__ void store(void* out, DType dtype, int64_t o, S s, int64_t) const {
    if (want_index) {
      detail::store_dyn(out, dtype, o, s.i);
    } else {
      detail::store_dyn(out, dtype, o, s.v);
    }
  }
};

template <class T, class R>
__global__ void reduce_block_kernel(R reducer, const T* in, int64_t outer, int64_t r, int64_t inner,
                                    void* out, DType out_dtype) {
  using S = typename R::S;
  TANDEM_SHARED(S, shared, detail::kThreads);
  for (int64_t o = blockIdx.x; o < outer * inner; o += gridDim.x) {
    const T* base = in + (o / inner) * r * inner + o % inner;
    auto partial = reducer.start();
    for (int64_t k = threadIdx.x; k < r; k += blockDim.x)
      reducer.add(partial, base[k * inner], k);
    S s = detail::block_reduce(reducer.finish(partial), shared,
                               [&](S a, S b) { return reducer.combine(a, b); });
    if (threadIdx.x == 0) reducer.store(out, out_dtype, o, s, r);
  }
}

template <class T, class R>
__global__ void reduce_thread_kernel(R reducer, const T* in, int64_t outer, int64_t r,
                                     int64_t inner, void* out, DType out_dtype) {
  for (int64_t o = detail::grid_start(); o < outer * inner; o += detail::grid_step()) {
    const T* base = in + (o / inner) * r * inner + o % inner;
    auto partial = reducer.start();
    for (int64_t k = 0; k < r; ++k)
      reducer.add(partial, base[k * inner], k);
    reducer.store(out, out_dtype, o, reducer.finish(partial), r);
  }
}

template <class T, class R>
void launch_reduce(R reducer, const TensorArg& in, int64_t outer, int64_t r, int64_t inner,
                   const TensorArg& out, cudaStream_t stream) {
  const T* data = static_cast<const T*>(in.data);
  int64_t outputs = outer * inner;
  if (inner == 1 || outputs < kFewOutputs) {
    int threads = detail::row_threads(r);
    auto blocks = static_cast<unsigned>(std::min<int64_t>(outputs, int64_t{1} << 16));
    detail::launch(reduce_block_kernel<T, R>, blocks, threads, 0, stream, reducer, data, outer, r,
                   inner, out.data, out.dtype);
  } else {
    detail::launch(reduce_thread_kernel<T, R>, detail::blocks_for(outputs), detail::kThreads, 0,
                   stream, reducer, data, outer, r, inner, out.data, out.dtype);
  }
}

// Softmax of one (o, ., j) line, walked by `lane` of `lanes` threads; the
// block variant combines the partial max and sum through `shared`.
template <class T, bool kBlock>
__device__ void softmax_line(const T* in, T* out, int64_t r, int64_t inner, bool log, int lane,
                             int lanes, acc_t<T>* shared) {
  using V = acc_t<T>;
  // The CPU's formulas: the max skips NaN, an all -inf line uses 0 as its
  // max, log_softmax subtracts m + log(sum), softmax multiplies by 1/sum.
  auto larger = [](V a, V b) { return a > b ? a : b; };
  V m = -std::numeric_limits<V>::infinity();
  for (int64_t k = lane; k < r; k += lanes)
    m = larger(load_as<V>(in[k * inner]), m);
  if constexpr (kBlock) m = detail::block_reduce(m, shared, larger);
  if (m == -std::numeric_limits<V>::infinity()) m = 0;
  detail::CascadeSum<V> partial;
  for (int64_t k = lane; k < r; k += lanes)
    partial.add(detail::d_exp(load_as<V>(in[k * inner]) - m));
  V sum = partial.total();
  if constexpr (kBlock) sum = detail::block_reduce(sum, shared, [](V a, V b) { return a + b; });
  const V shift = m + detail::d_log(sum);
  const V inv = sum > V(0) ? V(1) / sum : V(0);  // a fully masked line gives zeros
  for (int64_t k = lane; k < r; k += lanes) {
    V x = load_as<V>(in[k * inner]);
    out[k * inner] = T(log ? x - shift : detail::d_exp(x - m) * inv);
  }
}

template <class T>
__global__ void softmax_block_kernel(const T* in, T* out, int64_t outer, int64_t r, int64_t inner,
                                     bool log) {
  TANDEM_SHARED(acc_t<T>, shared, detail::kThreads);
  for (int64_t o = blockIdx.x; o < outer * inner; o += gridDim.x) {
    int64_t base = (o / inner) * r * inner + o % inner;
    softmax_line<T, true>(in + base, out + base, r, inner, log, threadIdx.x, blockDim.x, shared);
  }
}

template <class T>
__global__ void softmax_thread_kernel(const T* in, T* out, int64_t outer, int64_t r, int64_t inner,
                                      bool log) {
  for (int64_t o = detail::grid_start(); o < outer * inner; o += detail::grid_step()) {
    int64_t base = (o / inner) * r * inner + o % inner;
    softmax_line<T, false>(in + base, out + base, r, inner, log, 0, 1, nullptr);
  }
}

// Inclusive scan of contiguous rows, a tile of blockDim elements at a time
// (Hillis-Steele in shared memory), carrying the tiles' totals across in a
// CascadeSum (Note [Cascade summation]) so the carry's error grows like log r.
template <class T>
__global__ void cumsum_block_kernel(const T* in, void* out, DType out_dtype, int64_t rows,
                                    int64_t r) {
  using S = sum_t<T>;
  TANDEM_SHARED(S, tile, detail::kThreads);
  int tid = threadIdx.x;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    detail::CascadeSum<S> carry;
    for (int64_t t0 = 0; t0 < r; t0 += blockDim.x) {
      int64_t k = t0 + tid;
      tile[tid] = k < r ? load_as<S>(in[row * r + k]) : S(0);
      __syncthreads();
      for (int width = 1; width < static_cast<int>(blockDim.x); width *= 2) {
        S left = tid >= width ? tile[tid - width] : S(0);
        __syncthreads();
        tile[tid] += left;
        __syncthreads();
      }
      if (k < r) detail::store_dyn(out, out_dtype, row * r + k, carry.total() + tile[tid]);
      carry.add(tile[blockDim.x - 1]);
      __syncthreads();  // the tile is rewritten next round
    }
  }
}

template <class T>
__global__ void cumsum_thread_kernel(const T* in, void* out, DType out_dtype, int64_t outer,
                                     int64_t r, int64_t inner) {
  using S = sum_t<T>;
  for (int64_t o = detail::grid_start(); o < outer * inner; o += detail::grid_step()) {
    int64_t base = (o / inner) * r * inner + o % inner;
    detail::CascadeSum<S> s;
    for (int64_t k = 0; k < r; ++k) {
      s.add(load_as<S>(in[base + k * inner]));
      detail::store_dyn(out, out_dtype, base + k * inner, s.total());
    }
  }
}

}  // namespace

void reduce(ReduceOp op, const TensorArg& in, int64_t outer, int64_t r, int64_t inner,
            const TensorArg& out, void* stream) {
  if (outer * inner == 0) return;
  detail::StreamDeviceGuard guard(stream);
  dispatch_dtype(in.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    cudaStream_t s = detail::native(stream);
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Mean:
        launch_reduce<T>(SumReducer<T>{op == ReduceOp::Mean}, in, outer, r, inner, out, s);
        break;
      case ReduceOp::Max:
      case ReduceOp::Min:
      case ReduceOp::Argmax:
      case ReduceOp::Argmin: {
        bool is_max = op == ReduceOp::Max || op == ReduceOp::Argmax;
        bool want_index = op == ReduceOp::Argmax || op == ReduceOp::Argmin;
        launch_reduce<T>(ExtremumReducer<T>{is_max, want_index}, in, outer, r, inner, out, s);
        break;
      }
    }
  });
}

void softmax(const TensorArg& in, int64_t outer, int64_t r, int64_t inner, bool log,
             const TensorArg& out, void* stream) {
  if (outer * inner * r == 0) return;
  detail::StreamDeviceGuard guard(stream);
  dispatch_floating(in.dtype, "softmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* x = static_cast<const T*>(in.data);
    T* y = static_cast<T*>(out.data);
    int64_t lines = outer * inner;
    if (inner == 1 || lines < kFewOutputs) {
      auto blocks = static_cast<unsigned>(std::min<int64_t>(lines, int64_t{1} << 16));
      detail::launch(softmax_block_kernel<T>, blocks, detail::row_threads(r), 0, stream, x, y,
                     outer, r, inner, log);
    } else {
      detail::launch(softmax_thread_kernel<T>, detail::blocks_for(lines), detail::kThreads, 0,
                     stream, x, y, outer, r, inner, log);
    }
  });
}

void cumsum(const TensorArg& in, int64_t outer, int64_t r, int64_t inner, const TensorArg& out,
            void* stream) {
  if (outer * inner * r == 0) return;
  detail::StreamDeviceGuard guard(stream);
  dispatch_dtype(in.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* x = static_cast<const T*>(in.data);
    // Long contiguous rows scan cooperatively; short or strided lines are
    // scanned by one thread each.
    if (inner == 1 && r >= 64) {
      auto blocks = static_cast<unsigned>(std::min<int64_t>(outer, int64_t{1} << 16));
      detail::launch(cumsum_block_kernel<T>, blocks, detail::row_threads(r), 0, stream, x, out.data,
                     out.dtype, outer, r);
    } else {
      detail::launch(cumsum_thread_kernel<T>, detail::blocks_for(outer * inner), detail::kThreads,
                     0, stream, x, out.data, out.dtype, outer, r, inner);
    }
  });
}

}  // namespace tandem::TANDEM_KERNEL_SET
