// Differentiable views and copies. A view's backward maps the output gradient
// back to the input's shape: reshape back, permute back, or scatter into zeros
// at the viewed position (narrow/slice/select), or sum (expand).
#include "tandem/autograd/functions/node_name.h"
#include "tandem/autograd/ops.h"

namespace tandem {
namespace {

struct ReshapeBackward final : Node {
  TANDEM_NODE_NAME(ReshapeBackward)
  Shape shape;
  std::vector<Tensor> apply(std::vector<Tensor>& g) override { return {ops::reshape(g[0], shape)}; }
};

struct PermuteBackward final : Node {
  TANDEM_NODE_NAME(PermuteBackward)
  Dims inverse;
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    return {ops::permute(g[0], inverse)};
  }
};

// narrow/slice/select: the gradient lands at the viewed elements of zeros.
struct SliceBackward final : Node {
  TANDEM_NODE_NAME(SliceBackward)
  Shape shape;
  DType dtype;
  int dim = 0;
  int64_t start = 0, end = 0, step = 1;
  bool squeezed = false;  // select
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    Tensor out = ops::zeros(shape, dtype, g[0].device());
    Tensor src = squeezed ? ops::unsqueeze(g[0], dim) : g[0];
    ops::copy_(ops::slice(out, dim, start, end, step), src);
    return {out};
  }
};

// Note [One node per split]
// split/split_sizes/chunk record one node with an output per part: its
// backward concatenates the parts' gradients (zeros for parts that got none)
// in one pass, where a node per part scattered each gradient into a zero
// tensor of the whole shape and the engine then added those (for a fused qkv
// projection: three zero fills and two additions of the full (B, S, 3D)).
struct SplitBackward final : Node {
  TANDEM_NODE_NAME(SplitBackward)
  Shape shape;  // of the split tensor
  DType dtype;
  Device device;
  int dim = 0;
  std::vector<int64_t> sizes;  // of the parts along dim
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    std::vector<Tensor> parts(g.size());
    for (size_t i = 0; i < g.size(); ++i) {
      if (g[i].defined()) {
        parts[i] = ops::to(g[i], dtype);
        continue;
      }
      Shape part_shape = shape;
      part_shape[dim] = sizes[i];
      parts[i] = ops::zeros(part_shape, dtype, device);
    }
    return {ops::cat(parts, dim)};
  }
};

struct ExpandBackward final : Node {
  TANDEM_NODE_NAME(ExpandBackward)
  Shape shape;
  std::vector<Tensor> apply(std::vector<Tensor>& g) override { return {sum_to(g[0], shape)}; }
};

struct IdentityBackward final : Node {
  const char* node_name = "IdentityBackward";
  const char* name() const override { return node_name; }
  std::vector<Tensor> apply(std::vector<Tensor>& g) override { return {g[0]}; }
};

struct CastBackward final : Node {
  TANDEM_NODE_NAME(CastBackward)
  DType dtype;
  Device device;
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    return {ops::to(ops::to(g[0], device), dtype)};
  }
};

struct CatBackward final : Node {
  TANDEM_NODE_NAME(CatBackward)
  std::vector<int64_t> sizes;
  std::vector<DType> dtypes;
  int dim = 0;
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    std::vector<Tensor> parts = ops::split_sizes(g[0], sizes, dim);
    for (size_t i = 0; i < parts.size(); ++i)
      parts[i] = ops::to(parts[i], dtypes[i]);
    return parts;
  }
};

Tensor reshaped(const Tensor& t, Tensor out) {
  if (out.autograd_meta() == t.autograd_meta() && out.shape() == t.shape()) return t;
  out = detach(out);
  if (auto node = record<ReshapeBackward>({&t}, {&out})) node->shape = t.shape();
  return out;
}

Tensor sliced(const Tensor& t, Tensor out, int dim, int64_t start, int64_t end, int64_t step,
              bool squeezed) {
  out = detach(out);
  if (auto node = record<SliceBackward>({&t}, {&out})) {
    node->shape = t.shape();
    node->dtype = t.dtype();
    node->dim = dim;
    node->start = start;
    node->end = end;
    node->step = step;
    node->squeezed = squeezed;
  }
  return out;
}

// Note [One node per split]: `parts` are ops-level views of t along d.
std::vector<Tensor> split_parts(const Tensor& t, std::vector<Tensor> parts, int d) {
  for (Tensor& p : parts)
    p = detach(p);
  if (!grad_mode_enabled() || !any_requires_grad({&t}) || parts.empty()) return parts;
  auto node = std::make_shared<SplitBackward>();
  node->shape = t.shape();
  node->dtype = t.dtype();
  node->device = t.device();
  node->dim = d;
  std::vector<Tensor*> outputs;
  for (Tensor& p : parts) {
    node->sizes.push_back(p.shape()[d]);
    outputs.push_back(&p);
  }
  NodeRecorder::wire(node, {&t}, outputs);
  return parts;
}

Tensor identity(const char* name, const Tensor& t, Tensor out) {
  if (out.storage() == t.storage() && out.autograd_meta() == t.autograd_meta()) return t;
  out = detach(out);
  if (auto node = record<IdentityBackward>({&t}, {&out})) node->node_name = name;
  return out;
}

}  // namespace

