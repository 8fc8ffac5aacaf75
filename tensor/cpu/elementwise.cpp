// CPU elementwise kernels: unary, binary (broadcast by stride 0), scalar,
// where, the fused SwiGLU gate and the fused rotary embedding. 16-bit types compute in float and
// round on store (dtype.h acc_t). The op is chosen outside the loop (one instantiation per op) so
// the inner loop is a plain strided loop the compiler vectorises. Contiguous operands of at least
// kElementGrain elements are split over the kernel threads (Note [CPU kernel threads]); the per-op
// overhead of small tensors is one comparison.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "tandem/tensor/cpu/loops.h"
#include "tandem/tensor/cpu/parallel.h"
#include "tandem/tensor/cpu/simd.h"
#include "tandem/tensor/kernels.h"
#include "tandem/tensor/random.h"

namespace tandem::cpu {
namespace {

constexpr int64_t kElementGrain = int64_t{1} << 15;

// fn(begin, end) over [0, n), split over the kernel threads when large.
template <class F>
void for_range(int64_t n, F&& fn) {
  parallel_for(n, kElementGrain, fn);
}

template <class A>
inline A gelu_tanh(A x) {
  const A k = static_cast<A>(0.7978845608028654);  // sqrt(2/pi)
  return static_cast<A>(0.5) * x *
         (static_cast<A>(1) + std::tanh(k * (x + static_cast<A>(0.044715) * x * x * x)));
}

template <class A>
inline A gelu_erf(A x) {
  const A inv_sqrt2 = static_cast<A>(0.7071067811865476);
  return static_cast<A>(0.5) * x * (static_cast<A>(1) + std::erf(x * inv_sqrt2));
}

// The ops defined for every arithmetic type; false for the others.
template <class A, class Fn>
bool with_sign_op(UnaryOp op, Fn&& fn) {
  switch (op) {
    case UnaryOp::Neg:
      fn([](A x) { return static_cast<A>(-x); });
      return true;
    case UnaryOp::Abs:
      fn([](A x) { return x < A(0) ? static_cast<A>(-x) : x; });
      return true;
    case UnaryOp::Relu:
      fn([](A x) { return x > A(0) ? x : A(0); });
      return true;
    default:
      return false;
  }
}

// Calls fn(functor) with the functor of `op` for arithmetic type A. The
// floating switch names every op, with no default (-Werror=switch: Note
// [Adding a unary op]); integers have the sign ops only.
template <class A, class Fn>
void with_unary(UnaryOp op, Fn&& fn) {
  if constexpr (!std::is_floating_point_v<A>) {
    TANDEM_CHECK(with_sign_op<A>(op, fn), "[cpu::unary] op {} is not defined for this dtype",
                 static_cast<int>(op));
    return;
  } else {
    switch (op) {
      case UnaryOp::Neg:
      case UnaryOp::Abs:
      case UnaryOp::Relu:
        with_sign_op<A>(op, fn);
        return;
      case UnaryOp::Exp:
        return fn([](A x) { return std::exp(x); });
      case UnaryOp::Log:
        return fn([](A x) { return std::log(x); });
      case UnaryOp::Sqrt:
        return fn([](A x) { return std::sqrt(x); });
      case UnaryOp::Rsqrt:
        return fn([](A x) { return A(1) / std::sqrt(x); });
      case UnaryOp::Tanh:
        return fn([](A x) { return std::tanh(x); });
      case UnaryOp::Sigmoid:
        return fn([](A x) { return A(1) / (A(1) + std::exp(-x)); });
      case UnaryOp::Gelu:
        return fn([](A x) { return gelu_tanh(x); });
      case UnaryOp::Silu:
        return fn([](A x) { return x / (A(1) + std::exp(-x)); });
      case UnaryOp::Erf:
        return fn([](A x) { return std::erf(x); });
      case UnaryOp::Softplus:  // log(1 + e^x); x itself past 20, as PyTorch's threshold
        return fn([](A x) { return x > A(20) ? x : static_cast<A>(std::log1p(std::exp(x))); });
      case UnaryOp::GeluErf:
        return fn([](A x) { return gelu_erf(x); });
    }
  }
  TANDEM_FAIL("[cpu::unary] unknown op {}", static_cast<int>(op));
}

template <class A>
inline A int_pow(A base, A exp) {
  if (exp < 0) return base == 1 ? 1 : (base == -1 ? (exp % 2 ? -1 : 1) : 0);
  A r = 1;
  while (exp) {
    if (exp & 1) r *= base;
    base *= base;
    exp >>= 1;
  }
  return r;
}

template <class A, class Fn>
void with_binary(BinaryOp op, Fn&& fn) {
  switch (op) {
    case BinaryOp::Add:
      return fn([](A x, A y) { return static_cast<A>(x + y); });
    case BinaryOp::Sub:
      return fn([](A x, A y) { return static_cast<A>(x - y); });
    case BinaryOp::Mul:
      return fn([](A x, A y) { return static_cast<A>(x * y); });
    case BinaryOp::Div:
      if constexpr (std::is_integral_v<A>) {
        // Integer division by zero is undefined behaviour in C++: define it as 0.
        return fn([](A x, A y) { return y == 0 ? A(0) : static_cast<A>(x / y); });
      } else {
        return fn([](A x, A y) { return x / y; });
      }
    case BinaryOp::Pow:
      if constexpr (std::is_integral_v<A>) {
        return fn([](A x, A y) { return int_pow(x, y); });
      } else {
        return fn([](A x, A y) { return std::pow(x, y); });
      }
    case BinaryOp::Maximum:
      return fn([](A x, A y) { return x != x ? x : (x > y ? x : y); });
    case BinaryOp::Minimum:
      return fn([](A x, A y) { return x != x ? x : (x < y ? x : y); });
    case BinaryOp::Eq:
      return fn([](A x, A y) { return x == y; });
    case BinaryOp::Ne:
      return fn([](A x, A y) { return x != y; });
    case BinaryOp::Lt:
      return fn([](A x, A y) { return x < y; });
    case BinaryOp::Le:
      return fn([](A x, A y) { return x <= y; });
    case BinaryOp::Gt:
      return fn([](A x, A y) { return x > y; });
    case BinaryOp::Ge:
      return fn([](A x, A y) { return x >= y; });
  }
}

// bool arithmetic is done in int32 then stored as bool.
template <class T>
using compute_t = std::conditional_t<std::is_same_v<T, bool>, int32_t, acc_t<T>>;

template <class T, class R, class F>
void binary_loop(const TensorArg& a, const TensorArg& b, const TensorArg& out, F f) {
  const T* pa = static_cast<const T*>(a.data);
  const T* pb = static_cast<const T*>(b.data);
  R* po = static_cast<R*>(out.data);
  using A = compute_t<T>;
  if (a.contiguous && b.contiguous) {
    for_range(out.numel, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i)
        po[i] = static_cast<R>(f(A(pa[i]), A(pb[i])));
    });
    return;
  }
  for_each_row<3>(out, {&a, &b, &out}, [&](auto off, auto st, int64_t n) {
    const T* x = pa + off[0];
    const T* y = pb + off[1];
    R* o = po + off[2];
    if (st[0] == 1 && st[1] == 0) {  // common broadcast: row op scalar-per-row
      A yv = A(*y);
      for (int64_t i = 0; i < n; ++i)
        o[i * st[2]] = static_cast<R>(f(A(x[i]), yv));
    } else {
      for (int64_t i = 0; i < n; ++i) {
        o[i * st[2]] = static_cast<R>(f(A(x[i * st[0]]), A(y[i * st[1]])));
      }
    }
  });
}

}  // namespace

