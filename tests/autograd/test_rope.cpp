// Rotary position embedding (autograd/nn/rope.h, Note [Rotary positions]).
// The oracle is the definition, as naive f64 loops: the pair (x[i],
// x[i + D/2]) of every head turned by position * theta^(-2i/D); plus what
// follows from it — attention scores depend only on the distance between
// positions, the gradient is the rotation back — and Llama 3's scaling by
// the wavelength bands it names.
#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <numbers>
#include <vector>

#include "tandem/autograd/nn/attention.h"
#include "tandem/autograd/nn/rope.h"
#include "tandem/autograd/ops.h"
#include "tests/support/autograd_util.h"
#include "tests/support/test_util.h"

using namespace tandem;
using namespace tandem::test;
using Catch::Matchers::Contains;

namespace {

// x (B, S, H, D) or, with bnsd, (B, H, S, D), rotated by the naive loops.
std::vector<double> naive_rope(const std::vector<double>& x, int64_t B, int64_t S, int64_t H,
                               int64_t D, const std::vector<int64_t>& positions, double theta,
                               bool bnsd) {
  std::vector<double> out(x.size());
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t base = bnsd ? ((b * H + h) * S + s) * D : ((b * S + s) * H + h) * D;
        for (int64_t i = 0; i < D / 2; ++i) {
          const double angle = static_cast<double>(positions[s]) *
                               std::pow(theta, -2.0 * static_cast<double>(i) / D);
          const double a = x[base + i], c = x[base + i + D / 2];
          out[base + i] = a * std::cos(angle) - c * std::sin(angle);
          out[base + i + D / 2] = c * std::cos(angle) + a * std::sin(angle);
        }
      }
    }
  }
  return out;
}

Tensor rope_of(const Tensor& x, const nn::RotaryOptions& o, const std::vector<int64_t>& positions,
               int64_t seq_dim = 1) {
  auto [cos, sin] = nn::rope_tables(o, positions, x.dtype(), x.device());
  return nn::apply_rotary(x, cos, sin, seq_dim);
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i)
    s += a[i] * b[i];
  return s;
}

}  // namespace

TEST_CASE("apply_rotary turns each (i, i + D/2) pair by position x inv_freq", "[rope]") {
  const int64_t B = 2, S = 5, H = 3, D = 8;
  const std::vector<int64_t> positions = {0, 7, 3, 1000, 65536};  // any order, large
  for (double theta : {10000.0, 500000.0}) {
    for (bool bnsd : {false, true}) {
      for (DType dtype : {DType::F64, DType::F32}) {
        INFO("theta " << theta << (bnsd ? " BNSD " : " BSHD ") << dtype_name(dtype));
        const Shape shape = bnsd ? Shape{B, H, S, D} : Shape{B, S, H, D};
        Tensor x = random_tensor(shape, dtype, 3);
        Tensor y = rope_of(x, {.head_dim = D, .theta = theta}, positions, bnsd ? 2 : 1);
        const std::vector<double> want =
            naive_rope(values_of(x), B, S, H, D, positions, theta, bnsd);
        const double tol = dtype == DType::F64 ? 1e-12 : 2e-6;
        CloseReport r = compare_close(values_of(y), want, tol, tol);
        INFO(r.message);
        CHECK(r.ok);
      }
    }
  }
}

TEST_CASE("rotary scores depend only on the distance between positions", "[rope]") {
  const int64_t D = 16;
  const nn::RotaryOptions o{.head_dim = D, .theta = 10000.0};
  Tensor q = random_tensor(Shape{1, 1, 1, D}, DType::F64, 5);
  Tensor k = random_tensor(Shape{1, 1, 1, D}, DType::F64, 6);
  for (int64_t shift : {1, 13, 4096}) {
    for (auto [m, n] : std::vector<std::pair<int64_t, int64_t>>{{0, 0}, {9, 2}, {2, 9}}) {
      const double base = dot(values_of(rope_of(q, o, {m})), values_of(rope_of(k, o, {n})));
      const double moved =
          dot(values_of(rope_of(q, o, {m + shift})), values_of(rope_of(k, o, {n + shift})));
      CHECK(moved == Approx(base).margin(1e-10));
    }
  }
  // Not vacuous: a different distance gives a different score.
  const double d7 = dot(values_of(rope_of(q, o, {7})), values_of(rope_of(k, o, {0})));
  const double d3 = dot(values_of(rope_of(q, o, {3})), values_of(rope_of(k, o, {0})));
  CHECK(std::abs(d7 - d3) > 1e-3);
}

