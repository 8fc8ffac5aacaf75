// Elementwise ops against naive double-precision loops: every unary and
// binary op per dtype, scalar variants, comparisons, where, broadcasting,
// strided inputs and dtype promotion.
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "tandem/tensor/ops.h"
#include "tests/support/test_util.h"

using namespace tandem;
using namespace tandem::test;
using tandem::ops::operator+;
using tandem::ops::operator-;
using tandem::ops::operator*;
using tandem::ops::operator/;
using Catch::Matchers::Contains;

namespace {

using Index = std::vector<int64_t>;
using UnaryFn = std::function<Tensor(const Tensor&)>;
using BinaryFn = std::function<Tensor(const Tensor&, const Tensor&)>;
using Ref1 = std::function<double(double)>;
using Ref2 = std::function<double(double, double)>;

struct Tolerance {
  double rtol, atol;
};

// Kernels compute 16-bit types in float and round once on store (half.h), so
// the error is one rounding of the result plus float arithmetic.
Tolerance tolerance_for(DType dt) {
  switch (dt) {
    case DType::F64:
      return {1e-12, 1e-14};
    case DType::F32:
      return {1e-5, 1e-6};
    case DType::BF16:
      return {1e-2, 1e-3};
    case DType::F16:
      return {4e-3, 1e-3};
    default:
      return {0.0, 0.0};
  }
}

double gelu_ref(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}
double sigmoid_ref(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

struct UnaryCase {
  const char* name;
  UnaryFn op;
  Ref1 ref;
  double lo, hi;
};

std::vector<UnaryCase> unary_cases() {
  return {
      {"neg", [](const Tensor& t) { return ops::neg(t); }, [](double x) { return -x; }, -4, 4},
      {"exp", [](const Tensor& t) { return ops::exp(t); }, [](double x) { return std::exp(x); }, -5,
       5},
      {"log", [](const Tensor& t) { return ops::log(t); }, [](double x) { return std::log(x); },
       0.05, 10},
      {"sqrt", [](const Tensor& t) { return ops::sqrt(t); }, [](double x) { return std::sqrt(x); },
       0, 10},
      {"rsqrt", [](const Tensor& t) { return ops::rsqrt(t); },
       [](double x) { return 1.0 / std::sqrt(x); }, 0.1, 10},
      {"abs", [](const Tensor& t) { return ops::abs(t); }, [](double x) { return std::fabs(x); },
       -4, 4},
      {"tanh", [](const Tensor& t) { return ops::tanh(t); }, [](double x) { return std::tanh(x); },
       -3, 3},
      {"sigmoid", [](const Tensor& t) { return ops::sigmoid(t); }, sigmoid_ref, -8, 8},
      {"relu", [](const Tensor& t) { return ops::relu(t); },
       [](double x) { return x > 0 ? x : 0.0; }, -4, 4},
      {"gelu", [](const Tensor& t) { return ops::gelu(t); }, gelu_ref, -5, 5},
      {"silu", [](const Tensor& t) { return ops::silu(t); },
       [](double x) { return x * sigmoid_ref(x); }, -6, 6},
      {"gelu exact", [](const Tensor& t) { return ops::gelu(t, GeluApproximate::None); },
       [](double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); }, -5, 5},
      {"gelu tanh", [](const Tensor& t) { return ops::gelu(t, GeluApproximate::Tanh); }, gelu_ref,
       -5, 5},
      {"erf", [](const Tensor& t) { return ops::erf(t); }, [](double x) { return std::erf(x); }, -3,
       3},
      {"softplus", [](const Tensor& t) { return ops::softplus(t); },
       [](double x) { return x > 20 ? x : std::log1p(std::exp(x)); }, -30, 30},
      {"operator-", [](const Tensor& t) { return -t; }, [](double x) { return -x; }, -4, 4},
  };
}

struct BinaryCase {
  const char* name;
  BinaryFn op;
  Ref2 ref;
  double a_lo, a_hi, b_lo, b_hi;
  bool integral;  // meaningful (and exact) on integer dtypes
};

std::vector<BinaryCase> binary_cases() {
  return {
      {"add", [](const Tensor& a, const Tensor& b) { return ops::add(a, b); },
       [](double a, double b) { return a + b; }, -3, 3, -3, 3, true},
      {"sub", [](const Tensor& a, const Tensor& b) { return ops::sub(a, b); },
       [](double a, double b) { return a - b; }, -3, 3, -3, 3, true},
      {"mul", [](const Tensor& a, const Tensor& b) { return ops::mul(a, b); },
       [](double a, double b) { return a * b; }, -3, 3, -3, 3, true},
      {"div", [](const Tensor& a, const Tensor& b) { return ops::div(a, b); },
       [](double a, double b) { return a / b; }, -3, 3, 0.5, 3, false},
      {"pow", [](const Tensor& a, const Tensor& b) { return ops::pow(a, b); },
       [](double a, double b) { return std::pow(a, b); }, 0.2, 3, -2, 2, false},
      {"maximum", [](const Tensor& a, const Tensor& b) { return ops::maximum(a, b); },
       [](double a, double b) { return std::max(a, b); }, -3, 3, -3, 3, true},
      {"minimum", [](const Tensor& a, const Tensor& b) { return ops::minimum(a, b); },
       [](double a, double b) { return std::min(a, b); }, -3, 3, -3, 3, true},
      {"operator+", [](const Tensor& a, const Tensor& b) { return a + b; },
       [](double a, double b) { return a + b; }, -3, 3, -3, 3, true},
      {"operator-", [](const Tensor& a, const Tensor& b) { return a - b; },
       [](double a, double b) { return a - b; }, -3, 3, -3, 3, true},
      {"operator*", [](const Tensor& a, const Tensor& b) { return a * b; },
       [](double a, double b) { return a * b; }, -3, 3, -3, 3, true},
      {"operator/", [](const Tensor& a, const Tensor& b) { return a / b; },
       [](double a, double b) { return a / b; }, -3, 3, 0.5, 3, false},
  };
}

// Expected result of a broadcasting binary op from the operands' values.
std::vector<double> ref_binary(const std::vector<double>& a, const Index& a_shape,
                               const std::vector<double>& b, const Index& b_shape, const Ref2& ref,
                               Index& out_shape) {
  out_shape = broadcast_shape(a_shape, b_shape);
  std::vector<double> out;
  for_each_index(out_shape, [&](const Index& idx) {
    out.push_back(ref(a[broadcast_linear(idx, a_shape)], b[broadcast_linear(idx, b_shape)]));
  });
  return out;
}

const DType kFloatDTypes[] = {DType::F32, DType::F64, DType::BF16, DType::F16};

}  // namespace

