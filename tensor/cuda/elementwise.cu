// CUDA elementwise kernels: unary, binary, binary_scalar and where
// (tensor/kernels.h). One grid-stride kernel per family and dtype; the op is a
// run-time switch inside the kernel, uniform across the grid, which keeps the
// number of instantiations (and nvcc time) small at no measurable cost for
// these memory-bound loops. Inputs may be strided or broadcast (stride 0);
// outputs are contiguous. The CPU backend (tensor/cpu/elementwise.cpp) is the
// reference: same compute types, same formulas.
#include "tandem/tensor/cuda/cuda_common.cuh"
#include "tandem/tensor/random.h"

namespace tandem::TANDEM_KERNEL_SET {
namespace {

using detail::cast_to;
using detail::compute_t;
using detail::load_as;

template <class V>
__device__ V unary_apply(UnaryOp op, V x) {
  if constexpr (std::is_floating_point_v<V>) {
    switch (op) {
      case UnaryOp::Neg:
        return -x;
      case UnaryOp::Exp:
        return detail::d_exp(x);
      case UnaryOp::Log:
        return detail::d_log(x);
      case UnaryOp::Sqrt:
        return detail::d_sqrt(x);
      case UnaryOp::Rsqrt:
        return V(1) / detail::d_sqrt(x);
      case UnaryOp::Abs:
        return x < V(0) ? -x : x;
      case UnaryOp::Tanh:
        return detail::d_tanh(x);
      case UnaryOp::Sigmoid:
        return V(1) / (V(1) + detail::d_exp(-x));
      case UnaryOp::Relu:
        return x > V(0) ? x : V(0);
      case UnaryOp::Gelu: {
        const V k = V(0.7978845608028654);  // sqrt(2 / pi)
        return V(0.5) * x * (V(1) + detail::d_tanh(k * (x + V(0.044715) * x * x * x)));
      }
      case UnaryOp::Silu:
        return x / (V(1) + detail::d_exp(-x));
      case UnaryOp::Erf:
        return detail::d_erf(x);
      case UnaryOp::Softplus:  // as the CPU: x itself past 20
        return x > V(20) ? x : detail::d_log(V(1) + detail::d_exp(x));
      case UnaryOp::GeluErf:
        return V(0.5) * x * (V(1) + detail::d_erf(x * V(0.7071067811865476)));  // 1 / sqrt(2)
    }
    return x;
  } else {
    // Integers: sign ops are exact; the transcendental ones go through double.
    switch (op) {
      case UnaryOp::Neg:
        return -x;
      case UnaryOp::Abs:
        return x < V(0) ? -x : x;
      case UnaryOp::Relu:
        return x > V(0) ? x : V(0);
      default:
        return static_cast<V>(unary_apply(op, static_cast<double>(x)));
    }
  }
}

// a^b for integers by squaring; negative exponents truncate toward zero.
template <class V>
__device__ V int_pow(V a, V b) {
  if (b < 0) return a == 1 ? V(1) : (a == -1 ? ((b & 1) ? V(-1) : V(1)) : V(0));
  V result = 1;
  while (b > 0) {
    if (b & 1) result *= a;
    a *= a;
    b >>= 1;
  }
  return result;
}

template <class V>
__device__ V arith_apply(BinaryOp op, V a, V b) {
  switch (op) {
    case BinaryOp::Add:
      return a + b;
    case BinaryOp::Sub:
      return a - b;
    case BinaryOp::Mul:
      return a * b;
    case BinaryOp::Div:
      if constexpr (std::is_floating_point_v<V>) {
        return a / b;
      } else {
        return b == V(0) ? V(0) : V(a / b);  // defined as 0, as on the CPU
      }
    case BinaryOp::Pow:
      if constexpr (std::is_floating_point_v<V>) {
        return detail::d_pow(a, b);
      } else {
        return int_pow(a, b);
      }
    // NaN propagates: a NaN `a` is returned as is, a NaN `b` fails both
    // comparisons. The CPU's formulas, so the results match bit for bit.
    case BinaryOp::Maximum:
      return detail::is_nan(a) ? a : (a > b ? a : b);
    case BinaryOp::Minimum:
      return detail::is_nan(a) ? a : (a < b ? a : b);
    default:
      return V(0);  // comparisons are handled by compare_apply
  }
}

template <class V>
__device__ bool compare_apply(BinaryOp op, V a, V b) {
  switch (op) {
    case BinaryOp::Eq:
      return a == b;
    case BinaryOp::Ne:
      return a != b;
    case BinaryOp::Lt:
      return a < b;
    case BinaryOp::Le:
      return a <= b;
    case BinaryOp::Gt:
      return a > b;
    case BinaryOp::Ge:
      return a >= b;
    default:
      return false;
  }
}

// O is T for arithmetic ops and bool for comparisons.
template <class T, class O, class V>
__device__ __forceinline__ O binary_value(BinaryOp op, V a, V b) {
  if (is_comparison(op)) return cast_to<O>(compare_apply(op, a, b) ? 1 : 0);
  return cast_to<O>(arith_apply(op, a, b));
}

// Note [Vectorised elementwise]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// These loops are memory-bound, and a 16-byte load or store is one memory
// transaction where four 4-byte ones are four instructions. When every
// operand is contiguous (no broadcast, no stride) and 16-byte aligned, unary,
// binary and binary_scalar move 16-byte packs (4 f32, 8 bf16, 2 f64), each
// element computed by the very formula of the scalar kernel, so the results
// are its bits; the last n % pack elements, and every strided, broadcast or
// unaligned operand, take the scalar kernel. Comparisons (bool outputs) and
// bool tensors stay scalar.
template <class T>
constexpr int kPack = sizeof(T) < 16 ? static_cast<int>(16 / sizeof(T)) : 1;

template <class T>
struct alignas(16) Pack {
  T v[kPack<T>];
};

template <class T>
constexpr bool packs_ok() {
  return !std::is_same_v<T, bool> && sizeof(T) < 16 && 16 % sizeof(T) == 0;
}

inline bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

template <class T>
__global__ void unary_pack_kernel(UnaryOp op, const Pack<T>* in, Pack<T>* out, int64_t packs) {
  for (int64_t i = detail::grid_start(); i < packs; i += detail::grid_step()) {
    const Pack<T> x = in[i];
    Pack<T> y;
    for (int j = 0; j < kPack<T>; ++j)
      y.v[j] = cast_to<T>(unary_apply(op, load_as<compute_t<T>>(x.v[j])));
    out[i] = y;
  }
}

template <class T>
__global__ void binary_pack_kernel(BinaryOp op, const Pack<T>* a, const Pack<T>* b, Pack<T>* out,
                                   int64_t packs) {
  using V = compute_t<T>;
  for (int64_t i = detail::grid_start(); i < packs; i += detail::grid_step()) {
    const Pack<T> x = a[i], z = b[i];
    Pack<T> y;
    for (int j = 0; j < kPack<T>; ++j)
      y.v[j] = cast_to<T>(arith_apply(op, load_as<V>(x.v[j]), load_as<V>(z.v[j])));
    out[i] = y;
  }
}

template <class T>
__global__ void binary_scalar_pack_kernel(BinaryOp op, const Pack<T>* a, double s,
                                          bool scalar_first, Pack<T>* out, int64_t packs) {
  using V = compute_t<T>;
  const V sv = static_cast<V>(s);
  for (int64_t i = detail::grid_start(); i < packs; i += detail::grid_step()) {
    const Pack<T> x = a[i];
    Pack<T> y;
    for (int j = 0; j < kPack<T>; ++j) {
      const V e = load_as<V>(x.v[j]);
      y.v[j] = cast_to<T>(arith_apply(op, scalar_first ? sv : e, scalar_first ? e : sv));
    }
    out[i] = y;
  }
}

template <class T>
__global__ void unary_kernel(UnaryOp op, const T* in, T* out, int64_t n, bool contiguous,
                             detail::OffsetCalc<1> calc) {
  for (int64_t i = detail::grid_start(); i < n; i += detail::grid_step()) {
    int64_t off[1] = {i};
    if (!contiguous) calc.get(i, off);
    out[i] = cast_to<T>(unary_apply(op, load_as<compute_t<T>>(in[off[0]])));
  }
}

template <class T, class O>
__global__ void binary_kernel(BinaryOp op, const T* a, const T* b, O* out, int64_t n,
                              bool contiguous, detail::OffsetCalc<2> calc) {
  using V = compute_t<T>;
  for (int64_t i = detail::grid_start(); i < n; i += detail::grid_step()) {
    int64_t off[2] = {i, i};
    if (!contiguous) calc.get(i, off);
    out[i] = binary_value<T, O>(op, load_as<V>(a[off[0]]), load_as<V>(b[off[1]]));
  }
}

template <class T, class O>
__global__ void binary_scalar_kernel(BinaryOp op, const T* a, double s, bool scalar_first, O* out,
                                     int64_t n, bool contiguous, detail::OffsetCalc<1> calc) {
  using V = compute_t<T>;
  // The scalar meets the tensor in its compute type; the front end has
  // promoted integer tensors to f32 for non-integral scalars.
  const V sv = static_cast<V>(s);
  for (int64_t i = detail::grid_start(); i < n; i += detail::grid_step()) {
    int64_t off[1] = {i};
    if (!contiguous) calc.get(i, off);
    V x = load_as<V>(a[off[0]]);
    out[i] = binary_value<T, O>(op, scalar_first ? sv : x, scalar_first ? x : sv);
  }
}

// As cpu::dropout: element i drops when philox_uniform(offset, seed, i) < p
// (compared in f32), whatever the grid.
template <class T>
__global__ void dropout_kernel(const T* in, T* out, int64_t n, float threshold, acc_t<T> scale,
                               uint64_t seed, uint64_t offset) {
  using V = acc_t<T>;
  for (int64_t i = detail::grid_start(); i < n; i += detail::grid_step()) {
    const bool drop = philox_uniform(offset, seed, i) < threshold;
    out[i] = cast_to<T>(drop ? V(0) : load_as<V>(in[i]) * scale);
  }
}

template <class U>
__global__ void where_kernel(const bool* cond, const U* a, const U* b, U* out, int64_t n,
                             bool contiguous, detail::OffsetCalc<3> calc) {
  for (int64_t i = detail::grid_start(); i < n; i += detail::grid_step()) {
    int64_t off[3] = {i, i, i};
    if (!contiguous) calc.get(i, off);
    out[i] = cond[off[0]] ? a[off[1]] : b[off[2]];
  }
}

// Note [Fused SwiGLU] (tensor/cpu/elementwise.cpp); contiguous operands.
template <class T>
__global__ void swiglu_kernel(const T* a, const T* b, T* out, int64_t n) {
  using V = acc_t<T>;
  for (int64_t i = detail::grid_start(); i < n; i += detail::grid_step()) {
    const V x = load_as<V>(a[i]);
    const V s = V(1) / (V(1) + detail::d_exp(-x));
    out[i] = cast_to<T>(x * s * load_as<V>(b[i]));
  }
}

template <class T>
__global__ void swiglu_backward_kernel(const T* a, const T* b, const T* g, T* da, T* db,
                                       int64_t n) {
  using V = acc_t<T>;
  for (int64_t i = detail::grid_start(); i < n; i += detail::grid_step()) {
    const V x = load_as<V>(a[i]), gv = load_as<V>(g[i]);
    const V s = V(1) / (V(1) + detail::d_exp(-x));
    da[i] = cast_to<T>(gv * load_as<V>(b[i]) * (s * (V(1) + x * (V(1) - s))));
    db[i] = cast_to<T>(gv * x * s);
  }
}

// Note [Fused rotary embedding] (tensor/cpu/elementwise.cpp): one thread per
// pair (x[i], x[i + D/2]) of a row.
template <class T>
__global__ void rotary_kernel(const T* x, const T* cos, const T* sin, T* out, int64_t pairs,
                              int64_t d, int64_t seq_len, int64_t inner, bool inverse) {
  using V = acc_t<T>;
  const int64_t h = d / 2;
  for (int64_t j = detail::grid_start(); j < pairs; j += detail::grid_step()) {
    const int64_t r = j / h, i = j % h;
    const int64_t pos = (r / inner) % seq_len;
    const T* c = cos + pos * d;
    const T* sn = sin + pos * d;
    const V lo = load_as<V>(x[r * d + i]), hi = load_as<V>(x[r * d + h + i]);
    const V a = lo * load_as<V>(c[i]), e = hi * load_as<V>(c[h + i]);
    const V b = hi * load_as<V>(sn[inverse ? h + i : i]);
    const V f = lo * load_as<V>(sn[inverse ? i : h + i]);
    out[r * d + i] = cast_to<T>(inverse ? a + b : a - b);
    out[r * d + h + i] = cast_to<T>(inverse ? e - f : e + f);
  }
}

}  // namespace

void swiglu(const TensorArg& a, const TensorArg& b, const TensorArg& out, void* stream) {
  if (out.numel == 0) return;
  detail::StreamDeviceGuard guard(stream);
  dispatch_floating(a.dtype, "swiglu", [&](auto tag) {
    using T = typename decltype(tag)::type;
    detail::launch(swiglu_kernel<T>, detail::blocks_for(out.numel), detail::kThreads, 0, stream,
                   static_cast<const T*>(a.data), static_cast<const T*>(b.data),
                   static_cast<T*>(out.data), out.numel);
  });
}

void swiglu_backward(const TensorArg& a, const TensorArg& b, const TensorArg& g,
                     const TensorArg& da, const TensorArg& db, void* stream) {
  if (a.numel == 0) return;
  detail::StreamDeviceGuard guard(stream);
  dispatch_floating(a.dtype, "swiglu_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    detail::launch(swiglu_backward_kernel<T>, detail::blocks_for(a.numel), detail::kThreads, 0,
                   stream, static_cast<const T*>(a.data), static_cast<const T*>(b.data),
                   static_cast<const T*>(g.data), static_cast<T*>(da.data),
                   static_cast<T*>(db.data), a.numel);
  });
}

