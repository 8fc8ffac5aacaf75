// Optimizers, clipping and the schedule (autograd/optim.h) against updates
// computed by hand in double from the published formulas.
#include <catch2/catch.hpp>
#include <cmath>

#include "tandem/autograd/mixed_precision.h"
#include "tandem/autograd/nn/linear.h"
#include "tandem/autograd/ops.h"
#include "tandem/autograd/optim.h"

using namespace tandem;
using Vec = std::vector<double>;

namespace {

Vec values(const Tensor& t) {
  return ops::contiguous(ops::to(detach(t), DType::F64)).to_vector<double>();
}

Tensor leaf(const Vec& v, DType dtype = DType::F64) {
  Tensor t = ops::to(ops::from_vector(v, Shape{static_cast<int64_t>(v.size())}), dtype);
  set_requires_grad(t, true);
  return t;
}

void give_grad(const Tensor& p, const Vec& g) {
  set_grad(p, ops::to(ops::from_vector(g, Shape{static_cast<int64_t>(g.size())}), p.dtype()));
}

void check_close(const Vec& actual, const Vec& expected, double tol) {
  REQUIRE(actual.size() == expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    INFO("element " << i);
    CHECK(actual[i] == Approx(expected[i]).margin(tol).epsilon(tol));
  }
}

// One AdamW step on one element, from the paper's algorithm.
struct AdamRef {
  double p, m = 0, v = 0;
  int t = 0;
  void step(double g, double lr, double b1, double b2, double eps, double wd) {
    ++t;
    p -= lr * wd * p;
    m = b1 * m + (1 - b1) * g;
    v = b2 * v + (1 - b2) * g * g;
    const double mhat = m / (1 - std::pow(b1, t)), vhat = v / (1 - std::pow(b2, t));
    p -= lr * mhat / (std::sqrt(vhat) + eps);
  }
};

}  // namespace

TEST_CASE("SGD: plain, weight decay, momentum", "[optim]") {
  SECTION("plain step") {
    Tensor p = leaf({1.0, 2.0, -1.0});
    optim::SGD sgd({p}, {.lr = 0.1});
    give_grad(p, {0.5, -1.0, 2.0});
    sgd.step();
    check_close(values(p), {0.95, 2.1, -1.2}, 1e-15);
  }
  SECTION("coupled L2 weight decay") {
    Tensor p = leaf({1.0, -2.0});
    optim::SGD sgd({p}, {.lr = 0.1, .momentum = 0.0, .weight_decay = 0.5});
    give_grad(p, {1.0, 1.0});
    sgd.step();
    // d = g + 0.5 p = (1.5, 0); p -= 0.1 d.
    check_close(values(p), {0.85, -2.0}, 1e-15);
  }
  SECTION("momentum over three steps") {
    Tensor p = leaf({1.0, 0.0});
    optim::SGD sgd({p}, {.lr = 0.1, .momentum = 0.9});
    const Vec g1 = {1.0, -2.0}, g2 = {0.5, 0.5}, g3 = {-1.0, 0.0};
    Vec ref = {1.0, 0.0}, buf = {0.0, 0.0};
    for (const Vec& g : {g1, g2, g3}) {
      give_grad(p, g);
      sgd.step();
      for (int i = 0; i < 2; ++i) {
        buf[i] = 0.9 * buf[i] + g[i];
        ref[i] -= 0.1 * buf[i];
      }
      check_close(values(p), ref, 1e-14);
    }
    // Hand values of the first two steps: 1 - 0.1 = 0.9, then buf = 1.4,
    // p = 0.9 - 0.14 = 0.76.
    CHECK(ref[0] == Approx(0.76 - 0.1 * (0.9 * 1.4 - 1.0)));
  }
  SECTION("f32 parameters stay f32 and alias the module's member") {
    Generator gen(1);
    auto lin = nn::make<nn::Linear>({.in_features = 3, .out_features = 2}, gen);
    const Vec before = values(lin->weight());
    optim::SGD sgd(lin->named_parameters(), {.lr = 1.0});
    backward(sum((*lin)(ops::ones(Shape{1, 3}))));  // dW = 1 everywhere
    sgd.step();
    CHECK(lin->weight().dtype() == DType::F32);
    Vec expected = before;
    for (double& e : expected)
      e -= 1.0;
    check_close(values(lin->weight()), expected, 1e-6);
    sgd.zero_grad();
    CHECK_FALSE(grad(lin->weight()).defined());
  }
}