TEST_CASE("unary ops match a double-precision reference", "[elementwise]") {
  uint32_t seed = 100;
  for (const UnaryCase& c : unary_cases()) {
    for (DType dt : kFloatDTypes) {
      INFO(c.name << " on " << dtype_name(dt));
      const Shape shape{7, 37};  // not a multiple of any vector width
      std::vector<double> in = random_stored(shape.numel(), seed++, dt, c.lo, c.hi);
      Tensor out = c.op(tensor_of(in, shape, dt));
      REQUIRE(out.dtype() == dt);
      REQUIRE(out.shape() == shape);
      std::vector<double> expected;
      for (double x : in)
        expected.push_back(c.ref(x));
      Tolerance tol = tolerance_for(dt);
      TANDEM_REQUIRE_CLOSE(values_of(out), expected, tol.rtol, tol.atol);
    }
  }
}

TEST_CASE("unary ops at special points", "[elementwise]") {
  Tensor t = tensor_of({0.0, -0.0, 1.0, -1.0, 20.0, -20.0}, {6}, DType::F32);
  REQUIRE(values_of(ops::relu(t)) == std::vector<double>{0, 0, 1, 0, 20, 0});
  REQUIRE(values_of(ops::abs(t)) == std::vector<double>{0, 0, 1, 1, 20, 20});
  std::vector<double> sig = values_of(ops::sigmoid(t));
  REQUIRE(sig[0] == 0.5);
  REQUIRE(sig[4] == Approx(1.0).epsilon(1e-7));
  REQUIRE(sig[5] == Approx(sigmoid_ref(-20.0)).epsilon(1e-5));  // no underflow to 0
  std::vector<double> e = values_of(ops::exp(tensor_of({0, 100, -200}, {3}, DType::F32)));
  REQUIRE(e[0] == 1.0);
  REQUIRE(std::isinf(e[1]));  // overflows float
  REQUIRE(e[2] == 0.0);
  std::vector<double> l = values_of(ops::log(tensor_of({0, 1, -1}, {3}, DType::F64)));
  REQUIRE(std::isinf(l[0]));
  REQUIRE(l[0] < 0);
  REQUIRE(l[1] == 0.0);
  REQUIRE(std::isnan(l[2]));
  std::vector<double> s = values_of(ops::sqrt(tensor_of({4, 0, 2.25}, {3}, DType::F64)));
  REQUIRE(s == std::vector<double>{2, 0, 1.5});
}

