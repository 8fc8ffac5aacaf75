// CPU reference kernels for topk and argsort along the last dim of a
// contiguous (rows, n) tensor (the interface is in tensor/kernels.h; the front
// ends in tensor/ops_nn.cpp move any other dim last first).
//
// Both sort an index array per row by the row's values converted once to
// acc_t<T>. The order is total and therefore reproducible on every backend:
// NaN compares above every number (and equal to another NaN), like PyTorch;
// ties keep the lower index first — explicitly in topk (partial_sort is not
// stable), by stable_sort in argsort.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <type_traits>
#include <vector>

#include "tandem/tensor/kernels.h"

namespace tandem::cpu {
namespace {

template <class A>
bool is_nan(A v) {
  if constexpr (std::is_floating_point_v<A>) {
    return std::isnan(v);
  } else {
    return false;
  }
}

// a < b with NaN as the largest value: a strict weak order even with NaNs.
template <class A>
bool nan_last_less(A a, A b) {
  if (is_nan(a)) return false;
  if (is_nan(b)) return true;
  return a < b;
}

}  // namespace

void topk(const TensorArg& in, int64_t rows, int64_t n, int64_t k, bool largest,
          const TensorArg& values, const TensorArg& indices) {
  dispatch_dtype(in.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    const T* src = static_cast<const T*>(in.data);
    T* vals = static_cast<T*>(values.data);
    auto* idx = static_cast<int64_t*>(indices.data);
    std::vector<A> key(static_cast<size_t>(n));
    std::vector<int64_t> order(static_cast<size_t>(n));
    const auto before = [&](int64_t i, int64_t j) {
      const A a = key[i], b = key[j];
      if (largest ? nan_last_less(b, a) : nan_last_less(a, b)) return true;
      if (largest ? nan_last_less(a, b) : nan_last_less(b, a)) return false;
      return i < j;
    };
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = src + r * n;
      for (int64_t j = 0; j < n; ++j) {
        key[j] = static_cast<A>(row[j]);
      }
      std::iota(order.begin(), order.end(), int64_t{0});
      std::partial_sort(order.begin(), order.begin() + k, order.end(), before);
      for (int64_t t = 0; t < k; ++t) {
        vals[r * k + t] = row[order[t]];
        idx[r * k + t] = order[t];
      }
    }
  });
}

void argsort(const TensorArg& in, int64_t rows, int64_t n, bool descending,
             const TensorArg& indices) {
  dispatch_dtype(in.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    const T* src = static_cast<const T*>(in.data);
    auto* idx = static_cast<int64_t*>(indices.data);
    std::vector<A> key(static_cast<size_t>(n));
    const auto before = [&](int64_t i, int64_t j) {
      return descending ? nan_last_less(key[j], key[i]) : nan_last_less(key[i], key[j]);
    };
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = src + r * n;
      for (int64_t j = 0; j < n; ++j) {
        key[j] = static_cast<A>(row[j]);
      }
      int64_t* out = idx + r * n;
      std::iota(out, out + n, int64_t{0});
      std::stable_sort(out, out + n, before);
    }
  });
}

}  // namespace tandem::cpu
