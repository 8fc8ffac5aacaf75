// Gradients of every differentiable op in autograd/ops.h against central finite
// differences in f64 (gradcheck), plus exact values where the finite
// difference is undefined (ties of amax/amin/maximum, attention rows that see
// no key) and a check that gradcheck itself reports a wrong backward.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "tandem/autograd/function.h"
#include "tandem/autograd/gradcheck.h"
#include "tandem/autograd/ops.h"
#include "tests/support/autograd_util.h"
#include "tests/support/test_util.h"

using namespace tandem;
using namespace tandem::test;
using Catch::Matchers::Contains;

namespace {

constexpr DType F64 = DType::F64;

Tensor rnd(const Shape& shape, uint32_t seed, double lo = -1.0, double hi = 1.0) {
  return random_tensor(shape, F64, seed, lo, hi);
}

// Gradient of sum(f(x)) w.r.t. the leaf x, as doubles.
std::vector<double> grad_values(const Tensor& x) {
  return values_of(grad(x));
}

}  // namespace

// ---------------------------------------------------------------- elementwise

TEST_CASE("gradcheck: binary elementwise ops, same shape and broadcast both ways", "[gradcheck]") {
  using Bin = Tensor (*)(const Tensor&, const Tensor&);
  struct Op {
    const char* name;
    Bin fn;
    double lo_a, hi_a, lo_b, hi_b;
  };
  const std::vector<Op> binary = {
      {"add", static_cast<Bin>(&tandem::add), -1, 1, -1, 1},
      {"sub", static_cast<Bin>(&tandem::sub), -1, 1, -1, 1},
      {"mul", static_cast<Bin>(&tandem::mul), -1, 1, -1, 1},
      {"div", static_cast<Bin>(&tandem::div), -1, 1, 0.5, 2},
      {"pow", static_cast<Bin>(&tandem::pow), 0.5, 2, -1.5, 1.5},
      {"maximum", static_cast<Bin>(&tandem::maximum), -1, 1, -1, 1},
      {"minimum", static_cast<Bin>(&tandem::minimum), -1, 1, -1, 1},
  };
  // (a shape, b shape): same, column x row, trailing vector, and b wider than a.
  const std::vector<std::pair<Shape, Shape>> shapes = {
      {Shape{3, 4}, Shape{3, 4}}, {Shape{3, 1}, Shape{1, 4}},    {Shape{2, 3, 4}, Shape{4}},
      {Shape{4}, Shape{2, 3, 4}}, {Shape{2, 1, 4}, Shape{3, 1}},
  };
  uint32_t seed = 100;
  for (const Op& op : binary) {
    for (const auto& [sa, sb] : shapes) {
      Tensor a = rnd(sa, seed++, op.lo_a, op.hi_a);
      Tensor b = rnd(sb, seed++, op.lo_b, op.hi_b);
      Bin fn = op.fn;
      check_gradients(
          std::string(op.name) + " " + sa.str() + " x " + sb.str(),
          [fn](const std::vector<Tensor>& x) { return std::vector<Tensor>{fn(x[0], x[1])}; },
          {a, b});
    }
  }
}

TEST_CASE("gradcheck: binary backward sums broadcast dims by value", "[gradcheck]") {
  // a (3,1) * b (1,4): d sum / d a[i] = sum_j b[j], d sum / d b[j] = sum_i a[i].
  Tensor a = leaf(Shape{3, 1}, 1);
  Tensor b = leaf(Shape{1, 4}, 2);
  backward(sum(a * b));
  std::vector<double> av = values_of(a), bv = values_of(b);
  double sa = 0, sb = 0;
  for (double v : av)
    sa += v;
  for (double v : bv)
    sb += v;
  REQUIRE(grad(a).shape() == Shape{3, 1});
  REQUIRE(grad(b).shape() == Shape{1, 4});
  TANDEM_CHECK_CLOSE(grad_values(a), std::vector<double>(3, sb), 1e-12, 1e-12);
  TANDEM_CHECK_CLOSE(grad_values(b), std::vector<double>(4, sa), 1e-12, 1e-12);
}

