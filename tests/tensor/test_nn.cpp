// Tests of layer_norm, rms_norm, cross_entropy and scaled_dot_product_attention
// against naive double-precision loops written here, in f32 (tight
// tolerances) and bf16 (loose), on contiguous and strided inputs, plus the
// front ends' error messages; and of the CPU kernels' building blocks: the
// vectorised f32 exp, parallel_for and GEMM panels over 2 threads. The fused
// kernels' gradients are tested in tests/autograd/test_fused.cpp.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "tandem/tensor/cpu/parallel.h"
#include "tandem/tensor/half.h"
#include "tandem/tensor/ops.h"

using namespace tandem;
using Catch::Matchers::Contains;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

std::vector<float> random_floats(int64_t n, uint32_t seed, float lo = -2.0f, float hi = 2.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) {
    x = dist(gen);
  }
  return v;
}

// The values a bf16 tensor made from `v` holds.
std::vector<float> round_bf16(const std::vector<float>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    out[i] = static_cast<float>(BFloat16(v[i]));
  }
  return out;
}

// Values of a tensor of any floating dtype, as f32.
std::vector<float> values_f32(const Tensor& t) {
  return (t.dtype() == DType::F32 ? t : ops::to(t, DType::F32)).to_vector<float>();
}

// |got - want| <= atol + rtol * |want| everywhere; infinities must match exactly.
void require_close(const std::vector<float>& got, const std::vector<double>& want, double atol,
                   double rtol) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    INFO("element " << i << ": got " << got[i] << ", want " << want[i]);
    if (std::isinf(want[i])) {
      REQUIRE(static_cast<double>(got[i]) == want[i]);
    } else {
      REQUIRE(std::abs(static_cast<double>(got[i]) - want[i]) <= atol + rtol * std::abs(want[i]));
    }
  }
}

// The values of the (cols, rows) buffer `v` read as its transpose (rows, cols).
std::vector<float> transposed(const std::vector<float>& v, int64_t rows, int64_t cols) {
  std::vector<float> out(v.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      out[r * cols + c] = v[c * rows + r];
    }
  }
  return out;
}

struct NormRef {
  std::vector<double> out, mean, rstd;
};

NormRef naive_layer_norm(const std::vector<float>& x, const std::vector<float>* w,
                         const std::vector<float>* b, int64_t rows, int64_t d, double eps) {
  NormRef r;
  r.out.resize(x.size());
  for (int64_t i = 0; i < rows; ++i) {
    double mu = 0, var = 0;
    for (int64_t j = 0; j < d; ++j) {
      mu += x[i * d + j];
    }
    mu /= d;
    for (int64_t j = 0; j < d; ++j) {
      var += (x[i * d + j] - mu) * (x[i * d + j] - mu);
    }
    var /= d;
    const double rs = 1.0 / std::sqrt(var + eps);
    for (int64_t j = 0; j < d; ++j) {
      double y = (x[i * d + j] - mu) * rs;
      if (w) y *= (*w)[j];
      if (b) y += (*b)[j];
      r.out[i * d + j] = y;
    }
    r.mean.push_back(mu);
    r.rstd.push_back(rs);
  }
  return r;
}

NormRef naive_rms_norm(const std::vector<float>& x, const std::vector<float>* w, int64_t rows,
                       int64_t d, double eps) {
  NormRef r;
  r.out.resize(x.size());
  for (int64_t i = 0; i < rows; ++i) {
    double ms = 0;
    for (int64_t j = 0; j < d; ++j) {
      ms += static_cast<double>(x[i * d + j]) * x[i * d + j];
    }
    const double rs = 1.0 / std::sqrt(ms / d + eps);
    for (int64_t j = 0; j < d; ++j) {
      r.out[i * d + j] = x[i * d + j] * rs * (w ? (*w)[j] : 1.0);
    }
    r.rstd.push_back(rs);
  }
  return r;
}

}  // namespace

