// Numerics that a comparison with PyTorch turned up: pow's gradients where
// the formulas give 0 * inf, exact (erf) GELU, cross_entropy's reduction and
// label_smoothing, and dropout (its mask, its gradient, its replay under
// checkpoint and the nn::Dropout module). Gradients by finite differences in
// f64, values against formulas written out here.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "tandem/autograd/checkpoint.h"
#include "tandem/autograd/nn/dropout.h"
#include "tandem/autograd/ops.h"
#include "tests/support/autograd_util.h"
#include "tests/support/test_util.h"

using namespace tandem;
using namespace tandem::test;
using Catch::Matchers::Contains;

namespace {

using V = std::vector<Tensor>;
constexpr DType F64 = DType::F64;

Tensor f64(const std::vector<double>& v, const Shape& shape, bool grad = false) {
  Tensor t = tensor_of(v, shape, F64);
  if (grad) set_requires_grad(t, true);
  return t;
}

}  // namespace

// ---------------------------------------------------------------- pow

TEST_CASE("pow's gradients are finite where the base is 0, as in PyTorch", "[numerics]") {
  // a = 0 with b >= 0: d/db = a^b log a is 0 * -inf or 1 * -inf; PyTorch gives 0.
  // b = 0: d/da = b a^(b-1) is 0 * inf at a = 0; PyTorch gives 0.
  Tensor a = f64({0, 0, 0, 1, 2, 2}, {6}, true);
  Tensor b = f64({0, 2, 3, 1.5, 0, -1}, {6}, true);
  backward(sum(pow(a, b)));
  const std::vector<double> ga = values_of(grad(a)), gb = values_of(grad(b));
  const std::vector<double> expect_ga = {0, 0, 0, 1.5, 0, -1.0 / 4};
  const std::vector<double> expect_gb = {0, 0, 0, 0, std::log(2.0), 0.5 * std::log(2.0)};
  TANDEM_CHECK_CLOSE(ga, expect_ga, 1e-15, 1e-15);
  TANDEM_CHECK_CLOSE(gb, expect_gb, 1e-15, 1e-15);
}

TEST_CASE("x ** p with a learnable p after a relu has a finite gradient", "[numerics]") {
  Tensor x = f64({-1.0, 0.0, 0.5, 2.0}, {4});
  Tensor p = f64({1.5}, {1}, true);
  backward(sum(pow(relu(x), p)));
  // Only the positive inputs contribute: sum of r^p log r.
  const double expect = std::pow(0.5, 1.5) * std::log(0.5) + std::pow(2.0, 1.5) * std::log(2.0);
  CHECK(grad(p).item_double() == Approx(expect).epsilon(1e-14));
  // A scalar exponent of 0: constant 1, gradient 0 even at x = 0.
  Tensor y = f64({0.0, 3.0}, {2}, true);
  backward(sum(pow(y, 0.0)));
  CHECK(values_of(grad(y)) == std::vector<double>{0.0, 0.0});
  // Away from 0 the masks change nothing: gradcheck both operands.
  check_gradients(
      "pow away from 0", [](const V& t) { return V{pow(t[0], t[1])}; },
      {random_tensor({3, 4}, F64, 31, 0.5, 2.0), random_tensor({4}, F64, 32, -1.5, 1.5)});
}

// ---------------------------------------------------------------- gelu, erf

TEST_CASE("exact gelu and erf: values, derivative and gradcheck", "[numerics][gradcheck]") {
  const std::vector<double> xs = {-4.0, -1.5, -0.3, 0.0, 0.7, 2.5};
  Tensor x = f64(xs, {6}, true);
  Tensor y = gelu(x, GeluApproximate::None);
  backward(sum(y));
  const std::vector<double> got = values_of(y), dx = values_of(grad(x));
  for (size_t i = 0; i < xs.size(); ++i) {
    const double v = xs[i];
    const double cdf = 0.5 * (1.0 + std::erf(v / std::sqrt(2.0)));
    const double pdf = std::exp(-0.5 * v * v) / std::sqrt(2.0 * M_PI);
    CHECK(got[i] == Approx(v * cdf).margin(1e-15).epsilon(1e-14));
    CHECK(dx[i] == Approx(cdf + v * pdf).margin(1e-15).epsilon(1e-14));
  }
  // The two forms differ (by about 1e-4 at x = 2), so the option is honoured.
  const double exact = ops::gelu(f64({2.0}, {1}), GeluApproximate::None).item_double();
  const double approx = ops::gelu(f64({2.0}, {1}), GeluApproximate::Tanh).item_double();
  CHECK(std::abs(exact - approx) > 5e-5);
  CHECK(ops::gelu(f64({2.0}, {1})).item_double() == approx);  // the default is tanh
  check_gradients("gelu exact", [](const V& t) { return V{gelu(t[0], GeluApproximate::None)}; },
                  {random_tensor({3, 5}, F64, 33, -3, 3)});
  check_gradients("gelu tanh", [](const V& t) { return V{gelu(t[0], GeluApproximate::Tanh)}; },
                  {random_tensor({3, 5}, F64, 34, -3, 3)});
  check_gradients("erf", [](const V& t) { return V{tandem::erf(t[0])}; },
                  {random_tensor({3, 5}, F64, 35, -2, 2)});
}

