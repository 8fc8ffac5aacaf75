// 16-bit float storage types. Arithmetic converts to float; kernels compute in
// float and round on store (round-to-nearest-even), the same on CPU and CUDA
// so results compare bit-exactly. Usable in .cu files (TANDEM_HOST_DEVICE).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__F16C__) && !defined(__CUDACC__)
#include <immintrin.h>
#define TANDEM_F16C 1
#endif

#if defined(__CUDACC__)
#define TANDEM_HOST_DEVICE __host__ __device__
#else
#define TANDEM_HOST_DEVICE
#endif

namespace tandem {

TANDEM_HOST_DEVICE inline uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

TANDEM_HOST_DEVICE inline float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  TANDEM_HOST_DEVICE BFloat16(float f) {  // NOLINT: implicit like a float
    uint32_t u = float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it quiet
      bits = static_cast<uint16_t>((u >> 16) | 0x40);
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      bits = static_cast<uint16_t>(u >> 16);
    }
  }
  TANDEM_HOST_DEVICE operator float() const {
    return bits_float(static_cast<uint32_t>(bits) << 16);
  }
};

struct Half {
  uint16_t bits = 0;
  Half() = default;
  // Note [F16C conversions]: where the CPU converts in hardware (F16C, in
  // every x86-64-v3 build), it does: the same round-to-nearest-even on every
  // finite value and inf as the portable code below (a test compares all of
  // them), in one instruction instead of its branches. NaNs keep the portable
  // path, whose quiet NaN the CUDA side matches. Files nvcc compiles use the
  // portable path; as the two agree on every input, it does not matter which
  // copy of these inline functions the linker keeps.
  TANDEM_HOST_DEVICE Half(float f) {  // NOLINT
#if defined(TANDEM_F16C)
    if ((float_bits(f) & 0x7fffffffu) <= 0x7f800000u) {
      bits = static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      return;
    }
#endif
    bits = round_portable(f);
  }
  TANDEM_HOST_DEVICE operator float() const {
#if defined(TANDEM_F16C)
    if ((bits & 0x7fffu) <= 0x7c00u) return _cvtsh_ss(bits);  // not a NaN
#endif
    return widen_portable(bits);
  }

  // The conversions in plain integer arithmetic (round to nearest even).
  TANDEM_HOST_DEVICE static uint16_t round_portable(float f) {
    uint32_t x = float_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t abs = x & 0x7fffffffu;
    if (abs >= 0x7f800000u) {  // inf or NaN
      return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
    }
    if (abs >= 0x477ff000u) {  // rounds to >= 65520: overflow to inf
      return static_cast<uint16_t>(sign | 0x7c00u);
    }
    if (abs < 0x38800000u) {  // subnormal half (or zero)
      // value = abs_f * 2^24 rounded to nearest even, as an integer mantissa
      uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
      int shift = 126 - static_cast<int>(abs >> 23);  // 14 + (113 - exp)
      if (shift > 24) return static_cast<uint16_t>(sign);
      uint32_t half_mant = mant >> shift;
      uint32_t rem = mant & ((1u << shift) - 1u);
      uint32_t halfway = 1u << (shift - 1);
      if (rem > halfway || (rem == halfway && (half_mant & 1u))) ++half_mant;
      return static_cast<uint16_t>(sign | half_mant);
    }
    uint32_t exp = ((abs >> 23) - 112u) << 10;
    uint32_t mant = (abs >> 13) & 0x3ffu;
    uint32_t h = exp | mant;
    uint32_t rem = abs & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  TANDEM_HOST_DEVICE static float widen_portable(uint16_t bits) {
    uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
    uint32_t exp = (bits >> 10) & 0x1fu;
    uint32_t mant = bits & 0x3ffu;
    if (exp == 0x1fu) return bits_float(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
      if (mant == 0) return bits_float(sign);
      // subnormal: mant * 2^-24
      float v = static_cast<float>(mant) * 5.9604644775390625e-08f;
      return sign ? -v : v;
    }
    return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  }
};

}  // namespace tandem