TEST_CASE("layer_norm matches a double-precision reference", "[nn]") {
  const int64_t rows = 6, d = 16;
  const double eps = 1e-5;
  // An offset mean makes a one-pass variance visibly wrong.
  const std::vector<float> xv = random_floats(rows * d, 1, 3.0f, 7.0f);
  const std::vector<float> wv = random_floats(d, 2), bv = random_floats(d, 3);
  const Tensor w = ops::from_vector<float>(wv, {d});
  const Tensor b = ops::from_vector<float>(bv, {d});

  for (int affine = 0; affine < 3; ++affine) {  // none, weight, weight + bias
    for (bool strided : {false, true}) {
      DYNAMIC_SECTION("affine " << affine << (strided ? ", transposed x" : ", (2, 3, D) x")) {
        // The strided x is the transpose of a (d, rows) buffer.
        const Tensor x = strided ? ops::transpose(ops::from_vector<float>(xv, {d, rows}), 0, 1)
                                 : ops::from_vector<float>(xv, {2, 3, d});
        const std::vector<float> dense = strided ? transposed(xv, rows, d) : xv;
        const ops::NormResult r =
            ops::layer_norm(x, affine >= 1 ? w : Tensor(), affine == 2 ? b : Tensor(), eps);
        const NormRef want = naive_layer_norm(dense, affine >= 1 ? &wv : nullptr,
                                              affine == 2 ? &bv : nullptr, rows, d, eps);
        REQUIRE(r.out.shape() == x.shape());
        REQUIRE(r.out.dtype() == DType::F32);
        REQUIRE(r.mean.shape() == Shape{rows});
        REQUIRE(r.rstd.shape() == Shape{rows});
        REQUIRE(r.mean.dtype() == DType::F32);
        require_close(r.out.to_vector<float>(), want.out, 1e-5, 1e-4);
        require_close(r.mean.to_vector<float>(), want.mean, 1e-6, 1e-5);
        require_close(r.rstd.to_vector<float>(), want.rstd, 1e-6, 1e-5);
      }
    }
  }
  SECTION("bf16, loose tolerance") {
    const std::vector<float> xr = round_bf16(xv), wr = round_bf16(wv), br = round_bf16(bv);
    const ops::NormResult r =
        ops::layer_norm(ops::to(ops::from_vector<float>(xv, {rows, d}), DType::BF16),
                        ops::to(w, DType::BF16), ops::to(b, DType::BF16), eps);
    REQUIRE(r.out.dtype() == DType::BF16);
    REQUIRE(r.mean.dtype() == DType::F32);
    const NormRef want = naive_layer_norm(xr, &wr, &br, rows, d, eps);
    require_close(values_f32(r.out), want.out, 2e-2, 2e-2);
    require_close(r.rstd.to_vector<float>(), want.rstd, 1e-5, 1e-4);
  }
  SECTION("errors") {
    const Tensor x = ops::from_vector<float>(xv, {rows, d});
    REQUIRE_THROWS_WITH(ops::layer_norm(x, ops::ones({d + 1}), Tensor()),
                        Contains("[tensor::layer_norm]") && Contains("weight") && Contains("[17]"));
    REQUIRE_THROWS_WITH(ops::layer_norm(x, w, ops::ones({d}, DType::F64)),
                        Contains("[tensor::layer_norm]") && Contains("bias") && Contains("f64"));
    REQUIRE_THROWS_WITH(ops::layer_norm(ops::zeros({rows, d}, DType::I64), Tensor(), Tensor()),
                        Contains("[tensor::layer_norm]") && Contains("i64"));
  }
}

