// CUDA normalisation over the last dim: layer_norm and rms_norm, and their
// fused backward (tensor/kernels.h). One block per row of x (rows, d); the block reduces the
// row's statistics in shared memory and then writes the normalised row. The
// statistics are computed in acc_t (f32 for 16-bit inputs, f64 for f64) and
// stored as f32 for the backward pass. The variance is taken around the mean
// (two passes over the row, which stays in L1/L2) rather than E[x^2] - E[x]^2,
// which cancels catastrophically for rows with a large mean. Every sum adds
// through a CascadeSum per thread and block_reduce's tree
// (Note [Cascade summation]).
#include "tandem/tensor/cuda/cuda_common.cuh"

namespace tandem::TANDEM_KERNEL_SET {
namespace {

using detail::load_as;

// Element i of an optional (d) parameter, read in its own dtype (it may differ
// from x's under mixed precision); `fallback` when absent.
template <class V>
__device__ __forceinline__ V load_param(const void* p, DType dtype, int64_t i, V fallback) {
  if (p == nullptr) return fallback;
  switch (dtype) {
    case DType::F32:
      return static_cast<V>(static_cast<const float*>(p)[i]);
    case DType::F64:
      return static_cast<V>(static_cast<const double*>(p)[i]);
    case DType::BF16:
      return load_as<V>(static_cast<const BFloat16*>(p)[i]);
    case DType::F16:
      return load_as<V>(static_cast<const Half*>(p)[i]);
    default:
      return fallback;  // the front end allows floating parameters only
  }
}

struct Param {
  const void* data;
  DType dtype;
};

template <class T>
__global__ void layer_norm_kernel(const T* x, Param weight, Param bias, double eps, int64_t rows,
                                  int64_t d, T* out, float* mean_out, float* rstd_out) {
  using V = acc_t<T>;
  TANDEM_SHARED(V, shared, detail::kThreads);
  // As on the CPU: multiply by 1/d; an empty row gets mean 0, not NaN.
  const V inv_d = d > 0 ? V(1) / static_cast<V>(d) : V(0);
  auto add = [](V a, V b) { return a + b; };
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * d;
    detail::CascadeSum<V> sum;
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x)
      sum.add(load_as<V>(xr[i]));
    V mean = detail::block_reduce(sum.total(), shared, add) * inv_d;
    detail::CascadeSum<V> sq;
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
      V c = load_as<V>(xr[i]) - mean;
      sq.add(c * c);
    }
    V var = detail::block_reduce(sq.total(), shared, add) * inv_d;
    V rstd = V(1) / detail::d_sqrt(var + static_cast<V>(eps));
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
      V w = load_param<V>(weight.data, weight.dtype, i, V(1));
      V b = load_param<V>(bias.data, bias.dtype, i, V(0));
      out[row * d + i] = T((load_as<V>(xr[i]) - mean) * rstd * w + b);
    }
    if (threadIdx.x == 0) {
      if (mean_out != nullptr) mean_out[row] = static_cast<float>(mean);
      if (rstd_out != nullptr) rstd_out[row] = static_cast<float>(rstd);
    }
  }
}

template <class T>
__global__ void rms_norm_kernel(const T* x, Param weight, double eps, int64_t rows, int64_t d,
                                T* out, float* rstd_out) {
  using V = acc_t<T>;
  TANDEM_SHARED(V, shared, detail::kThreads);
  // As on the CPU: multiply by 1/d; an empty row gets mean 0, not NaN.
  const V inv_d = d > 0 ? V(1) / static_cast<V>(d) : V(0);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * d;
    detail::CascadeSum<V> sq;
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
      V v = load_as<V>(xr[i]);
      sq.add(v * v);
    }
    V ms = detail::block_reduce(sq.total(), shared, [](V a, V b) { return a + b; }) * inv_d;
    V rstd = V(1) / detail::d_sqrt(ms + static_cast<V>(eps));
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
      V w = load_param<V>(weight.data, weight.dtype, i, V(1));
      out[row * d + i] = T(load_as<V>(xr[i]) * rstd * w);
    }
    if (threadIdx.x == 0 && rstd_out != nullptr) rstd_out[row] = static_cast<float>(rstd);
  }
}

