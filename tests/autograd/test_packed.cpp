// Packed sequences (Note [Packed sequences] in tensor/ops.h): several
// documents laid end to end along one sequence, each attending only to
// itself. The oracle is the definition: the packed call equals attention run
// on each document separately, as an unpacked sequence, forward and
// gradients; a shard of the packed sequence at its offsets gives the whole
// call's rows; the tiled CUDA kernels give the CPU's results; bad bounds are
// refused with the values.
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "tandem/autograd/nn/attention.h"
#include "tandem/autograd/ops.h"
#include "tests/support/autograd_util.h"
#include "tests/support/skip_cuda.h"
#include "tests/support/test_util.h"

using namespace tandem;
using namespace tandem::test;
using Catch::Matchers::Contains;

namespace {

constexpr DType F64 = DType::F64;
constexpr DType F32 = DType::F32;

struct PackedCase {
  const char* name;
  int64_t B, Hq, Hkv, S, D;
  bool causal;
  std::vector<std::vector<int64_t>> lengths;  // one list for every row, or one per row
};

// Documents that cross the CPU kernel's 64-row blocks and 8-row tiles and the
// CUDA kernels' tiles, an empty document, one-token documents, bounds per row
// and shared, grouped-query heads.
const std::vector<PackedCase> kPackedCases = {
    {"causal, three documents and an empty one, crossing blocks",
     1,
     2,
     2,
     150,
     20,
     true,
     {{37, 0, 90, 23}}},
    {"non-causal, per-row documents, GQA 2, B=2", 2, 4, 2, 70, 16, false, {{1, 69}, {30, 30, 10}}},
    {"causal, one-token documents", 1, 1, 1, 19, 8, true, {{1, 1, 1, 5, 1, 10}}},
    {"causal, one document: the unpacked call", 1, 2, 1, 33, 12, true, {{33}}},
    {"causal, per-row documents, GQA 4, B=2", 2, 4, 1, 100, 24, true, {{64, 36}, {9, 9, 9, 73}}},
};

std::shared_ptr<const DocumentBounds> bounds_of(const PackedCase& c) {
  return DocumentBounds::from_lengths(c.lengths);
}

// The packed attention by its definition: each document of each batch row on
// its own (differentiable: narrow, attention, cat).
Tensor per_document_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                              const PackedCase& c) {
  std::vector<Tensor> rows;
  for (int64_t b = 0; b < c.B; ++b) {
    const std::vector<int64_t>& lengths =
        c.lengths.size() == 1 ? c.lengths[0] : c.lengths[static_cast<size_t>(b)];
    std::vector<Tensor> documents;
    int64_t at = 0;
    for (int64_t n : lengths) {
      if (n == 0) continue;
      auto piece = [&](const Tensor& t) { return narrow(narrow(t, 0, b, 1), 2, at, n); };
      AttentionOptions o;
      o.causal = c.causal;
      documents.push_back(scaled_dot_product_attention(piece(q), piece(k), piece(v), o).out);
      at += n;
    }
    rows.push_back(cat(documents, 2));
  }
  return cat(rows, 0);
}

void require_close(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  REQUIRE(got.shape() == want.shape());
  const std::vector<double> g = values_of(got), w = values_of(want);
  for (size_t i = 0; i < w.size(); ++i) {
    INFO(what << " element " << i << ": got " << g[i] << ", want " << w[i]);
    REQUIRE((g[i] == w[i] || std::abs(g[i] - w[i]) <= tol * (1 + std::abs(w[i]))));
  }
}

struct Inputs {
  Tensor q, k, v, up;
};

Inputs inputs_of(const PackedCase& c, DType dt, uint32_t seed) {
  return {random_tensor(Shape{c.B, c.Hq, c.S, c.D}, dt, seed, -2, 2),
          random_tensor(Shape{c.B, c.Hkv, c.S, c.D}, dt, seed + 1, -2, 2),
          random_tensor(Shape{c.B, c.Hkv, c.S, c.D}, dt, seed + 2),
          random_tensor(Shape{c.B, c.Hq, c.S, c.D}, dt, seed + 3)};
}

}  // namespace

TEST_CASE("packed attention equals attention on each document alone", "[packed]") {
  for (const PackedCase& c : kPackedCases) {
    for (DType dt : {F64, F32}) {
      DYNAMIC_SECTION(c.name << ", " << dtype_name(dt)) {
        const Inputs in = inputs_of(c, dt, static_cast<uint32_t>(c.S * 7 + c.B));
        AttentionOptions o;
        o.causal = c.causal;
        o.documents = bounds_of(c);
        auto packed = [&](const std::vector<Tensor>& t) {
          return scaled_dot_product_attention(t[0], t[1], t[2], o).out;
        };
        auto separate = [&](const std::vector<Tensor>& t) {
          return per_document_attention(t[0], t[1], t[2], c);
        };
        // Both sides run the same kernel, on different tiles: rounding apart.
        const double tol = dt == F64 ? 1e-12 : 2e-6;
        require_close(packed({in.q, in.k, in.v}), separate({in.q, in.k, in.v}), tol, "out");
        const std::vector<Tensor> want = gradients(separate, {in.q, in.k, in.v}, in.up);
        const std::vector<Tensor> got = gradients(packed, {in.q, in.k, in.v}, in.up);
        const char* names[] = {"dq", "dk", "dv"};
        for (int i = 0; i < 3; ++i)
          require_close(got[i], want[i], dt == F64 ? 1e-10 : 1e-5, names[i]);
      }
    }
  }
}

