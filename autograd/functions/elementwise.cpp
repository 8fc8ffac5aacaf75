// Differentiable elementwise ops: forward through tensor::ops, backward node
// right below (STYLE). Binary backward sums over broadcast dims (sum_to) and
// casts back to each input's dtype.
#include <cmath>

#include "tandem/autograd/checkpoint.h"
#include "tandem/autograd/functions/node_name.h"
#include "tandem/autograd/ops.h"

namespace tandem {
namespace {

// The gradient for an input of `shape` and `dtype` from a gradient of the
// (possibly broadcast, possibly promoted) output.
Tensor fit(const Tensor& g, const Shape& shape, DType dtype) {
  return ops::to(sum_to(g, shape), dtype);
}

struct InputInfo {
  Shape shape;
  DType dtype = DType::F32;
  void set(const Tensor& t) {
    shape = t.shape();
    dtype = t.dtype();
  }
};

struct AddBackward final : Node {
  TANDEM_NODE_NAME(AddBackward)
  InputInfo a, b;
  double alpha = 1.0;  // sub: -1
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    return {needs_grad(0) ? fit(g[0], a.shape, a.dtype) : Tensor(),
            needs_grad(1) ? fit(alpha == 1.0 ? g[0] : ops::mul(g[0], alpha), b.shape, b.dtype)
                          : Tensor()};
  }
};

struct MulBackward final : Node {
  TANDEM_NODE_NAME(MulBackward)
  Tensor a, b;
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    return {needs_grad(0) ? fit(ops::mul(g[0], b), a.shape(), a.dtype()) : Tensor(),
            needs_grad(1) ? fit(ops::mul(g[0], a), b.shape(), b.dtype()) : Tensor()};
  }
  void release_saved() override { a = b = Tensor(); }
};

struct DivBackward final : Node {
  TANDEM_NODE_NAME(DivBackward)
  Tensor a, b, out;
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    Tensor ga = ops::div(g[0], b);
    return {needs_grad(0) ? fit(ga, a.shape(), a.dtype()) : Tensor(),
            needs_grad(1) ? fit(ops::neg(ops::mul(ga, out)), b.shape(), b.dtype()) : Tensor()};
  }
  void release_saved() override { a = b = out = Tensor(); }
};

// PyTorch's conventions where the formulas give 0 * inf: d/da is 0 where
// b == 0 (a^0 is constant 1, even at a == 0), and d/db = a^b log(a) is 0 where
// a == 0 and b >= 0 (0^b is 0 or 1 there; x ** p with a learnable p after a
// relu must not turn the whole gradient into NaN).
struct PowBackward final : Node {
  TANDEM_NODE_NAME(PowBackward)
  Tensor a, b, out;
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    Tensor ga, gb;
    if (needs_grad(0)) {
      Tensor local = ops::mul(b, ops::pow(a, ops::sub(b, 1.0)));
      local =
          ops::where(ops::eq(b, 0.0), ops::zeros(Shape{}, local.dtype(), local.device()), local);
      ga = fit(ops::mul(g[0], local), a.shape(), a.dtype());
    }
    if (needs_grad(1)) {
      Tensor local = ops::mul(out, ops::log(a));
      const Tensor zero = ops::zeros(Shape{}, local.dtype(), local.device());
      local = ops::where(ops::ge(b, 0.0), ops::where(ops::eq(a, 0.0), zero, local), local);
      gb = fit(ops::mul(g[0], local), b.shape(), b.dtype());
    }
    return {ga, gb};
  }
  void release_saved() override { a = b = out = Tensor(); }
};

// maximum/minimum: the winner gets the gradient; ties split it evenly.
struct MaxMinBackward final : Node {
  TANDEM_NODE_NAME(MaxMinBackward)
  Tensor a, b;
  bool is_max = true;
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    Tensor wins_a = is_max ? ops::gt(a, b) : ops::lt(a, b);
    Tensor tie = ops::eq(a, b);
    Tensor share_a =
        ops::add(ops::to(wins_a, g[0].dtype()), ops::mul(ops::to(tie, g[0].dtype()), 0.5));
    Tensor ga = ops::mul(g[0], share_a);
    Tensor gb = ops::sub(g[0], ga);
    return {needs_grad(0) ? fit(ga, a.shape(), a.dtype()) : Tensor(),
            needs_grad(1) ? fit(gb, b.shape(), b.dtype()) : Tensor()};
  }
  void release_saved() override { a = b = Tensor(); }
};