// ---------------------------------------------------------------- cross_entropy

namespace {

// PyTorch's cross_entropy written out: per row (1 - e) * nll + e * mean_c(-logp),
// 0 for ignored rows; mean divides by the kept rows (0 when there are none).
std::vector<double> ce_rows(const std::vector<double>& x, const std::vector<int64_t>& t, int64_t C,
                            int64_t ignore, double e) {
  std::vector<double> out;
  for (size_t i = 0; i < t.size(); ++i) {
    if (t[i] == ignore) {
      out.push_back(0.0);
      continue;
    }
    double m = -INFINITY, z = 0, sum_logp = 0;
    for (int64_t c = 0; c < C; ++c)
      m = std::max(m, x[i * C + c]);
    for (int64_t c = 0; c < C; ++c)
      z += std::exp(x[i * C + c] - m);
    for (int64_t c = 0; c < C; ++c)
      sum_logp += x[i * C + c] - m - std::log(z);
    const double nll = -(x[i * C + t[i]] - m - std::log(z));
    out.push_back((1 - e) * nll + e * (-sum_logp / C));
  }
  return out;
}

}  // namespace

TEST_CASE("cross_entropy reduction and label_smoothing match PyTorch's formulas",
          "[numerics][gradcheck]") {
  constexpr int64_t N = 5, C = 4;
  const std::vector<int64_t> targets = {1, -100, 3, 0, 3};
  const Tensor t = long_tensor(targets, {N});
  const Tensor logits = random_tensor({N, C}, F64, 40, -2, 2);
  const std::vector<double> xv = values_of(logits);
  for (double e : {0.0, 0.1, 1.0}) {
    const std::vector<double> rows = ce_rows(xv, targets, C, -100, e);
    double total = 0;
    for (double r : rows)
      total += r;
    for (Reduction red : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
      CrossEntropyOptions o;
      o.reduction = red;
      o.label_smoothing = e;
      INFO("label_smoothing " << e << ", reduction " << static_cast<int>(red));
      // Both layers: the tensor op and the differentiable one.
      for (const Tensor& loss : {ops::cross_entropy(logits, t, o), cross_entropy(logits, t, o)}) {
        if (red == Reduction::None) {
          REQUIRE(loss.shape() == Shape{N});
          TANDEM_CHECK_CLOSE(values_of(loss), rows, 1e-13, 1e-14);
        } else {
          REQUIRE(loss.dim() == 0);
          const double expect = red == Reduction::Sum ? total : total / 4;  // 4 kept rows
          CHECK(loss.item_double() == Approx(expect).epsilon(1e-13));
        }
      }
      check_gradients("cross_entropy", [o](const V& x) { return V{cross_entropy(x[0], x[1], o)}; },
                      {logits, t}, {}, {1});
    }
  }
}

TEST_CASE("cross_entropy with every target ignored is 0 with zero gradients", "[numerics]") {
  // PyTorch returns NaN for the mean here; tandem returns 0 on purpose
  // (tensor/ops.h), with finite gradients, also with label smoothing.
  Tensor x = leaf({3, 4}, 41);
  const Tensor t = long_tensor({7, 7, 7}, {3});
  CrossEntropyOptions o;
  o.ignore_index = 7;
  o.label_smoothing = 0.2;
  Tensor loss = cross_entropy(x, t, o);
  CHECK(loss.item_double() == 0.0);
  backward(loss);
  CHECK(values_of(grad(x)) == std::vector<double>(12, 0.0));
  CHECK(ops::cross_entropy(x, t, o).item_double() == 0.0);
  o.label_smoothing = -0.1;
  CHECK_THROWS_WITH(cross_entropy(x, t, o),
                    Contains("[nn::cross_entropy] expected label_smoothing in [0, 1], got -0.1"));
  CHECK_THROWS_WITH(ops::cross_entropy(x, t, o),
                    Contains("[tensor::cross_entropy] expected label_smoothing in [0, 1]"));
}

// ---------------------------------------------------------------- dropout