// Note [Fused norm backward] (tensor/cpu/norm.cpp): dx per row, one block per
// row; the column sums (dweight, dbias) one thread per column over all rows in
// order through a CascadeSum, so they are deterministic and their error grows
// like log rows.
template <class T>
__global__ void norm_backward_dx_kernel(const T* dy, const T* x, Param weight, const float* mean,
                                        const float* rstd, int64_t rows, int64_t d, T* dx) {
  using V = acc_t<T>;
  TANDEM_SHARED(V, shared, detail::kThreads);
  const V inv_d = d > 0 ? V(1) / static_cast<V>(d) : V(0);
  auto add = [](V a, V b) { return a + b; };
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * d;
    const T* gr = dy + row * d;
    const V mu = mean != nullptr ? static_cast<V>(mean[row]) : V(0);
    const V rs = static_cast<V>(rstd[row]);
    detail::CascadeSum<V> s1, s2;
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
      const V xh = (load_as<V>(xr[i]) - mu) * rs;
      const V gw = load_as<V>(gr[i]) * load_param<V>(weight.data, weight.dtype, i, V(1));
      s1.add(gw);
      s2.add(gw * xh);
    }
    // mean == nullptr (rms_norm) is uniform across the block.
    const V m1 = mean != nullptr ? detail::block_reduce(s1.total(), shared, add) * inv_d : V(0);
    const V m2 = detail::block_reduce(s2.total(), shared, add) * inv_d;
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
      const V xh = (load_as<V>(xr[i]) - mu) * rs;
      const V gw = load_as<V>(gr[i]) * load_param<V>(weight.data, weight.dtype, i, V(1));
      dx[row * d + i] = T((gw - m1 - xh * m2) * rs);
    }
  }
}

template <class T>
__global__ void norm_backward_params_kernel(const T* dy, const T* x, const float* mean,
                                            const float* rstd, int64_t rows, int64_t d,
                                            acc_t<T>* dweight, acc_t<T>* dbias) {
  using V = acc_t<T>;
  for (int64_t j = detail::grid_start(); j < d; j += detail::grid_step()) {
    detail::CascadeSum<V> sw, sb;
    for (int64_t r = 0; r < rows; ++r) {
      const V g = load_as<V>(dy[r * d + j]);
      const V mu = mean != nullptr ? static_cast<V>(mean[r]) : V(0);
      sw.add(g * (load_as<V>(x[r * d + j]) - mu) * static_cast<V>(rstd[r]));
      sb.add(g);
    }
    if (dweight != nullptr) dweight[j] = sw.total();
    if (dbias != nullptr) dbias[j] = sb.total();
  }
}

unsigned row_blocks(int64_t rows) {
  return static_cast<unsigned>(std::min<int64_t>(rows, int64_t{1} << 16));
}

}  // namespace

void layer_norm(const TensorArg& x, const TensorArg& weight, const TensorArg& bias, double eps,
                int64_t rows, int64_t d, const TensorArg& out, const TensorArg& mean,
                const TensorArg& rstd, void* stream) {
  if (rows == 0) return;
  detail::StreamDeviceGuard guard(stream);
  dispatch_floating(x.dtype, "layer_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    detail::launch(layer_norm_kernel<T>, row_blocks(rows), detail::row_threads(d), 0, stream,
                   static_cast<const T*>(x.data), Param{weight.data, weight.dtype},
                   Param{bias.data, bias.dtype}, eps, rows, d, static_cast<T*>(out.data),
                   static_cast<float*>(mean.data), static_cast<float*>(rstd.data));
  });
}

void rms_norm(const TensorArg& x, const TensorArg& weight, double eps, int64_t rows, int64_t d,
              const TensorArg& out, const TensorArg& rstd, void* stream) {
  if (rows == 0) return;
  detail::StreamDeviceGuard guard(stream);
  dispatch_floating(x.dtype, "rms_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    detail::launch(rms_norm_kernel<T>, row_blocks(rows), detail::row_threads(d), 0, stream,
                   static_cast<const T*>(x.data), Param{weight.data, weight.dtype}, eps, rows, d,
                   static_cast<T*>(out.data), static_cast<float*>(rstd.data));
  });
}

void norm_backward(const TensorArg& dy, const TensorArg& x, const TensorArg& weight,
                   const TensorArg& mean, const TensorArg& rstd, int64_t rows, int64_t d,
                   const TensorArg& dx, const TensorArg& dweight, const TensorArg& dbias,
                   void* stream) {
  if (rows == 0 || d == 0) return;
  detail::StreamDeviceGuard guard(stream);
  dispatch_floating(x.dtype, "norm_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using V = acc_t<T>;
    const float* mean_p = static_cast<const float*>(mean.data);
    detail::launch(norm_backward_dx_kernel<T>, row_blocks(rows), detail::row_threads(d), 0, stream,
                   static_cast<const T*>(dy.data), static_cast<const T*>(x.data),
                   Param{weight.data, weight.dtype}, mean_p, static_cast<const float*>(rstd.data),
                   rows, d, static_cast<T*>(dx.data));
    if (dweight.data != nullptr || dbias.data != nullptr) {
      detail::launch(norm_backward_params_kernel<T>, detail::blocks_for(d), detail::kThreads, 0,
                     stream, static_cast<const T*>(dy.data), static_cast<const T*>(x.data), mean_p,
                     static_cast<const float*>(rstd.data), rows, d, static_cast<V*>(dweight.data),
                     static_cast<V*>(dbias.data));
    }
  });
}

}  // namespace tandem::TANDEM_KERNEL_SET
