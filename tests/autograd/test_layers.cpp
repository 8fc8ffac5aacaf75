// nn layers (autograd/nn/) and init (autograd/init.h): every forward against a
// reference written with naive loops over host vectors, every gradient against
// central finite differences in f64 (inputs through gradcheck, parameters by
// perturbing them in place), plus the Module plumbing the parallel layers rely
// on: parameter names, state dicts, named/positional Q/K/V on CoreAttention
// and the MoE dispatch plan.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <functional>
#include <numeric>

#include "tandem/autograd/gradcheck.h"
#include "tandem/autograd/init.h"
#include "tandem/autograd/nn/attention.h"
#include "tandem/autograd/nn/linear.h"
#include "tandem/autograd/nn/moe.h"
#include "tandem/autograd/nn/norm.h"
#include "tandem/autograd/nn/transformer.h"
#include "tandem/autograd/ops.h"

using namespace tandem;
using Vec = std::vector<double>;

namespace {

Vec values(const Tensor& t) {
  return ops::contiguous(ops::to(detach(t), DType::F64)).to_vector<double>();
}

Tensor f64_tensor(const Vec& v, const Shape& shape) {
  return ops::from_vector(v, shape);
}

double max_abs_diff(const Vec& a, const Vec& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i)
    m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

// Row-major (n, out) = (n, in) W^T + b, W (out, in).
Vec naive_linear(const Vec& x, int64_t n, int64_t in, const Vec& w, int64_t out,
                 const Vec& b = {}) {
  Vec y(static_cast<size_t>(n * out), 0.0);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double s = b.empty() ? 0.0 : b[o];
      for (int64_t i = 0; i < in; ++i)
        s += x[r * in + i] * w[o * in + i];
      y[r * out + o] = s;
    }
  }
  return y;
}

Vec naive_layer_norm(const Vec& x, int64_t n, int64_t d, const Vec& w, const Vec& b, double eps) {
  Vec y(x.size());
  for (int64_t r = 0; r < n; ++r) {
    double mu = 0, var = 0;
    for (int64_t j = 0; j < d; ++j)
      mu += x[r * d + j] / static_cast<double>(d);
    for (int64_t j = 0; j < d; ++j) {
      var += (x[r * d + j] - mu) * (x[r * d + j] - mu) / static_cast<double>(d);
    }
    for (int64_t j = 0; j < d; ++j) {
      y[r * d + j] = (x[r * d + j] - mu) / std::sqrt(var + eps) * w[j] + b[j];
    }
  }
  return y;
}

Vec naive_rms_norm(const Vec& x, int64_t n, int64_t d, const Vec& w, double eps) {
  Vec y(x.size());
  for (int64_t r = 0; r < n; ++r) {
    double ms = 0;
    for (int64_t j = 0; j < d; ++j)
      ms += x[r * d + j] * x[r * d + j] / static_cast<double>(d);
    for (int64_t j = 0; j < d; ++j)
      y[r * d + j] = x[r * d + j] / std::sqrt(ms + eps) * w[j];
  }
  return y;
}

double naive_silu(double v) {
  return v / (1.0 + std::exp(-v));
}

Vec naive_swiglu(const Vec& x, int64_t n, int64_t d, int64_t hidden, const Vec& w1, const Vec& w2,
                 const Vec& w3) {
  Vec a = naive_linear(x, n, d, w1, hidden);
  Vec b = naive_linear(x, n, d, w3, hidden);
  for (size_t i = 0; i < a.size(); ++i)
    a[i] = naive_silu(a[i]) * b[i];
  return naive_linear(a, n, hidden, w2, d);
}

// BSHD attention: q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D) → (B, Sq, Hq, D).
Vec naive_attention(const Vec& q, const Vec& k, const Vec& v, int64_t B, int64_t Sq, int64_t Sk,
                    int64_t Hq, int64_t Hkv, int64_t D, bool causal, int64_t q_offset = 0,
                    int64_t k_offset = 0) {
  Vec out(static_cast<size_t>(B * Sq * Hq * D), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / (Hq / Hkv);
      for (int64_t i = 0; i < Sq; ++i) {
        Vec s(static_cast<size_t>(Sk), -INFINITY);
        double mx = -INFINITY;
        for (int64_t j = 0; j < Sk; ++j) {
          if (causal && k_offset + j > q_offset + i) continue;
          double dot = 0;
          for (int64_t e = 0; e < D; ++e) {
            dot += q[((b * Sq + i) * Hq + h) * D + e] * k[((b * Sk + j) * Hkv + hk) * D + e];
          }
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
        }
        double denom = 0;
        for (int64_t j = 0; j < Sk; ++j)
          denom += std::isinf(s[j]) ? 0.0 : std::exp(s[j] - mx);
        for (int64_t j = 0; j < Sk; ++j) {
          if (std::isinf(s[j])) continue;
          const double p = std::exp(s[j] - mx) / denom;
          for (int64_t e = 0; e < D; ++e) {
            out[((b * Sq + i) * Hq + h) * D + e] += p * v[((b * Sk + j) * Hkv + hk) * D + e];
          }
        }
      }
    }
  }
  return out;
}