TEST_CASE("apply_rotary's gradient is the rotation back", "[rope]") {
  const int64_t B = 2, S = 4, H = 2, D = 6;
  const nn::RotaryOptions o{.head_dim = D, .theta = 100.0};
  const std::vector<int64_t> positions = {3, 0, 11, 5};
  auto [cos, sin] = nn::rope_tables(o, positions, DType::F64);
  check_gradients("apply_rotary",
                  [&](const std::vector<Tensor>& in) {
                    return std::vector<Tensor>{nn::apply_rotary(in[0], cos, sin)};
                  },
                  {leaf(Shape{B, S, H, D}, 7)});
  // The adjoint of a rotation by +angle is the rotation by -angle.
  Tensor up = random_tensor(Shape{B, S, H, D}, DType::F64, 8);
  std::vector<Tensor> g =
      gradients([&](const std::vector<Tensor>& in) { return nn::apply_rotary(in[0], cos, sin); },
                {random_tensor(Shape{B, S, H, D}, DType::F64, 9)}, up);
  Tensor back = nn::apply_rotary(up, cos, ops::mul(sin, -1.0));
  CloseReport r = compare_close(values_of(g[0]), values_of(back), 1e-12, 1e-12);
  INFO(r.message);
  CHECK(r.ok);
}

TEST_CASE("Llama 3 scaling stretches long wavelengths, keeps short ones, blends between",
          "[rope]") {
  const int64_t D = 128;
  const nn::Llama3Scaling s{.factor = 8.0,
                            .low_freq_factor = 1.0,
                            .high_freq_factor = 4.0,
                            .original_max_position_embeddings = 8192};
  const std::vector<double> plain = nn::rope_inv_freq({.head_dim = D, .theta = 500000.0});
  const std::vector<double> scaled =
      nn::rope_inv_freq({.head_dim = D, .theta = 500000.0, .llama3 = s});
  REQUIRE(plain.size() == static_cast<size_t>(D / 2));
  REQUIRE(scaled.size() == plain.size());
  int kept = 0, stretched = 0, blended = 0;
  for (size_t i = 0; i < plain.size(); ++i) {
    CHECK(plain[i] == Approx(std::pow(500000.0, -2.0 * static_cast<double>(i) / D)));
    const double wavelen = 2 * std::numbers::pi / plain[i];
    if (wavelen < 8192.0 / 4.0) {
      CHECK(scaled[i] == plain[i]);
      ++kept;
    } else if (wavelen > 8192.0 / 1.0) {
      CHECK(scaled[i] == Approx(plain[i] / 8.0).epsilon(1e-14));
      ++stretched;
    } else {
      CHECK(scaled[i] < plain[i]);
      CHECK(scaled[i] > plain[i] / 8.0);
      ++blended;
    }
  }
  CHECK(kept > 0);  // every band is exercised at this head_dim and theta
  CHECK(stretched > 0);
  CHECK(blended > 0);
  for (size_t i = 1; i < scaled.size(); ++i)
    CHECK(scaled[i] < scaled[i - 1]);  // frequencies still fall with i
}

TEST_CASE("rotary tables and apply_rotary handle empty sequences", "[rope]") {
  auto [cos, sin] = nn::rope_tables({.head_dim = 4}, {});
  CHECK(cos.shape() == Shape{0, 4});
  Tensor x = leaf(Shape{2, 0, 3, 4}, 1, DType::F32);
  Tensor y = nn::apply_rotary(x, cos, sin);
  CHECK(y.shape() == x.shape());
  backward(sum(y));
  CHECK(grad(x).shape() == x.shape());
  CHECK(nn::position_range(5, 3) == std::vector<int64_t>{5, 6, 7});
  CHECK(nn::position_range(5, 0).empty());
}