namespace {

// f32 exp, sigmoid and silu over contiguous operands on the vectorised exp
// (Note [Vectorised exp] in simd.h); false for every other case.
bool unary_f32_vectorised(UnaryOp op, const TensorArg& in, const TensorArg& out) {
  if (in.dtype != DType::F32 || !in.contiguous) return false;
  if (op != UnaryOp::Exp && op != UnaryOp::Sigmoid && op != UnaryOp::Silu) return false;
  const float* pi = static_cast<const float*>(in.data);
  float* po = static_cast<float*>(out.data);
  auto f = [op](simd::VecF x) {
    if (op == UnaryOp::Exp) return simd::exp_vec(x);
    const simd::VecF s = 1.0f / (1.0f + simd::exp_vec(-x));
    return op == UnaryOp::Sigmoid ? s : x * s;
  };
  for_range(out.numel, [&](int64_t i0, int64_t i1) {
    constexpr int64_t W = simd::kWidth<float>;
    int64_t i = i0;
    for (; i + W <= i1; i += W)
      simd::store(po + i, f(simd::load(pi + i)));
    if (i < i1) simd::store_partial(po + i, f(simd::load_partial(pi + i, i1 - i, 0.0f)), i1 - i);
  });
  return true;
}

}  // namespace

void unary(UnaryOp op, const TensorArg& in, const TensorArg& out) {
  if (unary_f32_vectorised(op, in, out)) return;
  dispatch_dtype(in.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = compute_t<T>;
    const T* pi = static_cast<const T*>(in.data);
    T* po = static_cast<T*>(out.data);
    with_unary<A>(op, [&](auto f) {
      if (in.contiguous) {
        for_range(out.numel, [&](int64_t i0, int64_t i1) {
          for (int64_t i = i0; i < i1; ++i)
            po[i] = static_cast<T>(f(A(pi[i])));
        });
        return;
      }
      for_each_row<2>(out, {&in, &out}, [&](auto off, auto st, int64_t n) {
        for (int64_t i = 0; i < n; ++i) {
          po[off[1] + i * st[1]] = static_cast<T>(f(A(pi[off[0] + i * st[0]])));
        }
      });
    });
  });
}