void rotary(const TensorArg& x, const TensorArg& cos, const TensorArg& sin, int64_t seq_len,
            int64_t inner, bool inverse, const TensorArg& out, void* stream) {
  if (out.numel == 0) return;
  detail::StreamDeviceGuard guard(stream);
  const int64_t d = x.shape[x.ndim - 1], pairs = x.numel / 2;
  dispatch_floating(x.dtype, "rotary", [&](auto tag) {
    using T = typename decltype(tag)::type;
    detail::launch(rotary_kernel<T>, detail::blocks_for(pairs), detail::kThreads, 0, stream,
                   static_cast<const T*>(x.data), static_cast<const T*>(cos.data),
                   static_cast<const T*>(sin.data), static_cast<T*>(out.data), pairs, d, seq_len,
                   inner, inverse);
  });
}

void unary(UnaryOp op, const TensorArg& in, const TensorArg& out, void* stream) {
  if (out.numel == 0) return;
  detail::StreamDeviceGuard guard(stream);
  const TensorArg* args[1] = {&in};
  auto calc = detail::make_offset_calc(args);
  dispatch_dtype(in.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* x = static_cast<const T*>(in.data);
    T* y = static_cast<T*>(out.data);
    int64_t done = 0;  // elements the packs cover (Note [Vectorised elementwise])
    if constexpr (packs_ok<T>()) {
      if (in.contiguous && aligned16(x) && aligned16(y)) {
        const int64_t packs = out.numel / kPack<T>;
        if (packs > 0) {
          detail::launch(unary_pack_kernel<T>, detail::blocks_for(packs), detail::kThreads, 0,
                         stream, op, reinterpret_cast<const Pack<T>*>(x),
                         reinterpret_cast<Pack<T>*>(y), packs);
        }
        done = packs * kPack<T>;
        if (done == out.numel) return;
        x += done;
        y += done;
      }
    }
    detail::launch(unary_kernel<T>, detail::blocks_for(out.numel - done), detail::kThreads, 0,
                   stream, op, x, y, out.numel - done, in.contiguous, calc);
  });
}

