// Shape checks shared by the two GEMMs behind GemmArgs (tensor/kernels.h):
// cuBLAS's (gemm.cu) and the emulated device's on OpenBLAS
// (emulated/gemm.cpp). Host code only.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>

#include "tandem/runtime/error.h"

namespace tandem::gemm_shape {

// Both libraries take int sizes.
inline int checked_int(int64_t v, const char* what) {
  TANDEM_CHECK(v >= 0 && v <= INT_MAX, "[cuda::gemm] expected {} in [0, {}], got {}", what, INT_MAX,
               v);
  return static_cast<int>(v);
}

// cuBLAS and cblas want ld >= max(1, row length) even where the stride is
// never stepped (a single stored row, or empty rows); any such value is then
// as good as the stored one. Real layouts pass through unchanged.
inline int64_t leading_dim(int64_t ld, int64_t rows, int64_t cols) {
  if (rows <= 1 || cols == 0) return std::max<int64_t>({ld, cols, 1});
  return ld;
}

}  // namespace tandem::gemm_shape
