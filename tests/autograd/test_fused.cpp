// The fused kernels behind autograd's attention, layer_norm/rms_norm backward,
// swiglu and the rotary embedding, against the composite of differentiable primitive ops they
// replace (forward and gradients, f64 and f32, shapes that cross the kernels'
// blocks, tiles and SIMD tails), by finite differences (gradcheck, f64), at 2
// kernel threads against 1 (Note [CPU kernel threads]: same bits), and the
// CUDA kernels against the CPU ones when a GPU is present.
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

#include "tandem/autograd/nn/rope.h"
#include "tandem/autograd/ops.h"
#include "tandem/runtime/device.h"
#include "tests/support/autograd_util.h"
#include "tests/support/skip_cuda.h"
#include "tests/support/test_util.h"

using namespace tandem;
using namespace tandem::test;

namespace {

constexpr DType F64 = DType::F64;
constexpr DType F32 = DType::F32;

// Runs `fn` with the CPU kernels on `threads` threads, restoring the setting.
template <class F>
auto with_threads(int threads, F&& fn) {
  const int saved = ops::num_threads();
  ops::set_num_threads(threads);
  struct Restore {
    int saved;
    ~Restore() { ops::set_num_threads(saved); }
  } restore{saved};
  return fn();
}

// max |got - want| <= atol + rtol * |want| over the elements.
void require_close(const Tensor& got, const Tensor& want, double atol, double rtol,
                   const std::string& what) {
  REQUIRE(got.defined());
  REQUIRE(got.shape() == want.shape());
  std::vector<double> g = values_of(got), w = values_of(want);
  for (size_t i = 0; i < w.size(); ++i) {
    INFO(what << " element " << i << ": got " << g[i] << ", want " << w[i]);
    // Equal values pass outright: an lse of -inf (a row that sees no key) on both sides.
    REQUIRE((g[i] == w[i] || std::abs(g[i] - w[i]) <= atol + rtol * std::abs(w[i])));
  }
}

// ---- composite references ----

// Attention from differentiable primitives: grouped kv heads repeated,
// scores, causal mask, softmax, product (no row may be fully masked).
Tensor composite_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                           const AttentionOptions& o) {
  const int64_t B = q.size(0), Hq = q.size(1), Sq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Sk = k.size(2), G = Hq / Hkv;
  auto repeat = [&](const Tensor& t) {
    return reshape(expand(unsqueeze(t, 2), Shape{B, Hkv, G, Sk, D}), Shape{B, Hq, Sk, D});
  };
  const double scale = o.scale.value_or(1.0 / std::sqrt(static_cast<double>(D)));
  Tensor s = mul(matmul(q, transpose(repeat(k), -1, -2)), scale);
  if (o.causal) {
    Tensor qpos = ops::unsqueeze(
        ops::arange(static_cast<double>(o.q_offset), static_cast<double>(o.q_offset + Sq)), 1);
    Tensor kpos = ops::unsqueeze(
        ops::arange(static_cast<double>(o.k_offset), static_cast<double>(o.k_offset + Sk)), 0);
    s = where(ops::le(kpos, qpos), s, -std::numeric_limits<double>::infinity());
  }
  return matmul(softmax(s, -1), repeat(v));
}

Tensor composite_layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps) {
  Tensor xc = sub(x, mean(x, Dims{-1}, true));
  Tensor y = mul(xc, rsqrt(add(mean(mul(xc, xc), Dims{-1}, true), eps)));
  if (w.defined()) y = mul(y, w);
  return b.defined() ? add(y, b) : y;
}

Tensor composite_rms_norm(const Tensor& x, const Tensor& w, double eps) {
  Tensor y = mul(x, rsqrt(add(mean(mul(x, x), Dims{-1}, true), eps)));
  return w.defined() ? mul(y, w) : y;
}

struct AttnCase {
  const char* name;
  int64_t B, Hq, Hkv, Sq, Sk, D;
  bool causal = false;
  int64_t q_offset = 0, k_offset = 0;
};