// Unary and scalar ops: grad_in = g * local(saved).
struct UnaryBackward final : Node {
  const char* node_name = "UnaryBackward";
  const char* name() const override { return node_name; }
  Tensor saved;                                               // input or output, as `local` needs
  std::function<Tensor(const Tensor&, const Tensor&)> local;  // (g, saved) -> grad_in
  DType in_dtype = DType::F32;
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    return {ops::to(local(g[0], saved), in_dtype)};
  }
  void release_saved() override { saved = Tensor(); }
};

template <class Local>
Tensor unary(const char* name, const Tensor& a, Tensor out, bool save_output, Local local) {
  if (auto node = record<UnaryBackward>({&a}, {&out})) {
    node->node_name = name;
    node->saved = detach(save_output ? out : a);
    node->local = local;
    node->in_dtype = a.dtype();
  }
  return out;
}

Tensor binary_add(const Tensor& a, const Tensor& b, double alpha) {
  Tensor out = alpha == 1.0 ? ops::add(a, b) : ops::sub(a, b);
  if (auto node = record<AddBackward>({&a, &b}, {&out})) {
    node->a.set(a);
    node->b.set(b);
    node->alpha = alpha;
  }
  return out;
}

Tensor max_min(const Tensor& a, const Tensor& b, bool is_max) {
  Tensor out = is_max ? ops::maximum(a, b) : ops::minimum(a, b);
  if (auto node = record<MaxMinBackward>({&a, &b}, {&out})) {
    node->a = detach(a);
    node->b = detach(b);
    node->is_max = is_max;
  }
  return out;
}

Tensor sign(const Tensor& x) {
  return ops::sub(ops::to(ops::gt(x, 0.0), x.dtype()), ops::to(ops::lt(x, 0.0), x.dtype()));
}

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) {
  return binary_add(a, b, 1.0);
}
Tensor sub(const Tensor& a, const Tensor& b) {
  return binary_add(a, b, -1.0);
}

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor out = ops::mul(a, b);
  if (auto node = record<MulBackward>({&a, &b}, {&out})) {
    node->a = detach(a);
    node->b = detach(b);
  }
  return out;
}

Tensor div(const Tensor& a, const Tensor& b) {
  Tensor out = ops::div(a, b);
  if (auto node = record<DivBackward>({&a, &b}, {&out})) {
    node->a = detach(a);
    node->b = detach(b);
    node->out = detach(out);
  }
  return out;
}

Tensor pow(const Tensor& a, const Tensor& b) {
  Tensor out = ops::pow(a, b);
  if (auto node = record<PowBackward>({&a, &b}, {&out})) {
    node->a = detach(a);
    node->b = detach(b);
    node->out = detach(out);
  }
  return out;
}

Tensor maximum(const Tensor& a, const Tensor& b) {
  return max_min(a, b, true);
}
Tensor minimum(const Tensor& a, const Tensor& b) {
  return max_min(a, b, false);
}