TEST_CASE("rotary embedding refuses bad options and shapes with the values", "[rope]") {
  CHECK_THROWS_WITH(nn::rope_inv_freq({.head_dim = 7}), Contains("positive even head_dim, got 7"));
  CHECK_THROWS_WITH(nn::rope_inv_freq({.head_dim = 8, .theta = 0}),
                    Contains("positive finite theta, got 0"));
  CHECK_THROWS_WITH(
      nn::rope_inv_freq({.head_dim = 8, .llama3 = nn::Llama3Scaling{.low_freq_factor = 4.0}}),
      Contains("low_freq_factor 4"));
  CHECK_THROWS_WITH(nn::rope_tables({.head_dim = 4}, {0, -2}),
                    Contains("non-negative positions, got -2 at index 1"));
  auto [cos, sin] = nn::rope_tables({.head_dim = 4}, {0, 1, 2});
  CHECK_THROWS_WITH(nn::apply_rotary(ops::zeros(Shape{1, 2, 1, 4}), cos, sin),
                    Contains("tables of shape [2,4] for x of shape [1,2,1,4], got [3,4]"));
  CHECK_THROWS_WITH(nn::apply_rotary(ops::zeros(Shape{3, 4}), cos, sin),
                    Contains("expected x of 4 dims"));
  CHECK_THROWS_WITH(nn::apply_rotary(ops::zeros(Shape{1, 3, 1, 4}, DType::F64), cos, sin),
                    Contains("dtype and device (f64"));
  CHECK_THROWS_WITH(nn::position_range(-1, 2), Contains("got -1 and 2"));
}

namespace {

nn::SelfAttentionOptions qwen_like() {
  return {.d_model = 12,
          .n_heads = 4,
          .n_kv_heads = 2,
          .causal = true,
          .head_dim = 6,  // != d_model / n_heads
          .qkv_bias = true,
          .qk_norm = true,
          .rope = nn::RotaryOptions{.theta = 50.0}};
}

}  // namespace

TEST_CASE("SelfAttention with biases, QK-norm and RoPE is the Llama-family composition",
          "[rope][layers]") {
  Generator gen(4);
  auto attn = nn::make<nn::SelfAttention>(qwen_like(), gen);
  std::map<std::string, Shape> shapes;
  for (const auto& [name, p] : attn->named_parameters())
    shapes[name] = p.shape();
  const std::map<std::string, Shape> want = {
      {"q_proj.weight", {24, 12}}, {"q_proj.bias", {24}},       {"k_proj.weight", {12, 12}},
      {"k_proj.bias", {12}},       {"v_proj.weight", {12, 12}}, {"v_proj.bias", {12}},
      {"o_proj.weight", {12, 24}}, {"q_norm.weight", {6}},      {"k_norm.weight", {6}}};
  CHECK(shapes == want);

  // The composition written out with the public ops and the layer's weights.
  const int64_t B = 2, S = 5;
  Tensor x = random_tensor(Shape{B, S, 12}, DType::F32, 11);
  for (const auto& [name, p] : attn->named_parameters())  // norms away from 1
    ops::copy_(p, random_tensor(p.shape(), DType::F32, static_cast<uint32_t>(name.size())));
  const std::vector<int64_t> positions = {4, 5, 6, 7, 8};
  auto [cos, sin] = nn::rope_tables({.head_dim = 6, .theta = 50.0}, positions);
  auto heads = [&](const Tensor& y) { return reshape(y, Shape{B, S, y.shape()[2] / 6, 6}); };
  Tensor q = heads(linear(x, attn->q_proj()->weight(), attn->q_proj()->bias()));
  Tensor k = heads(linear(x, attn->k_proj()->weight(), attn->k_proj()->bias()));
  Tensor v = heads(linear(x, attn->v_proj()->weight(), attn->v_proj()->bias()));
  q = nn::apply_rotary(rms_norm(q, attn->q_norm()->weight(), 1e-6), cos, sin);
  k = nn::apply_rotary(rms_norm(k, attn->k_norm()->weight(), 1e-6), cos, sin);
  AttentionOptions causal;
  causal.causal = true;
  Tensor o = scaled_dot_product_attention(transpose(q, 1, 2), transpose(k, 1, 2),
                                          transpose(v, 1, 2), causal)
                 .out;
  Tensor want_out = linear(reshape(transpose(o, 1, 2), Shape{B, S, 24}), attn->o_proj()->weight());
  Tensor got;
  {
    nn::PositionScope scope(positions);
    got = (*attn)(x);
  }
  CloseReport r = compare_close(values_of(got), values_of(want_out), 1e-5, 1e-6);
  INFO(r.message);
  CHECK(r.ok);
}

