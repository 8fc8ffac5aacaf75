// Differentiable matmul, normalisation, indexing, cross-entropy and attention.
#include <cmath>
#include <limits>

#include "tandem/autograd/functions/node_name.h"
#include "tandem/autograd/ops.h"

namespace tandem {

std::vector<Tensor> attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& out, const Tensor& lse, const Tensor& dout,
                                       const AttentionOptions& options) {
  return ops::scaled_dot_product_attention_backward(q, k, v, out, lse, dout, options);
}

namespace {

// (…, M, K) @ (…, K, N), both of rank >= 2 (1-D cases are views around it).
struct MatmulBackward final : Node {
  TANDEM_NODE_NAME(MatmulBackward)
  Tensor a, b;
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    Tensor ga, gb;
    if (needs_grad(0)) ga = sum_to(ops::matmul(g[0], ops::transpose(b, -1, -2)), a.shape());
    if (needs_grad(1)) gb = sum_to(ops::matmul(ops::transpose(a, -1, -2), g[0]), b.shape());
    return {ga, gb};
  }
  void release_saved() override { a = b = Tensor(); }
};

Tensor matmul_2d(const Tensor& a, const Tensor& b) {
  Tensor out = ops::matmul(a, b);
  if (auto node = record<MatmulBackward>({&a, &b}, {&out})) {
    node->a = detach(a);
    node->b = detach(b);
  }
  return out;
}

// Both norms' backward is one fused kernel (Note [Fused norm backward] in
// tensor/cpu/norm.cpp).
struct LayerNormBackward final : Node {
  TANDEM_NODE_NAME(LayerNormBackward)
  Tensor x, weight, mean, rstd;  // mean/rstd: (rows) f32
  bool has_bias = false;
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    NormGrads r =
        ops::norm_backward(g[0], x, weight, mean, rstd, needs_grad(1), has_bias && needs_grad(2));
    return {r.dx, r.dweight, r.dbias};
  }
  void release_saved() override { x = weight = mean = rstd = Tensor(); }
};

struct RmsNormBackward final : Node {
  TANDEM_NODE_NAME(RmsNormBackward)
  Tensor x, weight, rstd;
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    NormGrads r = ops::norm_backward(g[0], x, weight, Tensor(), rstd, needs_grad(1), false);
    return {r.dx, r.dweight};
  }
  void release_saved() override { x = weight = rstd = Tensor(); }
};

// Scatter-adds a gradient back along `dim` at `index` (same rank as g).
Tensor scatter_into_zeros(const Shape& shape, DType dtype, int64_t dim, const Tensor& index,
                          const Tensor& g) {
  return ops::scatter_add(ops::zeros(shape, dtype, g.device()), dim, index, g);
}

struct GatherBackward final : Node {
  TANDEM_NODE_NAME(GatherBackward)
  Shape shape;
  DType dtype;
  int64_t dim = 0;
  Tensor index;
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    // gather(t, dim, index) has two inputs; topk's values only one.
    std::vector<Tensor> out{scatter_into_zeros(shape, dtype, dim, index, g[0])};
    out.resize(next_edges().size());
    return out;
  }
  void release_saved() override { index = Tensor(); }
};

struct ScatterAddBackward final : Node {
  TANDEM_NODE_NAME(ScatterAddBackward)
  int64_t dim = 0;
  Tensor index;
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    return {g[0], Tensor(), needs_grad(2) ? ops::gather(g[0], dim, index) : Tensor()};
  }
  void release_saved() override { index = Tensor(); }
};

// Index tensor of g's shape that repeats a 1-D `index` along `dim`.
Tensor broadcast_index(const Tensor& index, int dim, const Shape& shape) {
  Shape view_shape = Dims::filled(shape.size(), 1);
  view_shape[dim] = index.numel();
  return ops::contiguous(ops::expand(ops::reshape(ops::to(index, DType::I64), view_shape), shape));
}

