// Accuracy and determinism of long floating sums (Note [Cascade summation] in
// tensor/cpu/cascade.h): sum, mean, a bias-gradient-style sum over two leading
// dims, softmax and log_softmax denominators, cumsum and the norms' statistics
// and weight gradients, each against an f64 reference computed here.
//
// The error bound of each case is the same at every length. Adding into one
// f32 accumulator per output gives an error that grows like n: for 1M
// uniform [0, 1) values it is about 2e-5 of the sum, far above the bound, so
// a kernel that went back to that order would fail here. The kernels must also
// give the same bits at 1, 2 and 3 CPU kernel threads.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "tandem/tensor/ops.h"
#include "tests/support/test_util.h"

using namespace tandem;
using namespace tandem::test;

namespace {

// f32 values in [lo, hi) as a tensor and as the doubles it holds.
struct Data {
  std::vector<double> v;
  Tensor t;
};

Data f32_data(const Shape& shape, uint32_t seed, double lo, double hi) {
  Data d;
  d.v = random_stored(static_cast<size_t>(shape.numel()), seed, DType::F32, lo, hi);
  d.t = tensor_of(d.v, shape, DType::F32);
  return d;
}

// The bound on |got - exact| / sum |x| for every f32 sum here: about 8 ulps
// of the sum, whatever the length. The cascade's worst case is
// (kSumBlock / kSumLanes + log2 n) rounding errors, each at most eps / 2 of
// a partial sum, and random rounding errors cancel to far less than that.
constexpr double kSumBound = 1e-6;

// Restores one CPU kernel thread when a test ends (the suite's default).
struct Threads {
  explicit Threads(int n) { ops::set_num_threads(n); }
  ~Threads() { ops::set_num_threads(1); }
  Threads(const Threads&) = delete;
  Threads& operator=(const Threads&) = delete;
};

bool same_bits(const Tensor& a, const Tensor& b) {
  return ops::equal(a, b);
}

}  // namespace

TEST_CASE("long f32 sums have an error bound that does not grow with n", "[reduce][numerics]") {
  for (int64_t n : {int64_t{10000}, int64_t{1} << 20, int64_t{4} << 20}) {
    INFO("n = " << n);
    const Data d = f32_data(Shape{n}, 11, 0.0, 1.0);
    double exact = 0, abs_sum = 0;
    for (double x : d.v) {
      exact += x;
      abs_sum += std::abs(x);
    }
    const double got = ops::sum(d.t).item_double();
    CHECK(std::abs(got - exact) / abs_sum < kSumBound);
    const double mean = ops::mean(d.t).item_double();
    CHECK(std::abs(mean - exact / n) / (abs_sum / n) < kSumBound);
  }
}

TEST_CASE("sums over a non-last dim have an error bound that does not grow with the rows",
          "[reduce][numerics]") {
  constexpr int64_t C = 3;
  for (int64_t rows : {int64_t{10000}, int64_t{1} << 20}) {
    INFO("rows = " << rows);
    const Data d = f32_data(Shape{rows, C}, 12, 0.0, 1.0);
    std::vector<double> exact(C, 0.0), abs_sum(C, 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < C; ++c) {
        exact[c] += d.v[r * C + c];
        abs_sum[c] += std::abs(d.v[r * C + c]);
      }
    }
    const std::vector<double> got = values_of(ops::sum(d.t, {0}));
    const std::vector<double> mean = values_of(ops::mean(d.t, {0}));
    for (int64_t c = 0; c < C; ++c) {
      CHECK(std::abs(got[c] - exact[c]) / abs_sum[c] < kSumBound);
      CHECK(std::abs(mean[c] - exact[c] / rows) / (abs_sum[c] / rows) < kSumBound);
    }
  }
}

TEST_CASE("a bias-gradient sum over 262k tokens is as accurate as a short one",
          "[reduce][numerics]") {
  // Linear's bias gradient: g (B, S, out) summed over B and S.
  constexpr int64_t out = 5;
  for (int64_t tokens : {int64_t{2048}, int64_t{1} << 18}) {
    INFO("tokens = " << tokens);
    const Data d = f32_data(Shape{4, tokens / 4, out}, 13, -0.5, 1.0);
    std::vector<double> exact(out, 0.0), abs_sum(out, 0.0);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t c = 0; c < out; ++c) {
        exact[c] += d.v[t * out + c];
        abs_sum[c] += std::abs(d.v[t * out + c]);
      }
    }
    const std::vector<double> got = values_of(ops::sum(d.t, {0, 1}));
    for (int64_t c = 0; c < out; ++c)
      CHECK(std::abs(got[c] - exact[c]) / abs_sum[c] < kSumBound);
  }
}