TEST_CASE("rms_norm matches a double-precision reference", "[nn]") {
  const int64_t rows = 5, d = 12;
  const double eps = 1e-6;
  const std::vector<float> xv = random_floats(rows * d, 4);
  const std::vector<float> wv = random_floats(d, 5);
  const Tensor w = ops::from_vector<float>(wv, {d});
  for (bool with_weight : {false, true}) {
    for (bool strided : {false, true}) {
      DYNAMIC_SECTION((with_weight ? "weight" : "no weight")
                      << (strided ? ", transposed x" : ", contiguous x")) {
        const Tensor x = strided ? ops::transpose(ops::from_vector<float>(xv, {d, rows}), 0, 1)
                                 : ops::from_vector<float>(xv, {rows, d});
        const std::vector<float> dense = strided ? transposed(xv, rows, d) : xv;
        const ops::NormResult r = ops::rms_norm(x, with_weight ? w : Tensor(), eps);
        const NormRef want = naive_rms_norm(dense, with_weight ? &wv : nullptr, rows, d, eps);
        REQUIRE(r.out.shape() == Shape{rows, d});
        REQUIRE_FALSE(r.mean.defined());
        REQUIRE(r.rstd.shape() == Shape{rows});
        require_close(r.out.to_vector<float>(), want.out, 1e-5, 1e-4);
        require_close(r.rstd.to_vector<float>(), want.rstd, 1e-6, 1e-5);
      }
    }
  }
  SECTION("bf16, loose tolerance") {
    const ops::NormResult r = ops::rms_norm(
        ops::to(ops::from_vector<float>(xv, {rows, d}), DType::BF16), ops::to(w, DType::BF16), eps);
    REQUIRE(r.out.dtype() == DType::BF16);
    const NormRef want = naive_rms_norm(round_bf16(xv), nullptr, rows, d, eps);
    const std::vector<float> wr = round_bf16(wv);
    std::vector<double> scaled = want.out;
    for (int64_t i = 0; i < rows * d; ++i) {
      scaled[i] *= wr[i % d];
    }
    require_close(values_f32(r.out), scaled, 2e-2, 2e-2);
  }
  SECTION("errors") {
    REQUIRE_THROWS_WITH(ops::rms_norm(ops::zeros({rows, d}), ops::ones({rows, d})),
                        Contains("[tensor::rms_norm]") && Contains("weight"));
    REQUIRE_THROWS_WITH(ops::rms_norm(ops::zeros({rows, d}), ops::ones({d}, DType::BF16)),
                        Contains("[tensor::rms_norm]") && Contains("bf16"));
  }
}

namespace {

// Mean over non-ignored rows of logsumexp(logits[i]) - logits[i, t_i]; 0 when
// every target is ignored.
double naive_cross_entropy(const std::vector<float>& logits, const std::vector<int64_t>& targets,
                           int64_t C, int64_t ignore_index) {
  double total = 0;
  int64_t count = 0;
  for (size_t i = 0; i < targets.size(); ++i) {
    if (targets[i] == ignore_index) continue;
    double m = -kInf;
    for (int64_t c = 0; c < C; ++c) {
      m = std::max(m, static_cast<double>(logits[i * C + c]));
    }
    double s = 0;
    for (int64_t c = 0; c < C; ++c) {
      s += std::exp(logits[i * C + c] - m);
    }
    total += m + std::log(s) - logits[i * C + targets[i]];
    ++count;
  }
  return count ? total / count : 0.0;
}

}  // namespace