TEST_CASE("AdamW matches the algorithm; weight decay is decoupled", "[optim]") {
  const double lr = 0.01, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.1;
  Tensor p = leaf({0.5, -1.5, 2.0});
  optim::AdamW adam({p}, {.lr = lr, .beta1 = b1, .beta2 = b2, .eps = eps, .weight_decay = wd});
  std::vector<AdamRef> ref = {{0.5}, {-1.5}, {2.0}};
  const std::vector<Vec> grads = {{0.1, -0.2, 3.0}, {-0.3, -0.2, 1.0}, {0.0, 0.4, -2.0}};
  for (const Vec& g : grads) {
    give_grad(p, g);
    adam.step();
    Vec expected;
    for (size_t i = 0; i < ref.size(); ++i) {
      ref[i].step(g[i], lr, b1, b2, eps, wd);
      expected.push_back(ref[i].p);
    }
    check_close(values(p), expected, 1e-13);
  }
  // First step by hand: mhat = g, vhat = g^2, so p1 = p0 (1 - lr wd) - lr sign(g).
  Tensor q = leaf({2.0});
  optim::AdamW one({q}, {.lr = 0.1, .beta1 = 0.9, .beta2 = 0.999, .eps = 0.0, .weight_decay = 0.5});
  give_grad(q, {-4.0});
  one.step();
  CHECK(values(q)[0] == Approx(2.0 * (1 - 0.05) + 0.1).epsilon(1e-14));

  // Decoupled: with a zero gradient the moments stay 0 and the parameter
  // only shrinks by (1 - lr wd). (Adam with L2 would move it by ~lr.)
  Tensor r = leaf({3.0, -1.0});
  optim::AdamW decay({r},
                     {.lr = 0.1, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.2});
  give_grad(r, {0.0, 0.0});
  decay.step();
  check_close(values(r), {3.0 * 0.98, -1.0 * 0.98}, 1e-15);
  auto state = decay.state_dict();
  CHECK(values(state.at("0.exp_avg")) == Vec{0.0, 0.0});
  CHECK(state.at("0.step").item<int64_t>() == 1);
}

TEST_CASE("optimizers skip parameters without gradients; set_lr applies", "[optim]") {
  Tensor a = leaf({1.0}), b = leaf({1.0});
  optim::AdamW adam({a, b},
                    {.lr = 0.1, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.0});
  give_grad(a, {1.0});
  adam.step();
  CHECK(values(a)[0] == Approx(0.9));
  CHECK(values(b)[0] == 1.0);
  auto state = adam.state_dict();
  CHECK(state.at("0.step").item<int64_t>() == 1);
  CHECK(state.at("1.step").item<int64_t>() == 0);

  Tensor c = leaf({1.0});
  optim::SGD sgd({c}, {.lr = 0.1});
  sgd.set_lr(0.5);
  CHECK(sgd.lr() == 0.5);
  give_grad(c, {1.0});
  sgd.step();
  CHECK(values(c)[0] == 0.5);
  CHECK_THROWS_WITH(sgd.set_lr(-1), Catch::Contains("[optim::SGD] expected lr >= 0"));
  CHECK_THROWS_WITH(optim::SGD(optim::NamedParams{{"w", c}, {"w", a}}, {.lr = 0.1}),
                    Catch::Contains("expected unique parameter names"));
}

TEST_CASE("clip_grad_norm uses the global L2 norm", "[optim]") {
  Tensor a = leaf({0.0, 0.0}), b = leaf({0.0}), c = leaf({0.0});
  give_grad(a, {3.0, 4.0});
  give_grad(b, {12.0});
  // c has no gradient and is ignored.
  const double norm = optim::clip_grad_norm({a, b, c}, 6.5);
  CHECK(norm == Approx(13.0).epsilon(1e-15));
  const double coef = 6.5 / (13.0 + 1e-6);
  check_close(values(grad(a)), {3.0 * coef, 4.0 * coef}, 1e-15);
  check_close(values(grad(b)), {12.0 * coef}, 1e-15);
  CHECK_FALSE(grad(c).defined());
  // Below the limit: the norm is reported and nothing changes.
  CHECK(optim::clip_grad_norm({a, b}, 100.0) == Approx(6.5).epsilon(1e-6));
  check_close(values(grad(b)), {12.0 * coef}, 1e-15);
}