TEST_CASE("a PositionScope places the tokens: a shift keeps the output, a shuffle does not",
          "[rope][layers]") {
  Generator gen(5);
  nn::SelfAttentionOptions o = qwen_like();
  o.qk_norm = false;
  auto attn = nn::make<nn::SelfAttention>(o, gen);
  Tensor x = random_tensor(Shape{1, 6, 12}, DType::F64, 12);
  attn->to(DType::F64);
  const Tensor from_zero = (*attn)(x);  // no scope: positions 0..5
  Tensor shifted, shuffled;
  {
    nn::PositionScope scope(nn::position_range(1000, 6));
    shifted = (*attn)(x);
  }
  {
    nn::PositionScope scope({0, 1, 2, 3, 5, 4});
    shuffled = (*attn)(x);
  }
  CHECK(compare_close(values_of(shifted), values_of(from_zero), 1e-9, 1e-9).ok);
  CHECK_FALSE(compare_close(values_of(shuffled), values_of(from_zero), 1e-6, 1e-6).ok);
  nn::PositionScope wrong({0, 1, 2});
  CHECK_THROWS_WITH((*attn)(x), Contains("hold the 6 positions of the local sequence, got 3"));
}

TEST_CASE("a PositionScope computes each rotary table once and keeps it while it lives", "[rope]") {
  const nn::RotaryOptions a{.head_dim = 8, .theta = 100.0};
  nn::RotaryOptions b = a;
  b.llama3 = nn::Llama3Scaling{.original_max_position_embeddings = 16};
  const std::vector<int64_t> positions = {7, 3, 9, 0};
  nn::PositionScope scope(positions);
  auto [c1, s1] = nn::rotary_tables(a, 4, DType::F32, Device::cpu(), "test");
  auto [c2, s2] = nn::rotary_tables(a, 4, DType::F32, Device::cpu(), "test");
  CHECK(c1.raw_data() == c2.raw_data());  // the same table, not recomputed
  CHECK(s1.raw_data() == s2.raw_data());
  auto [want_c, want_s] = nn::rope_tables(a, positions);
  CHECK(ops::equal(c1, want_c));
  CHECK(ops::equal(s1, want_s));
  // Other options or another dtype: their own tables.
  auto [cb, sb] = nn::rotary_tables(b, 4, DType::F32, Device::cpu(), "test");
  CHECK(cb.raw_data() != c1.raw_data());
  CHECK(ops::equal(cb, nn::rope_tables(b, positions).first));
  auto [cd, sd] = nn::rotary_tables(a, 4, DType::F64, Device::cpu(), "test");
  CHECK(cd.dtype() == DType::F64);
  CHECK(ops::equal(cd, nn::rope_tables(a, positions, DType::F64).first));
  CHECK_THROWS_WITH(nn::rotary_tables(a, 5, DType::F32, Device::cpu(), "test"),
                    Contains("[test] expected the PositionScope to hold the 5 positions"));
  {
    nn::PositionScope inner(nn::position_range(0, 4));  // the innermost scope's positions
    CHECK(ops::equal(nn::rotary_tables(a, 4, DType::F32, Device::cpu(), "test").first,
                     nn::rope_tables(a, nn::position_range(0, 4)).first));
  }
}

TEST_CASE("SelfAttention refuses a rotary head_dim other than its own", "[rope][layers]") {
  Generator gen(6);
  nn::SelfAttentionOptions o = qwen_like();
  o.rope->head_dim = 4;
  CHECK_THROWS_WITH(nn::make<nn::SelfAttention>(o, gen), Contains("layer's 6, got 4"));
  o.rope->head_dim = 0;
  o.rope->theta = -1;
  CHECK_THROWS_WITH(nn::make<nn::SelfAttention>(o, gen), Contains("positive finite theta"));
}
