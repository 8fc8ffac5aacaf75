// Portable SIMD helpers for the CPU kernels: GCC/Clang vector extensions of
// one vector register of the target the build selects (Note [SIMD width]),
// a fused multiply-add, and a vectorised exp for f32.
//
// Note [SIMD width]
// ~~~~~~~~~~~~~~~~~
// A vector here is exactly one register of the build's target: 64 bytes (one
// zmm) when it has AVX-512F, 32 bytes (one ymm) with AVX, 16 bytes (one xmm)
// otherwise; kVectorRegisters says how many there are (32 zmm, 16 ymm or xmm).
// Register-tiled kernels (tensor/cpu/gemm.cpp, the attention micro-kernel) size
// their tiles from these two numbers, so that accumulators, loaded operands
// and a broadcast fit the register file on every target: a tile written for
// 32 zmm runs at a fraction of its speed on AVX2, where each 64-byte vector is
// two ymm and half of the tile spills to the stack. -Dcpu_arch selects the
// target (tensor/meson.build).
//
// The build is ISO C++ (-std=c++20), in which GCC does not contract a * b + c
// into an FMA; kernels that want one call simd::fma, which uses the FMA
// instruction wherever the target has it and a * b + c elsewhere. Either way
// the result depends only on the build, never on the data or the thread count.
//
// Note [Vectorised exp]
// ~~~~~~~~~~~~~~~~~~~~~
// libm's expf is called once per element (the compiler cannot vectorise it
// without -ffast-math), which made exp the largest non-GEMM cost of the
// attention softmax and of SiLU. exp_vec is the Cephes single-precision
// polynomial: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 polynomial,
// 2^n by exponent arithmetic (one vscalefps on AVX-512, the same bits). Its
// error is within 2 ulp of expf over the normal range (tests/tensor/test_nn.cpp
// compares it with std::exp); results that would be subnormal (x < -87.3)
// flush to 0, x > 88.72 gives +inf, NaN stays NaN. f64 kernels keep std::exp
// (they serve gradchecks, not speed).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace tandem::cpu::simd {

// Note [SIMD width].
#if defined(__AVX512F__)
inline constexpr int64_t kVectorBytes = 64;
inline constexpr int kVectorRegisters = 32;
#elif defined(__AVX__)
inline constexpr int64_t kVectorBytes = 32;
inline constexpr int kVectorRegisters = 16;
#else
inline constexpr int64_t kVectorBytes = 16;
inline constexpr int kVectorRegisters = 16;
#endif

template <class T>
struct VecOf {
  typedef T type __attribute__((vector_size(kVectorBytes)));
};
template <class T>
using Vec = typename VecOf<T>::type;
template <class T>
constexpr int64_t kWidth = kVectorBytes / static_cast<int64_t>(sizeof(T));

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
// x in every lane. Written as x - 0, which GCC folds to a plain broadcast
// (a broadcast load when x comes from memory); 0 + x is not folded (it would
// turn -0 into +0), and costs an add and a register broadcast per call.
template <class T>
inline Vec<T> splat(T x) {
  return x - Vec<T>{};
}
// The first n (< width) lanes of p, the rest `fill`; lanes past n are never
// read or written. Masked loads and stores where the target has them: the
// lane-by-lane loop goes through the stack, and on rows of ~100 elements the
// tail cost as much as the rest of the row.
#if defined(__AVX512F__)
inline unsigned lanes_mask(int64_t n) {  // bit i set for lanes i < n
  return (1u << n) - 1;
}
#elif defined(__AVX2__)
inline __m256i lanes_mask(int64_t n) {  // all ones in the 32-bit lanes i < n
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif
template <class T>
inline Vec<T> load_partial(const T* p, int64_t n, T fill) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    return reinterpret_cast<Vec<T>>(_mm512_mask_loadu_ps(reinterpret_cast<__m512>(splat(fill)),
                                                         static_cast<__mmask16>(lanes_mask(n)), p));
  } else if constexpr (std::is_same_v<T, double>) {
    return reinterpret_cast<Vec<T>>(_mm512_mask_loadu_pd(reinterpret_cast<__m512d>(splat(fill)),
                                                         static_cast<__mmask8>(lanes_mask(n)), p));
  }
#elif defined(__AVX2__)
  if constexpr (std::is_same_v<T, float>) {
    const __m256i mask = lanes_mask(n);
    return reinterpret_cast<Vec<T>>(_mm256_blendv_ps(reinterpret_cast<__m256>(splat(fill)),
                                                     _mm256_maskload_ps(p, mask),
                                                     _mm256_castsi256_ps(mask)));
  }
#endif
  Vec<T> v = splat(fill);
  for (int64_t i = 0; i < n; ++i)
    v[i] = p[i];
  return v;
}
template <class T>
inline void store_partial(T* p, Vec<T> v, int64_t n) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_mask_storeu_ps(p, static_cast<__mmask16>(lanes_mask(n)),
                                 reinterpret_cast<__m512>(v));
  } else if constexpr (std::is_same_v<T, double>) {
    return _mm512_mask_storeu_pd(p, static_cast<__mmask8>(lanes_mask(n)),
                                 reinterpret_cast<__m512d>(v));
  }
#elif defined(__AVX2__)
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_maskstore_ps(p, lanes_mask(n), reinterpret_cast<__m256>(v));
  }
#endif
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

// a * b + c, fused where the target has FMA (Note [SIMD width]).
template <class V>
inline V fma(V a, V b, V c) {
  using E = Elem<V>;
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64 && std::is_same_v<E, float>) {
    return reinterpret_cast<V>(_mm512_fmadd_ps(
        reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b), reinterpret_cast<__m512>(c)));
  } else if constexpr (sizeof(V) == 64 && std::is_same_v<E, double>) {
    return reinterpret_cast<V>(_mm512_fmadd_pd(
        reinterpret_cast<__m512d>(a), reinterpret_cast<__m512d>(b), reinterpret_cast<__m512d>(c)));
  }
#endif
#if defined(__FMA__)
  if constexpr (sizeof(V) == 32 && std::is_same_v<E, float>) {
    return reinterpret_cast<V>(_mm256_fmadd_ps(
        reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b), reinterpret_cast<__m256>(c)));
  } else if constexpr (sizeof(V) == 32 && std::is_same_v<E, double>) {
    return reinterpret_cast<V>(_mm256_fmadd_pd(
        reinterpret_cast<__m256d>(a), reinterpret_cast<__m256d>(b), reinterpret_cast<__m256d>(c)));
  }
#endif
  return a * b + c;
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
  VecF out;
#if defined(__AVX512F__)
  // y * 2^n in one instruction, rounded once: the same bits as the two
  // factors below (y * 2^(n/2) is exact).
  out = reinterpret_cast<VecF>(
      _mm512_scalef_ps(reinterpret_cast<__m512>(y), reinterpret_cast<__m512>(n)));
#else
  // 2^n as 2^(n/2) * 2^(n - n/2): each factor stays normal for n in [-126, 128].
  const VecI ni = __builtin_convertvector(n, VecI);
  const VecI half = ni >> 1;
  const VecI e1 = (half + 127) << 23, e2 = (ni - half + 127) << 23;
  VecF s1, s2;
  std::memcpy(&s1, &e1, sizeof s1);
  std::memcpy(&s2, &e2, sizeof s2);
  out = y * s1 * s2;
#endif
  out = x < lo ? splat(0.0f) : out;
  out = x > hi ? splat(std::numeric_limits<float>::infinity()) : out;
  return x != x ? x : out;  // NaN
}

}  // namespace tandem::cpu::simd
