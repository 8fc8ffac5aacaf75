// Reductions, arg-reductions, cumsum and softmax against naive loops, over
// single, several, all and negative dims, with and without keepdim, on
// contiguous and strided inputs.
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "tandem/tensor/ops.h"
#include "tests/support/test_util.h"

using namespace tandem;
using namespace tandem::test;
using Catch::Matchers::Contains;

namespace {

using Index = std::vector<int64_t>;

enum class Kind { Sum, Mean, Amax, Amin };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Sum:
      return "sum";
    case Kind::Mean:
      return "mean";
    case Kind::Amax:
      return "amax";
    case Kind::Amin:
      return "amin";
  }
  return "?";
}

Tensor run(Kind k, const Tensor& t, const Dims& dims, bool keepdim) {
  switch (k) {
    case Kind::Sum:
      return ops::sum(t, dims, keepdim);
    case Kind::Mean:
      return ops::mean(t, dims, keepdim);
    case Kind::Amax:
      return ops::amax(t, dims, keepdim);
    case Kind::Amin:
      return ops::amin(t, dims, keepdim);
  }
  return {};
}

// Reference reduction of `v` (row-major, `shape`) over `dims` (possibly
// negative; empty = all dims).
std::vector<double> ref_reduce(Kind kind, const std::vector<double>& v, const Index& shape,
                               std::vector<int64_t> dims, bool keepdim, Index& out_shape) {
  const int n = static_cast<int>(shape.size());
  std::vector<bool> reduced(n, dims.empty());
  for (int64_t d : dims)
    reduced[d < 0 ? d + n : d] = true;
  Index full = shape;
  for (int d = 0; d < n; ++d) {
    if (reduced[d]) full[d] = 1;
  }
  const double init = kind == Kind::Amax   ? -std::numeric_limits<double>::infinity()
                      : kind == Kind::Amin ? std::numeric_limits<double>::infinity()
                                           : 0.0;
  std::vector<double> acc(numel_of(full), init);
  std::vector<int64_t> count(acc.size(), 0);
  for_each_index(shape, [&](const Index& idx) {
    Index o = idx;
    for (int d = 0; d < n; ++d) {
      if (reduced[d]) o[d] = 0;
    }
    int64_t j = ravel(o, full);
    double x = v[ravel(idx, shape)];
    if (kind == Kind::Amax) {
      acc[j] = std::max(acc[j], x);
    } else if (kind == Kind::Amin) {
      acc[j] = std::min(acc[j], x);
    } else {
      acc[j] += x;
    }
    ++count[j];
  });
  if (kind == Kind::Mean) {
    for (size_t j = 0; j < acc.size(); ++j)
      acc[j] /= static_cast<double>(count[j]);
  }
  out_shape.clear();
  for (int d = 0; d < n; ++d) {
    if (keepdim || !reduced[d]) out_shape.push_back(full[d]);
  }
  return acc;
}

// An input of logical shape (3, 4, 5) in one of three layouts, with its
// logical values.
struct Input {
  const char* layout;
  Tensor t;
  std::vector<double> values;
};

std::vector<Input> inputs(DType dt, uint32_t seed, double lo = -1.0, double hi = 1.0) {
  std::vector<Input> out;
  const Index shape{3, 4, 5};
  {
    std::vector<double> v = random_stored(60, seed, dt, lo, hi);
    out.push_back({"contiguous", tensor_of(v, {3, 4, 5}, dt), v});
  }
  {
    // base (5, 3, 4) permuted to (3, 4, 5): t[i][j][k] = base[k][i][j]
    std::vector<double> b = random_stored(60, seed + 1, dt, lo, hi);
    Tensor t = ops::permute(tensor_of(b, {5, 3, 4}, dt), {1, 2, 0});
    std::vector<double> v;
    for_each_index(shape, [&](const Index& i) {
      v.push_back(b[ravel({i[2], i[0], i[1]}, {5, 3, 4})]);
    });
    out.push_back({"permuted", t, v});
  }
  {
    // base (3, 8, 5) sliced with step 2 along dim 1: t[i][j][k] = base[i][2j+1][k]
    std::vector<double> b = random_stored(120, seed + 2, dt, lo, hi);
    Tensor t = ops::slice(tensor_of(b, {3, 8, 5}, dt), 1, 1, 8, 2);
    std::vector<double> v;
    for_each_index(shape, [&](const Index& i) {
      v.push_back(b[ravel({i[0], 2 * i[1] + 1, i[2]}, {3, 8, 5})]);
    });
    out.push_back({"sliced", t, v});
  }
  return out;
}