Tensor view(const Tensor& t, const Shape& shape) {
  return reshaped(t, ops::view(t, shape));
}
Tensor reshape(const Tensor& t, const Shape& shape) {
  return reshaped(t, ops::reshape(t, shape));
}
Tensor flatten(const Tensor& t, int64_t a, int64_t b) {
  return reshaped(t, ops::flatten(t, a, b));
}
Tensor squeeze(const Tensor& t) {
  return reshaped(t, ops::squeeze(t));
}
Tensor squeeze(const Tensor& t, int64_t dim) {
  return reshaped(t, ops::squeeze(t, dim));
}
Tensor unsqueeze(const Tensor& t, int64_t dim) {
  return reshaped(t, ops::unsqueeze(t, dim));
}

Tensor permute(const Tensor& t, const Dims& dims) {
  Tensor out = detach(ops::permute(t, dims));
  if (auto node = record<PermuteBackward>({&t}, {&out})) {
    node->inverse = Dims::filled(dims.size(), 0);
    for (int i = 0; i < dims.size(); ++i)
      node->inverse[wrap_dim(dims[i], t.dim(), "permute")] = i;
  }
  return out;
}

Tensor transpose(const Tensor& t, int64_t dim0, int64_t dim1) {
  Dims order = Dims::filled(t.dim(), 0);
  for (int i = 0; i < t.dim(); ++i)
    order[i] = i;
  std::swap(order[wrap_dim(dim0, t.dim(), "transpose")],
            order[wrap_dim(dim1, t.dim(), "transpose")]);
  return permute(t, order);
}

Tensor narrow(const Tensor& t, int64_t dim, int64_t start, int64_t length) {
  Tensor out = ops::narrow(t, dim, start, length);
  int d = wrap_dim(dim, t.dim(), "narrow");
  if (start < 0) start += t.shape()[d];
  return sliced(t, out, d, start, start + length, 1, false);
}

Tensor slice(const Tensor& t, int64_t dim, int64_t start, int64_t end, int64_t step) {
  Tensor out = ops::slice(t, dim, start, end, step);
  int d = wrap_dim(dim, t.dim(), "slice");
  return sliced(t, out, d, start, end, step, false);
}

Tensor select(const Tensor& t, int64_t dim, int64_t index) {
  Tensor out = ops::select(t, dim, index);
  int d = wrap_dim(dim, t.dim(), "select");
  if (index < 0) index += t.shape()[d];
  return sliced(t, out, d, index, index + 1, 1, true);
}

Tensor expand(const Tensor& t, const Shape& shape) {
  Tensor out = detach(ops::expand(t, shape));
  if (auto node = record<ExpandBackward>({&t}, {&out})) node->shape = t.shape();
  return out;
}

std::vector<Tensor> split(const Tensor& t, int64_t split_size, int64_t dim) {
  std::vector<Tensor> parts = ops::split(t, split_size, dim);
  return split_parts(t, std::move(parts), wrap_dim(dim, t.dim(), "split"));
}

std::vector<Tensor> split_sizes(const Tensor& t, const std::vector<int64_t>& sizes, int64_t dim) {
  std::vector<Tensor> parts = ops::split_sizes(t, sizes, dim);  // validates
  return split_parts(t, std::move(parts), wrap_dim(dim, t.dim(), "split_sizes"));
}

std::vector<Tensor> chunk(const Tensor& t, int64_t chunks, int64_t dim) {
  std::vector<Tensor> parts = ops::chunk(t, chunks, dim);
  return split_parts(t, std::move(parts), wrap_dim(dim, t.dim(), "chunk"));
}

Tensor contiguous(const Tensor& t) {
  return identity("ContiguousBackward", t, ops::contiguous(t));
}
Tensor clone(const Tensor& t) {
  return identity("CloneBackward", t, ops::clone(t));
}

Tensor to(const Tensor& t, DType dtype) {
  if (t.dtype() == dtype) return t;
  Tensor out = ops::to(t, dtype);
  if (auto node = record<CastBackward>({&t}, {&out})) {
    node->dtype = t.dtype();
    node->device = t.device();
  }
  return out;
}

Tensor to(const Tensor& t, Device device) {
  if (t.device() == device) return t;
  Tensor out = ops::to(t, device);
  if (auto node = record<CastBackward>({&t}, {&out})) {
    node->dtype = t.dtype();
    node->device = t.device();
  }
  return out;
}

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  Tensor out = ops::cat(tensors, dim);
  if (!grad_mode_enabled() || !any_requires_grad(tensors)) return out;
  auto node = std::make_shared<CatBackward>();
  std::vector<const Tensor*> inputs;
  for (const Tensor& t : tensors) {
    inputs.push_back(&t);
    node->sizes.push_back(t.shape()[wrap_dim(dim, t.dim(), "cat")]);
    node->dtypes.push_back(t.dtype());
  }
  node->dim = wrap_dim(dim, tensors[0].dim(), "cat");
  NodeRecorder::wire(node, inputs, {&out});
  return out;
}

Tensor stack(const std::vector<Tensor>& tensors, int64_t dim) {
  TANDEM_CHECK(!tensors.empty(), "[tensor::stack] expected at least one tensor, got none");
  int d = wrap_dim(dim, tensors[0].dim() + 1, "stack");
  std::vector<Tensor> parts;
  for (const Tensor& t : tensors)
    parts.push_back(unsqueeze(t, d));
  return cat(parts, d);
}

}  // namespace tandem