TEST_CASE("cross_entropy averages over non-ignored targets", "[nn]") {
  const int64_t N = 6, C = 9;
  const std::vector<float> lv = random_floats(N * C, 6, -4.0f, 4.0f);
  const Tensor logits = ops::from_vector<float>(lv, {N, C});
  const std::vector<int64_t> targets = {3, -100, 8, 0, 3, -100};

  SECTION("i64 targets with the default ignore_index") {
    const Tensor loss = ops::cross_entropy(logits, ops::from_vector<int64_t>(targets, {N}));
    REQUIRE(loss.dim() == 0);
    REQUIRE(loss.dtype() == DType::F32);
    REQUIRE(loss.item_double() == Approx(naive_cross_entropy(lv, targets, C, -100)).epsilon(1e-5));
  }
  SECTION("i32 targets, an ignore_index that is a class, transposed logits") {
    const std::vector<int64_t> t2 = {2, 2, 5, 0, 2, 7};
    const std::vector<int32_t> t32(t2.begin(), t2.end());
    const Tensor lt = ops::transpose(ops::from_vector<float>(lv, {C, N}), 0, 1);  // (N, C)
    const Tensor loss = ops::cross_entropy(lt, ops::from_vector<int32_t>(t32, {N}), 2);
    REQUIRE(loss.item_double() ==
            Approx(naive_cross_entropy(transposed(lv, N, C), t2, C, 2)).epsilon(1e-5));
  }
  SECTION("every target ignored gives 0, not NaN") {
    const Tensor loss =
        ops::cross_entropy(logits, ops::from_vector<int64_t>(std::vector<int64_t>(N, -1), {N}), -1);
    REQUIRE(loss.dim() == 0);
    REQUIRE(loss.item_double() == 0.0);
  }
  SECTION("f64 logits") {
    std::vector<double> ld(lv.begin(), lv.end());
    const Tensor loss = ops::cross_entropy(ops::from_vector<double>(ld, {N, C}),
                                           ops::from_vector<int64_t>(targets, {N}));
    REQUIRE(loss.item_double() == Approx(naive_cross_entropy(lv, targets, C, -100)).epsilon(1e-12));
  }
  SECTION("bf16 logits, loose tolerance") {
    const Tensor loss =
        ops::cross_entropy(ops::to(logits, DType::BF16), ops::from_vector<int64_t>(targets, {N}));
    REQUIRE(loss.dim() == 0);
    REQUIRE(loss.item_double() ==
            Approx(naive_cross_entropy(round_bf16(lv), targets, C, -100)).epsilon(2e-2));
  }
  SECTION("errors") {
    const Tensor t = ops::from_vector<int64_t>(targets, {N});
    REQUIRE_THROWS_WITH(ops::cross_entropy(logits, ops::from_vector<int64_t>({0, 1}, {2})),
                        Contains("[tensor::cross_entropy]") && Contains("[6]"));
    REQUIRE_THROWS_WITH(ops::cross_entropy(logits, ops::zeros({N})),
                        Contains("[tensor::cross_entropy]") && Contains("f32"));
    REQUIRE_THROWS_WITH(ops::cross_entropy(ops::zeros({2, 3, 4}), t),
                        Contains("[tensor::cross_entropy]") && Contains("2-D"));
    // A target outside [0, C) that is not ignored is caught by the lookup.
    REQUIRE_THROWS_WITH(
        ops::cross_entropy(logits, ops::from_vector<int64_t>({0, 1, 9, 0, 0, 0}, {N}))
            .item_double(),
        Contains("got 9") && Contains("[0, 9)"));
  }
}

