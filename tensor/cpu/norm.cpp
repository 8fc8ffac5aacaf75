// CPU reference kernels for layer_norm and rms_norm over the last dim (the
// interface is in tensor/kernels.h; front ends in tensor/ops_nn.cpp).
//
// Statistics are accumulated in acc_t<T> (f32 for the 16-bit types, f64 for
// f64). layer_norm takes the variance in a second pass over the centred row
// rather than E[x^2] - E[x]^2, which cancels catastrophically when |mean| is
// large next to the spread. mean and rstd are stored as f32 whatever T is,
// because that is what the backward pass and the CUDA kernels exchange.
#include <cmath>

#include "tensor/kernels.h"

namespace tandem::cpu {

void layer_norm(const TensorArg& x, const TensorArg& weight, const TensorArg& bias, double eps,
                int64_t rows, int64_t d, const TensorArg& out, const TensorArg& mean,
                const TensorArg& rstd) {
  dispatch_floating(x.dtype, "layer_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    const T* xp = static_cast<const T*>(x.data);
    const T* w = static_cast<const T*>(weight.data);  // null: no affine scale
    const T* b = static_cast<const T*>(bias.data);    // null: no shift
    T* op = static_cast<T*>(out.data);
    float* mean_p = static_cast<float*>(mean.data);
    float* rstd_p = static_cast<float*>(rstd.data);
    // An empty row has no statistics; mean 0 keeps the outputs finite.
    const A inv_d = d > 0 ? A(1) / static_cast<A>(d) : A(0);
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = xp + r * d;
      T* orow = op + r * d;
      A sum = 0;
      for (int64_t j = 0; j < d; ++j) {
        sum += static_cast<A>(row[j]);
      }
      const A mu = sum * inv_d;
      A sq = 0;
      for (int64_t j = 0; j < d; ++j) {
        const A c = static_cast<A>(row[j]) - mu;
        sq += c * c;
      }
      const A rs = A(1) / std::sqrt(sq * inv_d + static_cast<A>(eps));
      for (int64_t j = 0; j < d; ++j) {
        A y = (static_cast<A>(row[j]) - mu) * rs;
        if (w) y *= static_cast<A>(w[j]);
        if (b) y += static_cast<A>(b[j]);
        orow[j] = static_cast<T>(y);
      }
      mean_p[r] = static_cast<float>(mu);
      rstd_p[r] = static_cast<float>(rs);
    }
  });
}

void rms_norm(const TensorArg& x, const TensorArg& weight, double eps, int64_t rows, int64_t d,
              const TensorArg& out, const TensorArg& rstd) {
  dispatch_floating(x.dtype, "rms_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    const T* xp = static_cast<const T*>(x.data);
    const T* w = static_cast<const T*>(weight.data);  // null: no affine scale
    T* op = static_cast<T*>(out.data);
    float* rstd_p = static_cast<float*>(rstd.data);
    const A inv_d = d > 0 ? A(1) / static_cast<A>(d) : A(0);
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = xp + r * d;
      T* orow = op + r * d;
      A sq = 0;
      for (int64_t j = 0; j < d; ++j) {
        const A v = static_cast<A>(row[j]);
        sq += v * v;
      }
      const A rs = A(1) / std::sqrt(sq * inv_d + static_cast<A>(eps));
      for (int64_t j = 0; j < d; ++j) {
        A y = static_cast<A>(row[j]) * rs;
        if (w) y *= static_cast<A>(w[j]);
        orow[j] = static_cast<T>(y);
      }
      rstd_p[r] = static_cast<float>(rs);
    }
  });
}

}  // namespace tandem::cpu