TEST_CASE("unary ops on integers", "[elementwise]") {
  for (DType dt : {DType::I32, DType::I64}) {
    INFO(dtype_name(dt));
    std::vector<double> in = random_stored(50, 7, dt, -100, 100);
    Tensor t = tensor_of(in, {5, 10}, dt);
    std::vector<double> neg, abs, relu;
    for (double x : in) {
      neg.push_back(-x);
      abs.push_back(std::fabs(x));
      relu.push_back(std::max(x, 0.0));
    }
    Tensor n = ops::neg(t);
    REQUIRE(n.dtype() == dt);
    REQUIRE(values_of(n) == neg);
    REQUIRE(values_of(ops::abs(t)) == abs);
    REQUIRE(values_of(ops::relu(t)) == relu);
  }
}

TEST_CASE("binary ops match a double-precision reference", "[elementwise]") {
  uint32_t seed = 200;
  const Shape shape{5, 29};
  for (const BinaryCase& c : binary_cases()) {
    for (DType dt : {DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::I64}) {
      if (is_integral(dt) && !c.integral) continue;
      INFO(c.name << " on " << dtype_name(dt));
      double scale = is_integral(dt) ? 1000.0 : 1.0;  // integers: whole numbers in a wide range
      std::vector<double> a =
          random_stored(shape.numel(), seed++, dt, c.a_lo * scale, c.a_hi * scale);
      std::vector<double> b =
          random_stored(shape.numel(), seed++, dt, c.b_lo * scale, c.b_hi * scale);
      Tensor out = c.op(tensor_of(a, shape, dt), tensor_of(b, shape, dt));
      REQUIRE(out.dtype() == dt);
      REQUIRE(out.shape() == shape);
      std::vector<double> expected;
      for (size_t i = 0; i < a.size(); ++i)
        expected.push_back(c.ref(a[i], b[i]));
      Tolerance tol = tolerance_for(dt);
      TANDEM_REQUIRE_CLOSE(values_of(out), expected, tol.rtol, tol.atol);
    }
  }
}