Tensor add(const Tensor& a, double s) {
  return unary("AddScalarBackward", a, ops::add(a, s), false,
               [](const Tensor& g, const Tensor&) { return g; });
}
Tensor sub(const Tensor& a, double s) {
  return unary("SubScalarBackward", a, ops::sub(a, s), false,
               [](const Tensor& g, const Tensor&) { return g; });
}
Tensor rsub(const Tensor& a, double s) {
  return unary("RsubScalarBackward", a, ops::rsub(a, s), false,
               [](const Tensor& g, const Tensor&) { return ops::neg(g); });
}
Tensor mul(const Tensor& a, double s) {
  return unary("MulScalarBackward", a, ops::mul(a, s), false,
               [s](const Tensor& g, const Tensor&) { return ops::mul(g, s); });
}
Tensor div(const Tensor& a, double s) {
  return unary("DivScalarBackward", a, ops::div(a, s), false,
               [s](const Tensor& g, const Tensor&) { return ops::div(g, s); });
}
Tensor rdiv(const Tensor& a, double s) {
  // d(s/a)/da = -s/a^2 = -out/a
  Tensor out = ops::rdiv(a, s);
  return unary("RdivScalarBackward", a, out, false, [s](const Tensor& g, const Tensor& x) {
    return ops::mul(ops::div(g, ops::mul(x, x)), -s);
  });
}
Tensor pow(const Tensor& a, double e) {
  // x^0 is constant: its gradient is 0 even at x == 0, where e * x^(e-1) is 0 * inf.
  return unary("PowScalarBackward", a, ops::pow(a, e), false,
               [e](const Tensor& g, const Tensor& x) {
                 if (e == 0.0) return ops::zeros_like(g);
                 return ops::mul(g, ops::mul(ops::pow(x, e - 1.0), e));
               });
}
Tensor neg(const Tensor& a) {
  return unary("NegBackward", a, ops::neg(a), false,
               [](const Tensor& g, const Tensor&) { return ops::neg(g); });
}
Tensor exp(const Tensor& a) {
  return unary("ExpBackward", a, ops::exp(a), true,
               [](const Tensor& g, const Tensor& y) { return ops::mul(g, y); });
}
Tensor log(const Tensor& a) {
  return unary("LogBackward", a, ops::log(a), false,
               [](const Tensor& g, const Tensor& x) { return ops::div(g, x); });
}
Tensor sqrt(const Tensor& a) {
  return unary("SqrtBackward", a, ops::sqrt(a), true,
               [](const Tensor& g, const Tensor& y) { return ops::div(ops::mul(g, 0.5), y); });
}
Tensor rsqrt(const Tensor& a) {
  return unary("RsqrtBackward", a, ops::rsqrt(a), true, [](const Tensor& g, const Tensor& y) {
    return ops::mul(g, ops::mul(ops::mul(ops::mul(y, y), y), -0.5));
  });
}
Tensor abs(const Tensor& a) {
  return unary("AbsBackward", a, ops::abs(a), false,
               [](const Tensor& g, const Tensor& x) { return ops::mul(g, sign(x)); });
}
Tensor tanh(const Tensor& a) {
  return unary("TanhBackward", a, ops::tanh(a), true, [](const Tensor& g, const Tensor& y) {
    return ops::mul(g, ops::rsub(ops::mul(y, y), 1.0));
  });
}
Tensor sigmoid(const Tensor& a) {
  return unary("SigmoidBackward", a, ops::sigmoid(a), true, [](const Tensor& g, const Tensor& y) {
    return ops::mul(g, ops::mul(y, ops::rsub(y, 1.0)));
  });
}
Tensor relu(const Tensor& a) {
  return unary("ReluBackward", a, ops::relu(a), true, [](const Tensor& g, const Tensor& y) {
    return ops::mul(g, ops::to(ops::gt(y, 0.0), g.dtype()));
  });
}
Tensor gelu(const Tensor& a, GeluApproximate approximate) {
  if (approximate == GeluApproximate::None) {
    // y = x Phi(x): dy/dx = Phi(x) + x phi(x), Phi(x) = (1 + erf(x / sqrt 2)) / 2,
    // phi(x) = exp(-x^2 / 2) / sqrt(2 pi).
    return unary("GeluErfBackward", a, ops::gelu(a, approximate), false,
                 [](const Tensor& g, const Tensor& x) {
                   const double inv_sqrt2 = 0.7071067811865476, inv_sqrt_2pi = 0.3989422804014327;
                   Tensor cdf = ops::mul(ops::add(ops::erf(ops::mul(x, inv_sqrt2)), 1.0), 0.5);
                   Tensor pdf = ops::mul(ops::exp(ops::mul(ops::mul(x, x), -0.5)), inv_sqrt_2pi);
                   return ops::mul(g, ops::add(cdf, ops::mul(x, pdf)));
                 });
  }
  return unary("GeluBackward", a, ops::gelu(a), false, [](const Tensor& g, const Tensor& x) {
    // y = 0.5 x (1 + tanh(u)), u = k (x + c x^3)
    const double k = 0.7978845608028654, c = 0.044715;
    Tensor x2 = ops::mul(x, x);
    Tensor t = ops::tanh(ops::mul(ops::mul(x, ops::add(ops::mul(x2, c), 1.0)), k));
    Tensor du = ops::mul(ops::add(ops::mul(x2, 3.0 * c), 1.0), k);
    Tensor sech2 = ops::rsub(ops::mul(t, t), 1.0);
    Tensor d =
        ops::add(ops::mul(ops::add(t, 1.0), 0.5), ops::mul(ops::mul(ops::mul(x, sech2), du), 0.5));
    return ops::mul(g, d);
  });
}
Tensor erf(const Tensor& a) {
  // d erf(x)/dx = 2 / sqrt(pi) exp(-x^2)
  return unary("ErfBackward", a, ops::erf(a), false, [](const Tensor& g, const Tensor& x) {
    return ops::mul(g, ops::mul(ops::exp(ops::neg(ops::mul(x, x))), 1.1283791670955126));
  });
}
Tensor softplus(const Tensor& a) {
  // d softplus(x)/dx = sigmoid(x)
  return unary("SoftplusBackward", a, ops::softplus(a), false,
               [](const Tensor& g, const Tensor& x) { return ops::mul(g, ops::sigmoid(x)); });
}
Tensor silu(const Tensor& a) {
  return unary("SiluBackward", a, ops::silu(a), false, [](const Tensor& g, const Tensor& x) {
    Tensor s = ops::sigmoid(x);
    return ops::mul(g, ops::mul(s, ops::add(ops::mul(x, ops::rsub(s, 1.0)), 1.0)));
  });
}

