// Differentiable reductions, cumsum and softmax.
#include <algorithm>

#include "tandem/autograd/functions/node_name.h"
#include "tandem/autograd/ops.h"

namespace tandem {
namespace {

// Reduced dims of an input of rank `ndim` (all when `dims` is empty), sorted.
std::vector<int> reduced_dims(const Dims& dims, int ndim, const char* op) {
  std::vector<int> out;
  if (dims.empty()) {
    for (int i = 0; i < ndim; ++i)
      out.push_back(i);
  } else {
    for (int64_t d : dims)
      out.push_back(wrap_dim(d, ndim, op));
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Re-inserts reduced dims (as size 1) into a gradient computed without keepdim.
Tensor restore_dims(const Tensor& g, const std::vector<int>& reduced, bool keepdim, int ndim) {
  if (keepdim || ndim == 0) return g;
  Tensor out = g;
  for (int d : reduced)
    out = ops::unsqueeze(out, d);
  return out;
}

struct SumBackward final : Node {
  TANDEM_NODE_NAME(SumBackward)
  Shape shape;
  DType dtype;
  std::vector<int> reduced;
  bool keepdim = false;
  double scale = 1.0;  // mean: 1 / count
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    Tensor r = restore_dims(g[0], reduced, keepdim, shape.size());
    if (scale != 1.0) r = ops::mul(r, scale);
    return {ops::to(ops::expand(r, shape), dtype)};
  }
};

struct AmaxBackward final : Node {
  TANDEM_NODE_NAME(AmaxBackward)
  Tensor input, out_keep;
  std::vector<int> reduced;
  bool keepdim = false;
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    Tensor mask = ops::to(ops::eq(input, out_keep), input.dtype());
    Dims dims;
    for (int d : reduced)
      dims.push_back(d);
    Tensor count = ops::sum(mask, dims, true);
    Tensor gk = restore_dims(g[0], reduced, keepdim, input.dim());
    return {ops::div(ops::mul(mask, gk), count)};
  }
  void release_saved() override { input = out_keep = Tensor(); }
};

struct CumsumBackward final : Node {
  TANDEM_NODE_NAME(CumsumBackward)
  int64_t dim = 0;
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    // Reverse cumulative sum: total - cumsum + g.
    Tensor total = ops::sum(g[0], Dims{dim}, true);
    return {ops::add(ops::sub(total, ops::cumsum(g[0], dim)), g[0])};
  }
};

struct SoftmaxBackward final : Node {
  TANDEM_NODE_NAME(SoftmaxBackward)
  Tensor out;
  int64_t dim = -1;
  bool log = false;
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    if (log) {
      return {ops::sub(g[0], ops::mul(ops::exp(out), ops::sum(g[0], Dims{dim}, true)))};
    }
    Tensor dot = ops::sum(ops::mul(g[0], out), Dims{dim}, true);
    return {ops::mul(out, ops::sub(g[0], dot))};
  }
  void release_saved() override { out = Tensor(); }
};

Tensor reduce_sum(const Tensor& t, const Dims& dims, bool keepdim, bool is_mean) {
  Tensor out = is_mean ? ops::mean(t, dims, keepdim) : ops::sum(t, dims, keepdim);
  if (auto node = record<SumBackward>({&t}, {&out})) {
    node->shape = t.shape();
    node->dtype = t.dtype();
    node->reduced = reduced_dims(dims, t.dim(), is_mean ? "mean" : "sum");
    node->keepdim = keepdim;
    if (is_mean) {
      int64_t count = 1;
      for (int d : node->reduced)
        count *= t.shape()[d];
      node->scale = count > 0 ? 1.0 / static_cast<double>(count) : 0.0;
    }
  }
  return out;
}

Tensor extremum(const Tensor& t, const Dims& dims, bool keepdim, bool is_max) {
  Tensor out_keep = is_max ? ops::amax(t, dims, true) : ops::amin(t, dims, true);
  std::vector<int> reduced = reduced_dims(dims, t.dim(), is_max ? "amax" : "amin");
  Tensor out = out_keep;
  if (!keepdim && t.dim() > 0) {
    for (auto it = reduced.rbegin(); it != reduced.rend(); ++it)
      out = ops::squeeze(out, *it);
  }
  out = detach(out);
  if (auto node = record<AmaxBackward>({&t}, {&out})) {
    node->input = detach(t);
    node->out_keep = detach(out_keep);
    node->reduced = reduced;
    node->keepdim = keepdim;
  }
  return out;
}

}  // namespace

Tensor sum(const Tensor& t, const Dims& dims, bool keepdim) {
  return reduce_sum(t, dims, keepdim, false);
}
Tensor mean(const Tensor& t, const Dims& dims, bool keepdim) {
  return reduce_sum(t, dims, keepdim, true);
}
Tensor amax(const Tensor& t, const Dims& dims, bool keepdim) {
  return extremum(t, dims, keepdim, true);
}
Tensor amin(const Tensor& t, const Dims& dims, bool keepdim) {
  return extremum(t, dims, keepdim, false);
}
std::pair<Tensor, Tensor> max(const Tensor& t, int64_t dim, bool keepdim) {
  return {amax(t, Dims{dim}, keepdim), ops::argmax(t, dim, keepdim)};
}

Tensor cumsum(const Tensor& t, int64_t dim) {
  Tensor out = ops::cumsum(t, dim);
  if (auto node = record<CumsumBackward>({&t}, {&out})) node->dim = dim;
  return out;
}

Tensor softmax(const Tensor& t, int64_t dim) {
  Tensor out = ops::softmax(t, dim);
  if (auto node = record<SoftmaxBackward>({&t}, {&out})) {
    node->out = detach(out);
    node->dim = dim;
  }
  return out;
}

Tensor log_softmax(const Tensor& t, int64_t dim) {
  Tensor out = ops::log_softmax(t, dim);
  if (auto node = record<SoftmaxBackward>({&t}, {&out})) {
    node->out = detach(out);
    node->dim = dim;
    node->log = true;
  }
  return out;
}

Tensor sum_to(const Tensor& g, const Shape& shape) {
  if (g.shape() == shape) return g;
  int lead = g.dim() - shape.size();
  TANDEM_CHECK(lead >= 0, "[autograd::sum_to] expected a gradient of rank >= {}, got {}",
               shape.size(), g.shape());
  Dims dims;
  for (int i = 0; i < g.dim(); ++i) {
    if (i < lead || (shape[i - lead] == 1 && g.shape()[i] != 1)) dims.push_back(i);
  }
  Tensor r = dims.empty() ? g : ops::sum(g, dims, true);
  return ops::reshape(r, shape);
}

}  // namespace tandem
