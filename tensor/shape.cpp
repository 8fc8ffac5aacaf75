#include "tandem/tensor/shape.h"

namespace tandem {

std::string Dims::str() const {
  std::string s = "[";
  for (int i = 0; i < size_; ++i) {
    if (i) s += ",";
    s += std::to_string(data_[i]);
  }
  return s + "]";
}

Dims contiguous_strides(const Dims& shape) {
  Dims strides = Dims::filled(shape.size(), 1);
  int64_t acc = 1;
  for (int i = shape.size() - 1; i >= 0; --i) {
    strides[i] = acc;
    acc *= std::max<int64_t>(shape[i], 1);
  }
  return strides;
}

int wrap_dim(int64_t dim, int ndim, const char* op) {
  int64_t lo = ndim == 0 ? -1 : -ndim;
  int64_t hi = ndim == 0 ? 0 : ndim - 1;
  TANDEM_CHECK(dim >= lo && dim <= hi, "[tensor::{}] expected dim in [{}, {}], got {}", op, lo, hi,
               dim);
  return static_cast<int>(dim < 0 ? dim + std::max(ndim, 1) : dim);
}

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  int n = std::max(a.size(), b.size());
  Shape out = Dims::filled(n, 1);
  for (int i = 0; i < n; ++i) {
    int ia = a.size() - n + i, ib = b.size() - n + i;
    int64_t da = ia >= 0 ? a[ia] : 1;
    int64_t db = ib >= 0 ? b[ib] : 1;
    TANDEM_CHECK(da == db || da == 1 || db == 1,
                 "[tensor::{}] expected broadcastable shapes, got {} and {} (dim {}: {} vs {})", op,
                 a, b, i, da, db);
    out[i] = da == 1 ? db : da;
  }
  return out;
}

}  // namespace tandem