// Cases that cross the kernel's 64-row blocks, 8-row tiles and SIMD widths
// (16 floats, 8 doubles), with no fully masked row (the composite softmax
// would give NaN there; gradcheck covers those rows).
const std::vector<AttnCase> kAttnCases = {
    {"causal, two blocks, D not a SIMD multiple", 1, 2, 2, 100, 100, 20, true},
    {"causal GQA, B=2", 2, 4, 2, 67, 67, 16, true},
    {"causal shard: later queries over more keys", 1, 2, 1, 40, 90, 12, true, 50, 0},
    {"causal shard: keys start inside the queries", 1, 1, 1, 30, 50, 8, true, 20, 15},
    {"non-causal, Sq != Sk", 2, 3, 3, 70, 33, 64, false},
};

}  // namespace

TEST_CASE("fused attention matches the composite forward and gradients", "[fused]") {
  for (const AttnCase& c : kAttnCases) {
    DYNAMIC_SECTION(c.name) {
      AttentionOptions o;
      o.causal = c.causal;
      o.q_offset = c.q_offset;
      o.k_offset = c.k_offset;
      uint32_t seed = static_cast<uint32_t>(c.Sq * 131 + c.Sk);
      const Tensor q = random_tensor(Shape{c.B, c.Hq, c.Sq, c.D}, F64, seed, -2, 2);
      const Tensor k = random_tensor(Shape{c.B, c.Hkv, c.Sk, c.D}, F64, seed + 1, -2, 2);
      const Tensor v = random_tensor(Shape{c.B, c.Hkv, c.Sk, c.D}, F64, seed + 2);
      const Tensor up = random_tensor(Shape{c.B, c.Hq, c.Sq, c.D}, F64, seed + 3);
      auto fused = [&](const std::vector<Tensor>& t) {
        return scaled_dot_product_attention(t[0], t[1], t[2], o).out;
      };
      auto composite = [&](const std::vector<Tensor>& t) {
        return composite_attention(t[0], t[1], t[2], o);
      };
      require_close(fused({q, k, v}), composite({q, k, v}), 1e-12, 1e-10, "out f64");
      const std::vector<Tensor> want = gradients(composite, {q, k, v}, up);
      const std::vector<Tensor> got = gradients(fused, {q, k, v}, up);
      // Backward recomputes P from the f32 log-sum-exp: f32-level agreement.
      const char* names[] = {"dq f64", "dk f64", "dv f64"};
      for (int i = 0; i < 3; ++i)
        require_close(got[i], want[i], 1e-6, 1e-5, names[i]);
      // f32 inputs, against the f64 composite.
      auto f32 = [](const Tensor& t) { return ops::to(t, F32); };
      const std::vector<Tensor> got32 = gradients(fused, {f32(q), f32(k), f32(v)}, f32(up));
      require_close(fused({f32(q), f32(k), f32(v)}), composite({q, k, v}), 2e-5, 1e-4, "out f32");
      const char* names32[] = {"dq f32", "dk f32", "dv f32"};
      for (int i = 0; i < 3; ++i)
        require_close(got32[i], want[i], 5e-5, 5e-4, names32[i]);
      // Two kernel threads: the same bits (tasks never share an output element).
      const std::vector<Tensor> two = with_threads(2, [&] {
        return gradients(fused, {f32(q), f32(k), f32(v)}, f32(up));
      });
      CHECK(all_equal(two, got32));
    }
  }
}

TEST_CASE("fused attention forward: lse and bf16", "[fused]") {
  AttentionOptions o;
  o.causal = true;
  const Tensor q = random_tensor(Shape{1, 2, 80, 32}, F32, 11, -2, 2);
  const Tensor k = random_tensor(Shape{1, 2, 80, 32}, F32, 12, -2, 2);
  const Tensor v = random_tensor(Shape{1, 2, 80, 32}, F32, 13);
  const AttentionResult r = ops::scaled_dot_product_attention(q, k, v, o);
  // lse = logsumexp of the visible scaled scores, from the composite's scores.
  Tensor s = ops::mul(ops::matmul(q, ops::transpose(k, -1, -2)), 1.0 / std::sqrt(32.0));
  std::vector<double> sv = values_of(s), lse = values_of(r.lse);
  for (int64_t row = 0; row < 2 * 80; ++row) {
    const int64_t i = row % 80;
    double m = -INFINITY, z = 0;
    for (int64_t j = 0; j <= i; ++j)
      m = std::max(m, sv[row * 80 + j]);
    for (int64_t j = 0; j <= i; ++j)
      z += std::exp(sv[row * 80 + j] - m);
    INFO("row " << row);
    REQUIRE(lse[row] == Approx(m + std::log(z)).epsilon(1e-5));
  }
  // A negative scale (the row max of the scaled scores is a min of the scores).
  for (bool causal : {false, true}) {
    AttentionOptions neg;
    neg.causal = causal;
    neg.scale = -0.7;
    require_close(ops::scaled_dot_product_attention(q, k, v, neg).out,
                  composite_attention(ops::to(q, F64), ops::to(k, F64), ops::to(v, F64), neg), 2e-5,
                  1e-4, "negative scale");
  }
  // bf16 runs in f32 and rounds once.
  auto bf16 = [](const Tensor& t) { return ops::to(t, DType::BF16); };
  const AttentionResult rb = ops::scaled_dot_product_attention(bf16(q), bf16(k), bf16(v), o);
  REQUIRE(rb.out.dtype() == DType::BF16);
  require_close(rb.out, r.out, 3e-2, 3e-2, "bf16 out");
}