void binary(BinaryOp op, const TensorArg& a, const TensorArg& b, const TensorArg& out,
            void* stream) {
  if (out.numel == 0) return;
  detail::StreamDeviceGuard guard(stream);
  const TensorArg* args[2] = {&a, &b};
  auto calc = detail::make_offset_calc(args);
  bool contiguous = a.contiguous && b.contiguous;
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto launch = [&](auto* out_ptr) {
      using O = std::remove_pointer_t<decltype(out_ptr)>;
      detail::launch(binary_kernel<T, O>, detail::blocks_for(out.numel), detail::kThreads, 0,
                     stream, op, static_cast<const T*>(a.data), static_cast<const T*>(b.data),
                     out_ptr, out.numel, contiguous, calc);
    };
    if (is_comparison(op)) {
      launch(static_cast<bool*>(out.data));
      return;
    }
    if constexpr (packs_ok<T>()) {
      const T* x = static_cast<const T*>(a.data);
      const T* z = static_cast<const T*>(b.data);
      T* y = static_cast<T*>(out.data);
      const int64_t packs = out.numel / kPack<T>;
      if (contiguous && packs > 0 && aligned16(x) && aligned16(z) && aligned16(y)) {
        detail::launch(binary_pack_kernel<T>, detail::blocks_for(packs), detail::kThreads, 0,
                       stream, op, reinterpret_cast<const Pack<T>*>(x),
                       reinterpret_cast<const Pack<T>*>(z), reinterpret_cast<Pack<T>*>(y), packs);
        const int64_t done = packs * kPack<T>;
        if (done < out.numel) {
          detail::launch(binary_kernel<T, T>, detail::blocks_for(out.numel - done),
                         detail::kThreads, 0, stream, op, x + done, z + done, y + done,
                         out.numel - done, true, calc);
        }
        return;
      }
    }
    launch(static_cast<T*>(out.data));
  });
}