void binary(BinaryOp op, const TensorArg& a, const TensorArg& b, const TensorArg& out) {
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    with_binary<compute_t<T>>(op, [&](auto f) {
      if (is_comparison(op)) {
        binary_loop<T, bool>(a, b, out, f);
      } else {
        binary_loop<T, T>(a, b, out, f);
      }
    });
  });
}

void binary_scalar(BinaryOp op, const TensorArg& a, double s, bool scalar_first,
                   const TensorArg& out) {
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = compute_t<T>;
    const A sv = static_cast<A>(s);
    with_binary<A>(op, [&](auto f) {
      auto run = [&](auto g, auto result_tag) {
        using R = typename decltype(result_tag)::type;
        const T* pa = static_cast<const T*>(a.data);
        R* po = static_cast<R*>(out.data);
        if (a.contiguous) {
          for_range(out.numel, [&](int64_t i0, int64_t i1) {
            for (int64_t i = i0; i < i1; ++i)
              po[i] = static_cast<R>(g(A(pa[i])));
          });
          return;
        }
        for_each_row<2>(out, {&a, &out}, [&](auto off, auto st, int64_t n) {
          for (int64_t i = 0; i < n; ++i) {
            po[off[1] + i * st[1]] = static_cast<R>(g(A(pa[off[0] + i * st[0]])));
          }
        });
      };
      auto left = [&](A x) { return f(sv, x); };
      auto right = [&](A x) { return f(x, sv); };
      if (is_comparison(op)) {
        scalar_first ? run(left, TypeTag<bool>{}) : run(right, TypeTag<bool>{});
      } else {
        scalar_first ? run(left, TypeTag<T>{}) : run(right, TypeTag<T>{});
      }
    });
  });
}