TEST_CASE("softmax and log_softmax over 8192 keep per-element accuracy", "[reduce][numerics]") {
  for (int64_t n : {int64_t{64}, int64_t{8192}, int64_t{1} << 16}) {
    INFO("n = " << n);
    const Data d = f32_data(Shape{2, n}, 14, -1.0, 1.0);
    const std::vector<double> p = values_of(ops::softmax(d.t, -1));
    const std::vector<double> lp = values_of(ops::log_softmax(d.t, -1));
    double worst_p = 0, worst_lp = 0;
    for (int64_t row = 0; row < 2; ++row) {
      const double* x = d.v.data() + row * n;
      const double m = *std::max_element(x, x + n);
      double z = 0;
      for (int64_t j = 0; j < n; ++j)
        z += std::exp(x[j] - m);
      for (int64_t j = 0; j < n; ++j) {
        const double ref = std::exp(x[j] - m) / z;
        const double ref_log = x[j] - m - std::log(z);
        worst_p = std::max(worst_p, std::abs(p[row * n + j] - ref) / ref);
        // log_softmax: the error of log(z) is absolute; scale by |log z|.
        worst_lp = std::max(worst_lp, std::abs(lp[row * n + j] - ref_log) / std::log(z));
      }
    }
    INFO("softmax " << worst_p << ", log_softmax " << worst_lp);
    // exp and the final scaling add a few ulps on top of the denominator's
    // error. (A denominator added in one f32 accumulator is off by ~2e-6 at
    // n = 8192 already.)
    CHECK(worst_p < 1e-6);
    CHECK(worst_lp < 1e-6);
  }
}

TEST_CASE("softmax over a non-last dim of 8192 keeps per-element accuracy", "[reduce][numerics]") {
  constexpr int64_t n = 8192, C = 3;
  const Data d = f32_data(Shape{n, C}, 15, -1.0, 1.0);
  const std::vector<double> p = values_of(ops::softmax(d.t, 0));
  double worst = 0;
  for (int64_t c = 0; c < C; ++c) {
    double m = -INFINITY, z = 0;
    for (int64_t j = 0; j < n; ++j)
      m = std::max(m, d.v[j * C + c]);
    for (int64_t j = 0; j < n; ++j)
      z += std::exp(d.v[j * C + c] - m);
    for (int64_t j = 0; j < n; ++j) {
      const double ref = std::exp(d.v[j * C + c] - m) / z;
      worst = std::max(worst, std::abs(p[j * C + c] - ref) / ref);
    }
  }
  CHECK(worst < 1e-6);
}

TEST_CASE("cumsum keeps every prefix within a bound that does not grow with n",
          "[reduce][numerics]") {
  for (int64_t n : {int64_t{10000}, int64_t{1} << 20}) {
    INFO("n = " << n);
    // A last-dim scan of one row and a first-dim scan of two columns.
    const Data d = f32_data(Shape{n}, 16, 0.0, 1.0);
    const std::vector<double> got = values_of(ops::cumsum(d.t, 0));
    const Data d2 = f32_data(Shape{n / 2, 2}, 17, 0.0, 1.0);
    const std::vector<double> got2 = values_of(ops::cumsum(d2.t, 0));
    double exact = 0, abs_sum = 0, worst = 0;
    for (int64_t j = 0; j < n; ++j) {
      exact += d.v[j];
      abs_sum += std::abs(d.v[j]);
      worst = std::max(worst, std::abs(got[j] - exact) / abs_sum);
    }
    double worst2 = 0;
    for (int64_t c = 0; c < 2; ++c) {
      double e = 0, a = 0;
      for (int64_t j = 0; j < n / 2; ++j) {
        e += d2.v[j * 2 + c];
        a += std::abs(d2.v[j * 2 + c]);
        worst2 = std::max(worst2, std::abs(got2[j * 2 + c] - e) / a);
      }
    }
    INFO("last dim " << worst << ", first dim " << worst2);
    CHECK(worst < kSumBound);
    CHECK(worst2 < kSumBound);
  }
}