TEST_CASE("scalar variants", "[elementwise]") {
  struct ScalarCase {
    const char* name;
    std::function<Tensor(const Tensor&, double)> op;
    Ref2 ref;  // (element, scalar)
    double lo, hi, s;
  };
  const std::vector<ScalarCase> cases{
      {"add", [](const Tensor& a, double s) { return ops::add(a, s); },
       [](double x, double s) { return x + s; }, -3, 3, 1.75},
      {"sub", [](const Tensor& a, double s) { return ops::sub(a, s); },
       [](double x, double s) { return x - s; }, -3, 3, 0.5},
      {"rsub", [](const Tensor& a, double s) { return ops::rsub(a, s); },
       [](double x, double s) { return s - x; }, -3, 3, 2.0},
      {"mul", [](const Tensor& a, double s) { return ops::mul(a, s); },
       [](double x, double s) { return x * s; }, -3, 3, -1.5},
      {"div", [](const Tensor& a, double s) { return ops::div(a, s); },
       [](double x, double s) { return x / s; }, -3, 3, 4.0},
      {"rdiv", [](const Tensor& a, double s) { return ops::rdiv(a, s); },
       [](double x, double s) { return s / x; }, 0.25, 3, 3.0},
      {"pow 2", [](const Tensor& a, double s) { return ops::pow(a, s); },
       [](double x, double s) { return std::pow(x, s); }, -3, 3, 2.0},
      {"pow 0.5", [](const Tensor& a, double s) { return ops::pow(a, s); },
       [](double x, double s) { return std::pow(x, s); }, 0, 4, 0.5},
      {"pow -1.5", [](const Tensor& a, double s) { return ops::pow(a, s); },
       [](double x, double s) { return std::pow(x, s); }, 0.25, 4, -1.5},
      {"operator+", [](const Tensor& a, double s) { return a + s; },
       [](double x, double s) { return x + s; }, -3, 3, 0.25},
      {"operator-", [](const Tensor& a, double s) { return a - s; },
       [](double x, double s) { return x - s; }, -3, 3, 0.25},
      {"operator*", [](const Tensor& a, double s) { return a * s; },
       [](double x, double s) { return x * s; }, -3, 3, 3.0},
      {"operator/", [](const Tensor& a, double s) { return a / s; },
       [](double x, double s) { return x / s; }, -3, 3, -2.0},
  };
  uint32_t seed = 300;
  for (const ScalarCase& c : cases) {
    for (DType dt : kFloatDTypes) {
      INFO(c.name << " on " << dtype_name(dt));
      std::vector<double> a = random_stored(3 * 41, seed++, dt, c.lo, c.hi);
      Tensor out = c.op(tensor_of(a, {3, 41}, dt), c.s);
      REQUIRE(out.dtype() == dt);  // a double scalar does not promote the tensor
      std::vector<double> expected;
      for (double x : a)
        expected.push_back(c.ref(x, c.s));
      Tolerance tol = tolerance_for(dt);
      TANDEM_REQUIRE_CLOSE(values_of(out), expected, tol.rtol, tol.atol);
    }
  }
}