// Self-attention from its projection weights; x (B, S, d).
Vec naive_self_attention(const Vec& x, int64_t B, int64_t S, int64_t d, int64_t Hq, int64_t Hkv,
                         bool causal, std::map<std::string, Tensor> p,
                         const std::string& prefix = "") {
  const int64_t Dh = d / Hq, n = B * S;
  Vec q = naive_linear(x, n, d, values(p[prefix + "q_proj.weight"]), Hq * Dh);
  Vec k = naive_linear(x, n, d, values(p[prefix + "k_proj.weight"]), Hkv * Dh);
  Vec v = naive_linear(x, n, d, values(p[prefix + "v_proj.weight"]), Hkv * Dh);
  Vec a = naive_attention(q, k, v, B, S, S, Hq, Hkv, Dh, causal);
  return naive_linear(a, n, Hq * Dh, values(p[prefix + "o_proj.weight"]), d);
}

// Finite-difference check of every parameter gradient of `m` (already f64):
// projects run()'s outputs on fixed random directions, backpropagates once,
// then perturbs each parameter element in place by ±eps.
void check_param_grads(Module& m, const std::function<std::vector<Tensor>()>& run,
                       double atol = 1e-6, double rtol = 1e-5, double eps = 1e-6) {
  std::vector<Tensor> outs = run();
  Generator gen(4242);
  std::vector<Tensor> dirs;
  for (const Tensor& o : outs)
    dirs.push_back(ops::randn(o.shape(), gen, DType::F64));
  auto project = [&](const std::vector<Tensor>& ys) {
    double total = 0;
    for (size_t j = 0; j < ys.size(); ++j) {
      total += ops::sum(ops::mul(ops::to(detach(ys[j]), DType::F64), dirs[j])).item<double>();
    }
    return total;
  };
  Tensor loss;
  for (size_t j = 0; j < outs.size(); ++j) {
    Tensor term = sum(mul(outs[j], dirs[j]));
    loss = loss.defined() ? add(loss, term) : term;
  }
  m.zero_grad();
  backward(loss);
  NoGradGuard no_grad;
  for (auto& [name, p] : m.named_parameters()) {
    REQUIRE(p.dtype() == DType::F64);
    REQUIRE(p.is_contiguous());
    const Tensor g = grad(p);
    const Vec analytic = g.defined() ? values(g) : Vec(static_cast<size_t>(p.numel()), 0.0);
    auto* data = static_cast<double*>(p.raw_data());
    double worst = 0;
    std::string where;
    for (int64_t e = 0; e < p.numel(); ++e) {
      const double saved = data[e];
      data[e] = saved + eps;
      const double plus = project(run());
      data[e] = saved - eps;
      const double minus = project(run());
      data[e] = saved;
      const double numeric = (plus - minus) / (2 * eps);
      const double excess = std::abs(numeric - analytic[e]) - (atol + rtol * std::abs(numeric));
      if (excess > worst) {
        worst = excess;
        where = fmt::format("{}[{}]: analytic {} numeric {}", name, e, analytic[e], numeric);
      }
    }
    INFO(where);
    CHECK(worst == 0.0);
  }
}

void check_input_grads(const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& fn,
                       const std::vector<Tensor>& inputs, GradcheckOptions options = {}) {
  GradcheckResult r = gradcheck(fn, inputs, options);
  INFO(r.message);
  CHECK(r.ok);
}

std::vector<std::string> names_of(const Module& m) {
  std::vector<std::string> out;
  for (auto& [n, t] : m.named_parameters())
    out.push_back(n);
  return out;
}

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

}  // namespace