TEST_CASE("layer_norm statistics and norm weight gradients stay accurate over long sums",
          "[nn][numerics]") {
  SECTION("a row of 1M elements with a large mean") {
    constexpr int64_t d = int64_t{1} << 20;
    const Data x = f32_data(Shape{1, d}, 18, 999.0, 1001.0);
    double mean = 0;
    for (double v : x.v)
      mean += v;
    mean /= d;
    double var = 0;
    for (double v : x.v)
      var += (v - mean) * (v - mean);
    var /= d;
    NormResult r = ops::layer_norm(x.t, Tensor(), Tensor(), 0.0);
    // The mean's error is relative to it; the variance's to itself (its
    // terms are all positive).
    CHECK(std::abs(r.mean.item_double() - mean) / mean < kSumBound);
    const double rstd = r.rstd.item_double();
    CHECK(std::abs(1.0 / (rstd * rstd) - var) / var < 1e-5);
  }
  SECTION("dweight and dbias over 262k rows") {
    constexpr int64_t rows = int64_t{1} << 18, d = 4;
    const Data x = f32_data(Shape{rows, d}, 19, -1.0, 1.0);
    const Data dy = f32_data(Shape{rows, d}, 20, 0.0, 1.0);
    const Tensor weight = ops::ones(Shape{d});
    NormResult f = ops::layer_norm(x.t, weight, ops::zeros(Shape{d}));
    NormGrads g = ops::norm_backward(dy.t, x.t, weight, f.mean, f.rstd, true, true);
    const std::vector<double> mean = values_of(f.mean), rstd = values_of(f.rstd);
    const std::vector<double> dw = values_of(g.dweight), db = values_of(g.dbias);
    for (int64_t c = 0; c < d; ++c) {
      double ew = 0, aw = 0, eb = 0, ab = 0;
      for (int64_t r = 0; r < rows; ++r) {
        // xhat from the kernel's own f32 statistics, so only the sums differ.
        const double xh = (x.v[r * d + c] - static_cast<float>(mean[r])) * rstd[r];
        ew += dy.v[r * d + c] * xh;
        aw += std::abs(dy.v[r * d + c] * xh);
        eb += dy.v[r * d + c];
        ab += std::abs(dy.v[r * d + c]);
      }
      CHECK(std::abs(dw[c] - ew) / aw < kSumBound);
      CHECK(std::abs(db[c] - eb) / ab < kSumBound);
    }
  }
}

TEST_CASE("reductions, softmax, cumsum and norm gradients have the same bits at any thread count",
          "[reduce][numerics][threads]") {
  const Data a = f32_data(Shape{int64_t{3} << 20}, 21, -1.0, 1.0);
  const Data b = f32_data(Shape{int64_t{1} << 17, 24}, 22, -1.0, 1.0);
  const Data c = f32_data(Shape{64, 8192}, 23, -3.0, 3.0);
  const Data dy = f32_data(Shape{int64_t{1} << 17, 24}, 24, -1.0, 1.0);
  auto run = [&] {
    const Tensor w = ops::ones(Shape{24});
    NormResult f = ops::layer_norm(b.t, w, ops::zeros(Shape{24}));
    NormGrads g = ops::norm_backward(dy.t, b.t, w, f.mean, f.rstd, true, true);
    return std::vector<Tensor>{ops::sum(a.t),
                               ops::mean(a.t),
                               ops::sum(b.t, {0}),
                               ops::sum(b.t, {1}),
                               ops::mean(ops::reshape(b.t, Shape{64, 2048, 24}), {1}),
                               ops::softmax(c.t, -1),
                               ops::log_softmax(c.t, 0),
                               ops::cumsum(a.t, 0),
                               ops::cumsum(b.t, 0),
                               f.out,
                               g.dx,
                               g.dweight,
                               g.dbias};
  };
  const std::vector<Tensor> one = run();
  for (int threads : {2, 3}) {
    Threads scope(threads);
    const std::vector<Tensor> many = run();
    for (size_t i = 0; i < one.size(); ++i) {
      INFO("threads " << threads << ", result " << i);
      CHECK(same_bits(one[i], many[i]));
    }
  }
}

TEST_CASE("integer sums over long rows and columns stay exact", "[reduce][numerics]") {
  // 2^40 + i: a float accumulator would lose the low bits; i64 must not.
  constexpr int64_t n = 300000;
  std::vector<int64_t> v(n);
  int64_t exact = 0;
  for (int64_t i = 0; i < n; ++i) {
    v[i] = (int64_t{1} << 40) + i;
    exact += v[i];
  }
  const Tensor t = ops::from_vector<int64_t>(v, Shape{n});
  CHECK(ops::sum(t).item<int64_t>() == exact);
  const std::vector<int64_t> cols =
      ops::sum(ops::reshape(t, Shape{n / 2, 2}), {0}).to_vector<int64_t>();
  int64_t even = 0, odd = 0;
  for (int64_t i = 0; i < n; ++i)
    (i % 2 == 0 ? even : odd) += v[i];
  CHECK(cols == std::vector<int64_t>{even, odd});
  CHECK(ops::cumsum(t, 0).to_vector<int64_t>().back() == exact);
}