TEST_CASE("gradcheck: scalar variants and unary ops", "[gradcheck]") {
  using Un = std::function<Tensor(const Tensor&)>;
  struct Op {
    const char* name;
    Un fn;
    double lo, hi;
  };
  const std::vector<Op> unary = {
      {"add scalar", [](const Tensor& t) { return add(t, 2.5); }, -1, 1},
      {"sub scalar", [](const Tensor& t) { return sub(t, 2.5); }, -1, 1},
      {"rsub scalar", [](const Tensor& t) { return rsub(t, 2.5); }, -1, 1},
      {"mul scalar", [](const Tensor& t) { return mul(t, -1.5); }, -1, 1},
      {"div scalar", [](const Tensor& t) { return div(t, 0.7); }, -1, 1},
      {"rdiv scalar", [](const Tensor& t) { return rdiv(t, 1.3); }, 0.5, 2},
      {"pow scalar", [](const Tensor& t) { return pow(t, 2.5); }, 0.5, 2},
      {"pow scalar negative", [](const Tensor& t) { return pow(t, -1.5); }, 0.5, 2},
      {"neg", [](const Tensor& t) { return neg(t); }, -1, 1},
      {"exp", [](const Tensor& t) { return tandem::exp(t); }, -1, 1},
      {"log", [](const Tensor& t) { return tandem::log(t); }, 0.5, 2},
      {"sqrt", [](const Tensor& t) { return tandem::sqrt(t); }, 0.5, 2},
      {"rsqrt", [](const Tensor& t) { return rsqrt(t); }, 0.5, 2},
      {"abs", [](const Tensor& t) { return tandem::abs(t); }, -1, 1},
      {"tanh", [](const Tensor& t) { return tandem::tanh(t); }, -2, 2},
      {"sigmoid", [](const Tensor& t) { return sigmoid(t); }, -2, 2},
      {"relu", [](const Tensor& t) { return relu(t); }, -1, 1},
      {"gelu", [](const Tensor& t) { return gelu(t); }, -3, 3},
      {"silu", [](const Tensor& t) { return silu(t); }, -3, 3},
      {"softplus", [](const Tensor& t) { return softplus(t); }, -3, 3},
  };
  uint32_t seed = 200;
  for (const Op& op : unary) {
    Tensor a = rnd(Shape{3, 5}, seed++, op.lo, op.hi);
    Un fn = op.fn;
    check_gradients(
        op.name, [fn](const std::vector<Tensor>& x) { return std::vector<Tensor>{fn(x[0])}; }, {a});
  }
}

TEST_CASE("gradcheck: operators including scalar on the left", "[gradcheck]") {
  Tensor a = rnd(Shape{2, 3}, 300);
  Tensor b = rnd(Shape{3}, 301, 0.5, 2);
  check_gradients("a + b",
                  [](const std::vector<Tensor>& x) { return std::vector<Tensor>{x[0] + x[1]}; },
                  {a, b});
  check_gradients("a - b",
                  [](const std::vector<Tensor>& x) { return std::vector<Tensor>{x[0] - x[1]}; },
                  {a, b});
  check_gradients("a * b",
                  [](const std::vector<Tensor>& x) { return std::vector<Tensor>{x[0] * x[1]}; },
                  {a, b});
  check_gradients("a / b",
                  [](const std::vector<Tensor>& x) { return std::vector<Tensor>{x[0] / x[1]}; },
                  {a, b});
  check_gradients("scalar operators",
                  [](const std::vector<Tensor>& x) {
                    const Tensor& t = x[0];
                    return std::vector<Tensor>{t + 2.0, t - 2.0, t * 3.0, t / 4.0,
                                               2.0 * t, 2.0 + t, 2.0 - t, -t};
                  },
                  {a});
  // 2.0 * x by value: the gradient of sum(2x) is exactly 2.
  Tensor x = leaf(Shape{4}, 302);
  backward(sum(2.0 * x));
  CHECK(grad_values(x) == std::vector<double>(4, 2.0));
}

TEST_CASE("gradcheck: where with broadcasting", "[gradcheck]") {
  Tensor cond = ops::from_vector<bool>({true, false, true}, Shape{3, 1});
  Tensor a = rnd(Shape{1, 4}, 310);
  Tensor b = rnd(Shape{3, 4}, 311);
  check_gradients(
      "where(cond (3,1), a (1,4), b (3,4))",
      [](const std::vector<Tensor>& x) { return std::vector<Tensor>{where(x[0], x[1], x[2])}; },
      {cond, a, b}, {}, {0});
  check_gradients(
      "where(cond, a (3,4), scalar)",
      [](const std::vector<Tensor>& x) { return std::vector<Tensor>{where(x[0], x[1], 0.5)}; },
      {cond, b}, {}, {0});
  // By value: a (1,4) collects the gradient of the rows where cond is true.
  Tensor la = leaf(Shape{1, 4}, 312);
  Tensor lb = leaf(Shape{3, 4}, 313);
  backward(sum(where(cond, la, lb)));
  CHECK(grad_values(la) == std::vector<double>(4, 2.0));
  std::vector<double> expect_b = {0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0};
  CHECK(grad_values(lb) == expect_b);
}