TEST_CASE("gradcheck: swiglu", "[fused][gradcheck]") {
  using V = std::vector<Tensor>;
  check_gradients(
      "swiglu", [](const V& t) { return V{swiglu(t[0], t[1])}; },
      {random_tensor(Shape{3, 5}, F64, 21, -4, 4), random_tensor(Shape{3, 5}, F64, 22)});
}

TEST_CASE("fused swiglu matches silu(a) * b forward and gradients", "[fused]") {
  // 1000 elements: full 16-float vectors and a tail; values past exp's range.
  const Tensor a = random_tensor(Shape{8, 125}, F64, 31, -30, 30);
  const Tensor b = random_tensor(Shape{8, 125}, F64, 32, -2, 2);
  const Tensor up = random_tensor(Shape{8, 125}, F64, 33);
  auto fused = [](const std::vector<Tensor>& t) { return swiglu(t[0], t[1]); };
  auto composite = [](const std::vector<Tensor>& t) { return mul(silu(t[0]), t[1]); };
  for (DType dt : {F64, F32}) {
    DYNAMIC_SECTION(dtype_name(dt)) {
      const double tol = dt == F64 ? 1e-13 : 2e-6;
      const std::vector<Tensor> in = {ops::to(a, dt), ops::to(b, dt)};
      require_close(fused(in), composite({a, b}), tol, tol, "out");
      const std::vector<Tensor> got = gradients(fused, in, ops::to(up, dt));
      const std::vector<Tensor> want = gradients(composite, {a, b}, up);
      require_close(got[0], want[0], tol, tol, "da");
      require_close(got[1], want[1], tol, tol, "db");
    }
  }
  SECTION("bf16") {
    auto bf16 = [](const Tensor& t) { return ops::to(t, DType::BF16); };
    const Tensor out = ops::swiglu(bf16(a), bf16(b));
    REQUIRE(out.dtype() == DType::BF16);
    require_close(out, ops::mul(ops::silu(ops::to(bf16(a), F64)), ops::to(bf16(b), F64)), 2e-2,
                  2e-2, "bf16 out");
  }
  SECTION("errors") {
    REQUIRE_THROWS_WITH(ops::swiglu(ops::zeros({2, 3}), ops::zeros({3, 2})),
                        Catch::Matchers::Contains("[tensor::swiglu]"));
    REQUIRE_THROWS_WITH(ops::swiglu(ops::zeros({2, 3}), ops::zeros({2, 3}, F64)),
                        Catch::Matchers::Contains("f64"));
  }
}

// The rotary embedding as the composite ops it replaces (Note [Fused rotary
// embedding]): x c + rotate_half(x) s.
Tensor composite_rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t seq_dim) {
  const int64_t s = x.shape()[static_cast<int>(seq_dim)], d = x.shape()[3];
  const Shape bcast = seq_dim == 1 ? Shape{1, s, 1, d} : Shape{1, 1, s, d};
  const Tensor x1 = narrow(x, 3, 0, d / 2), x2 = narrow(x, 3, d / 2, d / 2);
  return add(mul(x, reshape(cos, bcast)), mul(cat({mul(x2, -1.0), x1}, 3), reshape(sin, bcast)));
}