struct IndexSelectBackward final : Node {
  TANDEM_NODE_NAME(IndexSelectBackward)
  Shape shape;
  DType dtype;
  int dim = 0;
  Tensor index;  // 1-D
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    return {scatter_into_zeros(shape, dtype, dim, broadcast_index(index, dim, g[0].shape()), g[0]),
            Tensor()};
  }
  void release_saved() override { index = Tensor(); }
};

// Attention backward from the saved inputs, output and log-sum-exp (the
// FlashAttention formulation): P = exp(S - lse) is recomputed, never saved.
struct AttentionBackward final : Node {
  TANDEM_NODE_NAME(AttentionBackward)
  Tensor q, k, v, out, lse;
  AttentionOptions options;
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    return attention_backward(q, k, v, out, lse, g[0], options);
  }
  void release_saved() override { q = k = v = out = lse = Tensor(); }
};

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b) {
  TANDEM_CHECK(a.dim() >= 1 && b.dim() >= 1,
               "[tensor::matmul] expected operands of rank >= 1, got {} and {}", a.shape(),
               b.shape());
  // (…, M, K) @ (K, N): fold the leading dims into M, one GEMM instead of a
  // batch over a broadcast weight, and a weight gradient without a sum_to.
  if (a.dim() > 2 && b.dim() == 2 && a.is_contiguous()) {
    Shape out_shape = a.shape();
    out_shape[out_shape.size() - 1] = b.shape()[1];
    // Rows spelled out, not -1: with K == 0 (an empty tensor-parallel shard)
    // a -1 could not be inferred from 0 elements.
    int64_t rows = 1;
    for (int i = 0; i + 1 < a.dim(); ++i)
      rows *= a.shape()[i];
    return reshape(matmul_2d(reshape(a, Shape{rows, a.shape()[a.dim() - 1]}), b), out_shape);
  }
  if (a.dim() >= 2 && b.dim() >= 2) return matmul_2d(a, b);
  Tensor a2 = a.dim() == 1 ? unsqueeze(a, 0) : a;
  Tensor b2 = b.dim() == 1 ? unsqueeze(b, 1) : b;
  Tensor out = matmul_2d(a2, b2);
  if (a.dim() == 1) out = squeeze(out, -2);
  if (b.dim() == 1) out = squeeze(out, -1);
  return out;
}

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b) {
  TANDEM_CHECK(w.dim() == 2, "[nn::linear] expected a weight of shape (out, in), got {}",
               w.shape());
  Tensor y = matmul(x, transpose(w, 0, 1));
  return b.defined() ? add(y, b) : y;
}

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  NormResult r = ops::layer_norm(x, weight, bias, eps);
  Tensor out = r.out;
  if (auto node = record<LayerNormBackward>({&x, &weight, &bias}, {&out})) {
    node->x = detach(x);
    node->weight = detach(weight);
    node->mean = r.mean;
    node->rstd = r.rstd;
    node->has_bias = bias.defined();
  }
  return out;
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  NormResult r = ops::rms_norm(x, weight, eps);
  Tensor out = r.out;
  if (auto node = record<RmsNormBackward>({&x, &weight}, {&out})) {
    node->x = detach(x);
    node->weight = detach(weight);
    node->rstd = r.rstd;
  }
  return out;
}

Tensor index_select(const Tensor& t, int64_t dim, const Tensor& index) {
  Tensor out = ops::index_select(t, dim, index);
  if (auto node = record<IndexSelectBackward>({&t, &index}, {&out})) {
    node->shape = t.shape();
    node->dtype = t.dtype();
    node->dim = wrap_dim(dim, t.dim(), "index_select");
    node->index = detach(ops::reshape(index, Shape{-1}));
  }
  return out;
}

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  TANDEM_CHECK(weight.dim() == 2, "[nn::embedding] expected a weight of shape (V, D), got {}",
               weight.shape());
  Tensor rows = index_select(weight, 0, ops::reshape(indices, Shape{-1}));
  Shape shape = indices.shape();
  shape.push_back(weight.shape()[1]);
  return reshape(rows, shape);
}