TEST_CASE("gradcheck: maximum/minimum ties split the gradient evenly", "[gradcheck]") {
  Tensor a = requires_grad_(tensor_of({1.0, 2.0, 5.0}, Shape{3}, F64));
  Tensor b = requires_grad_(tensor_of({1.0, 3.0, 4.0}, Shape{3}, F64));
  backward(sum(maximum(a, b)) + sum(minimum(a, b)) * 10.0);
  // max: tie 0.5/0.5, b wins, a wins; min: tie 5/5, a wins, b wins.
  CHECK(grad_values(a) == std::vector<double>{5.5, 10.0, 1.0});
  CHECK(grad_values(b) == std::vector<double>{5.5, 1.0, 10.0});
}

// ---------------------------------------------------------------- reductions

TEST_CASE("gradcheck: sum and mean over one, several and all dims", "[gradcheck]") {
  Tensor a = rnd(Shape{2, 3, 4}, 400);
  const std::vector<Dims> dim_sets = {Dims{},     Dims{0},    Dims{1},      Dims{-1},
                                      Dims{0, 2}, Dims{2, 0}, Dims{0, 1, 2}};
  for (const Dims& dims : dim_sets) {
    for (bool keepdim : {false, true}) {
      std::string what = dims.str() + (keepdim ? " keepdim" : "");
      check_gradients("sum " + what,
                      [dims, keepdim](const std::vector<Tensor>& x) {
                        return std::vector<Tensor>{sum(x[0], dims, keepdim)};
                      },
                      {a});
      check_gradients("mean " + what,
                      [dims, keepdim](const std::vector<Tensor>& x) {
                        return std::vector<Tensor>{mean(x[0], dims, keepdim)};
                      },
                      {a});
    }
  }
  // mean by value: every element gets 1/count.
  Tensor x = leaf(Shape{2, 3, 4}, 401);
  backward(sum(mean(x, Dims{0, 2})));
  TANDEM_CHECK_CLOSE(grad_values(x), std::vector<double>(24, 1.0 / 8.0), 0, 1e-15);
}

TEST_CASE("gradcheck: amax/amin/max(dim) without ties", "[gradcheck]") {
  Tensor a = rnd(Shape{3, 4, 2}, 410);
  const std::vector<Dims> dim_sets = {Dims{}, Dims{1}, Dims{-1}, Dims{0, 2}};
  for (const Dims& dims : dim_sets) {
    for (bool keepdim : {false, true}) {
      std::string what = dims.str() + (keepdim ? " keepdim" : "");
      check_gradients("amax " + what,
                      [dims, keepdim](const std::vector<Tensor>& x) {
                        return std::vector<Tensor>{amax(x[0], dims, keepdim)};
                      },
                      {a});
      check_gradients("amin " + what,
                      [dims, keepdim](const std::vector<Tensor>& x) {
                        return std::vector<Tensor>{amin(x[0], dims, keepdim)};
                      },
                      {a});
    }
  }
  for (int64_t dim : {0, 1, -1}) {
    for (bool keepdim : {false, true}) {
      check_gradients("max(dim) values " + std::to_string(dim),
                      [dim, keepdim](const std::vector<Tensor>& x) {
                        return std::vector<Tensor>{tandem::max(x[0], dim, keepdim).first};
                      },
                      {a});
    }
  }
}

TEST_CASE("gradcheck: amax/amin split ties evenly (by value)", "[gradcheck]") {
  Tensor x = requires_grad_(tensor_of({1, 3, 3, 2, 2, 2}, Shape{2, 3}, F64));
  SECTION("amax over dim 1") {
    backward(sum(amax(x, Dims{1}) * tensor_of({1.0, 6.0}, Shape{2}, F64)));
    TANDEM_CHECK_CLOSE(grad_values(x), (std::vector<double>{0, 0.5, 0.5, 2, 2, 2}), 0, 1e-15);
  }
  SECTION("amin over dim 1 keepdim") {
    backward(sum(amin(x, Dims{1}, true)));
    TANDEM_CHECK_CLOSE(grad_values(x), (std::vector<double>{1, 0, 0, 1.0 / 3, 1.0 / 3, 1.0 / 3}), 0,
                       1e-15);
  }
  SECTION("amax over all dims: the two 3s share") {
    backward(amax(x));
    TANDEM_CHECK_CLOSE(grad_values(x), (std::vector<double>{0, 0.5, 0.5, 0, 0, 0}), 0, 1e-15);
  }
  SECTION("max(dim) values split ties; indices carry no gradient") {
    auto [values, indices] = tandem::max(x, 1);
    CHECK_FALSE(requires_grad(indices));
    CHECK(values_of(indices) == std::vector<double>{1, 0});
    backward(sum(values));
    TANDEM_CHECK_CLOSE(grad_values(x),
                       (std::vector<double>{0, 0.5, 0.5, 1.0 / 3, 1.0 / 3, 1.0 / 3}), 0, 1e-15);
  }
}