void where(const TensorArg& cond, const TensorArg& a, const TensorArg& b, const TensorArg& out) {
  dispatch_dtype(out.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const bool* pc = static_cast<const bool*>(cond.data);
    const T* pa = static_cast<const T*>(a.data);
    const T* pb = static_cast<const T*>(b.data);
    T* po = static_cast<T*>(out.data);
    for_each_row<4>(out, {&cond, &a, &b, &out}, [&](auto off, auto st, int64_t n) {
      for (int64_t i = 0; i < n; ++i) {
        po[off[3] + i * st[3]] =
            pc[off[0] + i * st[0]] ? pa[off[1] + i * st[1]] : pb[off[2] + i * st[2]];
      }
    });
  });
}

// Note [Fused SwiGLU]
// ~~~~~~~~~~~~~~~~~~~
// silu(a) * b forward and its two gradients backward are one pass each over
// the (tokens, hidden) operands instead of silu, mul (forward) and sigmoid,
// four products, two sums (backward), with exp vectorised for f32 (Note
// [Vectorised exp] in simd.h):
//   s = sigmoid(a), silu = a s, silu' = s (1 + a (1 - s)),
//   out = silu b,   da = g b silu',   db = g silu.
void swiglu(const TensorArg& a, const TensorArg& b, const TensorArg& out) {
  dispatch_floating(a.dtype, "swiglu", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    const T* pa = static_cast<const T*>(a.data);
    const T* pb = static_cast<const T*>(b.data);
    T* po = static_cast<T*>(out.data);
    for_range(out.numel, [&](int64_t i0, int64_t i1) {
      int64_t i = i0;
      if constexpr (std::is_same_v<T, float>) {
        constexpr int64_t W = simd::kWidth<float>;
        for (; i + W <= i1; i += W) {
          const simd::VecF x = simd::load(pa + i);
          const simd::VecF s = 1.0f / (1.0f + simd::exp_vec(-x));
          simd::store(po + i, x * s * simd::load(pb + i));
        }
      }
      for (; i < i1; ++i) {
        const A x = static_cast<A>(pa[i]);
        const A s = A(1) / (A(1) + std::exp(-x));
        po[i] = static_cast<T>(x * s * static_cast<A>(pb[i]));
      }
    });
  });
}

void swiglu_backward(const TensorArg& a, const TensorArg& b, const TensorArg& g,
                     const TensorArg& da, const TensorArg& db) {
  dispatch_floating(a.dtype, "swiglu_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    const T* pa = static_cast<const T*>(a.data);
    const T* pb = static_cast<const T*>(b.data);
    const T* pg = static_cast<const T*>(g.data);
    T* pda = static_cast<T*>(da.data);
    T* pdb = static_cast<T*>(db.data);
    for_range(a.numel, [&](int64_t i0, int64_t i1) {
      int64_t i = i0;
      if constexpr (std::is_same_v<T, float>) {
        constexpr int64_t W = simd::kWidth<float>;
        for (; i + W <= i1; i += W) {
          const simd::VecF x = simd::load(pa + i), gv = simd::load(pg + i);
          const simd::VecF s = 1.0f / (1.0f + simd::exp_vec(-x));
          const simd::VecF silu = x * s;
          simd::store(pda + i, gv * simd::load(pb + i) * (s * (1.0f + x * (1.0f - s))));
          simd::store(pdb + i, gv * silu);
        }
      }
      for (; i < i1; ++i) {
        const A x = static_cast<A>(pa[i]), gv = static_cast<A>(pg[i]);
        const A s = A(1) / (A(1) + std::exp(-x));
        pda[i] = static_cast<T>(gv * static_cast<A>(pb[i]) * (s * (A(1) + x * (A(1) - s))));
        pdb[i] = static_cast<T>(gv * x * s);
      }
    });
  });
}

