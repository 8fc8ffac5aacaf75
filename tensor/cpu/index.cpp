// CPU reference kernels for index_select, gather, scatter_add and one_hot (the
// interface is in tensor/kernels.h; front ends in tensor/ops_nn.cpp).
//
// Every operand is contiguous and viewed as (outer, n, inner), with the
// indexed dim in the middle. Shapes and dtypes were checked by the front end;
// index *values* are data, which the front end cannot see without a host
// synchronisation, so they are checked here, before anything is written: a
// bad index leaves the output untouched and names the op, the value and the
// valid range.
#include <cstring>
#include <type_traits>

#include "tandem/tensor/kernels.h"

namespace tandem::cpu {
namespace {

void check_indices(const int64_t* index, int64_t count, int64_t n, const char* op) {
  for (int64_t i = 0; i < count; ++i) {
    TANDEM_CHECK(
        index[i] >= 0 && index[i] < n,
        "[tensor::{}] expected index in [0, {}), got {} (at flat position {} of the index)", op, n,
        index[i], i);
  }
}

}  // namespace

void index_select(const TensorArg& in, int64_t outer, int64_t n, int64_t inner,
                  const TensorArg& index, const TensorArg& out) {
  const auto* idx = static_cast<const int64_t*>(index.data);
  const int64_t k = index.numel;
  check_indices(idx, k, n, "index_select");
  // Whole (inner) rows move, so the copy is dtype-agnostic.
  const size_t row_bytes = static_cast<size_t>(inner) * dtype_size(in.dtype);
  if (row_bytes == 0) return;
  const auto* src = static_cast<const char*>(in.data);
  auto* dst = static_cast<char*>(out.data);
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t j = 0; j < k; ++j) {
      std::memcpy(dst + (o * k + j) * row_bytes, src + (o * n + idx[j]) * row_bytes, row_bytes);
    }
  }
}

void gather(const TensorArg& in, int64_t outer, int64_t n, int64_t inner, const TensorArg& index,
            int64_t k, const TensorArg& out) {
  const auto* idx = static_cast<const int64_t*>(index.data);
  check_indices(idx, outer * k * inner, n, "gather");
  dispatch_dtype(in.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* src = static_cast<const T*>(in.data);
    T* dst = static_cast<T*>(out.data);
    for (int64_t o = 0; o < outer; ++o) {
      const T* src_o = src + o * n * inner;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t base = (o * k + j) * inner;
        for (int64_t i = 0; i < inner; ++i) {
          dst[base + i] = src_o[idx[base + i] * inner + i];
        }
      }
    }
  });
}

void scatter_add(const TensorArg& out, int64_t outer, int64_t n, int64_t inner,
                 const TensorArg& index, int64_t k, const TensorArg& src) {
  const auto* idx = static_cast<const int64_t*>(index.data);
  check_indices(idx, outer * k * inner, n, "scatter_add");
  dispatch_dtype(out.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    const T* s = static_cast<const T*>(src.data);
    T* dst = static_cast<T*>(out.data);
    // Sequential order: duplicate indices accumulate deterministically.
    for (int64_t o = 0; o < outer; ++o) {
      T* dst_o = dst + o * n * inner;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t base = (o * k + j) * inner;
        for (int64_t i = 0; i < inner; ++i) {
          T& d = dst_o[idx[base + i] * inner + i];
          if constexpr (std::is_same_v<T, bool>) {
            d = d || s[base + i];
          } else {
            d = static_cast<T>(static_cast<A>(d) + static_cast<A>(s[base + i]));
          }
        }
      }
    }
  });
}

void one_hot(const TensorArg& indices, int64_t n, int64_t classes, const TensorArg& out) {
  const auto* idx = static_cast<const int64_t*>(indices.data);
  check_indices(idx, n, classes, "one_hot");
  if (n * classes == 0) return;
  auto* dst = static_cast<int64_t*>(out.data);
  std::memset(dst, 0, static_cast<size_t>(n * classes) * sizeof(int64_t));
  for (int64_t i = 0; i < n; ++i) {
    dst[i * classes + idx[i]] = 1;
  }
}

}  // namespace tandem::cpu