TEST_CASE("comparisons return bool tensors", "[elementwise]") {
  struct CmpCase {
    const char* name;
    BinaryFn op;
    std::function<Tensor(const Tensor&, double)> op_scalar;
    std::function<bool(double, double)> ref;
  };
  const std::vector<CmpCase> cases{
      {"eq", [](const Tensor& a, const Tensor& b) { return ops::eq(a, b); },
       [](const Tensor& a, double s) { return ops::eq(a, s); },
       [](double a, double b) { return a == b; }},
      {"ne", [](const Tensor& a, const Tensor& b) { return ops::ne(a, b); },
       [](const Tensor& a, double s) { return ops::ne(a, s); },
       [](double a, double b) { return a != b; }},
      {"lt", [](const Tensor& a, const Tensor& b) { return ops::lt(a, b); },
       [](const Tensor& a, double s) { return ops::lt(a, s); },
       [](double a, double b) { return a < b; }},
      {"le", [](const Tensor& a, const Tensor& b) { return ops::le(a, b); },
       [](const Tensor& a, double s) { return ops::le(a, s); },
       [](double a, double b) { return a <= b; }},
      {"gt", [](const Tensor& a, const Tensor& b) { return ops::gt(a, b); },
       [](const Tensor& a, double s) { return ops::gt(a, s); },
       [](double a, double b) { return a > b; }},
      {"ge", [](const Tensor& a, const Tensor& b) { return ops::ge(a, b); },
       [](const Tensor& a, double s) { return ops::ge(a, s); },
       [](double a, double b) { return a >= b; }},
  };
  uint32_t seed = 400;
  for (const CmpCase& c : cases) {
    for (DType dt : {DType::F32, DType::F64, DType::BF16, DType::I32, DType::I64}) {
      INFO(c.name << " on " << dtype_name(dt));
      // Whole numbers in [-2, 2]: many ties.
      std::vector<double> a = random_stored(60, seed++, DType::I64, -2, 2);
      std::vector<double> b = random_stored(5, seed++, DType::I64, -2, 2);
      Tensor ta = tensor_of(a, {12, 5}, dt), tb = tensor_of(b, {5}, dt);
      Tensor out = c.op(ta, tb);
      REQUIRE(out.dtype() == DType::Bool);
      REQUIRE(out.shape() == Shape{12, 5});
      std::vector<double> expected, expected_s;
      for (size_t i = 0; i < a.size(); ++i) {
        expected.push_back(c.ref(a[i], b[i % 5]) ? 1.0 : 0.0);
        expected_s.push_back(c.ref(a[i], 1.0) ? 1.0 : 0.0);
      }
      REQUIRE(values_of(out) == expected);
      Tensor out_s = c.op_scalar(ta, 1.0);
      REQUIRE(out_s.dtype() == DType::Bool);
      REQUIRE(values_of(out_s) == expected_s);
    }
  }
  // A fractional scalar against floats is compared exactly, not rounded.
  Tensor f = tensor_of({0.5, 0.25, 1.0}, {3}, DType::F64);
  REQUIRE(values_of(ops::lt(f, 0.3)) == std::vector<double>{0, 1, 0});
}

TEST_CASE("where selects elementwise with broadcasting", "[elementwise]") {
  const Index cond_shape{3, 1, 4}, a_shape{2, 1}, b_shape{4};
  std::vector<double> cond = random_stored(12, 1, DType::I64, 0, 1);
  std::vector<double> a = random_stored(2, 2, DType::F32), b = random_stored(4, 3, DType::F32);
  Tensor tc = tensor_of(cond, Shape(cond_shape), DType::Bool);
  Tensor out = ops::where(tc, tensor_of(a, Shape(a_shape)), tensor_of(b, Shape(b_shape)));
  const Index out_shape{3, 2, 4};
  REQUIRE(out.shape() == Shape(out_shape));
  REQUIRE(out.dtype() == DType::F32);
  std::vector<double> expected;
  for_each_index(out_shape, [&](const Index& i) {
    bool c = cond[broadcast_linear(i, cond_shape)] != 0;
    expected.push_back(c ? a[broadcast_linear(i, a_shape)] : b[broadcast_linear(i, b_shape)]);
  });
  REQUIRE(values_of(out) == expected);

  Tensor out_s = ops::where(tc, tensor_of(a, Shape(a_shape), DType::F64), 7.5);
  REQUIRE(out_s.dtype() == DType::F64);
  std::vector<double> expected_s;
  for_each_index(out_shape, [&](const Index& i) {
    bool c = cond[broadcast_linear(i, cond_shape)] != 0;
    expected_s.push_back(c ? a[broadcast_linear(i, a_shape)] : 7.5);
  });
  REQUIRE(values_of(out_s) == expected_s);

  REQUIRE_THROWS_AS(
      ops::where(tensor_of({1, 0, 1}, {3}, DType::Bool), ops::zeros({4}), ops::ones({4})), Error);
}

