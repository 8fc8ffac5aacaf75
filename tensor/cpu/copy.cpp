// CPU copy/cast, fill, arange and counter-based random fills. The fused
// multiply-adds are explicit so results do not depend on -ffp-contract and
// match the CUDA kernels bit for bit (Note [Random and arange rounding]).
#include <cmath>
#include <cstring>

#include "tandem/tensor/cpu/copy_bytes.h"
#include "tandem/tensor/cpu/loops.h"
#include "tandem/tensor/kernels.h"
#include "tandem/tensor/random.h"

namespace tandem::cpu {
namespace {

template <class To, class From>
inline To convert(From v) {
  if constexpr (std::is_same_v<To, bool>) {
    return static_cast<acc_t<From>>(v) != acc_t<From>(0);
  } else if constexpr (std::is_same_v<From, bool>) {
    return static_cast<To>(static_cast<acc_t<To>>(v ? 1 : 0));
  } else {
    return static_cast<To>(static_cast<acc_t<From>>(v));
  }
}

}  // namespace

void copy(const TensorArg& in, const TensorArg& out) {
  if (in.dtype == out.dtype && in.contiguous && out.contiguous) {
    copy_bytes(out.data, in.data, static_cast<size_t>(out.numel) * dtype_size(out.dtype));
    return;
  }
  dispatch_dtype(in.dtype, [&](auto in_tag) {
    using From = typename decltype(in_tag)::type;
    dispatch_dtype(out.dtype, [&](auto out_tag) {
      using To = typename decltype(out_tag)::type;
      const From* pi = static_cast<const From*>(in.data);
      To* po = static_cast<To*>(out.data);
      for_each_row<2>(out, {&in, &out}, [&](auto off, auto st, int64_t n) {
        const From* x = pi + off[0];
        To* y = po + off[1];
        if (st[0] == 1 && st[1] == 1) {
          for (int64_t i = 0; i < n; ++i)
            y[i] = convert<To>(x[i]);
        } else {
          for (int64_t i = 0; i < n; ++i)
            y[i * st[1]] = convert<To>(x[i * st[0]]);
        }
      });
    });
  });
}

void fill(const TensorArg& out, double value) {
  dispatch_dtype(out.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T v;
    if constexpr (std::is_same_v<T, bool>) {
      v = value != 0.0;
    } else {
      v = static_cast<T>(static_cast<acc_t<T>>(value));
    }
    T* po = static_cast<T*>(out.data);
    for_each_row<1>(out, {&out}, [&](auto off, auto st, int64_t n) {
      for (int64_t i = 0; i < n; ++i)
        po[off[0] + i * st[0]] = v;
    });
  });
}

void arange(const TensorArg& out, double start, double step) {
  dispatch_dtype(out.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* po = static_cast<T*>(out.data);
    for (int64_t i = 0; i < out.numel; ++i) {
      po[i] = convert<T>(std::fma(step, static_cast<double>(i), start));
    }
  });
}

void random(const TensorArg& out, RandomKind kind, uint64_t seed, uint64_t offset, double a,
            double b) {
  dispatch_dtype(out.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* po = static_cast<T*>(out.data);
    if (kind == RandomKind::Uniform) {
      // In float (as on the GPU) so both devices round identically.
      const float lo = static_cast<float>(a), width = static_cast<float>(b - a);
      for (int64_t i = 0; i < out.numel; ++i) {
        po[i] = convert<T>(std::fma(width, philox_uniform(offset, seed, i), lo));
      }
    } else {
      for (int64_t i = 0; i < out.numel; ++i) {
        po[i] = convert<T>(std::fma(b, philox_normal(offset, seed, i), a));
      }
    }
  });
}

}  // namespace tandem::cpu
