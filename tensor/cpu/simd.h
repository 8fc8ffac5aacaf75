// Portable SIMD helpers for the CPU kernels: GCC/Clang vector extensions of
// one 64-byte register (16 floats, 8 doubles), which -march=native lowers to
// one AVX-512 register, two AVX2 registers or four SSE registers, and a
// vectorised exp for f32.
//
// Note [Vectorised exp]
// ~~~~~~~~~~~~~~~~~~~~~
// libm's expf is called once per element (the compiler cannot vectorise it
// without -ffast-math), which made exp the largest non-GEMM cost of the
// attention softmax and of SiLU. exp_vec is the Cephes single-precision
// polynomial: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 polynomial,
// 2^n by exponent arithmetic. Its error is within 2 ulp of expf over the normal
// range (tests/tensor/test_nn.cpp compares it with std::exp); results that
// would be subnormal (x < -87.3) flush to 0, x > 88.72 gives +inf, NaN stays
// NaN. f64 kernels keep std::exp (they serve gradchecks, not speed).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

namespace tandem::cpu::simd {

template <class T>
struct VecOf {
  typedef T type __attribute__((vector_size(64)));
};
template <class T>
using Vec = typename VecOf<T>::type;
template <class T>
constexpr int64_t kWidth = 64 / static_cast<int64_t>(sizeof(T));

using VecF = Vec<float>;
using VecI = Vec<int32_t>;

template <class T>
inline Vec<T> load(const T* p) {
  Vec<T> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class T>
inline void store(T* p, Vec<T> v) {
  std::memcpy(p, &v, sizeof v);
}
template <class T>
inline Vec<T> splat(T x) {
  return Vec<T>{} + x;
}
// The first n (< width) lanes of p, the rest `fill`.
template <class T>
inline Vec<T> load_partial(const T* p, int64_t n, T fill) {
  Vec<T> v = splat(fill);
  for (int64_t i = 0; i < n; ++i)
    v[i] = p[i];
  return v;
}
template <class T>
inline void store_partial(T* p, Vec<T> v, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    p[i] = v[i];
}

// The element type and lane count of a vector type V.
template <class V>
using Elem = std::remove_cv_t<std::remove_reference_t<decltype(std::declval<V>()[0])>>;
template <class V>
constexpr int64_t kLanes = static_cast<int64_t>(sizeof(V) / sizeof(Elem<V>));

template <class V>
inline Elem<V> reduce_add(V v) {
  Elem<V> s = 0;
  for (int64_t i = 0; i < kLanes<V>; ++i)
    s += v[i];
  return s;
}
template <class V>
inline Elem<V> reduce_max(V v) {
  Elem<V> m = v[0];
  for (int64_t i = 1; i < kLanes<V>; ++i)
    m = v[i] > m ? v[i] : m;
  return m;
}
template <class V>
inline V max(V a, V b) {
  return a > b ? a : b;
}

// Note [Vectorised exp].
inline VecF exp_vec(VecF x) {
  const VecF hi = splat(88.7228393554688f), lo = splat(-87.3365447505531f);
  VecF xc = x > hi ? hi : x;
  xc = xc < lo ? lo : xc;
  // n = round(x / ln2): adding 1.5 * 2^23 rounds to an integer (|x / ln2| < 2^22).
  const VecF magic = splat(12582912.0f);
  VecF n = (xc * 1.44269504088896341f + magic) - magic;
  VecF r = xc - n * 0.693359375f;  // ln2 split in two for an exact first product
  r = r - n * -2.12194440e-4f;
  VecF y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  // 2^n as 2^(n/2) * 2^(n - n/2): each factor stays normal for n in [-126, 128].
  const VecI ni = __builtin_convertvector(n, VecI);
  const VecI half = ni >> 1;
  const VecI e1 = (half + 127) << 23, e2 = (ni - half + 127) << 23;
  VecF s1, s2;
  std::memcpy(&s1, &e1, sizeof s1);
  std::memcpy(&s2, &e2, sizeof s2);
  VecF out = y * s1 * s2;
  out = x < lo ? splat(0.0f) : out;
  out = x > hi ? splat(std::numeric_limits<float>::infinity()) : out;
  return x != x ? x : out;  // NaN
}

}  // namespace tandem::cpu::simd