TEST_CASE("broadcasting", "[elementwise]") {
  struct Pair {
    Index a, b;
  };
  const std::vector<Pair> pairs{
      {{4, 1, 3}, {2, 3}},    {{}, {2, 3}},     {{2, 3}, {}},  {{1}, {3, 1}},
      {{5, 1, 1, 2}, {3, 1}}, {{2, 1}, {1, 2}}, {{1, 1}, {1}},
  };
  const std::vector<std::pair<const char*, Ref2>> refs{
      {"add", [](double a, double b) { return a + b; }},
      {"mul", [](double a, double b) { return a * b; }},
      {"maximum", [](double a, double b) { return std::max(a, b); }},
  };
  uint32_t seed = 500;
  for (const Pair& p : pairs) {
    for (DType dt : {DType::F32, DType::F64}) {
      std::vector<double> a = random_stored(numel_of(p.a), seed++, dt);
      std::vector<double> b = random_stored(numel_of(p.b), seed++, dt);
      Tensor ta = tensor_of(a, Shape(p.a), dt), tb = tensor_of(b, Shape(p.b), dt);
      for (const auto& [name, ref] : refs) {
        INFO(name << " " << Shape(p.a).str() << " with " << Shape(p.b).str() << " in "
                  << dtype_name(dt));
        Index out_shape;
        std::vector<double> expected = ref_binary(a, p.a, b, p.b, ref, out_shape);
        Tensor out = std::string(name) == "add"   ? ops::add(ta, tb)
                     : std::string(name) == "mul" ? ops::mul(ta, tb)
                                                  : ops::maximum(ta, tb);
        REQUIRE(out.shape() == Shape(out_shape));
        Tolerance tol = tolerance_for(dt);
        TANDEM_REQUIRE_CLOSE(values_of(out), expected, tol.rtol, tol.atol);
      }
    }
  }
}

TEST_CASE("non-contiguous inputs", "[elementwise]") {
  // Base tensors whose values the test knows; the operands are views of them.
  std::vector<double> va = random_stored(12, 1, DType::F32);  // (3, 4)
  std::vector<double> vb = random_stored(28, 2, DType::F32);  // (4, 7)
  std::vector<double> vc = random_stored(3, 3, DType::F32);   // (1, 3)
  Tensor a = ops::transpose(tensor_of(va, {3, 4}), 0, 1);     // (4, 3): a[i][j] = va[j][i]
  Tensor b = ops::slice(tensor_of(vb, {4, 7}), 1, 0, 7, 3);   // (4, 3): b[i][j] = vb[i][3j]
  Tensor c = ops::expand(tensor_of(vc, {1, 3}), {4, 3});      // (4, 3): c[i][j] = vc[j]
  REQUIRE_FALSE(a.is_contiguous());
  REQUIRE_FALSE(b.is_contiguous());
  REQUIRE_FALSE(c.is_contiguous());
  auto A = [&](int64_t i, int64_t j) { return va[j * 4 + i]; };
  auto B = [&](int64_t i, int64_t j) { return vb[i * 7 + 3 * j]; };
  auto C = [&](int64_t i, int64_t j) { return vc[j]; };

  std::vector<double> e_ab, e_bc, e_exp, e_ca;
  for (int64_t i = 0; i < 4; ++i) {
    for (int64_t j = 0; j < 3; ++j) {
      e_ab.push_back(A(i, j) + B(i, j));
      e_bc.push_back(B(i, j) * C(i, j));
      e_exp.push_back(std::exp(A(i, j)));
      e_ca.push_back(C(i, j) - A(i, j));
    }
  }
  Tolerance tol = tolerance_for(DType::F32);
  TANDEM_REQUIRE_CLOSE(values_of(ops::add(a, b)), e_ab, tol.rtol, tol.atol);
  TANDEM_REQUIRE_CLOSE(values_of(ops::mul(b, c)), e_bc, tol.rtol, tol.atol);
  TANDEM_REQUIRE_CLOSE(values_of(ops::exp(a)), e_exp, tol.rtol, tol.atol);
  TANDEM_REQUIRE_CLOSE(values_of(ops::sub(c, a)), e_ca, tol.rtol, tol.atol);
  Tensor out = ops::add(a, b);
  REQUIRE(out.is_contiguous());
  REQUIRE_FALSE(out.is_alias_of(a));
  // A scalar op on a strided input.
  std::vector<double> e_s;
  for (int64_t i = 0; i < 4; ++i) {
    for (int64_t j = 0; j < 3; ++j)
      e_s.push_back(B(i, j) * 2.0);
  }
  TANDEM_REQUIRE_CLOSE(values_of(ops::mul(b, 2.0)), e_s, tol.rtol, tol.atol);
}