TEST_CASE("init helpers are deterministic and respect their bounds", "[layers]") {
  Generator a(7), b(7);
  Tensor u1 = init::kaiming_uniform(Shape{64, 100}, a);
  Tensor u2 = init::kaiming_uniform(Shape{64, 100}, b);
  CHECK(ops::equal(u1, u2));
  CHECK(u1.dtype() == DType::F32);
  CHECK(a.offset() == 6400);  // one counter per element, nothing hidden
  // torch.nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
  const Vec v = values(u1);
  const double bound = 1.0 / std::sqrt(100.0);
  CHECK(*std::max_element(v.begin(), v.end()) <= bound);
  CHECK(*std::min_element(v.begin(), v.end()) >= -bound);
  CHECK(*std::max_element(v.begin(), v.end()) > 0.9 * bound);

  const init::Fans f = init::fans(Shape{8, 3, 5, 5});
  CHECK(f.fan_in == 75);
  CHECK(f.fan_out == 200);

  Generator g(11);
  const Vec x = values(init::xavier_uniform(Shape{30, 20}, g));
  const double xb = std::sqrt(6.0 / 50.0);
  CHECK(*std::max_element(x.begin(), x.end()) <= xb);
  CHECK(*std::min_element(x.begin(), x.end()) >= -xb);

  // Sample statistics of a large normal draw: std 0.5 within a few percent.
  const Vec n = values(init::normal(Shape{20000}, 1.0, 0.5, g));
  double mu = std::accumulate(n.begin(), n.end(), 0.0) / static_cast<double>(n.size());
  double var = 0;
  for (double e : n)
    var += (e - mu) * (e - mu) / static_cast<double>(n.size());
  CHECK(mu == Approx(1.0).margin(0.02));
  CHECK(std::sqrt(var) == Approx(0.5).epsilon(0.03));
  const Vec kn = values(init::kaiming_normal(Shape{400, 50}, g));
  double ss = 0;
  for (double e : kn)
    ss += e * e / static_cast<double>(kn.size());
  CHECK(std::sqrt(ss) == Approx(std::sqrt(2.0 / 50.0)).epsilon(0.03));
  CHECK_THROWS_WITH(init::uniform(Shape{2}, 1.0, 0.0, g), Catch::Contains("[init::uniform]"));
}

TEST_CASE("Linear matches x W^T + b and its gradients", "[layers]") {
  Generator gen(1);
  auto lin = nn::make<nn::Linear>({.in_features = 5, .out_features = 3}, gen);
  CHECK(names_of(*lin) == std::vector<std::string>{"weight", "bias"});
  CHECK(lin->weight().shape() == Shape({3, 5}));
  Tensor x = ops::randn(Shape{2, 4, 5}, gen);
  Tensor y = (*lin)(x);
  REQUIRE(y.shape() == Shape({2, 4, 3}));
  Vec expected = naive_linear(values(x), 8, 5, values(lin->weight()), 3, values(lin->bias()));
  CHECK(max_abs_diff(values(y), expected) < 1e-5);

  auto no_bias = nn::make<nn::Linear>({.in_features = 5, .out_features = 3, .bias = false}, gen);
  CHECK(names_of(*no_bias) == std::vector<std::string>{"weight"});
  CHECK_THROWS_WITH((*lin)(ops::randn(Shape{2, 4}, gen)),
                    Catch::Contains("[nn::Linear] expected an input of shape (…, 5)"));

  lin->to(DType::F64);
  Tensor x64 = ops::randn(Shape{3, 5}, gen, DType::F64);
  check_input_grads(
      [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{(*lin)(in[0])}; }, {x64});
  check_param_grads(*lin, [&] { return std::vector<Tensor>{(*lin)(x64)}; });
}

TEST_CASE("Embedding looks up rows and scatters gradients back", "[layers]") {
  Generator gen(2);
  auto emb = nn::make<nn::Embedding>({.num_embeddings = 6, .dim = 4}, gen);
  Tensor idx = ops::from_vector<int64_t>({5, 0, 5, 2}, Shape{2, 2});
  Tensor y = (*emb)(idx);
  REQUIRE(y.shape() == Shape({2, 2, 4}));
  const Vec w = values(emb->weight()), out = values(y);
  const int64_t rows[] = {5, 0, 5, 2};
  for (int r = 0; r < 4; ++r) {
    for (int j = 0; j < 4; ++j)
      CHECK(out[r * 4 + j] == w[rows[r] * 4 + j]);
  }
  backward(sum(y));
  // Row 5 is used twice, rows 1, 3, 4 never.
  const Vec g = values(grad(emb->weight()));
  const double counts[] = {1, 0, 1, 0, 0, 2};
  for (int r = 0; r < 6; ++r) {
    for (int j = 0; j < 4; ++j)
      CHECK(g[r * 4 + j] == counts[r]);
  }
  CHECK_THROWS_WITH((*emb)(ops::zeros(Shape{2})), Catch::Contains("expected integer indices"));
}