TEST_CASE("gradcheck: cumsum, softmax and log_softmax along each dim", "[gradcheck]") {
  Tensor a = rnd(Shape{2, 3, 4}, 420, -2, 2);
  for (int64_t dim : {0, 1, 2, -1, -3}) {
    std::string d = std::to_string(dim);
    check_gradients(
        "cumsum " + d,
        [dim](const std::vector<Tensor>& x) { return std::vector<Tensor>{cumsum(x[0], dim)}; },
        {a});
    check_gradients(
        "softmax " + d,
        [dim](const std::vector<Tensor>& x) { return std::vector<Tensor>{softmax(x[0], dim)}; },
        {a});
    check_gradients(
        "log_softmax " + d,
        [dim](const std::vector<Tensor>& x) { return std::vector<Tensor>{log_softmax(x[0], dim)}; },
        {a});
  }
  // cumsum by value: element i of a row feeds outputs i..n-1.
  Tensor x = leaf(Shape{4}, 421);
  backward(sum(cumsum(x, 0)));
  CHECK(grad_values(x) == std::vector<double>{4, 3, 2, 1});
}

// ---------------------------------------------------------------- views

TEST_CASE("gradcheck: views and copies", "[gradcheck]") {
  Tensor a = rnd(Shape{3, 4}, 500);
  Tensor b = rnd(Shape{2, 3, 4}, 501);
  Tensor c = rnd(Shape{3, 1, 4}, 502);
  Tensor d = rnd(Shape{5, 3}, 503);
  using V = std::vector<Tensor>;
  auto one = [](std::function<Tensor(const Tensor&)> f) {
    return [f](const V& x) { return V{f(x[0])}; };
  };
  check_gradients("view on transposed input", one([](const Tensor& t) {
                    return view(transpose(t, 0, 1), Shape{2, 2, 3});
                  }),
                  {a});
  check_gradients("reshape on transposed input", one([](const Tensor& t) {
                    return reshape(transpose(t, 0, 1), Shape{2, 6});
                  }),
                  {a});
  check_gradients("reshape with -1", one([](const Tensor& t) { return reshape(t, Shape{-1}); }),
                  {b});
  check_gradients("flatten 1..2", one([](const Tensor& t) { return flatten(t, 1, 2); }), {b});
  check_gradients("flatten all", one([](const Tensor& t) { return flatten(t); }), {b});
  check_gradients("permute", one([](const Tensor& t) { return permute(t, Dims{2, 0, 1}); }), {b});
  check_gradients("permute negative dims", one([](const Tensor& t) {
                    return permute(t, Dims{-1, -3, -2});
                  }),
                  {b});
  check_gradients("transpose", one([](const Tensor& t) { return transpose(t, 0, 2); }), {b});
  check_gradients("narrow", one([](const Tensor& t) { return narrow(t, 1, 1, 2); }), {b});
  check_gradients("narrow negative dim", one([](const Tensor& t) { return narrow(t, -1, 2, 2); }),
                  {b});
  check_gradients("slice with step", one([](const Tensor& t) { return slice(t, 2, 0, 4, 2); }),
                  {b});
  check_gradients("slice with step and negative start",
                  one([](const Tensor& t) { return slice(t, 1, -3, 4, 2); }), {a});
  check_gradients("select negative index", one([](const Tensor& t) { return select(t, 0, -1); }),
                  {b});
  check_gradients("select negative dim and index",
                  one([](const Tensor& t) { return select(t, -1, -2); }), {b});
  check_gradients("expand", one([](const Tensor& t) { return expand(t, Shape{2, 3, 5, 4}); }), {c});
  check_gradients("expand keeping an extent with -1", one([](const Tensor& t) {
                    return expand(t, Shape{3, 2, -1});
                  }),
                  {c});
  check_gradients("squeeze all", one([](const Tensor& t) { return squeeze(t); }), {c});
  check_gradients("squeeze dim", one([](const Tensor& t) { return squeeze(t, 1); }), {c});
  check_gradients("unsqueeze", one([](const Tensor& t) { return unsqueeze(t, -1); }), {a});
  check_gradients("split (some parts unused)",
                  [](const V& x) {
                    V parts = split(x[0], 2, 0);  // sizes 2, 2, 1
                    return V{parts[0], parts[2] * 3.0};
                  },
                  {d});
  check_gradients("split along dim 1", [](const V& x) { return split(x[0], 3, 1); }, {a});
  check_gradients("split_sizes",
                  [](const V& x) {
                    V parts = split_sizes(x[0], {1, 2, 1}, 1);
                    return V{parts[0] * 2.0, parts[1], parts[2] * parts[2]};
                  },
                  {a});
  check_gradients("chunk",
                  [](const V& x) {
                    V parts = chunk(x[0], 3, 0);  // sizes 2, 2, 1
                    return V{parts[0], parts[1] * parts[1], parts[2]};
                  },
                  {d});
  check_gradients("cat (one input twice, negative dim)",
                  [](const V& x) {
                    return V{cat({x[0], x[1], x[0]}, -1)};
                  },
                  {a, rnd(Shape{3, 2}, 504)});
  check_gradients("cat dim 0",
                  [](const V& x) {
                    return V{cat({x[0], x[1]}, 0)};
                  },
                  {a, rnd(Shape{2, 4}, 505)});
  check_gradients("stack dim 0",
                  [](const V& x) {
                    return V{stack({x[0], x[1]}, 0)};
                  },
                  {a, rnd(Shape{3, 4}, 506)});
  check_gradients("stack dim -1",
                  [](const V& x) {
                    return V{stack({x[0], x[1] * x[0]}, -1)};
                  },
                  {a, rnd(Shape{3, 4}, 507)});
  check_gradients("contiguous of a transposed view",
                  one([](const Tensor& t) { return contiguous(transpose(t, 0, 1)) * 2.0; }), {a});
  check_gradients("contiguous of a contiguous tensor",
                  one([](const Tensor& t) { return contiguous(t) * t; }), {a});
  check_gradients("clone", one([](const Tensor& t) { return clone(t) * t; }), {a});
  // f64 -> f32 -> f64 loses precision: central differences over a larger step.
  GradcheckOptions loose;
  loose.eps = 1e-3;
  loose.atol = 1e-3;
  loose.rtol = 1e-3;
  check_gradients("to(f32) and back",
                  one([](const Tensor& t) { return to(to(t, DType::F32) * 3.0, F64) * t; }), {a},
                  loose);
  check_gradients("to(same device)", one([](const Tensor& t) { return to(t, Device::cpu()) * t; }),
                  {a});
  // The cast node hands back a gradient of the input's dtype.
  Tensor x = leaf(Shape{3}, 508);
  backward(sum(to(x, DType::F32) * 2.0));
  CHECK(grad(x).dtype() == F64);
  CHECK(grad_values(x) == std::vector<double>(3, 2.0));
}