TEST_CASE("dtype promotion", "[elementwise]") {
  Tensor i32 = tensor_of({1, -2, 3}, {3}, DType::I32);
  Tensor i64 = tensor_of({10, 20, 30}, {3}, DType::I64);
  Tensor f32 = tensor_of({0.5, 0.25, -1.5}, {3}, DType::F32);
  Tensor f64 = tensor_of({0.125, 1e-10, 2.0}, {3}, DType::F64);
  Tensor bf16 = tensor_of({1.5, 2.0, -0.5}, {3}, DType::BF16);
  Tensor f16 = tensor_of({0.25, 3.0, 1.0}, {3}, DType::F16);
  Tensor bools = tensor_of({1, 0, 1}, {3}, DType::Bool);

  Tensor r = ops::add(i32, f32);
  REQUIRE(r.dtype() == DType::F32);
  REQUIRE(values_of(r) == std::vector<double>{1.5, -1.75, 1.5});
  r = ops::add(f32, i32);
  REQUIRE(r.dtype() == DType::F32);
  r = ops::mul(i64, f64);
  REQUIRE(r.dtype() == DType::F64);
  REQUIRE(values_of(r) == std::vector<double>{1.25, 20 * 1e-10, 60.0});
  r = ops::add(i32, i64);
  REQUIRE(r.dtype() == DType::I64);
  REQUIRE(values_of(r) == std::vector<double>{11, 18, 33});
  r = ops::add(bf16, f32);
  REQUIRE(r.dtype() == DType::F32);
  REQUIRE(values_of(r) == std::vector<double>{2.0, 2.25, -2.0});
  r = ops::add(bf16, f16);
  REQUIRE(r.dtype() == DType::F32);
  REQUIRE(values_of(r) == std::vector<double>{1.75, 5.0, 0.5});
  r = ops::sub(i32, bf16);
  REQUIRE(r.dtype() == DType::BF16);
  REQUIRE(values_of(r) == std::vector<double>{-0.5, -4.0, 3.5});
  r = ops::add(bools, i32);
  REQUIRE(r.dtype() == DType::I32);
  REQUIRE(values_of(r) == std::vector<double>{2, -2, 4});
  r = ops::maximum(f32, f64);
  REQUIRE(r.dtype() == DType::F64);
  REQUIRE(values_of(r) == std::vector<double>{0.5, 0.25, 2.0});
  REQUIRE(ops::lt(i32, f32).dtype() == DType::Bool);
  REQUIRE(values_of(ops::lt(i32, f32)) == std::vector<double>{0, 1, 0});
  REQUIRE(ops::add(bf16, 1.0).dtype() == DType::BF16);
}

TEST_CASE("shape mismatch names the op and both shapes", "[elementwise]") {
  Tensor a = ops::zeros({2, 3}), b = ops::zeros({4, 5});
  try {
    ops::add(a, b);
    FAIL("add of mismatched shapes succeeded");
  } catch (const Error& e) {
    std::string msg = e.what();
    REQUIRE_THAT(msg, Contains("[tensor::add]"));
    REQUIRE_THAT(msg, Contains("[2,3]"));
    REQUIRE_THAT(msg, Contains("[4,5]"));
  }
  REQUIRE_THROWS_WITH(ops::mul(a, ops::zeros({3, 2})), Contains("[tensor::mul]"));
  REQUIRE_THROWS_WITH(ops::where(ops::zeros({2, 3}, DType::Bool), a, b), Contains("[4,5]"));
  REQUIRE_THROWS_AS(ops::eq(a, ops::zeros({4})), Error);
}