namespace {

struct AttnCase {
  int64_t B, Hq, Hkv, Sq, Sk, D;
  bool causal = false;
  int64_t q_offset = 0, k_offset = 0;
  std::optional<double> scale = std::nullopt;
};

struct AttnRef {
  std::vector<double> out, lse;
};

// Attention by the definition, in double; q (B, Hq, Sq, D), k and v
// (B, Hkv, Sk, D), all row-major.
AttnRef naive_attention(const AttnCase& c, const std::vector<float>& q, const std::vector<float>& k,
                        const std::vector<float>& v) {
  const double scale = c.scale.value_or(1.0 / std::sqrt(static_cast<double>(c.D)));
  const int64_t group = c.Hq / c.Hkv;
  AttnRef r;
  r.out.assign(c.B * c.Hq * c.Sq * c.D, 0.0);
  r.lse.assign(c.B * c.Hq * c.Sq, -kInf);
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t h = 0; h < c.Hq; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < c.Sq; ++i) {
        const float* qi = &q[((b * c.Hq + h) * c.Sq + i) * c.D];
        std::vector<double> s(c.Sk);
        std::vector<bool> visible(c.Sk);
        double m = -kInf;
        for (int64_t j = 0; j < c.Sk; ++j) {
          visible[j] = !c.causal || c.k_offset + j <= c.q_offset + i;
          const float* kj = &k[((b * c.Hkv + hk) * c.Sk + j) * c.D];
          double dot = 0;
          for (int64_t d = 0; d < c.D; ++d) {
            dot += static_cast<double>(qi[d]) * kj[d];
          }
          s[j] = dot * scale;
          if (visible[j]) m = std::max(m, s[j]);
        }
        if (m == -kInf) continue;  // no visible key: output 0, lse -inf
        double z = 0;
        for (int64_t j = 0; j < c.Sk; ++j) {
          z += visible[j] ? std::exp(s[j] - m) : 0.0;
        }
        const double lse = m + std::log(z);
        const int64_t row = (b * c.Hq + h) * c.Sq + i;
        r.lse[row] = lse;
        for (int64_t j = 0; j < c.Sk; ++j) {
          if (!visible[j]) continue;
          const double p = std::exp(s[j] - lse);
          const float* vj = &v[((b * c.Hkv + hk) * c.Sk + j) * c.D];
          for (int64_t d = 0; d < c.D; ++d) {
            r.out[row * c.D + d] += p * vj[d];
          }
        }
      }
    }
  }
  return r;
}

// A (B, H, S, D) tensor with the values `v` (row-major in that order); when
// `strided`, stored as (B, S, H, D) and transposed, as attention inputs come
// out of a projection.
Tensor bhsd_tensor(const std::vector<float>& v, int64_t B, int64_t H, int64_t S, int64_t D,
                   bool strided) {
  if (!strided) return ops::from_vector<float>(v, {B, H, S, D});
  std::vector<float> bshd(v.size());
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t s = 0; s < S; ++s) {
        for (int64_t d = 0; d < D; ++d) {
          bshd[((b * S + s) * H + h) * D + d] = v[((b * H + h) * S + s) * D + d];
        }
      }
    }
  }
  Tensor t = ops::transpose(ops::from_vector<float>(bshd, {B, S, H, D}), 1, 2);
  return t;
}

void check_attention(const AttnCase& c, bool strided, uint32_t seed) {
  const std::vector<float> qv = random_floats(c.B * c.Hq * c.Sq * c.D, seed);
  const std::vector<float> kv = random_floats(c.B * c.Hkv * c.Sk * c.D, seed + 1);
  const std::vector<float> vv = random_floats(c.B * c.Hkv * c.Sk * c.D, seed + 2);
  const Tensor q = bhsd_tensor(qv, c.B, c.Hq, c.Sq, c.D, strided);
  const Tensor k = bhsd_tensor(kv, c.B, c.Hkv, c.Sk, c.D, strided);
  const Tensor v = bhsd_tensor(vv, c.B, c.Hkv, c.Sk, c.D, strided);
  if (strided && c.Hq > 1 && c.Sq > 1) REQUIRE_FALSE(q.is_contiguous());
  ops::AttentionOptions opt;
  opt.causal = c.causal;
  opt.q_offset = c.q_offset;
  opt.k_offset = c.k_offset;
  opt.scale = c.scale;
  const ops::AttentionResult r = ops::scaled_dot_product_attention(q, k, v, opt);
  const AttnRef want = naive_attention(c, qv, kv, vv);
  REQUIRE(r.out.shape() == Shape{c.B, c.Hq, c.Sq, c.D});
  REQUIRE(r.out.dtype() == DType::F32);
  REQUIRE(r.lse.shape() == Shape{c.B, c.Hq, c.Sq});
  REQUIRE(r.lse.dtype() == DType::F32);
  require_close(r.out.to_vector<float>(), want.out, 1e-5, 1e-4);
  require_close(r.lse.to_vector<float>(), want.lse, 1e-5, 1e-5);
}

}  // namespace