TEST_CASE("gradcheck: sum_to is the adjoint of broadcasting (by value)", "[gradcheck]") {
  Tensor g = rnd(Shape{2, 3, 4}, 510);
  std::vector<double> gv = values_of(g);
  // To (3, 1): sum over the leading dim and the last.
  std::vector<double> expect(3, 0.0);
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j)
      for (int k = 0; k < 4; ++k)
        expect[j] += gv[(i * 3 + j) * 4 + k];
  Tensor r = sum_to(g, Shape{3, 1});
  REQUIRE(r.shape() == Shape{3, 1});
  TANDEM_CHECK_CLOSE(values_of(r), expect, 1e-14, 1e-14);
  // To (1, 4): sum over the first two dims; to the same shape: unchanged.
  std::vector<double> expect2(4, 0.0);
  for (int n = 0; n < 6; ++n)
    for (int k = 0; k < 4; ++k)
      expect2[k] += gv[n * 4 + k];
  Tensor r2 = sum_to(g, Shape{1, 4});
  REQUIRE(r2.shape() == Shape{1, 4});
  TANDEM_CHECK_CLOSE(values_of(r2), expect2, 1e-14, 1e-14);
  CHECK(ops::equal(sum_to(g, g.shape()), g));
}

TEST_CASE("gradcheck: view backward lands gradients at the viewed elements (by value)",
          "[gradcheck]") {
  Tensor x = leaf(Shape{2, 5}, 1);
  backward(sum(slice(x, 1, 1, 5, 2)) + sum(select(x, 0, -1)) * 10.0);
  CHECK(grad_values(x) == std::vector<double>{0, 1, 0, 1, 0, 10, 11, 10, 11, 10});
  Tensor y = leaf(Shape{2, 3}, 2);
  auto parts = split(y, 1, 1);
  backward(sum(parts[2]) * 2.0 + sum(parts[0]));
  CHECK(grad_values(y) == std::vector<double>{1, 0, 2, 1, 0, 2});
}

// ---------------------------------------------------------------- linear algebra, norms

TEST_CASE("gradcheck: matmul shapes", "[gradcheck]") {
  using V = std::vector<Tensor>;
  auto mm = [](const V& x) { return V{matmul(x[0], x[1])}; };
  check_gradients("2-D", mm, {rnd(Shape{3, 4}, 600), rnd(Shape{4, 5}, 601)});
  check_gradients("batched", mm, {rnd(Shape{2, 3, 4}, 602), rnd(Shape{2, 4, 5}, 603)});
  check_gradients("broadcast batch", mm, {rnd(Shape{2, 1, 3, 4}, 604), rnd(Shape{3, 4, 2}, 605)});
  check_gradients("2-D @ batched", mm, {rnd(Shape{3, 4}, 606), rnd(Shape{2, 4, 5}, 607)});
  check_gradients("1-D @ 2-D", mm, {rnd(Shape{4}, 608), rnd(Shape{4, 5}, 609)});
  check_gradients("2-D @ 1-D", mm, {rnd(Shape{3, 4}, 610), rnd(Shape{4}, 611)});
  check_gradients("1-D @ 1-D", mm, {rnd(Shape{4}, 612), rnd(Shape{4}, 613)});
  check_gradients("1-D @ batched", mm, {rnd(Shape{4}, 614), rnd(Shape{2, 4, 3}, 615)});
  check_gradients("transposed operand",
                  [](const V& x) { return V{matmul(transpose(x[0], 0, 1), x[1])}; },
                  {rnd(Shape{4, 3}, 616), rnd(Shape{4, 5}, 617)});
}