TEST_CASE("LayerNorm and RMSNorm match the formulas and their gradients", "[layers]") {
  Generator gen(3);
  Tensor x = ops::add(ops::mul(ops::randn(Shape{2, 3, 6}, gen, DType::F64), 2.0), 0.5);
  const Vec xw = values(ops::randn(Shape{6}, gen, DType::F64));
  const Vec xb = values(ops::randn(Shape{6}, gen, DType::F64));

  SECTION("LayerNorm") {
    auto ln = nn::make<nn::LayerNorm>({.dim = 6, .eps = 1e-5});
    // The defaults are the identity affine map.
    CHECK(values(ln->weight()) == Vec(6, 1.0));
    CHECK(values(ln->bias()) == Vec(6, 0.0));
    ln->to(DType::F64);
    ln->load_state_dict({{"weight", f64_tensor(xw, Shape{6})}, {"bias", f64_tensor(xb, Shape{6})}});
    CHECK(max_abs_diff(values((*ln)(x)), naive_layer_norm(values(x), 6, 6, xw, xb, 1e-5)) < 1e-12);
    // The backward kernel works in f32 (mean/rstd are f32): gradcheck's default tolerances.
    check_input_grads(
        [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{(*ln)(in[0])}; }, {x});
    check_param_grads(
        *ln, [&] { return std::vector<Tensor>{(*ln)(x)}; }, 1e-5, 1e-4);
  }
  SECTION("RMSNorm") {
    auto rn = nn::make<nn::RMSNorm>({.dim = 6, .eps = 1e-6});
    CHECK(names_of(*rn) == std::vector<std::string>{"weight"});
    rn->to(DType::F64);
    rn->load_state_dict({{"weight", f64_tensor(xw, Shape{6})}});
    CHECK(max_abs_diff(values((*rn)(x)), naive_rms_norm(values(x), 6, 6, xw, 1e-6)) < 1e-12);
    check_input_grads(
        [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{(*rn)(in[0])}; }, {x});
    check_param_grads(
        *rn, [&] { return std::vector<Tensor>{(*rn)(x)}; }, 1e-5, 1e-4);
  }
}

TEST_CASE("SwiGLU is w2(silu(w1 x) * w3 x)", "[layers]") {
  Generator gen(4);
  auto mlp = nn::make<nn::SwiGLU>({.d_model = 4, .hidden = 6}, gen);
  CHECK(names_of(*mlp) == std::vector<std::string>{"w1.weight", "w2.weight", "w3.weight"});
  mlp->to(DType::F64);
  auto p = mlp->state_dict();
  CHECK(p["w1.weight"].shape() == Shape({6, 4}));
  CHECK(p["w2.weight"].shape() == Shape({4, 6}));
  Tensor x = ops::randn(Shape{2, 3, 4}, gen, DType::F64);
  Vec expected = naive_swiglu(values(x), 6, 4, 6, values(p["w1.weight"]), values(p["w2.weight"]),
                              values(p["w3.weight"]));
  CHECK(max_abs_diff(values((*mlp)(x)), expected) < 1e-12);
  check_input_grads(
      [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{(*mlp)(in[0])}; }, {x});
  check_param_grads(*mlp, [&] { return std::vector<Tensor>{(*mlp)(x)}; });
}

TEST_CASE("CoreAttention takes BSHD q/k/v by name or position", "[layers]") {
  Generator gen(5);
  const int64_t B = 2, S = 5, Hq = 4, Hkv = 2, D = 3;
  Tensor q = ops::randn(Shape{B, S, Hq, D}, gen, DType::F64);
  Tensor k = ops::randn(Shape{B, S, Hkv, D}, gen, DType::F64);
  Tensor v = ops::randn(Shape{B, S, Hkv, D}, gen, DType::F64);
  AttentionOptions options;
  options.causal = true;
  auto core = std::make_shared<nn::CoreAttention>(options);
  CHECK(core->parameters().empty());

  Tensor positional = core->call(Args{q, k, v})[0];
  REQUIRE(positional.shape() == Shape({B, S, Hq, D}));
  const Vec expected =
      naive_attention(values(q), values(k), values(v), B, S, S, Hq, Hkv, D, /*causal=*/true);
  CHECK(max_abs_diff(values(positional), expected) < 1e-12);

  Args named;
  named.named = {{"q", q}, {"k", k}, {"v", v}};
  CHECK(max_abs_diff(values(core->call(named)[0]), expected) < 1e-12);

  SECTION("non-causal") {
    core->set_options(AttentionOptions{});
    const Vec full = naive_attention(values(q), values(k), values(v), B, S, S, Hq, Hkv, D, false);
    CHECK(max_abs_diff(values(core->call(Args{q, k, v})[0]), full) < 1e-12);
  }
  SECTION("global offsets of a sharded sequence") {
    // The second half of the queries (positions 3..4 of an 8-long sequence
    // sharded by 3) against all of K/V (positions 0..4).
    Tensor q2 = ops::narrow(q, 1, 3, 2);
    const Vec ref = naive_attention(values(q2), values(k), values(v), B, 2, S, Hq, Hkv, D, true,
                                    /*q_offset=*/3, /*k_offset=*/0);
    AttentionOptions shard = options;
    shard.q_offset = 3;
    core->set_options(shard);
    CHECK(max_abs_diff(values(core->call(Args{q2, k, v})[0]), ref) < 1e-12);
    // Per-call named offsets override the module's options.
    core->set_options(options);
    Args call{q2, k, v};
    call.named["q_offset"] = ops::scalar_tensor(3, DType::I64);
    CHECK(max_abs_diff(values(core->call(call)[0]), ref) < 1e-12);
    // And differ from the unshifted mask (the test can tell them apart).
    CHECK(max_abs_diff(values(core->call(Args{q2, k, v})[0]), ref) > 1e-3);
  }
  SECTION("a pre-hook can substitute named q/k/v") {
    auto handle = core->register_forward_pre_hook([&](Module&, const Args& a) {
      Args replaced;
      replaced.named = {
          {"q", a.positional[0]}, {"k", a.positional[1]}, {"v", ops::mul(a.positional[2], 2.0)}};
      return std::optional<Args>(replaced);
    });
    Vec doubled = expected;
    for (double& e : doubled)
      e *= 2;
    CHECK(max_abs_diff(values(core->call(Args{q, k, v})[0]), doubled) < 1e-12);
    handle.remove();
  }
  SECTION("gradients") {
    check_input_grads(
        [&](const std::vector<Tensor>& in) {
          return std::vector<Tensor>{core->call(Args{in[0], in[1], in[2]})[0]};
        },
        {q, k, v});
  }
  CHECK_THROWS_WITH(core->call(Args{q, k}), Catch::Contains("expected 'v'"));
}