TEST_CASE("scaled_dot_product_attention matches a double-precision reference", "[nn]") {
  for (bool strided : {false, true}) {
    const char* layout = strided ? " (transposed BSHD inputs)" : "";
    DYNAMIC_SECTION("non-causal" << layout) {
      check_attention({.B = 2, .Hq = 3, .Hkv = 3, .Sq = 5, .Sk = 7, .D = 8}, strided, 10);
    }
    DYNAMIC_SECTION("causal, square" << layout) {
      check_attention({.B = 1, .Hq = 2, .Hkv = 2, .Sq = 6, .Sk = 6, .D = 4, .causal = true},
                      strided, 20);
    }
    DYNAMIC_SECTION("causal, a later query chunk over all keys" << layout) {
      check_attention(
          {.B = 1, .Hq = 2, .Hkv = 2, .Sq = 3, .Sk = 8, .D = 4, .causal = true, .q_offset = 5},
          strided, 30);
    }
    DYNAMIC_SECTION("causal, keys after the first queries: fully masked rows" << layout) {
      const AttnCase c{
          .B = 2, .Hq = 2, .Hkv = 1, .Sq = 5, .Sk = 4, .D = 4, .causal = true, .k_offset = 3};
      check_attention(c, strided, 40);
      // Queries 0..2 see no key: their output is exactly 0 and their lse -inf.
      const auto r =
          ops::scaled_dot_product_attention(ops::ones({2, 2, 5, 4}), ops::ones({2, 1, 4, 4}),
                                            ops::ones({2, 1, 4, 4}), {true, 0, 3, std::nullopt});
      const std::vector<float> out = r.out.to_vector<float>();
      const std::vector<float> lse = r.lse.to_vector<float>();
      for (int64_t row = 0; row < 2 * 2 * 5; ++row) {
        const bool masked = row % 5 < 3;
        INFO("row " << row);
        REQUIRE(std::isinf(lse[row]) == masked);
        for (int64_t d = 0; d < 4; ++d) {
          if (masked) {
            REQUIRE(out[row * 4 + d] == 0.0f);
          } else {
            REQUIRE(out[row * 4 + d] == Approx(1.0f));  // the mean of ones
          }
        }
      }
    }
    DYNAMIC_SECTION("grouped-query heads" << layout) {
      check_attention({.B = 2, .Hq = 6, .Hkv = 2, .Sq = 4, .Sk = 5, .D = 8}, strided, 50);
    }
    DYNAMIC_SECTION("grouped-query heads, causal with offsets, explicit scale" << layout) {
      check_attention({.B = 1,
                       .Hq = 4,
                       .Hkv = 1,
                       .Sq = 4,
                       .Sk = 6,
                       .D = 8,
                       .causal = true,
                       .q_offset = 2,
                       .scale = 0.3},
                      strided, 60);
    }
  }
  SECTION("bf16, loose tolerance") {
    const AttnCase c{
        .B = 1, .Hq = 4, .Hkv = 2, .Sq = 5, .Sk = 6, .D = 8, .causal = true, .q_offset = 1};
    const std::vector<float> qv = random_floats(c.B * c.Hq * c.Sq * c.D, 70);
    const std::vector<float> kv = random_floats(c.B * c.Hkv * c.Sk * c.D, 71);
    const std::vector<float> vv = random_floats(c.B * c.Hkv * c.Sk * c.D, 72);
    const auto to_bf16 = [](const std::vector<float>& v, const Shape& s) {
      return ops::to(ops::from_vector<float>(v, s), DType::BF16);
    };
    ops::AttentionOptions opt;
    opt.causal = true;
    opt.q_offset = 1;
    const auto r = ops::scaled_dot_product_attention(to_bf16(qv, {c.B, c.Hq, c.Sq, c.D}),
                                                     to_bf16(kv, {c.B, c.Hkv, c.Sk, c.D}),
                                                     to_bf16(vv, {c.B, c.Hkv, c.Sk, c.D}), opt);
    REQUIRE(r.out.dtype() == DType::BF16);
    REQUIRE(r.lse.dtype() == DType::F32);
    const AttnRef want = naive_attention(c, round_bf16(qv), round_bf16(kv), round_bf16(vv));
    require_close(values_f32(r.out), want.out, 2e-2, 2e-2);
    require_close(r.lse.to_vector<float>(), want.lse, 1e-4, 1e-4);
  }
  SECTION("errors") {
    const Tensor q = ops::zeros({1, 4, 3, 8});
    const Tensor k = ops::zeros({1, 2, 5, 8});
    const auto sdpa = [](const Tensor& a, const Tensor& b, const Tensor& c) {
      return ops::scaled_dot_product_attention(a, b, c);
    };
    const auto op = Contains("[tensor::scaled_dot_product_attention]");
    REQUIRE_THROWS_WITH(sdpa(ops::zeros({4, 3, 8}), k, k), op && Contains("4-D"));
    REQUIRE_THROWS_WITH(sdpa(ops::zeros({1, 3, 3, 8}), k, k), op && Contains("Hq=3, Hkv=2"));
    REQUIRE_THROWS_WITH(sdpa(ops::zeros({1, 4, 3, 6}), k, k), op && Contains("same B and D"));
    REQUIRE_THROWS_WITH(sdpa(ops::zeros({2, 4, 3, 8}), k, k), op && Contains("same B and D"));
    REQUIRE_THROWS_WITH(sdpa(q, k, ops::zeros({1, 2, 4, 8})), op && Contains("k and v"));
    REQUIRE_THROWS_WITH(sdpa(q, k, ops::zeros({1, 2, 5, 8}, DType::F64)), op && Contains("f64"));
  }
}