namespace {
// The mask is recomputed from the counters (ops::dropout on the gradient).
struct DropoutBackward final : Node {
  TANDEM_NODE_NAME(DropoutBackward)
  double p = 0.0;
  RandomDraw draw;
  DType in_dtype = DType::F32;
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    return {ops::to(ops::dropout(g[0], p, draw.seed, draw.offset), in_dtype)};
  }
};
}  // namespace

Tensor dropout(const Tensor& x, double p, bool training, Generator& gen) {
  TANDEM_CHECK(x.defined(), "[nn::dropout] expected a defined tensor, got an empty handle");
  TANDEM_CHECK(p >= 0.0 && p <= 1.0, "[nn::dropout] expected p in [0, 1], got {}", p);
  if (!training) return x;
  TANDEM_CHECK(is_floating(x.dtype()), "[nn::dropout] expected a floating x, got {}",
               dtype_name(x.dtype()));
  // Counters are reserved whatever p, as ops::dropout(x, p, gen) does.
  const RandomDraw draw = draw_random(gen, static_cast<uint64_t>(x.numel()));
  if (p == 0.0) return x;
  Tensor out = ops::dropout(x, p, draw.seed, draw.offset);
  if (auto node = record<DropoutBackward>({&x}, {&out})) {
    node->p = p;
    node->draw = draw;
    node->in_dtype = x.dtype();
  }
  return out;
}

namespace {
// Note [Fused SwiGLU] in tensor/cpu/elementwise.cpp: one kernel each way.
struct SwigluBackward final : Node {
  TANDEM_NODE_NAME(SwigluBackward)
  Tensor a, b;
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    auto [da, db] = ops::swiglu_backward(a, b, g[0]);
    return {needs_grad(0) ? da : Tensor(), needs_grad(1) ? db : Tensor()};
  }
  void release_saved() override { a = b = Tensor(); }
};
}  // namespace

Tensor swiglu(const Tensor& a, const Tensor& b) {
  Tensor out = ops::swiglu(a, b);
  if (auto node = record<SwigluBackward>({&a, &b}, {&out})) {
    node->a = detach(a);
    node->b = detach(b);
  }
  return out;
}

namespace {
struct WhereBackward final : Node {
  TANDEM_NODE_NAME(WhereBackward)
  Tensor cond;
  InputInfo a, b;
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    Tensor zero = ops::zeros(Shape{}, g[0].dtype(), g[0].device());
    return {Tensor(),
            needs_grad(1) ? fit(ops::where(cond, g[0], zero), a.shape, a.dtype) : Tensor(),
            needs_grad(2) ? fit(ops::where(cond, zero, g[0]), b.shape, b.dtype) : Tensor()};
  }
  void release_saved() override { cond = Tensor(); }
};
}  // namespace

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  Tensor out = ops::where(cond, a, b);
  if (auto node = record<WhereBackward>({&cond, &a, &b}, {&out})) {
    node->cond = detach(cond);
    node->a.set(a);
    node->b.set(b);
  }
  return out;
}

Tensor where(const Tensor& cond, const Tensor& a, double b) {
  return where(cond, a, ops::scalar_tensor(b, a.dtype(), a.device()));
}

Tensor operator+(const Tensor& a, const Tensor& b) {
  return add(a, b);
}
Tensor operator-(const Tensor& a, const Tensor& b) {
  return sub(a, b);
}
Tensor operator*(const Tensor& a, const Tensor& b) {
  return mul(a, b);
}
Tensor operator/(const Tensor& a, const Tensor& b) {
  return div(a, b);
}
Tensor operator+(const Tensor& a, double s) {
  return add(a, s);
}
Tensor operator-(const Tensor& a, double s) {
  return sub(a, s);
}
Tensor operator*(const Tensor& a, double s) {
  return mul(a, s);
}
Tensor operator/(const Tensor& a, double s) {
  return div(a, s);
}
Tensor operator*(double s, const Tensor& a) {
  return mul(a, s);
}
Tensor operator+(double s, const Tensor& a) {
  return add(a, s);
}
Tensor operator-(double s, const Tensor& a) {
  return rsub(a, s);
}
Tensor operator-(const Tensor& a) {
  return neg(a);
}

}  // namespace tandem