// Note [Fused rotary embedding]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The rotary embedding turns each pair (x[i], x[i + D/2]) of a row by its
// position's angles: with h = D/2 and the row's table entries c, s,
//   out[i]     = x[i] c[i]         - x[i + h] s[i]
//   out[i + h] = x[i + h] c[i + h] + x[i] s[i + h],
// and the inverse (the gradient: the rotation's transpose) swaps the signs
// and the halves of s:
//   out[i]     = x[i] c[i]         + x[i + h] s[i + h]
//   out[i + h] = x[i + h] c[i + h] - x[i] s[i].
// As composite ops (two narrows, a negation, a cat, two products and a sum
// forward; as many again backward, with a scatter into zeros per narrow and
// their sums) it was about a dozen passes over q and k per step; here it is
// one each way, and backward saves only the tables. The compiler may fuse a
// product and the sum into one FMA, so the bits may differ from the
// composite's in the last place; 16-bit types compute in float and round
// once.
// One row of D = 2h: s_lo and s_hi are the halves of s that the low and high
// halves' s terms read (0 and h forward, h and 0 inverse).
template <class T>
void rotate_row(const T* x, const T* c, const T* s, int64_t h, int64_t s_lo, int64_t s_hi,
                bool inverse, T* out) {
  using A = acc_t<T>;
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    constexpr int64_t W = simd::kWidth<float>;
    for (; h % W == 0 && i < h; i += W) {
      const simd::VecF lo = simd::load(x + i), hi = simd::load(x + h + i);
      const simd::VecF a = lo * simd::load(c + i), b = hi * simd::load(s + s_lo + i);
      const simd::VecF e = hi * simd::load(c + h + i), f = lo * simd::load(s + s_hi + i);
      simd::store(out + i, inverse ? a + b : a - b);
      simd::store(out + h + i, inverse ? e - f : e + f);
    }
  }
  for (; i < h; ++i) {
    const A lo = static_cast<A>(x[i]), hi = static_cast<A>(x[h + i]);
    const A a = lo * static_cast<A>(c[i]), b = hi * static_cast<A>(s[s_lo + i]);
    const A e = hi * static_cast<A>(c[h + i]), f = lo * static_cast<A>(s[s_hi + i]);
    out[i] = static_cast<T>(inverse ? a + b : a - b);
    out[h + i] = static_cast<T>(inverse ? e - f : e + f);
  }
}

void rotary(const TensorArg& x, const TensorArg& cos, const TensorArg& sin, int64_t seq_len,
            int64_t inner, bool inverse, const TensorArg& out) {
  if (x.numel == 0) return;
  const int64_t d = x.shape[x.ndim - 1], h = d / 2, rows = x.numel / d;
  const int64_t s_lo = inverse ? h : 0, s_hi = inverse ? 0 : h;
  dispatch_floating(x.dtype, "rotary", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* px = static_cast<const T*>(x.data);
    const T* pc = static_cast<const T*>(cos.data);
    const T* ps = static_cast<const T*>(sin.data);
    T* po = static_cast<T*>(out.data);
    parallel_for(rows, std::max<int64_t>(1, kElementGrain / d), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t pos = (r / inner) % seq_len;
        rotate_row(px + r * d, pc + pos * d, ps + pos * d, h, s_lo, s_hi, inverse, po + r * d);
      }
    });
  });
}

// Counter-based: element i's keep/drop depends only on (seed, offset + i),
// so any chunking, the CUDA kernel and a recomputed forward agree.
void dropout(const TensorArg& in, double p, uint64_t seed, uint64_t offset, const TensorArg& out) {
  dispatch_floating(in.dtype, "dropout", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    const T* pi = static_cast<const T*>(in.data);
    T* po = static_cast<T*>(out.data);
    const float threshold = static_cast<float>(p);
    const A scale = static_cast<A>(1.0 / (1.0 - p));
    for_range(out.numel, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const bool drop = philox_uniform(offset, seed, i) < threshold;
        po[i] = static_cast<T>(drop ? A(0) : static_cast<A>(pi[i]) * scale);
      }
    });
  });
}

}  // namespace tandem::cpu