TEST_CASE("gradcheck: linear with and without bias", "[gradcheck]") {
  using V = std::vector<Tensor>;
  check_gradients("with bias", [](const V& x) { return V{linear(x[0], x[1], x[2])}; },
                  {rnd(Shape{2, 3, 4}, 620), rnd(Shape{5, 4}, 621), rnd(Shape{5}, 622)});
  check_gradients("without bias", [](const V& x) { return V{linear(x[0], x[1])}; },
                  {rnd(Shape{3, 4}, 623), rnd(Shape{5, 4}, 624)});
}

TEST_CASE("gradcheck: layer_norm and rms_norm with and without affine parameters", "[gradcheck]") {
  using V = std::vector<Tensor>;
  Tensor x = rnd(Shape{2, 3, 5}, 630, -2, 2);
  Tensor w = rnd(Shape{5}, 631, 0.5, 1.5);
  Tensor b = rnd(Shape{5}, 632);
  check_gradients("layer_norm weight+bias",
                  [](const V& t) { return V{layer_norm(t[0], t[1], t[2])}; }, {x, w, b});
  check_gradients("layer_norm weight only",
                  [](const V& t) { return V{layer_norm(t[0], t[1], Tensor())}; }, {x, w});
  check_gradients("layer_norm bias only",
                  [](const V& t) { return V{layer_norm(t[0], Tensor(), t[1])}; }, {x, b});
  check_gradients("layer_norm plain",
                  [](const V& t) { return V{layer_norm(t[0], Tensor(), Tensor())}; }, {x});
  check_gradients("rms_norm weight", [](const V& t) { return V{rms_norm(t[0], t[1])}; }, {x, w});
  check_gradients("rms_norm plain", [](const V& t) { return V{rms_norm(t[0], Tensor())}; }, {x});
  // Gradients keep their input's dtype, also for a bias without a weight;
  // the bias gradient is the column sum of the output gradient.
  Tensor xl = leaf(Shape{2, 5}, 633);
  Tensor bl = leaf(Shape{5}, 634);
  Tensor up = rnd(Shape{2, 5}, 635);
  backward(sum(layer_norm(xl, Tensor(), bl) * up));
  CHECK(grad(xl).dtype() == F64);
  REQUIRE(grad(bl).dtype() == F64);
  std::vector<double> upv = values_of(up), expect_bias(5);
  for (int j = 0; j < 5; ++j)
    expect_bias[j] = upv[j] + upv[5 + j];
  TANDEM_CHECK_CLOSE(grad_values(bl), expect_bias, 1e-6, 1e-6);
}

// ---------------------------------------------------------------- indexing

TEST_CASE("gradcheck: embedding, index_select, gather, scatter_add, topk", "[gradcheck]") {
  using V = std::vector<Tensor>;
  Tensor weight = rnd(Shape{5, 3}, 700);
  Tensor idx = long_tensor({1, 3, 1, 0, 1, 4}, Shape{2, 3});
  check_gradients("embedding (repeated indices)",
                  [](const V& t) { return V{embedding(t[0], t[1])}; }, {weight, idx}, {}, {1});
  Tensor a = rnd(Shape{3, 4}, 701);
  Tensor sel = long_tensor({2, 0, 2, 2}, Shape{4});
  check_gradients("index_select dim 0", [](const V& t) { return V{index_select(t[0], 0, t[1])}; },
                  {a, sel}, {}, {1});
  check_gradients("index_select dim -1", [](const V& t) { return V{index_select(t[0], -1, t[1])}; },
                  {a, sel}, {}, {1});
  Tensor gidx = long_tensor({0, 0, 3, 1, 2, 2, 3, 3, 0}, Shape{3, 3});
  check_gradients("gather dim 1", [](const V& t) { return V{gather(t[0], 1, t[1])}; }, {a, gidx},
                  {}, {1});
  Tensor gidx0 = long_tensor({2, 0, 1, 2, 2, 2, 0, 0}, Shape{2, 4});
  check_gradients("gather dim 0", [](const V& t) { return V{gather(t[0], 0, t[1])}; }, {a, gidx0},
                  {}, {1});
  Tensor src = rnd(Shape{3, 3}, 702);
  check_gradients("scatter_add dim 1",
                  [](const V& t) { return V{scatter_add(t[0], 1, t[1], t[2]) * t[0]}; },
                  {a, gidx, src}, {}, {1});
  check_gradients("topk largest", [](const V& t) { return V{topk(t[0], 2).first}; }, {a});
  check_gradients("topk smallest dim 0",
                  [](const V& t) { return V{topk(t[0], 2, 0, false).first}; }, {a});
  // By value: a repeated embedding row collects one gradient per use.
  Tensor w = leaf(Shape{5, 3}, 703);
  backward(sum(embedding(w, idx)));
  std::vector<double> expect = {1, 1, 1, 3, 3, 3, 0, 0, 0, 1, 1, 1, 1, 1, 1};
  CHECK(grad_values(w) == expect);
  auto [vals, inds] = topk(w, 2);
  CHECK_FALSE(requires_grad(inds));
  CHECK(requires_grad(vals));
}

