// CUDA per-row sorting: argsort and topk (tensor/kernels.h) over contiguous
// (rows, n) inputs.
//
// Both are a bitonic sorting network over (key, index) pairs ordered by key and
// then by index. With the index as tie-break the order is total, so the
// (unstable) network yields exactly the stable order: ties keep the lower index
// first, the same result as the CPU's stable sort. NaN sorts as the largest
// value, as in PyTorch. The network is the variant whose comparators all point
// the same way (a "flip" stage then half-cleaners per merge size), which sorts
// any n, not only powers of two: positions >= n act as +infinity, which never
// move, so comparators reaching them are skipped.
//
// Rows that fit in shared memory are sorted by one block each; longer rows are
// sorted in global memory, one launch per network stage across all rows,
// permuting an index array and reading keys through it. topk keeps the first k.
#include "tandem/tensor/cuda/cuda_common.cuh"

namespace tandem::TANDEM_KERNEL_SET {
namespace {

using detail::compute_t;
using detail::load_as;

// Default (non opt-in) shared memory per block.
constexpr int64_t kSharedBytes = 48 * 1024;

template <class K>
__device__ __forceinline__ bool goes_before(K a, int64_t ia, K b, int64_t ib, bool descending) {
  bool a_nan = detail::is_nan(a), b_nan = detail::is_nan(b);
  if (a_nan || b_nan) {
    if (a_nan && b_nan) return ia < ib;
    return descending ? a_nan : b_nan;  // NaN is the largest value
  }
  if (a != b) return descending ? a > b : a < b;
  return ia < ib;
}

// Comparator c of the stage (size, stride) of a network over p slots.
__device__ __forceinline__ void comparator(int64_t c, int64_t size, int64_t stride, int64_t& a,
                                           int64_t& b) {
  if (stride == size / 2) {  // flip: compare mirrored positions of each block
    int64_t block = c / stride, pos = c % stride;
    a = block * size + pos;
    b = block * size + size - 1 - pos;
  } else {  // half-cleaner
    a = (c / stride) * stride * 2 + c % stride;
    b = a + stride;
  }
}

// Sorts each row in shared memory and writes its first `keep` entries.
template <class T>
__global__ void __launch_bounds__(detail::kMaxBlock)
    sort_shared_kernel(const T* in, int64_t rows, int64_t n, int64_t p, bool descending,
                       int64_t keep, T* values, int64_t* indices) {
  using K = compute_t<T>;
  TANDEM_DYNAMIC_SHARED(unsigned char, smem);
  K* keys = reinterpret_cast<K*>(smem);
  int32_t* idx = reinterpret_cast<int32_t*>(keys + p);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* x = in + row * n;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      keys[i] = load_as<K>(x[i]);
      idx[i] = static_cast<int32_t>(i);
    }
    __syncthreads();
    for (int64_t size = 2; size <= p; size *= 2) {
      for (int64_t stride = size / 2; stride > 0; stride /= 2) {
        for (int64_t c = threadIdx.x; c < p / 2; c += blockDim.x) {
          int64_t a, b;
          comparator(c, size, stride, a, b);
          if (b < n && goes_before(keys[b], idx[b], keys[a], idx[a], descending)) {
            K tk = keys[a];
            keys[a] = keys[b];
            keys[b] = tk;
            int32_t ti = idx[a];
            idx[a] = idx[b];
            idx[b] = ti;
          }
        }
        __syncthreads();
      }
    }
    for (int64_t i = threadIdx.x; i < keep; i += blockDim.x) {
      indices[row * keep + i] = idx[i];
      if (values != nullptr) values[row * keep + i] = x[idx[i]];
    }
    __syncthreads();  // smem is refilled for the next row
  }
}

__global__ void iota_rows_kernel(int64_t* idx, int64_t n, int64_t total) {
  for (int64_t i = detail::grid_start(); i < total; i += detail::grid_step())
    idx[i] = i % n;
}