TEST_CASE("dropout's gradient applies its forward's mask and scale", "[numerics][gradcheck]") {
  Tensor x = leaf({400}, 50, DType::F32, 0.5, 1.5);
  Generator gen(3);
  Tensor y = dropout(x, 0.25, true, gen);
  CHECK(gen.offset() == 400);
  backward(sum(y));
  const std::vector<double> yv = values_of(y), xv = values_of(x), g = values_of(grad(x));
  const double scale = static_cast<float>(1.0 / 0.75);
  int64_t kept = 0;
  for (size_t i = 0; i < yv.size(); ++i) {
    const bool keep = yv[i] != 0.0;  // x is never 0
    kept += keep ? 1 : 0;
    CHECK(g[i] == (keep ? scale : 0.0));
    if (keep) CHECK(yv[i] == static_cast<float>(static_cast<float>(xv[i]) * scale));
  }
  CHECK(kept > 0);
  CHECK(kept < 400);
  // gradcheck: a fresh generator per call, so every evaluation has one mask.
  check_gradients("dropout p=0.4",
                  [](const V& t) {
                    Generator g(11);
                    return V{dropout(t[0], 0.4, true, g)};
                  },
                  {random_tensor({4, 6}, F64, 51)});
  // eval mode and p = 0 are the identity (the tensor itself); p = 1 drops all.
  Generator other(4);
  CHECK(dropout(x, 0.5, false, other).raw_data() == x.raw_data());
  CHECK(other.offset() == 0);  // eval draws nothing
  CHECK(dropout(x, 0.0, true, other).raw_data() == x.raw_data());
  Tensor z = leaf({5}, 52);
  Tensor dropped = dropout(z, 1.0, true, other);
  backward(sum(dropped));
  CHECK(values_of(dropped) == std::vector<double>(5, 0.0));
  CHECK(values_of(grad(z)) == std::vector<double>(5, 0.0));
}

namespace {

// A small block with dropout inside: relu(x w) dropped, times x w again.
Tensor block(const Tensor& x, const Tensor& w, Generator& gen) {
  Tensor h = matmul(x, w);
  return dropout(relu(h), 0.5, true, gen) * h;
}

}  // namespace

TEST_CASE("a checkpointed block re-runs dropout with its forward's mask",
          "[numerics][checkpoint]") {
  // Note [Random draws under checkpoint]: with the replay, a checkpointed
  // block's gradients equal the plain block's bit for bit and the generator
  // advances once; without it the re-run would draw a second mask.
  Tensor x = random_tensor({6, 8}, DType::F32, 60);
  Tensor w_plain = leaf({8, 8}, 61, DType::F32);
  Tensor w_ckpt = ops::clone(w_plain);
  set_requires_grad(w_ckpt, true);
  Generator g_plain(9), g_ckpt(9);
  backward(sum(block(block(x, w_plain, g_plain), w_plain, g_plain)));
  Tensor out = checkpoint(
      [&](const V& in) {
        // A checkpoint nested in another: replays from the outer log.
        Tensor inner =
            checkpoint([&](const V& i) { return V{block(i[0], w_ckpt, g_ckpt)}; }, {in[0]})[0];
        return V{block(inner, w_ckpt, g_ckpt)};
      },
      {x})[0];
  CHECK(g_ckpt.offset() == g_plain.offset());
  backward(sum(out));
  CHECK(g_ckpt.offset() == g_plain.offset());  // the re-runs drew nothing new
  CHECK(ops::equal(grad(w_ckpt), grad(w_plain)));
}

TEST_CASE("a checkpoint whose re-run draws differently is an error", "[numerics][checkpoint]") {
  Tensor x = leaf({4}, 62);
  Generator gen(1);
  int calls = 0;
  Tensor out = checkpoint(
      [&](const V& in) {
        ++calls;
        // The re-run draws one more time than the forward did.
        Tensor y = dropout(in[0], 0.5, true, gen);
        if (calls > 1) y = dropout(y, 0.5, true, gen);
        return V{y};
      },
      {x})[0];
  CHECK_THROWS_WITH(backward(sum(out)), Contains("[autograd::checkpoint]") &&
                                            Contains("the forward's 1 random draw(s), got more"));
}

TEST_CASE("nn::Dropout drops in training, passes through in eval, and owns its stream",
          "[numerics][module]") {
  Generator init(123);
  auto a = nn::make<nn::Dropout>({.p = 0.5}, init);
  auto b = nn::make<nn::Dropout>({.p = 0.5}, init);
  CHECK(a->seed() != b->seed());  // two layers never share a mask
  CHECK(a->parameters().empty());
  Tensor x = ops::ones({1000});
  Tensor y1 = (*a)(x);
  Tensor y2 = (*a)(x);
  CHECK(a->offset() == 2000);
  CHECK_FALSE(ops::equal(y1, y2));  // each call draws new counters
  const std::vector<double> v = values_of(y1);
  for (double e : v)
    CHECK((e == 0.0 || e == 2.0));
  a->eval();
  CHECK(ops::equal((*a)(x), x));
  CHECK(a->offset() == 2000);
  // The same construction seed gives the same masks.
  Generator init2(123);
  auto c = nn::make<nn::Dropout>({.p = 0.5}, init2);
  CHECK(ops::equal((*c)(x), y1));
  CHECK_THROWS_WITH(nn::Dropout({.p = 1.5}, init2),
                    Contains("[nn::Dropout] expected p in [0, 1], got 1.5"));
}