// ---- the CPU kernels' building blocks ----

TEST_CASE("f32 exp, sigmoid and silu are within a few ulp and handle the edges", "[nn][simd]") {
  // Note [Vectorised exp] in tensor/cpu/simd.h: f32 exp runs on exp_vec.
  std::vector<float> xs;
  for (float x = -87.0f; x < 88.5f; x += 0.0137f)
    xs.push_back(x);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> edges = {static_cast<float>(-kInf), -100.0f, 0.0f, 88.72f, 89.0f,
                                    static_cast<float>(kInf),  nan};
  xs.insert(xs.end(), edges.begin(), edges.end());
  const int64_t n = static_cast<int64_t>(xs.size());
  const Tensor x = ops::from_vector<float>(xs, {n});
  const std::vector<float> e = ops::exp(x).to_vector<float>();
  const std::vector<float> sg = ops::sigmoid(x).to_vector<float>();
  const std::vector<float> si = ops::silu(x).to_vector<float>();
  double worst = 0;
  for (int64_t i = 0; i < n - static_cast<int64_t>(edges.size()); ++i) {
    const double want = std::exp(static_cast<double>(xs[i]));
    const float wf = static_cast<float>(want);
    worst = std::max(worst, std::abs(e[i] - want) / (std::nextafter(wf, INFINITY) - wf));
    const double s = 1.0 / (1.0 + std::exp(-static_cast<double>(xs[i])));
    REQUIRE(std::abs(sg[i] - s) <= 6e-7 * s);
    REQUIRE(std::abs(si[i] - xs[i] * s) <= 6e-7 * std::abs(xs[i] * s) + 1e-37);
  }
  INFO("worst exp error " << worst << " ulp");
  CHECK(worst <= 2.0);
  const float* edge = &e[n - static_cast<int64_t>(edges.size())];
  CHECK(edge[0] == 0.0f);
  CHECK(edge[1] == 0.0f);
  CHECK(edge[2] == 1.0f);
  CHECK(edge[3] == Approx(std::exp(static_cast<double>(88.72f))).epsilon(1e-6));
  CHECK(std::isinf(edge[4]));
  CHECK(std::isinf(edge[5]));
  CHECK(std::isnan(edge[6]));
  CHECK(std::isnan(sg[n - 1]));
}

