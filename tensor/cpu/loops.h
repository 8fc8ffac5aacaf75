// Strided loops shared by the CPU kernels.
//
// for_each_row walks K operands that share a shape: adjacent dims that are
// contiguous in every operand are merged first, then the innermost dim is
// handed to `inner(offsets, inner_strides, n)` so the hot loop is a plain
// strided (often unit-stride, vectorisable) loop.
#pragma once

#include <array>
#include <cstdint>

#include "tandem/tensor/kernels.h"

namespace tandem::cpu {

template <size_t K>
struct Layout {
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  std::array<std::array<int64_t, kMaxDims>, K> strides = {};
};

template <size_t K>
Layout<K> coalesce(const TensorArg& shape_of, const std::array<const TensorArg*, K>& args) {
  Layout<K> l;
  for (int d = 0; d < shape_of.ndim; ++d) {
    if (shape_of.shape[d] == 1) continue;  // size-1 dims carry no stride information
    bool merge = l.ndim > 0;
    for (size_t k = 0; k < K && merge; ++k) {
      merge = l.strides[k][l.ndim - 1] == args[k]->strides[d] * shape_of.shape[d];
    }
    if (merge) {
      l.shape[l.ndim - 1] *= shape_of.shape[d];
      for (size_t k = 0; k < K; ++k)
        l.strides[k][l.ndim - 1] = args[k]->strides[d];
    } else {
      l.shape[l.ndim] = shape_of.shape[d];
      for (size_t k = 0; k < K; ++k)
        l.strides[k][l.ndim] = args[k]->strides[d];
      ++l.ndim;
    }
  }
  return l;
}

template <size_t K, class Inner>
void for_each_row(const TensorArg& shape_of, const std::array<const TensorArg*, K>& args,
                  Inner&& inner) {
  if (shape_of.numel == 0) return;
  Layout<K> l = coalesce(shape_of, args);
  std::array<int64_t, K> off{};
  if (l.ndim == 0) {
    std::array<int64_t, K> ones;
    ones.fill(1);
    inner(off, ones, int64_t{1});
    return;
  }
  const int last = l.ndim - 1;
  std::array<int64_t, K> inner_stride;
  for (size_t k = 0; k < K; ++k)
    inner_stride[k] = l.strides[k][last];
  int64_t rows = 1;
  for (int d = 0; d < last; ++d)
    rows *= l.shape[d];
  int64_t idx[kMaxDims] = {};
  for (int64_t r = 0; r < rows; ++r) {
    inner(off, inner_stride, l.shape[last]);
    for (int d = last - 1; d >= 0; --d) {  // odometer increment
      for (size_t k = 0; k < K; ++k)
        off[k] += l.strides[k][d];
      if (++idx[d] < l.shape[d]) break;
      for (size_t k = 0; k < K; ++k)
        off[k] -= l.strides[k][d] * l.shape[d];
      idx[d] = 0;
    }
  }
}

}  // namespace tandem::cpu