TEST_CASE("gradcheck: cross_entropy with ignore_index", "[gradcheck]") {
  using V = std::vector<Tensor>;
  Tensor logits = rnd(Shape{4, 5}, 710, -2, 2);
  Tensor targets = long_tensor({1, -100, 4, 1}, Shape{4});
  check_gradients("default ignore_index", [](const V& t) { return V{cross_entropy(t[0], t[1])}; },
                  {logits, targets}, {}, {1});
  Tensor targets2 = long_tensor({2, 0, 2, 3}, Shape{4});
  check_gradients("ignore_index 2", [](const V& t) { return V{cross_entropy(t[0], t[1], 2)}; },
                  {logits, targets2}, {}, {1});
  // Naive reference: mean over kept rows of -log softmax; ignored rows get 0.
  Tensor x = leaf(Shape{4, 5}, 711, F64, -2, 2);
  Tensor loss = cross_entropy(x, targets);
  std::vector<double> xv = values_of(x);
  std::vector<int64_t> tv = {1, -100, 4, 1};
  double expect_loss = 0;
  std::vector<double> expect_grad(20, 0.0);
  for (int i = 0; i < 4; ++i) {
    if (tv[i] == -100) continue;
    double m = -INFINITY, z = 0;
    for (int j = 0; j < 5; ++j)
      m = std::max(m, xv[i * 5 + j]);
    for (int j = 0; j < 5; ++j)
      z += std::exp(xv[i * 5 + j] - m);
    expect_loss += -(xv[i * 5 + tv[i]] - m - std::log(z)) / 3.0;
    for (int j = 0; j < 5; ++j) {
      expect_grad[i * 5 + j] = (std::exp(xv[i * 5 + j] - m) / z - (j == tv[i] ? 1.0 : 0.0)) / 3.0;
    }
  }
  CHECK(loss.item_double() == Approx(expect_loss).epsilon(1e-12));
  backward(loss);
  TANDEM_CHECK_CLOSE(grad_values(x), expect_grad, 1e-10, 1e-12);
}

// ---------------------------------------------------------------- attention