TEST_CASE("SelfAttention: projections, GQA, causal, gradients", "[layers]") {
  Generator gen(6);
  const int64_t B = 2, S = 4, d = 8, Hq = 4, Hkv = 2;
  auto attn = nn::make<nn::SelfAttention>(
      {.d_model = d, .n_heads = Hq, .n_kv_heads = Hkv, .causal = /*causal=*/true}, gen);
  CHECK(names_of(*attn) == std::vector<std::string>{"q_proj.weight", "k_proj.weight",
                                                    "v_proj.weight", "o_proj.weight"});
  auto p = attn->state_dict();
  CHECK(p["k_proj.weight"].shape() == Shape({Hkv * 2, d}));
  bool has_core = false;
  for (auto& [name, m] : attn->named_modules()) {
    if (name == "core") has_core = m->type_name() == "CoreAttention";
  }
  CHECK(has_core);

  attn->to(DType::F64);
  p = attn->state_dict();
  Tensor x = ops::randn(Shape{B, S, d}, gen, DType::F64);
  Tensor y = (*attn)(x);
  REQUIRE(y.shape() == Shape({B, S, d}));
  CHECK(max_abs_diff(values(y), naive_self_attention(values(x), B, S, d, Hq, Hkv, true, p)) <
        1e-12);
  // Causality: changing the last token leaves earlier outputs unchanged.
  Tensor x2 = ops::clone(x);
  ops::copy_(ops::narrow(x2, 1, S - 1, 1), ops::randn(Shape{B, 1, d}, gen, DType::F64));
  Tensor y2 = (*attn)(x2);
  CHECK(ops::equal(ops::narrow(y, 1, 0, S - 1), ops::narrow(y2, 1, 0, S - 1)));
  CHECK_FALSE(ops::equal(ops::narrow(y, 1, S - 1, 1), ops::narrow(y2, 1, S - 1, 1)));

  check_input_grads(
      [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{(*attn)(in[0])}; }, {x});
  check_param_grads(*attn, [&] { return std::vector<Tensor>{(*attn)(x)}; });
}