TEST_CASE("fused rotary embedding matches the composite forward and gradient", "[fused]") {
  // D = 6 (scalar pairs only), 32 (whole vectors), 40 (vectors and a tail on
  // AVX2, scalar on AVX-512); tables whose halves differ, so a kernel that
  // read the wrong half of sin would fail.
  for (int64_t d : {6, 32, 40}) {
    for (int64_t seq_dim : {1, 2}) {
      DYNAMIC_SECTION("D=" << d << " seq_dim " << seq_dim) {
        const int64_t B = 2, S = 5, H = 3;
        const Shape shape = seq_dim == 1 ? Shape{B, S, H, d} : Shape{B, H, S, d};
        const Tensor x = random_tensor(shape, F64, 81, -2, 2);
        const Tensor up = random_tensor(shape, F64, 82);
        const Tensor cos = random_tensor(Shape{S, d}, F64, 83, -1, 1);
        const Tensor sin = random_tensor(Shape{S, d}, F64, 84, -1, 1);
        for (DType dt : {F64, F32}) {
          INFO(dtype_name(dt));
          const Tensor c = ops::to(cos, dt), sn = ops::to(sin, dt), xd = ops::to(x, dt);
          auto fused = [&](const std::vector<Tensor>& t) {
            return nn::apply_rotary(t[0], c, sn, seq_dim);
          };
          auto composite = [&](const std::vector<Tensor>& t) {
            return composite_rotary(t[0], c, sn, seq_dim);
          };
          const Tensor got = fused({xd});
          const std::vector<Tensor> got_grad = gradients(fused, {xd}, ops::to(up, dt));
          const std::vector<Tensor> want_grad = gradients(composite, {xd}, ops::to(up, dt));
          const double tol = dt == F64 ? 1e-14 : 1e-6;
          require_close(got, composite({xd}), tol, tol, "out");
          require_close(got_grad[0], want_grad[0], tol, tol, "dx");
          const Tensor two = with_threads(2, [&] { return fused({xd}); });
          CHECK(all_equal({two}, {got}));
        }
        check_gradients("apply_rotary",
                        [&](const std::vector<Tensor>& t) {
                          return std::vector<Tensor>{nn::apply_rotary(t[0], cos, sin, seq_dim)};
                        },
                        {x});
      }
    }
  }
  SECTION("bf16 computes in float and rounds once") {
    const Tensor x = random_tensor(Shape{1, 4, 2, 8}, F64, 85, -2, 2);
    auto [cos, sin] =
        nn::rope_tables({.head_dim = 8}, nn::position_range(0, 4), F64, Device::cpu());
    auto bf16 = [](const Tensor& t) { return ops::to(t, DType::BF16); };
    const Tensor out = ops::rotary(bf16(x), bf16(cos), bf16(sin));
    REQUIRE(out.dtype() == DType::BF16);
    auto f64 = [](const Tensor& t) { return ops::to(t, F64); };
    require_close(out, ops::rotary(f64(bf16(x)), f64(bf16(cos)), f64(bf16(sin))), 2e-2, 1e-2,
                  "bf16 out");
  }
  SECTION("errors") {
    const Tensor t = ops::zeros({3, 4});
    REQUIRE_THROWS_WITH(ops::rotary(ops::zeros({1, 3, 2, 4}), t, ops::zeros({3, 5})),
                        Catch::Matchers::Contains("[tensor::rotary]") &&
                            Catch::Matchers::Contains("sin of shape (3, 4)"));
    REQUIRE_THROWS_WITH(ops::rotary(ops::zeros({1, 3, 2, 4}), t, t, 3),
                        Catch::Matchers::Contains("seq_dim 3"));
    Tensor learned = ops::zeros({3, 4});
    set_requires_grad(learned, true);
    REQUIRE_THROWS_WITH(nn::apply_rotary(ops::zeros({1, 3, 2, 4}), learned, t),
                        Catch::Matchers::Contains("do not require grad"));
  }
}