TEST_CASE("CosineSchedule: linear warm-up, cosine decay, floor", "[optim]") {
  optim::CosineSchedule s({.base_lr = 1.0, .warmup_steps = 10, .total_steps = 110, .min_lr = 0.1});
  CHECK(s.lr(0) == Approx(0.1));
  CHECK(s.lr(4) == Approx(0.5));
  CHECK(s.lr(9) == Approx(1.0));
  CHECK(s.lr(10) == Approx(1.0));
  CHECK(s.lr(60) == Approx(0.55));  // half-way: min + (max - min) / 2
  CHECK(s.lr(35) == Approx(0.1 + 0.9 * 0.5 * (1 + std::sqrt(0.5))));
  CHECK(s.lr(109) < 0.1 + 1e-3);
  CHECK(s.lr(109) > 0.1);
  CHECK(s.lr(110) == Approx(0.1));
  CHECK(s.lr(1000) == Approx(0.1));
  optim::CosineSchedule no_warmup({.base_lr = 2.0, .warmup_steps = 0, .total_steps = 4});
  CHECK(no_warmup.lr(0) == Approx(2.0));
  CHECK(no_warmup.lr(2) == Approx(1.0));
  CHECK_THROWS_WITH(optim::CosineSchedule({.base_lr = 1.0, .warmup_steps = 5, .total_steps = 4}),
                    Catch::Contains("warmup_steps <= total"));
}

TEST_CASE("optimizer state_dict round trip resumes bit-identically", "[optim]") {
  const std::vector<Vec> grads = {
      {0.1, -0.2, 0.3}, {0.5, 0.1, -0.4}, {-0.2, 0.3, 0.2}, {0.05, -0.5, 0.1}};
  auto run = [&](optim::Optimizer& opt, const Tensor& p, size_t from, size_t to) {
    for (size_t s = from; s < to; ++s) {
      give_grad(p, grads[s]);
      opt.step();
    }
  };
  SECTION("AdamW") {
    Tensor p = leaf({1.0, 2.0, 3.0}, DType::F32);
    optim::AdamW a({p}, {.lr = 0.05});
    run(a, p, 0, 2);
    auto saved_state = a.state_dict();
    Tensor saved_p = ops::clone(p);
    run(a, p, 2, 4);

    Tensor q = leaf({0.0, 0.0, 0.0}, DType::F32);
    ops::copy_(q, saved_p);
    optim::AdamW b({q}, {.lr = 0.5});  // a different lr, restored from the state
    b.load_state_dict(saved_state);
    CHECK(b.lr() == 0.05);
    run(b, q, 2, 4);
    CHECK(ops::equal(p, q));
    // The saved dict is a snapshot: later steps did not change it.
    CHECK(saved_state.at("0.step").item<int64_t>() == 2);
  }
  SECTION("SGD with momentum") {
    Tensor p = leaf({1.0, 2.0, 3.0}, DType::F32);
    optim::SGD a({p}, {.lr = 0.1, .momentum = 0.9});
    run(a, p, 0, 2);
    auto saved_state = a.state_dict();
    REQUIRE(saved_state.count("0.momentum_buffer") == 1);
    Tensor saved_p = ops::clone(p);
    run(a, p, 2, 4);
    Tensor q = leaf({0.0, 0.0, 0.0}, DType::F32);
    ops::copy_(q, saved_p);
    optim::SGD b({q}, {.lr = 0.1, .momentum = 0.9});
    b.load_state_dict(saved_state);
    run(b, q, 2, 4);
    CHECK(ops::equal(p, q));
    // Without the momentum state the continuation differs.
    Tensor r = leaf({0.0, 0.0, 0.0}, DType::F32);
    ops::copy_(r, saved_p);
    optim::SGD c({r}, {.lr = 0.1, .momentum = 0.9});
    run(c, r, 2, 4);
    CHECK_FALSE(ops::equal(p, r));
  }
  SECTION("mismatched state is rejected") {
    Tensor p = leaf({1.0, 2.0, 3.0});
    optim::AdamW a({p}, {.lr = 0.05});
    auto state = a.state_dict();
    state["0.exp_avg"] = ops::zeros(Shape{2}, DType::F64);
    CHECK_THROWS_WITH(a.load_state_dict(state), Catch::Contains("expected '0.exp_avg' of shape"));
    state = a.state_dict();
    state.erase("0.exp_avg_sq");
    CHECK_THROWS_WITH(a.load_state_dict(state), Catch::Contains("expected key '0.exp_avg_sq'"));
    state = a.state_dict();
    state["1.step"] = ops::scalar_tensor(0, DType::I64);
    CHECK_THROWS_WITH(a.load_state_dict(state), Catch::Contains("got '1.step'"));
  }
}