TEST_CASE("TransformerBlock is pre-norm attention + SwiGLU with residuals", "[layers]") {
  Generator gen(7);
  const int64_t B = 2, S = 3, d = 8;
  nn::TransformerBlockConfig config;
  config.d_model = d;
  config.n_heads = 2;
  config.n_kv_heads = 1;
  config.hidden = 12;
  config.causal = true;
  for (nn::NormKind kind : {nn::NormKind::Layer, nn::NormKind::Rms}) {
    config.norm = kind;
    auto block = std::make_shared<nn::TransformerBlock>(config, gen);
    const auto names = names_of(*block);
    CHECK(contains(names, "attn.q_proj.weight"));
    CHECK(contains(names, "mlp.w2.weight"));
    CHECK(contains(names, "norm1.weight"));
    CHECK(contains(names, "norm2.bias") == (kind == nn::NormKind::Layer));
    block->to(DType::F64);
    // Non-trivial norm weights, so a swapped norm1/norm2 would show.
    std::map<std::string, Tensor> state = block->state_dict();
    for (auto& [name, t] : state) {
      if (name.rfind("norm", 0) == 0) t = ops::randn(t.shape(), gen, DType::F64);
    }
    block->load_state_dict(state);
    auto p = block->state_dict();

    Tensor x = ops::randn(Shape{B, S, d}, gen, DType::F64);
    const int64_t n = B * S;
    auto norm = [&](const Vec& v, const std::string& which) {
      if (kind == nn::NormKind::Layer) {
        return naive_layer_norm(v, n, d, values(p[which + ".weight"]), values(p[which + ".bias"]),
                                1e-5);
      }
      return naive_rms_norm(v, n, d, values(p[which + ".weight"]), 1e-5);
    };
    Vec h = values(x);
    Vec a = naive_self_attention(norm(h, "norm1"), B, S, d, 2, 1, true, p, "attn.");
    for (size_t i = 0; i < h.size(); ++i)
      h[i] += a[i];
    Vec m = naive_swiglu(norm(h, "norm2"), n, d, 12, values(p["mlp.w1.weight"]),
                         values(p["mlp.w2.weight"]), values(p["mlp.w3.weight"]));
    for (size_t i = 0; i < h.size(); ++i)
      h[i] += m[i];
    std::vector<Tensor> out = block->call(Args{x});
    REQUIRE(out.size() == 1);
    CHECK(max_abs_diff(values(out[0]), h) < 1e-12);

    check_input_grads(
        [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{(*block)(in[0])}; }, {x});
    check_param_grads(
        *block, [&] { return std::vector<Tensor>{(*block)(x)}; }, 1e-5, 1e-4);
  }
}

TEST_CASE("MoE dispatch plan permutes tokens to expert-major order", "[layers]") {
  // 5 tokens, top-2 of 4 experts.
  Tensor idx = ops::from_vector<int64_t>({2, 0, 1, 2, 0, 3, 2, 1, 0, 2}, Shape{5, 2});
  nn::MoEDispatchPlan plan = nn::plan_dispatch(idx, 4);
  CHECK(plan.num_tokens == 5);
  CHECK(plan.top_k == 2);
  CHECK(plan.counts == std::vector<int64_t>{3, 2, 4, 1});
  // Assignments a = t*2+j sorted stably by expert: e0 {1, 4, 8}, e1 {2, 7},
  // e2 {0, 3, 6, 9}, e3 {5}.
  CHECK(plan.order.to_vector<int64_t>() == std::vector<int64_t>{1, 4, 8, 2, 7, 0, 3, 6, 9, 5});
  CHECK(plan.token_index.to_vector<int64_t>() ==
        std::vector<int64_t>{0, 2, 4, 1, 3, 0, 1, 3, 4, 2});
  // Every token appears top_k times.
  std::vector<int> seen(5, 0);
  for (int64_t t : plan.token_index.to_vector<int64_t>())
    ++seen[t];
  CHECK(seen == std::vector<int>(5, 2));
  // Rows of expert e are contiguous.
  const auto experts = ops::index_select(ops::reshape(idx, Shape{10}), 0, plan.order);
  CHECK(experts.to_vector<int64_t>() == std::vector<int64_t>{0, 0, 0, 1, 1, 2, 2, 2, 2, 3});
  // The inverse permutation restores assignment order.
  Tensor a = ops::arange(0, 10, 1, DType::I64);
  CHECK(ops::equal(ops::index_select(ops::index_select(a, 0, plan.order), 0, plan.inverse), a));

  // dispatch_tokens / combine_tokens with identity experts and weights (1, 0)
  // give back the tokens.
  Generator gen(8);
  Tensor x = ops::randn(Shape{5, 3}, gen, DType::F64);
  Tensor rows = nn::dispatch_tokens(x, plan);
  const Vec xv = values(x), rv = values(rows);
  const auto ti = plan.token_index.to_vector<int64_t>();
  for (int p = 0; p < 10; ++p) {
    for (int j = 0; j < 3; ++j)
      CHECK(rv[p * 3 + j] == xv[ti[p] * 3 + j]);
  }
  Tensor w =
      ops::from_vector<double>({0.25, 0.75, 0.5, 0.5, 1, 0, 0.1, 0.9, 0.6, 0.4}, Shape{5, 2});
  CHECK(ops::allclose(nn::combine_tokens(rows, w, plan), x, 1e-12, 1e-12));

  CHECK_THROWS_WITH(nn::plan_dispatch(idx, 3),
                    Catch::Contains("expected expert indices in [0, 3)"));
}