TEST_CASE("dropout zeroes the elements its counters pick and scales the rest", "[elementwise]") {
  constexpr int64_t n = 100000;
  const double p = 0.3;
  const std::vector<double> in = random_stored(n, 900, DType::F32, 0.5, 2.0);  // never 0
  const Tensor x = tensor_of(in, {n}, DType::F32);
  const uint64_t seed = 1234, offset = 77;
  const std::vector<double> out = values_of(ops::dropout(x, p, seed, offset));
  const float scale = static_cast<float>(1.0 / (1.0 - p));
  int64_t dropped = 0;
  bool mask_ok = true, scale_ok = true;
  for (int64_t i = 0; i < n; ++i) {
    // The documented contract: element i drops where its uniform is below p.
    const bool drop = philox_uniform(offset, seed, i) < static_cast<float>(p);
    dropped += drop ? 1 : 0;
    mask_ok = mask_ok && (drop == (out[i] == 0.0));
    if (!drop) scale_ok = scale_ok && out[i] == static_cast<float>(in[i]) * scale;
  }
  CHECK(mask_ok);
  CHECK(scale_ok);
  // 5 standard deviations of a binomial(n, p) count.
  CHECK(std::abs(static_cast<double>(dropped) / n - p) < 5 * std::sqrt(p * (1 - p) / n));
  // Same counters, same mask; other counters, another mask; any thread count.
  CHECK(ops::equal(ops::dropout(x, p, seed, offset), ops::dropout(x, p, seed, offset)));
  CHECK_FALSE(ops::equal(ops::dropout(x, p, seed, offset), ops::dropout(x, p, seed, offset + 1)));
  ops::set_num_threads(2);
  const Tensor threaded = ops::dropout(x, p, seed, offset);
  ops::set_num_threads(1);
  CHECK(ops::equal(threaded, ops::dropout(x, p, seed, offset)));
}

TEST_CASE("dropout at p = 0 and p = 1, on 16-bit and strided inputs, and its errors",
          "[elementwise]") {
  const Tensor x = tensor_of({1, -2, 3, -4, 5, -6}, {2, 3}, DType::F32);
  CHECK(ops::dropout(x, 0.0, 1, 0).raw_data() == x.raw_data());  // x itself
  CHECK(values_of(ops::dropout(x, 1.0, 1, 0)) == std::vector<double>(6, 0.0));
  // A transposed view is read in its logical order: element i of the result
  // uses counter offset + i, as for a contiguous copy.
  const Tensor xt = ops::transpose(x, 0, 1);
  CHECK(ops::equal(ops::dropout(xt, 0.5, 9, 3), ops::dropout(ops::contiguous(xt), 0.5, 9, 3)));
  const Tensor h = ops::to(x, DType::BF16);
  const std::vector<double> hv = values_of(ops::dropout(h, 0.5, 9, 3));
  const std::vector<double> fv = values_of(ops::dropout(x, 0.5, 9, 3));
  CHECK(hv == fv);  // x / 0.5 is exact in bf16 for these values
  // The generator form reserves numel counters, whatever p.
  Generator gen(5);
  ops::dropout(x, 0.0, gen);
  CHECK(gen.offset() == 6);
  CHECK_THROWS_WITH(ops::dropout(x, 1.5, gen),
                    Contains("[tensor::dropout] expected p in [0, 1], got 1.5"));
  CHECK(gen.offset() == 6);  // a rejected call draws nothing
  CHECK_THROWS_WITH(ops::dropout(ops::ones({2}, DType::I64), 0.5, 1, 0),
                    Contains("[tensor::dropout] expected a floating x, got i64"));
}