TEST_CASE("fused norm backward matches the composite gradients", "[fused]") {
  // 70 rows (two full 32-row blocks and a partial one); d = 37 (SIMD tail) and 256.
  for (int64_t d : {37, 256}) {
    const Tensor x = random_tensor(Shape{2, 35, d}, F64, 41, 2, 6);  // offset mean
    const Tensor w = random_tensor(Shape{d}, F64, 42, 0.5, 1.5);
    const Tensor b = random_tensor(Shape{d}, F64, 43);
    const Tensor up = random_tensor(Shape{2, 35, d}, F64, 44);
    for (int affine = 0; affine < 3; ++affine) {
      DYNAMIC_SECTION("layer_norm d=" << d << " affine " << affine) {
        std::vector<Tensor> in = {x};
        if (affine >= 1) in.push_back(w);
        if (affine == 2) in.push_back(b);
        auto params = [affine](const std::vector<Tensor>& t) {
          return std::pair{affine >= 1 ? t[1] : Tensor(), affine == 2 ? t[2] : Tensor()};
        };
        auto fused = [&](const std::vector<Tensor>& t) {
          auto [pw, pb] = params(t);
          return layer_norm(t[0], pw, pb, 1e-5);
        };
        auto composite = [&](const std::vector<Tensor>& t) {
          auto [pw, pb] = params(t);
          return composite_layer_norm(t[0], pw, pb, 1e-5);
        };
        const std::vector<Tensor> want = gradients(composite, in, up);
        const std::vector<Tensor> got = gradients(fused, in, up);
        // The saved statistics are f32 (Note [Fused norm backward]).
        for (size_t i = 0; i < in.size(); ++i)
          require_close(got[i], want[i], 1e-5, 1e-5, "f64 grad " + std::to_string(i));
        std::vector<Tensor> in32;
        for (const Tensor& t : in)
          in32.push_back(ops::to(t, F32));
        const std::vector<Tensor> got32 = gradients(fused, in32, ops::to(up, F32));
        for (size_t i = 0; i < in.size(); ++i)
          require_close(got32[i], want[i], 1e-4, 1e-4, "f32 grad " + std::to_string(i));
        const std::vector<Tensor> two =
            with_threads(2, [&] { return gradients(fused, in32, ops::to(up, F32)); });
        CHECK(all_equal(two, got32));
      }
    }
    for (bool with_weight : {false, true}) {
      DYNAMIC_SECTION("rms_norm d=" << d << (with_weight ? " weight" : " plain")) {
        std::vector<Tensor> in = {x};
        if (with_weight) in.push_back(w);
        auto fused = [&](const std::vector<Tensor>& t) {
          return rms_norm(t[0], with_weight ? t[1] : Tensor(), 1e-6);
        };
        auto composite = [&](const std::vector<Tensor>& t) {
          return composite_rms_norm(t[0], with_weight ? t[1] : Tensor(), 1e-6);
        };
        const std::vector<Tensor> want = gradients(composite, in, up);
        const std::vector<Tensor> got = gradients(fused, in, up);
        for (size_t i = 0; i < in.size(); ++i)
          require_close(got[i], want[i], 1e-5, 1e-5, "grad " + std::to_string(i));
      }
    }
  }
  SECTION("bf16 runs in f32 and rounds once") {
    auto bf16 = [](const Tensor& t) { return ops::to(t, DType::BF16); };
    const Tensor x = random_tensor(Shape{40, 48}, F32, 51, -2, 2);
    const Tensor w = random_tensor(Shape{48}, F32, 52, 0.5, 1.5);
    const Tensor dy = random_tensor(Shape{40, 48}, F32, 53);
    const NormResult f = ops::layer_norm(bf16(x), bf16(w), bf16(w));
    const NormGrads g = ops::norm_backward(bf16(dy), bf16(x), bf16(w), f.mean, f.rstd, true, true);
    const NormResult f32 = ops::layer_norm(ops::to(bf16(x), F32), ops::to(bf16(w), F32), Tensor());
    const NormGrads g32 = ops::norm_backward(ops::to(bf16(dy), F32), ops::to(bf16(x), F32),
                                             ops::to(bf16(w), F32), f32.mean, f32.rstd, true, true);
    REQUIRE(g.dx.dtype() == DType::BF16);
    REQUIRE(g.dweight.dtype() == DType::BF16);
    REQUIRE(g.dbias.dtype() == DType::BF16);
    require_close(g.dx, g32.dx, 3e-2, 3e-2, "dx");
    require_close(g.dweight, g32.dweight, 1e-1, 2e-2, "dweight");
    require_close(g.dbias, g32.dbias, 1e-1, 2e-2, "dbias");
  }
  SECTION("errors") {
    const NormResult f = ops::layer_norm(ops::ones({4, 8}), Tensor(), Tensor());
    REQUIRE_THROWS_WITH(
        ops::norm_backward(ops::ones({4, 7}), ops::ones({4, 8}), Tensor(), f.mean, f.rstd, false,
                           false),
        Catch::Matchers::Contains("[tensor::norm_backward]") && Catch::Matchers::Contains("dy"));
    REQUIRE_THROWS_WITH(ops::norm_backward(ops::ones({4, 8}), ops::ones({4, 8}), Tensor(), Tensor(),
                                           f.rstd, false, true),
                        Catch::Matchers::Contains("mean"));
  }
}