TEST_CASE("MoE load-balancing loss equals E * sum f_e P_e", "[layers]") {
  // 4 tokens, 3 experts, top-1.
  const Vec probs = {0.7, 0.2, 0.1, 0.1, 0.8, 0.1, 0.6, 0.3, 0.1, 0.2, 0.2, 0.6};
  Tensor pt = f64_tensor(probs, Shape{4, 3});
  nn::MoEDispatchPlan plan =
      nn::plan_dispatch(ops::from_vector<int64_t>({0, 1, 0, 2}, Shape{4, 1}), 3);
  // f = (2/4, 1/4, 1/4), P = (1.6/4, 1.5/4, 0.9/4).
  const double expected = 3 * (0.5 * 0.4 + 0.25 * 0.375 + 0.25 * 0.225);
  CHECK(nn::load_balancing_loss(pt, plan).item<double>() == Approx(expected).epsilon(1e-12));
  // Uniform routing and probabilities give exactly 1.
  Tensor uniform = ops::full(Shape{3, 3}, 1.0 / 3, DType::F64);
  nn::MoEDispatchPlan even =
      nn::plan_dispatch(ops::from_vector<int64_t>({0, 1, 2}, Shape{3, 1}), 3);
  CHECK(nn::load_balancing_loss(uniform, even).item<double>() == Approx(1.0).epsilon(1e-12));
}

TEST_CASE("MoE forward matches per-token expert mixing; gradients", "[layers]") {
  Generator gen(9);
  const int64_t d = 4, hidden = 6, E = 4, k = 2, B = 2, S = 3, T = B * S;
  auto moe = nn::make<nn::MoE>({.d_model = d, .hidden = hidden, .num_experts = E, .top_k = k}, gen);
  const auto names = names_of(*moe);
  CHECK(names.front() == "router.weight");
  CHECK(contains(names, "experts.0.w1.weight"));
  CHECK(contains(names, "experts.3.w3.weight"));
  CHECK(names.size() == 1 + 3 * E);
  moe->to(DType::F64);
  // A sharper router keeps the top-k choices well separated under the ±eps
  // perturbations of the finite differences.
  auto state = moe->state_dict();
  state["router.weight"] = ops::mul(ops::randn(Shape{E, d}, gen, DType::F64), 3.0);
  moe->load_state_dict(state);
  auto p = moe->state_dict();

  Tensor x = ops::randn(Shape{B, S, d}, gen, DType::F64);
  const Vec xv = values(x);
  const Vec logits = naive_linear(xv, T, d, values(p["router.weight"]), E);
  Vec expected(static_cast<size_t>(T * d), 0.0);
  Vec mean_prob(E, 0.0), fraction(E, 0.0);
  double min_gap = INFINITY;
  for (int64_t t = 0; t < T; ++t) {
    Vec pr(E);
    double mx = *std::max_element(logits.begin() + t * E, logits.begin() + (t + 1) * E), z = 0;
    for (int64_t e = 0; e < E; ++e)
      z += std::exp(logits[t * E + e] - mx);
    for (int64_t e = 0; e < E; ++e)
      pr[e] = std::exp(logits[t * E + e] - mx) / z;
    std::vector<int64_t> rank(E);
    std::iota(rank.begin(), rank.end(), 0);
    std::sort(rank.begin(), rank.end(), [&](int64_t a, int64_t b) { return pr[a] > pr[b]; });
    // Routing is stable when the k-th and (k+1)-th logits are far apart
    // next to the ±1e-6 perturbations.
    min_gap = std::min(min_gap, logits[t * E + rank[k - 1]] - logits[t * E + rank[k]]);
    double wsum = 0;
    for (int64_t j = 0; j < k; ++j)
      wsum += pr[rank[j]];
    Vec tok(xv.begin() + t * d, xv.begin() + (t + 1) * d);
    for (int64_t j = 0; j < k; ++j) {
      const std::string pre = "experts." + std::to_string(rank[j]) + ".";
      Vec y = naive_swiglu(tok, 1, d, hidden, values(p[pre + "w1.weight"]),
                           values(p[pre + "w2.weight"]), values(p[pre + "w3.weight"]));
      for (int64_t c = 0; c < d; ++c)
        expected[t * d + c] += pr[rank[j]] / wsum * y[c];
      fraction[rank[j]] += 1.0 / (T * k);
    }
    for (int64_t e = 0; e < E; ++e)
      mean_prob[e] += pr[e] / T;
  }
  REQUIRE(min_gap > 1e-2);
  double aux = 0;
  for (int64_t e = 0; e < E; ++e)
    aux += E * fraction[e] * mean_prob[e];

  std::vector<Tensor> out = moe->call(Args{x});
  REQUIRE(out.size() == 2);
  REQUIRE(out[0].shape() == x.shape());
  CHECK(max_abs_diff(values(out[0]), expected) < 1e-12);
  CHECK(out[1].item<double>() == Approx(aux).epsilon(1e-12));

  // Output and aux loss together; unchosen experts get zero (or no) gradient.
  check_input_grads([&](const std::vector<Tensor>& in) { return moe->call(Args{in[0]}); }, {x});
  check_param_grads(*moe, [&] { return moe->call(Args{x}); });
}