TEST_CASE("gradcheck: scaled_dot_product_attention", "[gradcheck]") {
  using V = std::vector<Tensor>;
  auto attn = [](AttentionOptions o) {
    return [o](const V& t) { return V{scaled_dot_product_attention(t[0], t[1], t[2], o).out}; };
  };
  SECTION("non-causal, Sq != Sk") {
    check_gradients(
        "non-causal", attn({}),
        {rnd(Shape{1, 2, 3, 4}, 800), rnd(Shape{1, 2, 5, 4}, 801), rnd(Shape{1, 2, 5, 4}, 802)});
  }
  SECTION("non-causal with an explicit scale") {
    AttentionOptions o;
    o.scale = 0.3;
    check_gradients(
        "scale", attn(o),
        {rnd(Shape{2, 1, 3, 4}, 803), rnd(Shape{2, 1, 3, 4}, 804), rnd(Shape{2, 1, 3, 4}, 805)});
  }
  SECTION("causal") {
    AttentionOptions o;
    o.causal = true;
    check_gradients(
        "causal", attn(o),
        {rnd(Shape{1, 2, 4, 3}, 806), rnd(Shape{1, 2, 4, 3}, 807), rnd(Shape{1, 2, 4, 3}, 808)});
  }
  SECTION("causal sequence shard: q_offset/k_offset") {
    AttentionOptions o;
    o.causal = true;
    o.q_offset = 4;  // queries at positions 4..5
    o.k_offset = 1;  // keys at positions 1..6
    check_gradients(
        "causal shard", attn(o),
        {rnd(Shape{1, 2, 2, 3}, 809), rnd(Shape{1, 2, 6, 3}, 810), rnd(Shape{1, 2, 6, 3}, 811)});
  }
  SECTION("grouped-query heads Hq=4, Hkv=2, causal") {
    AttentionOptions o;
    o.causal = true;
    check_gradients(
        "GQA", attn(o),
        {rnd(Shape{1, 4, 3, 2}, 812), rnd(Shape{1, 2, 3, 2}, 813), rnd(Shape{1, 2, 3, 2}, 814)});
    check_gradients(
        "GQA non-causal", attn({}),
        {rnd(Shape{2, 4, 2, 3}, 815), rnd(Shape{2, 2, 3, 3}, 816), rnd(Shape{2, 2, 3, 3}, 817)});
  }
  SECTION("a query row with no visible key gets zero gradient") {
    AttentionOptions o;
    o.causal = true;
    o.q_offset = 0;  // queries at positions 0..2
    o.k_offset = 1;  // keys at 1..3: query 0 sees none
    check_gradients(
        "row without keys", attn(o),
        {rnd(Shape{1, 1, 3, 2}, 818), rnd(Shape{1, 1, 3, 2}, 819), rnd(Shape{1, 1, 3, 2}, 820)});
    Tensor q = leaf(Shape{1, 1, 3, 2}, 821);
    Tensor k = leaf(Shape{1, 1, 3, 2}, 822);
    Tensor v = leaf(Shape{1, 1, 3, 2}, 823);
    Tensor out = scaled_dot_product_attention(q, k, v, o).out;
    backward(sum(out * rnd(Shape{1, 1, 3, 2}, 824)));
    std::vector<double> dq = grad_values(q);
    REQUIRE(dq.size() == 6);
    // Query 0 sees no key; query 1 sees one key (softmax constant 1, so also
    // no gradient); query 2 sees two keys and does get a gradient.
    CHECK(dq[0] == 0.0);
    CHECK(dq[1] == 0.0);
    CHECK(std::abs(dq[2]) < 1e-15);
    CHECK(std::abs(dq[3]) < 1e-15);
    CHECK((dq[4] != 0.0 || dq[5] != 0.0));
    std::vector<double> ov = values_of(out);
    CHECK(std::isfinite(ov[0]));
    CHECK(std::isfinite(ov[1]));
    for (double g : values_of(grad(k)))
      CHECK(std::isfinite(g));
    for (double g : values_of(grad(v)))
      CHECK(std::isfinite(g));
  }
}

// ---------------------------------------------------------------- gradcheck itself

namespace {

// y = 3 * a + b * b, with a deliberately wrong gradient for one input.
struct WrongBackward final : Function {
  bool wrong_a = true;
  const char* name() const override { return "WrongBackward"; }
  std::vector<Tensor> forward(FunctionCtx& ctx, const std::vector<Tensor>& in) override {
    ctx.save_for_backward({in[1]});
    return {ops::add(ops::mul(in[0], 3.0), ops::mul(in[1], in[1]))};
  }
  std::vector<Tensor> backward(FunctionCtx& ctx, const std::vector<Tensor>& g) override {
    const Tensor& b = ctx.saved_tensors()[0];
    Tensor ga = ops::mul(g[0], wrong_a ? 2.0 : 3.0);
    Tensor gb = ops::mul(g[0], ops::mul(b, wrong_a ? 2.0 : 1.0));  // right: 2b
    return {ga, gb};
  }
};

}  // namespace

TEST_CASE("gradcheck reports a wrong custom backward", "[gradcheck]") {
  Tensor a = rnd(Shape{2, 3}, 900);
  Tensor b = rnd(Shape{2, 3}, 901);
  SECTION("wrong gradient of input 0") {
    auto fn = [](const std::vector<Tensor>& x) {
      return Function::apply(std::make_shared<WrongBackward>(), x);
    };
    GradcheckResult r = gradcheck(fn, {a, b});
    CHECK_FALSE(r.ok);
    CHECK_THAT(r.message, Contains("input 0") && Contains("element"));
    CHECK(r.max_abs_error > 0.1);
  }
  SECTION("wrong gradient of input 1 only") {
    auto fn = [](const std::vector<Tensor>& x) {
      auto f = std::make_shared<WrongBackward>();
      f->wrong_a = false;
      // Make input 1 the wrong one: a correct 3a, but b's gradient is b, not 2b.
      return Function::apply(f, x);
    };
    GradcheckResult r = gradcheck(fn, {a, b});
    CHECK_FALSE(r.ok);
    CHECK_THAT(r.message, Contains("input 1") && Contains("element"));
  }
  SECTION("the same function with a correct backward passes") {
    auto fn = [](const std::vector<Tensor>& x) {
      return std::vector<Tensor>{add(mul(x[0], 3.0), mul(x[1], x[1]))};
    };
    GradcheckResult r = gradcheck(fn, {a, b});
    INFO(r.message);
    CHECK(r.ok);
    CHECK(r.max_abs_error < 1e-6);
  }
}