// One network stage over every row: (rows, p/2) comparators.
template <class T>
__global__ void sort_stage_kernel(const T* in, int64_t* idx, int64_t rows, int64_t n, int64_t p,
                                  int64_t size, int64_t stride, bool descending) {
  using K = compute_t<T>;
  int64_t half = p / 2;
  for (int64_t g = detail::grid_start(); g < rows * half; g += detail::grid_step()) {
    int64_t row = g / half;
    int64_t a, b;
    comparator(g % half, size, stride, a, b);
    if (b >= n) continue;
    int64_t* r = idx + row * n;
    int64_t ia = r[a], ib = r[b];
    K ka = load_as<K>(in[row * n + ia]), kb = load_as<K>(in[row * n + ib]);
    if (goes_before(kb, ib, ka, ia, descending)) {
      r[a] = ib;
      r[b] = ia;
    }
  }
}

template <class T>
__global__ void take_first_kernel(const T* in, const int64_t* idx, int64_t rows, int64_t n,
                                  int64_t keep, T* values, int64_t* indices) {
  for (int64_t g = detail::grid_start(); g < rows * keep; g += detail::grid_step()) {
    int64_t row = g / keep;
    int64_t i = idx[row * n + g % keep];
    indices[g] = i;
    values[g] = in[row * n + i];
  }
}

// Sorts every row of `in` and writes the first `keep` of each: values (if not
// null) and indices, both (rows, keep).
void sort_rows(const TensorArg& in, int64_t rows, int64_t n, int64_t keep, bool descending,
               void* values, int64_t* indices, cudaStream_t stream) {
  int64_t p = 1;
  while (p < n)
    p *= 2;
  dispatch_dtype(in.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using K = compute_t<T>;
    const T* x = static_cast<const T*>(in.data);
    T* vals = static_cast<T*>(values);
    int64_t shared_bytes = p * static_cast<int64_t>(sizeof(K) + sizeof(int32_t));
    if (shared_bytes <= kSharedBytes) {
      int threads = static_cast<int>(std::clamp<int64_t>(p / 2, 32, detail::kMaxBlock));
      auto blocks = static_cast<unsigned>(std::min<int64_t>(rows, int64_t{1} << 16));
      detail::launch(sort_shared_kernel<T>, blocks, threads, shared_bytes, stream, x, rows, n, p,
                     descending, keep, vals, indices);
      return;
    }
    // Long rows: permute a (rows, n) index array in place. argsort sorts its
    // output directly; topk sorts a stream-ordered scratch buffer (freed in
    // stream order, so it is not reused before the kernels that read it).
    bool scratch = keep < n;
    int64_t* idx = indices;
    if (scratch) {
      void* buffer = nullptr;
      TANDEM_CUDA_CHECK(cudaMallocAsync(&buffer, rows * n * sizeof(int64_t), stream));
      idx = static_cast<int64_t*>(buffer);
    }
    detail::launch(iota_rows_kernel, detail::blocks_for(rows * n), detail::kThreads, 0, stream, idx,
                   n, rows * n);
    for (int64_t size = 2; size <= p; size *= 2) {
      for (int64_t stride = size / 2; stride > 0; stride /= 2) {
        detail::launch(sort_stage_kernel<T>, detail::blocks_for(rows * (p / 2)), detail::kThreads,
                       0, stream, x, idx, rows, n, p, size, stride, descending);
      }
    }
    if (vals != nullptr && keep > 0) {
      detail::launch(take_first_kernel<T>, detail::blocks_for(rows * keep), detail::kThreads, 0,
                     stream, x, idx, rows, n, keep, vals, indices);
    }
    if (scratch) TANDEM_CUDA_CHECK(cudaFreeAsync(idx, stream));
  });
}

}  // namespace

void topk(const TensorArg& in, int64_t rows, int64_t n, int64_t k, bool largest,
          const TensorArg& values, const TensorArg& indices, void* stream) {
  if (rows == 0 || k == 0) return;
  detail::StreamDeviceGuard guard(stream);
  sort_rows(in, rows, n, k, largest, values.data, static_cast<int64_t*>(indices.data),
            detail::native(stream));
}

void argsort(const TensorArg& in, int64_t rows, int64_t n, bool descending,
             const TensorArg& indices, void* stream) {
  if (rows == 0 || n == 0) return;
  detail::StreamDeviceGuard guard(stream);
  sort_rows(in, rows, n, n, descending, nullptr, static_cast<int64_t*>(indices.data),
            detail::native(stream));
}

}  // namespace tandem::TANDEM_KERNEL_SET
