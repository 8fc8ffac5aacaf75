// Front ends: views. Each returns a Tensor sharing the input's storage with a
// new shape/strides/offset; reshape() and contiguous() are the only copies.
#include <algorithm>

#include "tandem/tensor/ops.h"

namespace tandem::ops {
namespace {

Tensor make_view(const Tensor& t, const Shape& shape, const Dims& strides, int64_t offset) {
  Tensor v(t.storage(), shape, strides, offset, t.dtype());
  return v;
}

// Resolves one -1 extent; checks the element count.
Shape infer_shape(const Shape& shape, int64_t numel, const char* op) {
  Shape out = shape;
  int infer = -1;
  int64_t known = 1;
  for (int i = 0; i < out.size(); ++i) {
    if (out[i] == -1) {
      TANDEM_CHECK(infer < 0, "[tensor::{}] expected at most one -1 in the shape, got {}", op,
                   shape);
      infer = i;
    } else {
      TANDEM_CHECK(out[i] >= 0, "[tensor::{}] expected non-negative extents, got {}", op, shape);
      known *= out[i];
    }
  }
  if (infer >= 0) {
    // As in PyTorch: with a 0 extent beside the -1, every size fits 0
    // elements, so the -1 is ambiguous and refused (callers that may see
    // empty tensors spell every extent out).
    TANDEM_CHECK(known != 0,
                 "[tensor::{}] expected a shape whose -1 can be inferred, got {} for {} elements "
                 "(a 0 extent beside the -1 lets it be any size: give every extent)",
                 op, shape, numel);
    TANDEM_CHECK(numel % known == 0,
                 "[tensor::{}] expected shape {} to be compatible with {} elements", op, shape,
                 numel);
    out[infer] = numel / known;
  }
  TANDEM_CHECK(out.numel() == numel, "[tensor::{}] expected shape {} to hold {} elements, got {}",
               op, shape, numel, out.numel());
  return out;
}

// Strides for viewing (old_shape, old_strides) as new_shape without a copy, if
// possible: each group of old dims that is contiguous with respect to itself
// must map onto a group of new dims of the same element count.
bool view_strides(const Shape& old_shape, const Dims& old_strides, const Shape& new_shape,
                  Dims& new_strides) {
  new_strides = Dims::filled(new_shape.size(), 1);
  if (old_shape.numel() == 0 || old_shape.size() == 0) {
    new_strides = contiguous_strides(new_shape);
    return true;
  }
  int view_d = new_shape.size() - 1;
  int64_t chunk_base = old_strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int d = old_shape.size() - 1; d >= 0; --d) {
    tensor_numel *= old_shape[d];
    if (d == 0 || (old_shape[d - 1] != 1 && old_strides[d - 1] != tensor_numel * chunk_base)) {
      while (view_d >= 0 && (view_numel < tensor_numel || new_shape[view_d] == 1)) {
        new_strides[view_d] = view_numel * chunk_base;
        view_numel *= new_shape[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return false;
      if (d > 0) {
        chunk_base = old_strides[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  return view_d == -1;
}

}  // namespace

Tensor view(const Tensor& t, const Shape& shape) {
  Shape s = infer_shape(shape, t.numel(), "view");
  Dims strides;
  TANDEM_CHECK(view_strides(t.shape(), t.strides(), s, strides),
               "[tensor::view] expected strides compatible with shape {}, got shape {} strides {} "
               "(use reshape, which copies)",
               s, t.shape(), t.strides());
  return make_view(t, s, strides, t.storage_offset());
}

Tensor reshape(const Tensor& t, const Shape& shape) {
  Shape s = infer_shape(shape, t.numel(), "reshape");
  Dims strides;
  if (view_strides(t.shape(), t.strides(), s, strides)) {
    return make_view(t, s, strides, t.storage_offset());
  }
  return view(clone(t), s);
}

Tensor flatten(const Tensor& t, int64_t start_dim, int64_t end_dim) {
  if (t.dim() == 0) return reshape(t, Shape{1});
  int a = wrap_dim(start_dim, t.dim(), "flatten");
  int b = wrap_dim(end_dim, t.dim(), "flatten");
  TANDEM_CHECK(a <= b, "[tensor::flatten] expected start_dim <= end_dim, got {} > {}", a, b);
  Shape s;
  for (int i = 0; i < a; ++i)
    s.push_back(t.shape()[i]);
  int64_t merged = 1;
  for (int i = a; i <= b; ++i)
    merged *= t.shape()[i];
  s.push_back(merged);
  for (int i = b + 1; i < t.dim(); ++i)
    s.push_back(t.shape()[i]);
  return reshape(t, s);
}

Tensor permute(const Tensor& t, const Dims& dims) {
  TANDEM_CHECK(dims.size() == t.dim(), "[tensor::permute] expected {} dims, got {} ({})", t.dim(),
               dims.size(), dims);
  Shape shape;
  Dims strides;
  bool seen[kMaxDims] = {};
  for (int i = 0; i < dims.size(); ++i) {
    int d = wrap_dim(dims[i], t.dim(), "permute");
    TANDEM_CHECK(!seen[d], "[tensor::permute] expected a permutation, got {} (dim {} repeats)",
                 dims, d);
    seen[d] = true;
    shape.push_back(t.shape()[d]);
    strides.push_back(t.strides()[d]);
  }
  return make_view(t, shape, strides, t.storage_offset());
}

Tensor transpose(const Tensor& t, int64_t dim0, int64_t dim1) {
  int a = wrap_dim(dim0, t.dim(), "transpose");
  int b = wrap_dim(dim1, t.dim(), "transpose");
  Shape shape = t.shape();
  Dims strides = t.strides();
  std::swap(shape[a], shape[b]);
  std::swap(strides[a], strides[b]);
  return make_view(t, shape, strides, t.storage_offset());
}

// narrow, slice and select need a dim to cut: wrap_dim accepts dim 0 of a 0-dim
// tensor (as reductions do), whose shape()[0] is not an extent.
Tensor narrow(const Tensor& t, int64_t dim, int64_t start, int64_t length) {
  TANDEM_CHECK(t.dim() > 0,
               "[tensor::narrow] expected a tensor with at least one dim, got a 0-dim tensor");
  int d = wrap_dim(dim, t.dim(), "narrow");
  int64_t n = t.shape()[d];
  if (start < 0) start += n;
  TANDEM_CHECK(start >= 0 && length >= 0 && start + length <= n,
               "[tensor::narrow] expected 0 <= start and start + length <= {} in dim {}, got "
               "start={} length={} (shape {})",
               n, d, start, length, t.shape());
  Shape shape = t.shape();
  shape[d] = length;
  return make_view(t, shape, t.strides(), t.storage_offset() + start * t.strides()[d]);
}

Tensor slice(const Tensor& t, int64_t dim, int64_t start, int64_t end, int64_t step) {
  TANDEM_CHECK(t.dim() > 0,
               "[tensor::slice] expected a tensor with at least one dim, got a 0-dim tensor");
  int d = wrap_dim(dim, t.dim(), "slice");
  TANDEM_CHECK(step > 0, "[tensor::slice] expected step > 0, got {}", step);
  int64_t n = t.shape()[d];
  auto clamp = [n](int64_t i) {
    if (i < 0) i += n;
    return std::clamp<int64_t>(i, 0, n);
  };
  start = clamp(start);
  end = std::max(clamp(end), start);
  Shape shape = t.shape();
  Dims strides = t.strides();
  shape[d] = (end - start + step - 1) / step;
  strides[d] *= step;
  return make_view(t, shape, strides, t.storage_offset() + start * t.strides()[d]);
}

Tensor select(const Tensor& t, int64_t dim, int64_t index) {
  TANDEM_CHECK(t.dim() > 0,
               "[tensor::select] expected a tensor with at least one dim, got a 0-dim tensor");
  int d = wrap_dim(dim, t.dim(), "select");
  int64_t n = t.shape()[d];
  TANDEM_CHECK(index >= -n && index < n,
               "[tensor::select] expected index in [{}, {}) for dim {} of shape {}, got {}", -n, n,
               d, t.shape(), index);
  if (index < 0) index += n;
  Shape shape = t.shape();
  Dims strides = t.strides();
  int64_t offset = t.storage_offset() + index * strides[d];
  shape.erase(d);
  strides.erase(d);
  return make_view(t, shape, strides, offset);
}

Tensor expand(const Tensor& t, const Shape& shape) {
  TANDEM_CHECK(shape.size() >= t.dim(),
               "[tensor::expand] expected at least {} dims, got {} (tensor {})", t.dim(), shape,
               t.shape());
  int lead = shape.size() - t.dim();
  Shape out = shape;
  Dims strides = Dims::filled(shape.size(), 0);
  for (int i = 0; i < shape.size(); ++i) {
    int j = i - lead;
    if (j < 0) {
      TANDEM_CHECK(shape[i] >= 0, "[tensor::expand] expected a size for new dim {}, got {}", i,
                   shape[i]);
      continue;
    }
    int64_t have = t.shape()[j];
    if (shape[i] == -1) out[i] = have;
    TANDEM_CHECK(out[i] >= 0, "[tensor::expand] expected a size >= 0 or -1 for dim {}, got {} ({})",
                 i, shape[i], shape);
    TANDEM_CHECK(out[i] == have || have == 1,
                 "[tensor::expand] expected dim {} of {} to be 1 or {}, got {} -> {}", j, t.shape(),
                 out[i], have, shape);
    strides[i] = out[i] == have ? t.strides()[j] : 0;
  }
  return make_view(t, out, strides, t.storage_offset());
}

Tensor squeeze(const Tensor& t) {
  Shape shape;
  Dims strides;
  for (int i = 0; i < t.dim(); ++i) {
    if (t.shape()[i] == 1) continue;
    shape.push_back(t.shape()[i]);
    strides.push_back(t.strides()[i]);
  }
  return make_view(t, shape, strides, t.storage_offset());
}

Tensor squeeze(const Tensor& t, int64_t dim) {
  int d = wrap_dim(dim, t.dim(), "squeeze");
  if (t.dim() == 0 || t.shape()[d] != 1) return t;
  Shape shape = t.shape();
  Dims strides = t.strides();
  shape.erase(d);
  strides.erase(d);
  return make_view(t, shape, strides, t.storage_offset());
}

Tensor unsqueeze(const Tensor& t, int64_t dim) {
  int d = wrap_dim(dim, t.dim() + 1, "unsqueeze");
  Shape shape = t.shape();
  Dims strides = t.strides();
  int64_t stride = d < t.dim() ? t.strides()[d] * t.shape()[d] : 1;
  shape.insert(d, 1);
  strides.insert(d, stride);
  return make_view(t, shape, strides, t.storage_offset());
}

std::vector<Tensor> split(const Tensor& t, int64_t split_size, int64_t dim) {
  int d = wrap_dim(dim, t.dim(), "split");
  TANDEM_CHECK(split_size > 0, "[tensor::split] expected split_size > 0, got {}", split_size);
  std::vector<Tensor> out;
  int64_t n = t.shape()[d];
  for (int64_t start = 0; start < n; start += split_size) {
    out.push_back(narrow(t, d, start, std::min(split_size, n - start)));
  }
  if (n == 0) out.push_back(t);
  return out;
}

std::vector<Tensor> split_sizes(const Tensor& t, const std::vector<int64_t>& sizes, int64_t dim) {
  int d = wrap_dim(dim, t.dim(), "split_sizes");
  int64_t total = 0;
  for (int64_t s : sizes) {
    TANDEM_CHECK(s >= 0, "[tensor::split_sizes] expected non-negative sizes, got {}", s);
    total += s;
  }
  TANDEM_CHECK(total == t.shape()[d],
               "[tensor::split_sizes] expected sizes summing to {} (dim {} of {}), got {}",
               t.shape()[d], d, t.shape(), total);
  std::vector<Tensor> out;
  int64_t start = 0;
  for (int64_t s : sizes) {
    out.push_back(narrow(t, d, start, s));
    start += s;
  }
  return out;
}

std::vector<Tensor> chunk(const Tensor& t, int64_t chunks, int64_t dim) {
  TANDEM_CHECK(chunks > 0, "[tensor::chunk] expected chunks > 0, got {}", chunks);
  int d = wrap_dim(dim, t.dim(), "chunk");
  int64_t n = t.shape()[d];
  // As torch.chunk: an empty dim gives `chunks` empty pieces (split would
  // give one, losing the count).
  if (n == 0) return std::vector<Tensor>(static_cast<size_t>(chunks), t);
  int64_t size = (n + chunks - 1) / chunks;
  return split(t, size, d);
}

}  // namespace tandem::ops