Tensor gather(const Tensor& t, int64_t dim, const Tensor& index) {
  Tensor out = ops::gather(t, dim, index);
  if (auto node = record<GatherBackward>({&t, &index}, {&out})) {
    node->shape = t.shape();
    node->dtype = t.dtype();
    node->dim = dim;
    node->index = detach(index);
  }
  return out;
}

Tensor scatter_add(const Tensor& t, int64_t dim, const Tensor& index, const Tensor& src) {
  Tensor out = ops::scatter_add(t, dim, index, src);
  if (auto node = record<ScatterAddBackward>({&t, &index, &src}, {&out})) {
    node->dim = dim;
    node->index = detach(index);
  }
  return out;
}

std::pair<Tensor, Tensor> topk(const Tensor& t, int64_t k, int64_t dim, bool largest) {
  auto [values, indices] = ops::topk(t, k, dim, largest);
  if (auto node = record<GatherBackward>({&t}, {&values})) {
    node->shape = t.shape();
    node->dtype = t.dtype();
    node->dim = dim;
    node->index = indices;
  }
  return {values, indices};
}

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index) {
  CrossEntropyOptions options;
  options.ignore_index = ignore_index;
  return cross_entropy(logits, targets, options);
}

// The composition of ops::cross_entropy from differentiable ops.
Tensor cross_entropy(const Tensor& logits, const Tensor& targets,
                     const CrossEntropyOptions& options) {
  TANDEM_CHECK(logits.dim() == 2 && targets.dim() == 1 && targets.shape()[0] == logits.shape()[0],
               "[nn::cross_entropy] expected logits (N, C) and targets (N), got {} and {}",
               logits.shape(), targets.shape());
  TANDEM_CHECK(!is_floating(targets.dtype()),
               "[nn::cross_entropy] expected integer targets, got {}", dtype_name(targets.dtype()));
  const double eps = options.label_smoothing;
  TANDEM_CHECK(eps >= 0.0 && eps <= 1.0,
               "[nn::cross_entropy] expected label_smoothing in [0, 1], got {}", eps);
  Tensor t = ops::to(targets, DType::I64);
  Tensor keep = ops::ne(t, static_cast<double>(options.ignore_index));
  Tensor safe = ops::where(keep, t, 0.0);
  Tensor logp = log_softmax(to(logits, logits.dtype() == DType::F64 ? DType::F64 : DType::F32), 1);
  Tensor row = neg(squeeze(gather(logp, 1, ops::unsqueeze(safe, 1)), 1));
  if (eps > 0.0) {
    Tensor uniform = div(neg(sum(logp, Dims{1})), static_cast<double>(logits.shape()[1]));
    row = add(mul(row, 1.0 - eps), mul(uniform, eps));
  }
  // where, not a multiply by the mask: an ignored row's terms may be -inf.
  Tensor masked = where(keep, row, 0.0);
  if (options.reduction == Reduction::None) return masked;
  if (options.reduction == Reduction::Sum) return sum(masked);
  // The count stays on the device (no host synchronisation in the forward).
  Tensor count = ops::maximum(ops::sum(ops::to(keep, masked.dtype())),
                              ops::ones(Shape{}, masked.dtype(), masked.device()));
  return div(sum(masked), count);
}

AttentionResult scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const AttentionOptions& options) {
  AttentionResult r = ops::scaled_dot_product_attention(q, k, v, options);
  Tensor out = r.out;
  if (auto node = record<AttentionBackward>({&q, &k, &v}, {&out})) {
    node->q = detach(q);
    node->k = detach(k);
    node->v = detach(v);
    node->out = detach(out);
    node->lse = r.lse;
    node->options = options;
  }
  return {out, r.lse};
}

}  // namespace tandem