TEST_CASE("master weights: f32 copies of bf16 parameters, updated and rounded back",
          "[optim][bf16]") {
  Generator gen(21);
  Tensor p = ops::to(ops::randn({5, 3}, gen), DType::BF16);
  set_requires_grad(p);
  Tensor f = ops::randn({4}, gen);  // an f32 parameter gets a copy of its own
  set_requires_grad(f);
  MasterWeights master({{"p", p}, {"f", f}});
  REQUIRE(master.params().size() == 2);
  const Tensor& mp = master.params()[0].second;
  CHECK(mp.dtype() == DType::F32);
  CHECK(ops::equal(ops::to(mp, DType::BF16), p));  // widening is exact
  CHECK_FALSE(master.params()[1].second.is_alias_of(f));
  set_grad(p, ops::to(ops::full({5, 3}, 0.5), DType::BF16));
  master.grads_to_master();
  CHECK_FALSE(grad(p).defined());
  CHECK(ops::equal(grad(mp), ops::full({5, 3}, 0.5)));
  CHECK_FALSE(grad(master.params()[1].second).defined());  // f had no gradient
  // An update below bf16's resolution stays in the master, not in the model.
  {
    NoGradGuard no_grad;
    ops::copy_(mp, ops::add(mp, 1e-4));
  }
  master.master_to_model();
  CHECK(ops::equal(p, ops::to(mp, DType::BF16)));
  CHECK_FALSE(ops::equal(ops::to(p, DType::F32), mp));
}

// Note [Dynamic loss scaling]: the gradients of a small f16 loss underflow
// unscaled; scaled by a power of two they survive, and unscaling them in f32
// is exact. An overflow halves the scale and skips; growth_interval good
// steps double it.
TEST_CASE("LossScaler keeps f16 gradients from underflowing and backs off on overflow",
          "[optim][f16]") {
  Tensor p = ops::to(ops::full({4}, 1.0), DType::F16);
  set_requires_grad(p);
  // d/dp of 1e-8 * sum(p) is 1e-8: below f16's smallest subnormal (6e-8).
  auto loss = [&] { return to(mul(sum(p), 1e-8), DType::F32); };
  backward(loss());
  CHECK(ops::equal(grad(p), ops::zeros_like(p)));  // lost
  zero_grad(p);

  // (The scale meets f16 at the cast: 2^16 would overflow it there.)
  LossScaler scaler({.init_scale = 32768.0, .growth_interval = 3});
  backward(scaler.scale(loss()));
  MasterWeights master({{"p", p}});
  master.grads_to_master();
  scaler.unscale(master.tensors());
  const Tensor g = grad(master.tensors()[0]);
  // f16(1e-8 * 32768) / 32768: the f16 rounding of the scaled value, exactly.
  const double want = static_cast<float>(Half(static_cast<float>(1e-8 * 32768))) / 32768.0;
  INFO("got " << g.to_vector<float>()[0] << ", want " << want);
  CHECK(ops::equal(g, ops::full({4}, want)));
  CHECK(want == Approx(1e-8).epsilon(1e-3));

  CHECK_FALSE(scaler.update(true));  // an overflow: skip, halve
  CHECK(scaler.scale() == 16384.0);
  CHECK(scaler.skipped() == 1);
  CHECK(scaler.update(false));
  CHECK(scaler.update(false));
  CHECK(scaler.scale() == 16384.0);
  CHECK(scaler.update(false));  // the third good step in a row: doubled
  CHECK(scaler.scale() == 32768.0);
  CHECK(scaler.state().good_steps == 0);
  scaler.update(false);
  LossScaler resumed;
  resumed.load_state(scaler.state());
  CHECK(resumed.scale() == 32768.0);
  CHECK(resumed.state().good_steps == 1);

  CHECK_THROWS_WITH(LossScaler({.init_scale = 0}), Catch::Contains("init_scale"));
  CHECK_THROWS_WITH(LossScaler({.backoff_factor = 1.0}), Catch::Contains("backoff_factor"));
  CHECK_THROWS_WITH(resumed.load_state({-1.0, 0}), Catch::Contains("finite positive scale"));
}