void binary_scalar(BinaryOp op, const TensorArg& a, double s, bool scalar_first,
                   const TensorArg& out, void* stream) {
  if (out.numel == 0) return;
  detail::StreamDeviceGuard guard(stream);
  const TensorArg* args[1] = {&a};
  auto calc = detail::make_offset_calc(args);
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto launch = [&](auto* out_ptr) {
      using O = std::remove_pointer_t<decltype(out_ptr)>;
      detail::launch(binary_scalar_kernel<T, O>, detail::blocks_for(out.numel), detail::kThreads, 0,
                     stream, op, static_cast<const T*>(a.data), s, scalar_first, out_ptr, out.numel,
                     a.contiguous, calc);
    };
    if (is_comparison(op)) {
      launch(static_cast<bool*>(out.data));
      return;
    }
    if constexpr (packs_ok<T>()) {
      const T* x = static_cast<const T*>(a.data);
      T* y = static_cast<T*>(out.data);
      const int64_t packs = out.numel / kPack<T>;
      if (a.contiguous && packs > 0 && aligned16(x) && aligned16(y)) {
        detail::launch(binary_scalar_pack_kernel<T>, detail::blocks_for(packs), detail::kThreads, 0,
                       stream, op, reinterpret_cast<const Pack<T>*>(x), s, scalar_first,
                       reinterpret_cast<Pack<T>*>(y), packs);
        const int64_t done = packs * kPack<T>;
        if (done < out.numel) {
          detail::launch(binary_scalar_kernel<T, T>, detail::blocks_for(out.numel - done),
                         detail::kThreads, 0, stream, op, x + done, s, scalar_first, y + done,
                         out.numel - done, true, calc);
        }
        return;
      }
    }
    launch(static_cast<T*>(out.data));
  });
}