const std::vector<std::vector<int64_t>> kDimSets{{0},    {1},       {2},         {-1},   {-3},
                                                 {0, 2}, {2, 0},    {-1, 0},     {1, 2}, {0, 1},
                                                 {},     {0, 1, 2}, {-3, -2, -1}};

}  // namespace

TEST_CASE("sum, mean, amax and amin over dims", "[reduce]") {
  for (DType dt : {DType::F32, DType::F64}) {
    for (const Input& in : inputs(dt, 11)) {
      for (Kind kind : {Kind::Sum, Kind::Mean, Kind::Amax, Kind::Amin}) {
        for (const auto& dims : kDimSets) {
          for (bool keepdim : {false, true}) {
            INFO(kind_name(kind) << " " << dtype_name(dt) << " " << in.layout << " dims "
                                 << Dims(dims).str() << " keepdim " << keepdim);
            Index out_shape;
            std::vector<double> expected =
                ref_reduce(kind, in.values, {3, 4, 5}, dims, keepdim, out_shape);
            Tensor out = run(kind, in.t, Dims(dims), keepdim);
            REQUIRE(out.shape() == Shape(out_shape));
            REQUIRE(out.dtype() == dt);
            if (kind == Kind::Amax || kind == Kind::Amin) {
              REQUIRE(values_of(out) == expected);  // a selection: exact
            } else {
              double tol = dt == DType::F64 ? 1e-12 : 1e-5;
              TANDEM_REQUIRE_CLOSE(values_of(out), expected, tol, tol);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("reducing every dim gives a 0-d tensor", "[reduce]") {
  std::vector<double> v = random_stored(24, 5, DType::F64);
  Tensor t = tensor_of(v, {2, 3, 4}, DType::F64);
  double total = 0;
  for (double x : v)
    total += x;
  Tensor s = ops::sum(t);
  REQUIRE(s.dim() == 0);
  REQUIRE(s.item<double>() == Approx(total).epsilon(1e-12));
  Tensor k = ops::sum(t, {}, true);
  REQUIRE(k.shape() == Shape{1, 1, 1});
  REQUIRE(ops::mean(t).item<double>() == Approx(total / 24).epsilon(1e-12));
  // A long reduction stays accurate in f32 (pairwise or wider accumulation is not
  // required, but the error must stay within float rounding of the sum).
  std::vector<double> ones(100000, 0.1);
  Tensor many = tensor_of(ones, {100000});
  double ref = 100000 * static_cast<double>(0.1f);
  REQUIRE(ops::sum(many).item<float>() == Approx(ref).epsilon(1e-3));
}

TEST_CASE("reductions of 16-bit and integer tensors", "[reduce]") {
  for (DType dt : {DType::BF16, DType::F16}) {
    INFO(dtype_name(dt));
    for (const Input& in : inputs(dt, 21)) {
      for (const auto& dims : {std::vector<int64_t>{1}, std::vector<int64_t>{0, 2}}) {
        Index out_shape;
        std::vector<double> expected =
            ref_reduce(Kind::Sum, in.values, {3, 4, 5}, dims, false, out_shape);
        Tensor out = ops::sum(in.t, Dims(dims));
        REQUIRE(out.shape() == Shape(out_shape));
        REQUIRE(out.dtype() == dt);
        TANDEM_REQUIRE_CLOSE(values_of(out), expected, 1e-2, 2e-2);
        std::vector<double> emax =
            ref_reduce(Kind::Amax, in.values, {3, 4, 5}, dims, false, out_shape);
        REQUIRE(values_of(ops::amax(in.t, Dims(dims))) == emax);
      }
    }
  }
  for (DType dt : {DType::I32, DType::I64}) {
    INFO(dtype_name(dt));
    for (const Input& in : inputs(dt, 31, -1000, 1000)) {
      for (const auto& dims : kDimSets) {
        Index out_shape;
        std::vector<double> expected =
            ref_reduce(Kind::Sum, in.values, {3, 4, 5}, dims, false, out_shape);
        Tensor out = ops::sum(in.t, Dims(dims));
        REQUIRE(out.shape() == Shape(out_shape));
        REQUIRE(is_integral(out.dtype()));
        REQUIRE(values_of(out) == expected);
        REQUIRE(values_of(ops::amin(in.t, Dims(dims))) ==
                ref_reduce(Kind::Amin, in.values, {3, 4, 5}, dims, false, out_shape));
      }
    }
  }
}

TEST_CASE("max, argmax and argmin pick the first occurrence", "[reduce]") {
  for (DType dt : {DType::F32, DType::F64, DType::I32}) {
    // Whole numbers in [-2, 2]: most rows have ties.
    for (const Input& in : inputs(dt, 41, -2, 2)) {
      for (int64_t dim : {0, 1, 2, -1, -2}) {
        for (bool keepdim : {false, true}) {
          INFO(dtype_name(dt) << " " << in.layout << " dim " << dim << " keepdim " << keepdim);
          const Index shape{3, 4, 5};
          const int d = static_cast<int>(dim < 0 ? dim + 3 : dim);
          Index out_full = shape;
          out_full[d] = 1;
          std::vector<double> vmax, vargmax, vargmin;
          for_each_index(out_full, [&](const Index& o) {
            double best = 0, worst = 0;
            int64_t ibest = -1, iworst = -1;
            for (int64_t r = 0; r < shape[d]; ++r) {
              Index idx = o;
              idx[d] = r;
              double x = in.values[ravel(idx, shape)];
              if (ibest < 0 || x > best) best = x, ibest = r;
              if (iworst < 0 || x < worst) worst = x, iworst = r;
            }
            vmax.push_back(best);
            vargmax.push_back(static_cast<double>(ibest));
            vargmin.push_back(static_cast<double>(iworst));
          });
          Index out_shape = out_full;
          if (!keepdim) out_shape.erase(out_shape.begin() + d);

          auto [values, indices] = ops::max(in.t, dim, keepdim);
          REQUIRE(values.shape() == Shape(out_shape));
          REQUIRE(values.dtype() == dt);
          REQUIRE(indices.shape() == Shape(out_shape));
          REQUIRE(indices.dtype() == DType::I64);
          REQUIRE(values_of(values) == vmax);
          REQUIRE(values_of(indices) == vargmax);
          Tensor am = ops::argmax(in.t, dim, keepdim);
          REQUIRE(am.dtype() == DType::I64);
          REQUIRE(am.shape() == Shape(out_shape));
          REQUIRE(values_of(am) == vargmax);
          REQUIRE(values_of(ops::argmin(in.t, dim, keepdim)) == vargmin);
        }
      }
    }
  }
  // All equal: index 0 everywhere.
  Tensor flat = ops::full({2, 6}, 3.0);
  REQUIRE(values_of(ops::argmax(flat, 1)) == std::vector<double>{0, 0});
  REQUIRE(values_of(ops::argmin(flat, 0)) == std::vector<double>(6, 0));
}

TEST_CASE("cumsum along each dim", "[reduce]") {
  for (DType dt : {DType::F32, DType::F64, DType::I64}) {
    for (const Input& in : inputs(dt, 51, -10, 10)) {
      for (int64_t dim : {0, 1, 2, -1, -3}) {
        INFO(dtype_name(dt) << " " << in.layout << " dim " << dim);
        const Index shape{3, 4, 5};
        const int d = static_cast<int>(dim < 0 ? dim + 3 : dim);
        std::vector<double> expected(in.values.size());
        for_each_index(shape, [&](const Index& idx) {
          double s = 0;
          Index j = idx;
          for (j[d] = 0; j[d] <= idx[d]; ++j[d])
            s += in.values[ravel(j, shape)];
          expected[ravel(idx, shape)] = s;
        });
        Tensor out = ops::cumsum(in.t, dim);
        REQUIRE(out.shape() == Shape{3, 4, 5});
        if (is_integral(dt)) {
          REQUIRE(values_of(out) == expected);
        } else {
          REQUIRE(out.dtype() == dt);
          double tol = dt == DType::F64 ? 1e-12 : 1e-5;
          TANDEM_REQUIRE_CLOSE(values_of(out), expected, tol, tol);
        }
      }
    }
  }
}

namespace {

std::vector<double> ref_softmax(const std::vector<double>& v, const Index& shape, int d, bool log) {
  std::vector<double> out(v.size());
  Index full = shape;
  full[d] = 1;
  for_each_index(full, [&](const Index& o) {
    Index idx = o;
    double m = -INFINITY;
    for (idx[d] = 0; idx[d] < shape[d]; ++idx[d])
      m = std::max(m, v[ravel(idx, shape)]);
    double s = 0;
    for (idx[d] = 0; idx[d] < shape[d]; ++idx[d])
      s += std::exp(v[ravel(idx, shape)] - m);
    for (idx[d] = 0; idx[d] < shape[d]; ++idx[d]) {
      double x = v[ravel(idx, shape)] - m;
      out[ravel(idx, shape)] = log ? x - std::log(s) : std::exp(x) / s;
    }
  });
  return out;
}

}  // namespace

TEST_CASE("softmax and log_softmax along each dim", "[reduce]") {
  for (DType dt : {DType::F32, DType::F64, DType::BF16}) {
    for (const Input& in : inputs(dt, 61, -4, 4)) {
      for (int64_t dim : {0, 1, 2, -1, -2}) {
        for (bool log : {false, true}) {
          INFO((log ? "log_softmax " : "softmax ")
               << dtype_name(dt) << " " << in.layout << " dim " << dim);
          const int d = static_cast<int>(dim < 0 ? dim + 3 : dim);
          std::vector<double> expected = ref_softmax(in.values, {3, 4, 5}, d, log);
          Tensor out = log ? ops::log_softmax(in.t, dim) : ops::softmax(in.t, dim);
          REQUIRE(out.shape() == Shape{3, 4, 5});
          REQUIRE(out.dtype() == dt);
          double rtol = dt == DType::F64 ? 1e-12 : dt == DType::F32 ? 1e-5 : 1e-2;
          double atol = dt == DType::F64 ? 1e-14 : dt == DType::F32 ? 1e-6 : 1e-2;
          TANDEM_REQUIRE_CLOSE(values_of(out), expected, rtol, atol);
        }
      }
    }
  }
  // The default dim is the last.
  Tensor t = random_tensor({2, 3}, DType::F64, 7);
  REQUIRE(values_of(ops::softmax(t)) == values_of(ops::softmax(t, 1)));
}

TEST_CASE("softmax is numerically stable for large inputs", "[reduce]") {
  for (DType dt : {DType::F32, DType::F64}) {
    INFO(dtype_name(dt));
    std::vector<double> small = random_stored(24, 71, dt, -3, 3);
    std::vector<double> large, neg_large;
    for (double x : small) {
      large.push_back(x + 1000.0);
      neg_large.push_back(x - 1000.0);
    }
    // Shift invariance, computed in double from the stored values.
    std::vector<double> expected =
        ref_softmax(values_of(tensor_of(large, {4, 6}, dt)), {4, 6}, 1, false);
    std::vector<double> got = values_of(ops::softmax(tensor_of(large, {4, 6}, dt), 1));
    for (double x : got)
      REQUIRE(std::isfinite(x));
    double tol = dt == DType::F64 ? 1e-12 : 1e-5;
    TANDEM_REQUIRE_CLOSE(got, expected, tol, 1e-6);
    std::vector<double> got_neg = values_of(ops::softmax(tensor_of(neg_large, {4, 6}, dt), 1));
    for (double x : got_neg)
      REQUIRE(std::isfinite(x));
    for (int64_t r = 0; r < 4; ++r) {
      double s = 0;
      for (int64_t c = 0; c < 6; ++c)
        s += got_neg[r * 6 + c];
      REQUIRE(s == Approx(1.0).epsilon(1e-5));
    }
    std::vector<double> lexpected =
        ref_softmax(values_of(tensor_of(large, {4, 6}, dt)), {4, 6}, 1, true);
    std::vector<double> lgot = values_of(ops::log_softmax(tensor_of(large, {4, 6}, dt), 1));
    for (double x : lgot)
      REQUIRE(std::isfinite(x));
    TANDEM_REQUIRE_CLOSE(lgot, lexpected, tol, 1e-4);
  }
  // One dominant logit: probability 1, no NaN from exp overflow.
  std::vector<double> p = values_of(ops::softmax(tensor_of({0, 1000, 0}, {3})));
  REQUIRE(p == std::vector<double>{0, 1, 0});
}

TEST_CASE("reductions reject bad dims", "[reduce]") {
  Tensor t = ops::zeros({3, 4, 5});
  REQUIRE_THROWS_WITH(ops::sum(t, {3}), Contains("[tensor::"));
  REQUIRE_THROWS_AS(ops::sum(t, {-4}), Error);
  REQUIRE_THROWS_AS(ops::mean(t, {0, 0}), Error);
  REQUIRE_THROWS_AS(ops::mean(t, {1, -2}), Error);
  REQUIRE_THROWS_AS(ops::amax(t, {5}), Error);
  REQUIRE_THROWS_AS(ops::amin(t, {0, 3}), Error);
  REQUIRE_THROWS_AS(ops::max(t, 3), Error);
  REQUIRE_THROWS_AS(ops::argmax(t, -4), Error);
  REQUIRE_THROWS_AS(ops::argmin(t, 7), Error);
  REQUIRE_THROWS_AS(ops::cumsum(t, 3), Error);
  REQUIRE_THROWS_AS(ops::softmax(t, 3), Error);
  REQUIRE_THROWS_AS(ops::log_softmax(t, -4), Error);
}

TEST_CASE("softmax of masked lines: -inf elements get 0, an all -inf line gives zeros",
          "[reduce]") {
  const double ninf = -std::numeric_limits<double>::infinity();
  for (DType dt : {DType::F32, DType::F64}) {
    INFO(dtype_name(dt));
    // Row 0 is fully masked (PyTorch: NaN; tandem: zeros, tensor/ops.h).
    const Tensor t = tensor_of({ninf, ninf, ninf, 0.0, ninf, std::log(3.0)}, {2, 3}, dt);
    const std::vector<double> p = values_of(ops::softmax(t, 1));
    CHECK(p[0] == 0.0);
    CHECK(p[1] == 0.0);
    CHECK(p[2] == 0.0);
    CHECK(p[3] == Approx(0.25).epsilon(1e-6));
    CHECK(p[4] == 0.0);
    CHECK(p[5] == Approx(0.75).epsilon(1e-6));
    const std::vector<double> lp = values_of(ops::log_softmax(t, 1));
    CHECK(lp[3] == Approx(std::log(0.25)).epsilon(1e-6));
    CHECK(lp[4] == ninf);
    // Along dim 0 (a strided line): column 1 is all -inf.
    const std::vector<double> q = values_of(ops::softmax(t, 0));
    CHECK(q[1] == 0.0);
    CHECK(q[4] == 0.0);
    CHECK(q[3] == 1.0);
  }
}