TEST_CASE("fused kernels on CUDA match the CPU", "[fused][cuda]") {
  TANDEM_SKIP_WITHOUT_CUDA();
  const Device gpu = Device::cuda(0);
  auto on_gpu = [&](const Tensor& t) { return ops::to(t, gpu); };
  auto on_cpu = [](const Tensor& t) { return ops::to(t, Device::cpu()); };
  for (DType dt : {F32, F64}) {
    const double tol = dt == F64 ? 1e-10 : 2e-5;
    DYNAMIC_SECTION("attention " << dtype_name(dt)) {
      for (const AttnCase& c : kAttnCases) {
        INFO(c.name);
        AttentionOptions o;
        o.causal = c.causal;
        o.q_offset = c.q_offset;
        o.k_offset = c.k_offset;
        const Tensor q = random_tensor(Shape{c.B, c.Hq, c.Sq, c.D}, dt, 61, -2, 2);
        const Tensor k = random_tensor(Shape{c.B, c.Hkv, c.Sk, c.D}, dt, 62, -2, 2);
        const Tensor v = random_tensor(Shape{c.B, c.Hkv, c.Sk, c.D}, dt, 63);
        const Tensor dout = random_tensor(Shape{c.B, c.Hq, c.Sq, c.D}, dt, 64);
        const AttentionResult cpu = ops::scaled_dot_product_attention(q, k, v, o);
        const AttentionResult gpu_r =
            ops::scaled_dot_product_attention(on_gpu(q), on_gpu(k), on_gpu(v), o);
        require_close(on_cpu(gpu_r.out), cpu.out, tol, tol, "out");
        require_close(on_cpu(gpu_r.lse), cpu.lse, 1e-5, 1e-6, "lse");
        const std::vector<Tensor> want =
            ops::scaled_dot_product_attention_backward(q, k, v, cpu.out, cpu.lse, dout, o);
        const std::vector<Tensor> got = ops::scaled_dot_product_attention_backward(
            on_gpu(q), on_gpu(k), on_gpu(v), on_gpu(cpu.out), on_gpu(cpu.lse), on_gpu(dout), o);
        for (int i = 0; i < 3; ++i)
          require_close(on_cpu(got[i]), want[i], 10 * tol, 10 * tol, "grad " + std::to_string(i));
      }
    }
    DYNAMIC_SECTION("norm backward, swiglu and rotary " << dtype_name(dt)) {
      const Tensor x = random_tensor(Shape{70, 37}, dt, 71, -2, 2);
      const Tensor w = random_tensor(Shape{37}, dt, 72, 0.5, 1.5);
      const Tensor dy = random_tensor(Shape{70, 37}, dt, 73);
      const NormResult f = ops::layer_norm(x, w, w);
      const NormGrads want = ops::norm_backward(dy, x, w, f.mean, f.rstd, true, true);
      const NormGrads got = ops::norm_backward(on_gpu(dy), on_gpu(x), on_gpu(w), on_gpu(f.mean),
                                               on_gpu(f.rstd), true, true);
      require_close(on_cpu(got.dx), want.dx, tol, tol, "dx");
      require_close(on_cpu(got.dweight), want.dweight, 10 * tol, tol, "dweight");
      require_close(on_cpu(got.dbias), want.dbias, 10 * tol, tol, "dbias");
      const NormResult fr = ops::rms_norm(x, w);
      const NormGrads want_r = ops::norm_backward(dy, x, w, Tensor(), fr.rstd, true, false);
      const NormGrads got_r = ops::norm_backward(on_gpu(dy), on_gpu(x), on_gpu(w), Tensor(),
                                                 on_gpu(fr.rstd), true, false);
      require_close(on_cpu(got_r.dx), want_r.dx, tol, tol, "rms dx");
      require_close(on_cpu(got_r.dweight), want_r.dweight, 10 * tol, tol, "rms dweight");
      const Tensor a = random_tensor(Shape{1000}, dt, 74, -30, 30);
      require_close(on_cpu(ops::swiglu(on_gpu(a), on_gpu(a))), ops::swiglu(a, a), tol, tol,
                    "swiglu");
      auto [da, db] = ops::swiglu_backward(on_gpu(a), on_gpu(a), on_gpu(a));
      auto [wa, wb] = ops::swiglu_backward(a, a, a);
      require_close(on_cpu(da), wa, tol, tol, "swiglu da");
      require_close(on_cpu(db), wb, tol, tol, "swiglu db");
      const Tensor xr = random_tensor(Shape{2, 5, 3, 6}, dt, 75, -2, 2);
      const Tensor cr = random_tensor(Shape{5, 6}, dt, 76, -1, 1);
      const Tensor sr = random_tensor(Shape{5, 6}, dt, 77, -1, 1);
      for (bool inverse : {false, true}) {
        require_close(on_cpu(ops::rotary(on_gpu(xr), on_gpu(cr), on_gpu(sr), 1, inverse)),
                      ops::rotary(xr, cr, sr, 1, inverse), tol, tol, "rotary");
      }
    }
  }
}