TEST_CASE("parallel_for covers the range once, nests, and rethrows", "[nn][threads]") {
  const int saved = ops::num_threads();
  ops::set_num_threads(2);
  std::vector<int> hits(10000, 0);
  std::atomic<int> nested_not_inline{0};  // Catch2 asserts only on this thread
  cpu::parallel_for(10000, 100, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      ++hits[i];
    // A nested loop runs inline on the chunk's thread.
    cpu::parallel_for(4, 1, [&](int64_t, int64_t) {
      if (cpu::num_threads() != 1) ++nested_not_inline;
    });
  });
  CHECK(std::count(hits.begin(), hits.end(), 1) == 10000);
  CHECK(nested_not_inline == 0);
  // Chunks depend on n, grain and the thread count only (4 per thread here),
  // whichever thread runs them, and also when the pool is busy.
  auto chunks_of = [](int64_t n, int64_t grain) {
    std::vector<std::pair<int64_t, int64_t>> chunks;
    std::mutex mu;
    cpu::parallel_for(n, grain, [&](int64_t b, int64_t e) {
      std::lock_guard<std::mutex> lock(mu);
      chunks.emplace_back(b, e);
    });
    std::sort(chunks.begin(), chunks.end());
    return chunks;
  };
  std::vector<std::pair<int64_t, int64_t>> want;
  for (int64_t b = 0; b < 1000; b += 125)
    want.emplace_back(b, b + 125);
  CHECK(chunks_of(1000, 10) == want);
  CHECK(chunks_of(1000, 400) ==
        std::vector<std::pair<int64_t, int64_t>>{{0, 400}, {400, 800}, {800, 1000}});
  std::vector<std::pair<int64_t, int64_t>> busy;
  cpu::parallel_for(2, 1, [&](int64_t b, int64_t) {
    // While a region runs the pool is held: from another thread the same
    // chunks run one after the other.
    if (b != 0) return;
    std::thread other([&] { busy = chunks_of(1000, 10); });
    other.join();
  });
  CHECK(busy == want);
  REQUIRE_THROWS_WITH(
      cpu::parallel_for(1000, 10,
                        [&](int64_t b, int64_t) { TANDEM_CHECK(b == 0, "[test] chunk at {}", b); }),
      Contains("[test] chunk at"));
  ops::set_num_threads(saved);
}

TEST_CASE("matmul split into panels over 2 threads matches 1 thread", "[nn][threads]") {
  // Every transpose combination, C taller than wide (row panels) and wider
  // than tall (column panels), and a batch (split by item).
  const std::vector<std::pair<Shape, Shape>> cases = {
      {Shape{300, 200}, Shape{200, 100}},
      {Shape{100, 200}, Shape{200, 300}},
      {Shape{3, 150, 64}, Shape{3, 64, 150}},
  };
  for (size_t c = 0; c < cases.size(); ++c) {
    const auto& [sa, sb] = cases[c];
    for (int trans = 0; trans < 4; ++trans) {
      const std::vector<float> av = random_floats(sa.numel(), 80),
                               bv = random_floats(sb.numel(), 81);
      auto operand = [](const std::vector<float>& v, const Shape& s, bool t) {
        if (!t) return ops::from_vector<float>(v, s);
        Shape st = s;
        std::swap(st[st.size() - 1], st[st.size() - 2]);
        return ops::transpose(ops::from_vector<float>(v, st), -1, -2);
      };
      const Tensor a = operand(av, sa, trans & 1), b = operand(bv, sb, trans & 2);
      const std::vector<float> one = ops::matmul(a, b).to_vector<float>();
      ops::set_num_threads(2);
      const std::vector<float> two = ops::matmul(a, b).to_vector<float>();
      ops::set_num_threads(1);
      std::vector<double> want(one.begin(), one.end());
      INFO("case " << c << " trans=" << trans);
      require_close(two, want, 1e-4, 1e-5);
    }
  }
}