TEST_CASE("a shard of a packed sequence at its offsets gives the whole call's rows", "[packed]") {
  // What context parallelism does with the same bounds: a query chunk at
  // q_offset against all keys (all-gather KV), and against a key chunk at
  // k_offset (a ring step) whose partial rows merge by log-sum-exp.
  const PackedCase c{"", 2, 2, 1, 120, 16, true, {{50, 3, 67}, {10, 100, 10}}};
  const Inputs in = inputs_of(c, F32, 5);
  AttentionOptions o;
  o.causal = true;
  o.documents = bounds_of(c);
  const AttentionResult whole = ops::scaled_dot_product_attention(in.q, in.k, in.v, o);
  for (const auto& [q0, len] : {std::pair<int64_t, int64_t>{0, 40}, {40, 45}, {85, 35}}) {
    INFO("queries " << q0 << ".." << q0 + len);
    AttentionOptions oq = o;
    oq.q_offset = q0;
    const AttentionResult part =
        ops::scaled_dot_product_attention(ops::narrow(in.q, 2, q0, len), in.k, in.v, oq);
    require_close(part.out, ops::narrow(whole.out, 2, q0, len), 1e-6, "query shard out");
    require_close(part.lse, ops::narrow(whole.lse, 2, q0, len), 1e-6, "query shard lse");
  }
  // Key chunks: every query row's lse over the chunks merges to the whole lse.
  Tensor lse = ops::full({c.B, c.Hq, c.S}, -INFINITY, F32);
  for (const auto& [k0, len] : {std::pair<int64_t, int64_t>{0, 52}, {52, 30}, {82, 38}}) {
    AttentionOptions ok = o;
    ok.k_offset = k0;
    const AttentionResult part = ops::scaled_dot_product_attention(
        in.q, ops::narrow(in.k, 2, k0, len), ops::narrow(in.v, 2, k0, len), ok);
    lse = ops::log(ops::add(ops::exp(lse), ops::exp(part.lse)));
  }
  require_close(lse, whole.lse, 1e-5, "lse merged over key chunks");
}

TEST_CASE("packed attention: two kernel threads give the same bits", "[packed][threads]") {
  const PackedCase& c = kPackedCases[0];
  const Inputs in = inputs_of(c, F32, 3);
  AttentionOptions o;
  o.causal = c.causal;
  o.documents = bounds_of(c);
  auto run = [&] {
    const AttentionResult r = ops::scaled_dot_product_attention(in.q, in.k, in.v, o);
    std::vector<Tensor> g =
        ops::scaled_dot_product_attention_backward(in.q, in.k, in.v, r.out, r.lse, in.up, o);
    g.push_back(r.out);
    return g;
  };
  const int saved = ops::num_threads();
  ops::set_num_threads(1);
  const std::vector<Tensor> one = run();
  ops::set_num_threads(2);
  const std::vector<Tensor> two = run();
  ops::set_num_threads(saved);
  CHECK(all_equal(one, two));
}

TEST_CASE("CoreAttention reads the documents a DocumentScope declares", "[packed]") {
  const PackedCase& c = kPackedCases[1];
  const Inputs in = inputs_of(c, F32, 9);
  AttentionOptions o;
  o.causal = c.causal;
  auto core = std::make_shared<nn::CoreAttention>(o);
  auto bshd = [](const Tensor& t) { return ops::contiguous(ops::transpose(t, 1, 2)); };
  Tensor scoped;
  {
    nn::DocumentScope scope(bounds_of(c));
    REQUIRE(nn::scoped_documents() != nullptr);
    scoped = core->call(Args{bshd(in.q), bshd(in.k), bshd(in.v)})[0];
  }
  REQUIRE(nn::scoped_documents() == nullptr);
  const Tensor plain = core->call(Args{bshd(in.q), bshd(in.k), bshd(in.v)})[0];
  require_close(scoped, bshd(per_document_attention(in.q, in.k, in.v, c)), 2e-6, "scoped");
  REQUIRE_FALSE(ops::allclose(scoped, plain, 1e-3, 1e-3));  // the scope changed the result
}