TEST_CASE("TransformerBlock with MoE returns the aux loss", "[layers]") {
  Generator gen(10);
  nn::TransformerBlockConfig config;
  config.d_model = 8;
  config.n_heads = 2;
  config.hidden = 8;
  config.experts = 3;
  config.top_k = 1;
  auto block = std::make_shared<nn::TransformerBlock>(config, gen);
  CHECK(block->mlp() == nullptr);
  REQUIRE(block->moe() != nullptr);
  CHECK(contains(names_of(*block), "moe.experts.2.w2.weight"));
  std::vector<Tensor> out = block->call(Args{ops::randn(Shape{2, 5, 8}, gen)});
  REQUIRE(out.size() == 2);
  CHECK(out[0].shape() == Shape({2, 5, 8}));
  CHECK(out[1].dim() == 0);
  // With top-1 routing E * sum f_e P_e lies in (0, E].
  CHECK(out[1].item<float>() > 0.0f);
  CHECK(out[1].item<float>() <= 3.0f);
}

TEST_CASE("TransformerLM shapes, names, causality and state dict round trip", "[layers]") {
  nn::TransformerLMConfig config;
  config.vocab = 11;
  config.d_model = 8;
  config.layers = 2;
  config.heads = 2;
  config.kv_heads = 1;
  config.hidden = 16;
  config.max_seq = 6;
  Generator g1(11), g2(12);
  auto a = std::make_shared<nn::TransformerLM>(config, g1);
  auto b = std::make_shared<nn::TransformerLM>(config, g2);
  const auto names = names_of(*a);
  CHECK(names.front() == "tok_emb.weight");
  CHECK(contains(names, "pos_emb.weight"));
  CHECK(contains(names, "blocks.1.attn.o_proj.weight"));
  CHECK(contains(names, "norm_f.weight"));
  CHECK(names.back() == "lm_head.weight");
  bool found_core = false;
  for (auto& [name, m] : a->named_modules()) {
    found_core |= name == "blocks.0.attn.core" && m->type_name() == "CoreAttention";
  }
  CHECK(found_core);

  Tensor tokens = ops::from_vector<int64_t>({1, 2, 3, 4, 5, 6, 0, 10, 9, 8}, Shape{2, 5});
  Tensor la = (*a)(tokens);
  REQUIRE(la.shape() == Shape({2, 5, 11}));
  CHECK_FALSE(ops::equal(la, (*b)(tokens)));
  // Changing the last token leaves the logits of earlier positions alone.
  Tensor t2 = ops::clone(tokens);
  ops::fill_(ops::narrow(t2, 1, 4, 1), 7);
  CHECK(ops::equal(ops::narrow(la, 1, 0, 4), ops::narrow((*a)(t2), 1, 0, 4)));

  b->load_state_dict(a->state_dict());
  CHECK(ops::equal(la, (*b)(tokens)));

  auto bad = a->state_dict();
  bad["blocks.0.mlp.w1.weight"] = ops::zeros(Shape{3, 3});
  CHECK_THROWS_WITH(b->load_state_dict(bad),
                    Catch::Contains("expected 'blocks.0.mlp.w1.weight' of shape"));
  auto missing = a->state_dict();
  missing.erase("lm_head.weight");
  CHECK_THROWS_WITH(b->load_state_dict(missing), Catch::Contains("lm_head.weight"));
  CHECK_THROWS_WITH((*a)(ops::zeros(Shape{1, 7}, DType::I64)), Catch::Contains("S <= 6"));

  // Same seed, same model.
  Generator g3(11);
  auto c = std::make_shared<nn::TransformerLM>(config, g3);
  CHECK(ops::equal(la, (*c)(tokens)));

  // With experts, the second output is the summed aux loss of both layers.
  config.experts = 2;
  config.top_k = 1;
  Generator g4(13);
  auto moe_lm = std::make_shared<nn::TransformerLM>(config, g4);
  std::vector<Tensor> out = moe_lm->call(Args{tokens});
  REQUIRE(out.size() == 2);
  CHECK(std::isfinite(out[1].item<float>()));
  CHECK(out[1].item<float>() > 0.0f);
  // The aux loss reaches the routers (and only through the probabilities).
  backward(out[1]);
  CHECK(grad(moe_lm->block(0)->moe()->router()->weight()).defined());
  CHECK(grad(moe_lm->block(1)->moe()->router()->weight()).defined());
  CHECK_FALSE(grad(moe_lm->block(1)->moe()->expert(0)->w2()->weight()).defined());
}