// Cases for the tiled CUDA kernels (Note [Tiled CUDA attention] in
// tensor/cuda/attention.cu): sequence lengths (70, 133, 170, 100) that leave
// ragged last tiles for the tile sizes the kernels choose (64 down to 2), causal
// shards offset both ways (with whole query tiles that see no key and key
// tiles that no query sees), grouped-query attention with 2 and 4 query heads
// per kv head, and head dims from 24 to 256 (the smallest tiles, f64 at 256).
const std::vector<AttnCase> kTiledCases = {
    {"ragged tiles, non-causal, D=24", 1, 2, 2, 70, 133, 24},
    {"non-causal GQA 4, B=2, D=64", 2, 4, 1, 70, 133, 64},
    {"causal, queries after the keys, GQA 2, D=64", 2, 4, 2, 70, 133, 64, true, 90, 20},
    {"causal, keys after the queries: query tiles that see no key, GQA 4, D=128", 1, 8, 2, 170, 133,
     128, true, 0, 80},
    {"causal self-attention, GQA 2, D=256", 1, 4, 2, 100, 100, 256, true},
    {"causal, keys start inside the queries, D=256", 1, 1, 1, 70, 133, 256, true, 30, 50},
};

TEST_CASE("tiled CUDA attention matches the CPU", "[fused][cuda]") {
  TANDEM_SKIP_WITHOUT_CUDA();
  const Device gpu = Device::cuda(0);
  auto on_gpu = [&](const Tensor& t) { return ops::to(t, gpu); };
  auto on_cpu = [](const Tensor& t) { return ops::to(t, Device::cpu()); };
  for (DType dt : {F32, F64}) {
    const double tol = dt == F64 ? 1e-10 : 2e-5;
    for (const AttnCase& c : kTiledCases) {
      DYNAMIC_SECTION(c.name << ", " << dtype_name(dt)) {
        AttentionOptions o;
        o.causal = c.causal;
        o.q_offset = c.q_offset;
        o.k_offset = c.k_offset;
        const Tensor q = random_tensor(Shape{c.B, c.Hq, c.Sq, c.D}, dt, 81, -2, 2);
        const Tensor k = random_tensor(Shape{c.B, c.Hkv, c.Sk, c.D}, dt, 82, -2, 2);
        const Tensor v = random_tensor(Shape{c.B, c.Hkv, c.Sk, c.D}, dt, 83);
        const Tensor dout = random_tensor(Shape{c.B, c.Hq, c.Sq, c.D}, dt, 84);
        const AttentionResult cpu = ops::scaled_dot_product_attention(q, k, v, o);
        const AttentionResult got =
            ops::scaled_dot_product_attention(on_gpu(q), on_gpu(k), on_gpu(v), o);
        require_close(on_cpu(got.out), cpu.out, tol, tol, "out");
        require_close(on_cpu(got.lse), cpu.lse, 1e-5, 1e-6, "lse");
        const std::vector<Tensor> want =
            ops::scaled_dot_product_attention_backward(q, k, v, cpu.out, cpu.lse, dout, o);
        auto gpu_backward = [&] {
          return ops::scaled_dot_product_attention_backward(
              on_gpu(q), on_gpu(k), on_gpu(v), on_gpu(cpu.out), on_gpu(cpu.lse), on_gpu(dout), o);
        };
        const std::vector<Tensor> grads = gpu_backward();
        const char* names[] = {"dq", "dk", "dv"};
        for (int i = 0; i < 3; ++i)
          require_close(on_cpu(grads[i]), want[i], 10 * tol, 10 * tol, names[i]);
        // No atomics: a second run gives the same bits.
        const std::vector<Tensor> again = gpu_backward();
        for (int i = 0; i < 3; ++i) {
          INFO(names[i] << " twice");
          REQUIRE(values_of(on_cpu(again[i])) == values_of(on_cpu(grads[i])));
        }
      }
    }
    // Ring attention's backward: each step sees one chunk of the keys (a
    // strided view here) with the lse and output of the whole computation.
    // The chunk's gradients match the CPU's for the same inputs; summed over
    // the chunks, dq is the full dq, and the chunks' dk, dv are the full ones.
    DYNAMIC_SECTION("backward with the lse of a larger computation, " << dtype_name(dt)) {
      AttentionOptions o;
      o.causal = true;
      o.q_offset = 60;
      const int64_t B = 1, Hq = 4, Hkv = 2, Sq = 70, Sk = 133, D = 64;
      const Tensor q = random_tensor(Shape{B, Hq, Sq, D}, dt, 91, -2, 2);
      const Tensor k = random_tensor(Shape{B, Hkv, Sk, D}, dt, 92, -2, 2);
      const Tensor v = random_tensor(Shape{B, Hkv, Sk, D}, dt, 93);
      const Tensor dout = random_tensor(Shape{B, Hq, Sq, D}, dt, 94);
      const AttentionResult full = ops::scaled_dot_product_attention(q, k, v, o);
      const std::vector<Tensor> want =
          ops::scaled_dot_product_attention_backward(q, k, v, full.out, full.lse, dout, o);
      const Tensor k_gpu = on_gpu(k), v_gpu = on_gpu(v);
      Tensor dq_sum = ops::zeros_like(want[0]);
      std::vector<Tensor> dk_chunks, dv_chunks;
      // The last chunk starts at key 90: query rows 0..29 (positions 60..89)
      // see none of its keys although their lse is finite.
      for (const auto& [start, end] : {std::pair<int64_t, int64_t>{0, 45}, {45, 90}, {90, 133}}) {
        INFO("keys " << start << ".." << end);
        AttentionOptions oc = o;
        oc.k_offset = start;
        const Tensor kc = ops::narrow(k, 2, start, end - start);
        const Tensor vc = ops::narrow(v, 2, start, end - start);
        const std::vector<Tensor> chunk_want =
            ops::scaled_dot_product_attention_backward(q, kc, vc, full.out, full.lse, dout, oc);
        const std::vector<Tensor> chunk = ops::scaled_dot_product_attention_backward(
            on_gpu(q), ops::narrow(k_gpu, 2, start, end - start),
            ops::narrow(v_gpu, 2, start, end - start), on_gpu(full.out), on_gpu(full.lse),
            on_gpu(dout), oc);
        const char* names[] = {"chunk dq", "chunk dk", "chunk dv"};
        for (int i = 0; i < 3; ++i)
          require_close(on_cpu(chunk[i]), chunk_want[i], 10 * tol, 10 * tol, names[i]);
        dq_sum = ops::add(dq_sum, on_cpu(chunk[0]));
        dk_chunks.push_back(on_cpu(chunk[1]));
        dv_chunks.push_back(on_cpu(chunk[2]));
      }
      require_close(dq_sum, want[0], 10 * tol, 10 * tol, "dq summed over the chunks");
      require_close(ops::cat(dk_chunks, 2), want[1], 10 * tol, 10 * tol, "dk of the chunks");
      require_close(ops::cat(dv_chunks, 2), want[2], 10 * tol, 10 * tol, "dv of the chunks");
    }
  }
}

TEST_CASE("tiled CUDA attention names a head dim too large for its tiles", "[fused][cuda]") {
  TANDEM_SKIP_WITHOUT_CUDA();
  // Even single-row tiles of an f64 head dim of 4096 pass 48 KiB of shared
  // memory (Note [Tiled CUDA attention]): a clear error, not a bad launch.
  Tensor q = ops::zeros({1, 1, 2, 4096}, F64, Device::cuda(0));
  REQUIRE_THROWS_WITH(ops::scaled_dot_product_attention(q, q, q),
                      Catch::Matchers::Contains("expected a head dim whose single-row tiles fit") &&
                          Catch::Matchers::Contains("D=4096"));
}