TEST_CASE("document bounds that do not fit are refused with the values", "[packed]") {
  const auto op = Contains("[tensor::DocumentBounds]");
  REQUIRE_THROWS_WITH(DocumentBounds::make({}), op && Contains("got none"));
  REQUIRE_THROWS_WITH(DocumentBounds::make({{1, 5}}),
                      op && Contains("start at 0") && Contains("1, 5"));
  REQUIRE_THROWS_WITH(DocumentBounds::make({{0}}), op && Contains("at least one document"));
  REQUIRE_THROWS_WITH(DocumentBounds::make({{0, 6, 4}}), op && Contains("got 4 after 6"));
  REQUIRE_THROWS_WITH(DocumentBounds::from_lengths({{3, -1}}), op && Contains("got -1"));

  const Tensor q = ops::zeros({2, 2, 8, 4});
  AttentionOptions o;
  o.documents = DocumentBounds::from_lengths({{4, 4}, {8}, {2, 6}});
  const auto sdpa = Contains("[tensor::scaled_dot_product_attention]");
  REQUIRE_THROWS_WITH(ops::scaled_dot_product_attention(q, q, q, o),
                      sdpa && Contains("1 or 2 (batch) rows, got 3"));
  o.documents = DocumentBounds::from_lengths({{4, 3}});
  REQUIRE_THROWS_WITH(ops::scaled_dot_product_attention(q, q, q, o),
                      sdpa && Contains("cover positions [0, 8)") && Contains("ending at 7"));
  o.q_offset = 4;  // a shard at position 4: the bounds must reach 12
  o.documents = DocumentBounds::from_lengths({{8}});
  REQUIRE_THROWS_WITH(ops::scaled_dot_product_attention(q, q, q, o),
                      sdpa && Contains("[0, 12)") && Contains("q at 4"));
  // The backward checks the same way.
  REQUIRE_THROWS_WITH(
      ops::scaled_dot_product_attention_backward(q, q, q, q, ops::zeros({2, 2, 8}), q, o),
      Contains("[0, 12)"));
}

// Cases for the tiled CUDA kernels (Note [Tiled CUDA attention]): windows that
// begin and end inside tiles, query and key tiles that see nothing of a
// document, and a shard at offsets both ways.
TEST_CASE("tiled CUDA attention with packed sequences matches the CPU", "[packed][cuda]") {
  TANDEM_SKIP_WITHOUT_CUDA();
  const Device gpu = Device::cuda(0);
  auto on_gpu = [&](const Tensor& t) { return ops::to(t, gpu); };
  auto on_cpu = [](const Tensor& t) { return ops::to(t, Device::cpu()); };
  struct Shard {
    int64_t q0, q_len, k0, k_len;
  };
  const std::vector<std::pair<PackedCase, Shard>> cases = {
      {{"causal, GQA 2, D=64", 1, 4, 2, 170, 64, true, {{45, 0, 100, 25}}}, {0, 170, 0, 170}},
      {{"non-causal, per-row, D=24", 2, 2, 2, 133, 24, false, {{70, 63}, {1, 131, 1}}},
       {0, 133, 0, 133}},
      {{"causal shard: queries after the keys, GQA 4, D=128",
        1,
        8,
        2,
        200,
        128,
        true,
        {{30, 90, 7, 73}}},
       {120, 70, 20, 133}},
      {{"causal shard: keys after the queries", 2, 2, 1, 200, 32, true, {{50, 50, 100}}},
       {10, 90, 60, 140}},
  };
  for (DType dt : {F32, F64}) {
    const double tol = dt == F64 ? 1e-10 : 2e-5;
    for (const auto& [c, sh] : cases) {
      DYNAMIC_SECTION(c.name << ", " << dtype_name(dt)) {
        AttentionOptions o;
        o.causal = c.causal;
        o.documents = bounds_of(c);
        o.q_offset = sh.q0;
        o.k_offset = sh.k0;
        const Inputs in = inputs_of(c, dt, 81);
        const Tensor q = ops::narrow(in.q, 2, sh.q0, sh.q_len);
        const Tensor k = ops::narrow(in.k, 2, sh.k0, sh.k_len);
        const Tensor v = ops::narrow(in.v, 2, sh.k0, sh.k_len);
        const Tensor dout = ops::narrow(in.up, 2, sh.q0, sh.q_len);
        const AttentionResult cpu = ops::scaled_dot_product_attention(q, k, v, o);
        const AttentionResult got =
            ops::scaled_dot_product_attention(on_gpu(q), on_gpu(k), on_gpu(v), o);
        require_close(on_cpu(got.out), cpu.out, tol, "out");
        require_close(on_cpu(got.lse), cpu.lse, 1e-5, "lse");
        const std::vector<Tensor> want =
            ops::scaled_dot_product_attention_backward(q, k, v, cpu.out, cpu.lse, dout, o);
        const std::vector<Tensor> grads = ops::scaled_dot_product_attention_backward(
            on_gpu(q), on_gpu(k), on_gpu(v), on_gpu(cpu.out), on_gpu(cpu.lse), on_gpu(dout), o);
        const char* names[] = {"dq", "dk", "dv"};
        for (int i = 0; i < 3; ++i)
          require_close(on_cpu(grads[i]), want[i], 10 * tol, names[i]);
      }
    }
  }
}