void where(const TensorArg& cond, const TensorArg& a, const TensorArg& b, const TensorArg& out,
           void* stream) {
  if (out.numel == 0) return;
  detail::StreamDeviceGuard guard(stream);
  const TensorArg* args[3] = {&cond, &a, &b};
  auto calc = detail::make_offset_calc(args);
  bool contiguous = cond.contiguous && a.contiguous && b.contiguous;
  // where only moves elements: one instantiation per element width.
  detail::dispatch_width(out.dtype, [&](auto tag) {
    using U = typename decltype(tag)::type;
    detail::launch(where_kernel<U>, detail::blocks_for(out.numel), detail::kThreads, 0, stream,
                   static_cast<const bool*>(cond.data), static_cast<const U*>(a.data),
                   static_cast<const U*>(b.data), static_cast<U*>(out.data), out.numel, contiguous,
                   calc);
  });
}

void dropout(const TensorArg& in, double p, uint64_t seed, uint64_t offset, const TensorArg& out,
             void* stream) {
  if (out.numel == 0) return;
  detail::StreamDeviceGuard guard(stream);
  dispatch_floating(in.dtype, "dropout", [&](auto tag) {
    using T = typename decltype(tag)::type;
    detail::launch(dropout_kernel<T>, detail::blocks_for(out.numel), detail::kThreads, 0, stream,
                   static_cast<const T*>(in.data), static_cast<T*>(out.data), out.numel,
                   static_cast<float>(p), static_cast<acc_t<T>>(1.0 / (1.0 - p)), seed, offset);
  });
}

}  // namespace tandem::TANDEM_KERNEL_SET
