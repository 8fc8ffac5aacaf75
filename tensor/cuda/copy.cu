// CUDA copy-family kernels: copy (strided, casting), fill, arange and random
// (tensor/kernels.h). Conversions follow tensor/cuda/cuda_common.cuh so a cast
// gives the same bits as the CPU backend. Random numbers come from the
// counter-based Philox of tensor/random.h, element i using counter offset + i,
// so a draw is identical on CPU and CUDA for the same generator state.
//
// Note [Random and arange rounding]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Bit-identical results need the same roundings as tensor/cpu/copy.cpp:
// uniform is lo + width * u in float with lo = float(a), width = float(b - a);
// normal is a + b * z and arange start + step * i, both in double. The CPU
// build (g++ -O3 -march=native, whose default -ffp-contract=fast) compiles each
// of these into one fused multiply-add, so the kernels call fma explicitly
// rather than leaving the choice to nvcc's contraction.
#include "tandem/tensor/cuda/cuda_common.cuh"
#include "tandem/tensor/random.h"

namespace tandem::TANDEM_KERNEL_SET {
namespace {

using detail::cast_to;
using detail::compute_t;
using detail::load_as;

template <class T, class U>
__global__ void copy_kernel(const T* in, U* out, int64_t n, bool contiguous,
                            detail::OffsetCalc<2> calc) {
  for (int64_t i = detail::grid_start(); i < n; i += detail::grid_step()) {
    int64_t off[2] = {i, i};
    if (!contiguous) calc.get(i, off);
    if constexpr (std::is_same_v<T, U>) {
      out[off[1]] = in[off[0]];
    } else {
      out[off[1]] = cast_to<U>(load_as<compute_t<T>>(in[off[0]]));
    }
  }
}

template <class T>
__global__ void fill_kernel(T* out, T value, int64_t n, bool contiguous,
                            detail::OffsetCalc<1> calc) {
  for (int64_t i = detail::grid_start(); i < n; i += detail::grid_step()) {
    int64_t off[1] = {i};
    if (!contiguous) calc.get(i, off);
    out[off[0]] = value;
  }
}

template <class T>
__global__ void arange_kernel(T* out, double start, double step, int64_t n, bool contiguous,
                              detail::OffsetCalc<1> calc) {
  for (int64_t i = detail::grid_start(); i < n; i += detail::grid_step()) {
    int64_t off[1] = {i};
    if (!contiguous) calc.get(i, off);
    // Note [Random and arange rounding]
    out[off[0]] = cast_to<T>(fma(step, static_cast<double>(i), start));
  }
}

template <class T>
__global__ void random_kernel(T* out, RandomKind kind, uint64_t seed, uint64_t offset, double a,
                              double b, float lo, float width, int64_t n, bool contiguous,
                              detail::OffsetCalc<1> calc) {
  for (int64_t i = detail::grid_start(); i < n; i += detail::grid_step()) {
    int64_t off[1] = {i};
    if (!contiguous) calc.get(i, off);
    // Note [Random and arange rounding]
    if (kind == RandomKind::Uniform) {
      out[off[0]] = cast_to<T>(__fmaf_rn(width, philox_uniform(offset, seed, i), lo));
    } else {
      out[off[0]] = cast_to<T>(fma(b, philox_normal(offset, seed, i), a));
    }
  }
}

}  // namespace

void copy(const TensorArg& in, const TensorArg& out, void* stream) {
  if (out.numel == 0) return;
  detail::StreamDeviceGuard guard(stream);
  if (in.dtype == out.dtype && in.contiguous && out.contiguous) {
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(out.data, in.data, out.numel * dtype_size(out.dtype),
                                      cudaMemcpyDeviceToDevice, detail::native(stream)));
    return;
  }
  const TensorArg* args[2] = {&in, &out};
  auto calc = detail::make_offset_calc(args);
  bool contiguous = in.contiguous && out.contiguous;
  auto launch = [&](auto* in_ptr, auto* out_ptr) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(in_ptr)>>;
    using U = std::remove_pointer_t<decltype(out_ptr)>;
    detail::launch(copy_kernel<T, U>, detail::blocks_for(out.numel), detail::kThreads, 0, stream,
                   in_ptr, out_ptr, out.numel, contiguous, calc);
  };
  if (in.dtype == out.dtype) {
    // A same-dtype copy only moves bits: one instantiation per element width.
    detail::dispatch_width(in.dtype, [&](auto tag) {
      using U = typename decltype(tag)::type;
      launch(static_cast<const U*>(in.data), static_cast<U*>(out.data));
    });
  } else {
    dispatch_dtype(in.dtype, [&](auto in_tag) {
      using T = typename decltype(in_tag)::type;
      dispatch_dtype(out.dtype, [&](auto out_tag) {
        using U = typename decltype(out_tag)::type;
        launch(static_cast<const T*>(in.data), static_cast<U*>(out.data));
      });
    });
  }
}

void fill(const TensorArg& out, double value, void* stream) {
  if (out.numel == 0) return;
  detail::StreamDeviceGuard guard(stream);
  const TensorArg* args[1] = {&out};
  auto calc = detail::make_offset_calc(args);
  dispatch_dtype(out.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    // The value is converted on the host with the same rules as the CPU backend.
    T v;
    if constexpr (std::is_same_v<T, bool>) {
      v = value != 0.0;
    } else {
      v = static_cast<T>(static_cast<acc_t<T>>(value));
    }
    detail::launch(fill_kernel<T>, detail::blocks_for(out.numel), detail::kThreads, 0, stream,
                   static_cast<T*>(out.data), v, out.numel, out.contiguous, calc);
  });
}

void arange(const TensorArg& out, double start, double step, void* stream) {
  if (out.numel == 0) return;
  detail::StreamDeviceGuard guard(stream);
  const TensorArg* args[1] = {&out};
  auto calc = detail::make_offset_calc(args);
  dispatch_dtype(out.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    detail::launch(arange_kernel<T>, detail::blocks_for(out.numel), detail::kThreads, 0, stream,
                   static_cast<T*>(out.data), start, step, out.numel, out.contiguous, calc);
  });
}

void random(const TensorArg& out, RandomKind kind, uint64_t seed, uint64_t offset, double a,
            double b, void* stream) {
  if (out.numel == 0) return;
  detail::StreamDeviceGuard guard(stream);
  const TensorArg* args[1] = {&out};
  auto calc = detail::make_offset_calc(args);
  dispatch_dtype(out.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    detail::launch(random_kernel<T>, detail::blocks_for(out.numel), detail::kThreads, 0, stream,
                   static_cast<T*>(out.data), kind, seed, offset, a, b, static_cast<float>(a),
                   static_cast<float>(b - a), out.numel, out.contiguous, calc);
  });
}

}  // namespace tandem::TANDEM_KERNEL_SET
