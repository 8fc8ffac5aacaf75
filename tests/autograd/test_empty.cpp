// Zero-size dims: every differentiable op and every nn layer, forward and
// backward, with a 0 extent in each position of its inputs. Empty shards are
// what tandem's own uneven sharding produces (chunk semantics: the last ranks
// of a sequence or feature split may hold nothing), so these are not corner
// cases of user input but states a rank reaches in normal training.
//
// Expected results are PyTorch's: an empty output where an output dim is 0;
// zeros where a sum runs over nothing (sum, matmul/linear with K == 0,
// attention with no keys); NaN for a mean over nothing; an error for amax and
// amin over nothing. Every input that takes part gets a gradient of its own
// shape: empty, or zeros (a nonempty input whose every use is empty).
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "tandem/autograd/nn/attention.h"
#include "tandem/autograd/nn/linear.h"
#include "tandem/autograd/nn/moe.h"
#include "tandem/autograd/nn/norm.h"
#include "tandem/autograd/nn/transformer.h"
#include "tandem/autograd/ops.h"
#include "tests/support/autograd_util.h"

using namespace tandem;

// Shapes print as [2,0,4] in assertion messages.
namespace Catch {
template <>
struct StringMaker<tandem::Dims> {
  static std::string convert(const tandem::Dims& d) { return d.str(); }
};
}  // namespace Catch

namespace {

using Vec = std::vector<double>;
using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

// What the (first) output holds when it is not empty.
enum class Fill { Zeros, NaN, Any };

Vec values(const Tensor& t) {
  return ops::to(ops::contiguous(detach(t)), DType::F64).to_vector<double>();
}

bool all_are(const Tensor& t, double v) {
  for (double x : values(t)) {
    if (std::isnan(v) ? !std::isnan(x) : x != v) return false;
  }
  return true;
}

// Shape `base` with extent 0 at `pos`.
Shape zero_at(Shape base, int pos) {
  base[pos] = 0;
  return base;
}

std::string str(const std::vector<Shape>& shapes) {
  std::string s;
  for (const Shape& x : shapes)
    s += (s.empty() ? "" : ", ") + x.str();
  return s;
}

// Runs fn on f64 leaves of `shapes` (uniform in [0.5, 1.5), so log and sqrt
// are defined), checks the output's shape and fill, seeds backward with ones
// of the output's shape, and checks that every leaf got a gradient of its
// shape that is all zeros, unless `grad_ones` names it (then all ones).
void check_op(const std::string& what, const std::vector<Shape>& shapes, const Fn& fn,
              const Shape& want, Fill fill = Fill::Zeros, std::vector<size_t> grad_ones = {}) {
  INFO(what << " on " << str(shapes));
  std::vector<Tensor> in;
  for (size_t i = 0; i < shapes.size(); ++i)
    in.push_back(test::leaf(shapes[i], static_cast<uint32_t>(i + 1), DType::F64, 0.5, 1.5));
  Tensor y;
  REQUIRE_NOTHROW(y = fn(in));
  REQUIRE(y.shape() == want);
  if (y.numel() > 0 && fill == Fill::Zeros) CHECK(all_are(y, 0.0));
  if (y.numel() > 0 && fill == Fill::NaN) CHECK(all_are(y, std::nan("")));
  REQUIRE(requires_grad(y));
  REQUIRE_NOTHROW(backward({y}, {ops::ones_like(y)}));
  for (size_t i = 0; i < in.size(); ++i) {
    INFO("gradient of input " << i);
    Tensor g = grad(in[i]);
    REQUIRE(g.defined());
    CHECK(g.shape() == in[i].shape());
    const bool ones = std::find(grad_ones.begin(), grad_ones.end(), i) != grad_ones.end();
    CHECK(all_are(g, ones ? 1.0 : 0.0));
  }
}

const Shape kBase = {2, 3, 4};

}  // namespace

TEST_CASE("elementwise ops on a zero-size dim in each position", "[empty]") {
  const std::vector<std::pair<std::string, std::function<Tensor(const Tensor&)>>> unary = {
      {"neg", [](const Tensor& x) { return neg(x); }},
      {"exp", [](const Tensor& x) { return exp(x); }},
      {"log", [](const Tensor& x) { return log(x); }},
      {"sqrt", [](const Tensor& x) { return sqrt(x); }},
      {"rsqrt", [](const Tensor& x) { return rsqrt(x); }},
      {"abs", [](const Tensor& x) { return abs(x); }},
      {"tanh", [](const Tensor& x) { return tanh(x); }},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }},
      {"relu", [](const Tensor& x) { return relu(x); }},
      {"gelu", [](const Tensor& x) { return gelu(x); }},
      {"silu", [](const Tensor& x) { return silu(x); }},
      {"pow 2", [](const Tensor& x) { return pow(x, 2.0); }},
      {"x + 1", [](const Tensor& x) { return add(x, 1.0); }},
      {"1 - x", [](const Tensor& x) { return rsub(x, 1.0); }},
      {"x * 3", [](const Tensor& x) { return mul(x, 3.0); }},
      {"2 / x", [](const Tensor& x) { return rdiv(x, 2.0); }},
      {"clone", [](const Tensor& x) { return clone(x); }},
      {"to f32", [](const Tensor& x) { return to(x, DType::F32); }},
  };
  const std::vector<std::pair<std::string, std::function<Tensor(const Tensor&, const Tensor&)>>>
      binary = {
          {"add", [](const Tensor& a, const Tensor& b) { return add(a, b); }},
          {"sub", [](const Tensor& a, const Tensor& b) { return sub(a, b); }},
          {"mul", [](const Tensor& a, const Tensor& b) { return mul(a, b); }},
          {"div", [](const Tensor& a, const Tensor& b) { return div(a, b); }},
          {"pow", [](const Tensor& a, const Tensor& b) { return pow(a, b); }},
          {"maximum", [](const Tensor& a, const Tensor& b) { return maximum(a, b); }},
          {"minimum", [](const Tensor& a, const Tensor& b) { return minimum(a, b); }},
          {"where", [](const Tensor& a, const Tensor& b) { return where(gt(a, b), a, b); }},
      };
  for (int p = 0; p < 3; ++p) {
    const Shape s = zero_at(kBase, p);
    for (const auto& [name, f] : unary)
      check_op(
          name, {s}, [&](const std::vector<Tensor>& x) { return f(x[0]); }, s);
    for (const auto& [name, f] : binary) {
      check_op(
          name, {s, s}, [&](const std::vector<Tensor>& x) { return f(x[0], x[1]); }, s);
      // Broadcasting against nonempty operands: their gradients are zeros.
      Shape one = kBase;
      one[p] = 1;
      check_op(
          name + " broadcast size-1 dim", {s, one},
          [&](const std::vector<Tensor>& x) { return f(x[0], x[1]); }, s);
      if (p != 2) {
        check_op(
            name + " broadcast last dim", {s, Shape{4}},
            [&](const std::vector<Tensor>& x) { return f(x[0], x[1]); }, s);
      }
    }
    check_op(
        "swiglu", {s, s}, [](const std::vector<Tensor>& x) { return swiglu(x[0], x[1]); }, s);
  }
}

TEST_CASE("reductions, softmax and cumsum over and beside a zero-size dim", "[empty]") {
  for (int p = 0; p < 3; ++p) {
    const Shape s = zero_at(kBase, p);
    for (int d = 0; d < 3; ++d) {
      for (bool keep : {false, true}) {
        Shape out = s;
        if (keep) {
          out[d] = 1;
        } else {
          out.erase(d);
        }
        const std::string tag = fmt::format(" dim {} keepdim {}", d, keep);
        // Over the empty dim: sum is 0 and mean NaN, as in PyTorch.
        check_op(
            "sum" + tag, {s}, [&](const std::vector<Tensor>& x) { return sum(x[0], {d}, keep); },
            out, Fill::Zeros);
        check_op(
            "mean" + tag, {s}, [&](const std::vector<Tensor>& x) { return mean(x[0], {d}, keep); },
            out, Fill::NaN);
        if (d == p) {
          // No identity for a max over nothing: PyTorch refuses too.
          Tensor x = ops::zeros(s);
          CHECK_THROWS_WITH(amax(x, {d}, keep), Catch::Contains("non-empty reduction"));
          CHECK_THROWS_WITH(amin(x, {d}, keep), Catch::Contains("non-empty reduction"));
          CHECK_THROWS_WITH(ops::argmax(x, d, keep), Catch::Contains("non-empty reduction"));
        } else {
          check_op(
              "amax" + tag, {s},
              [&](const std::vector<Tensor>& x) { return amax(x[0], {d}, keep); }, out);
          check_op(
              "amin" + tag, {s},
              [&](const std::vector<Tensor>& x) { return amin(x[0], {d}, keep); }, out);
          check_op(
              "max" + tag, {s},
              [&](const std::vector<Tensor>& x) { return max(x[0], d, keep).first; }, out);
          CHECK(ops::argmax(ops::zeros(s), d, keep).shape() == out);
        }
      }
      check_op(
          fmt::format("softmax dim {}", d), {s},
          [&](const std::vector<Tensor>& x) { return softmax(x[0], d); }, s);
      check_op(
          fmt::format("log_softmax dim {}", d), {s},
          [&](const std::vector<Tensor>& x) { return log_softmax(x[0], d); }, s);
      check_op(
          fmt::format("cumsum dim {}", d), {s},
          [&](const std::vector<Tensor>& x) { return cumsum(x[0], d); }, s);
    }
    // Over every dim: one element, 0 for sum and NaN for mean.
    check_op(
        "sum all", {s}, [](const std::vector<Tensor>& x) { return sum(x[0]); }, Shape{});
    check_op(
        "mean all", {s}, [](const std::vector<Tensor>& x) { return mean(x[0]); }, Shape{},
        Fill::NaN);
  }
}

TEST_CASE("views, splits and joins of a zero-size dim", "[empty]") {
  for (int p = 0; p < 3; ++p) {
    const Shape s = zero_at(kBase, p);
    INFO("zero at " << p);
    const Shape flat = {s.numel()};
    check_op(
        "reshape", {s}, [&](const std::vector<Tensor>& x) { return reshape(x[0], flat); }, flat);
    check_op(
        "view", {s},
        [&](const std::vector<Tensor>& x) {
          return view(x[0], {s[0] * s[1], s[2]});
        },
        Shape{s[0] * s[1], s[2]});
    check_op(
        "flatten", {s}, [](const std::vector<Tensor>& x) { return flatten(x[0], 1); },
        Shape{s[0], s[1] * s[2]});
    check_op(
        "permute", {s},
        [](const std::vector<Tensor>& x) {
          return permute(x[0], {2, 0, 1});
        },
        Shape{s[2], s[0], s[1]});
    check_op(
        "transpose", {s}, [](const std::vector<Tensor>& x) { return transpose(x[0], 0, 2); },
        Shape{s[2], s[1], s[0]});
    check_op(
        "contiguous of a transpose", {s},
        [](const std::vector<Tensor>& x) { return contiguous(transpose(x[0], 0, 2)); },
        Shape{s[2], s[1], s[0]});
    check_op(
        "unsqueeze", {s}, [](const std::vector<Tensor>& x) { return unsqueeze(x[0], 1); },
        Shape{s[0], 1, s[1], s[2]});
    check_op(
        "squeeze", {zero_at({2, 1, 4}, p == 1 ? 0 : p)},
        [](const std::vector<Tensor>& x) { return squeeze(x[0], 1); },
        zero_at({2, 4}, p == 2 ? 1 : 0));
    check_op(
        "expand", {zero_at({2, 1, 4}, p == 1 ? 0 : p)},
        [&](const std::vector<Tensor>& x) {
          Shape e = x[0].shape();
          e[1] = 3;
          return expand(x[0], e);
        },
        zero_at({2, 3, 4}, p == 1 ? 0 : p));
    // Cuts along a nonempty dim keep the empty one; an empty cut of any dim.
    const int q = (p + 1) % 3;
    Shape cut = s;
    cut[q] = 1;
    check_op(
        "narrow", {s}, [&](const std::vector<Tensor>& x) { return narrow(x[0], q, 1, 1); }, cut);
    check_op(
        "slice", {s}, [&](const std::vector<Tensor>& x) { return slice(x[0], q, 0, 1); }, cut);
    Shape sel = s;
    sel.erase(q);
    check_op(
        "select", {s}, [&](const std::vector<Tensor>& x) { return select(x[0], q, -1); }, sel);
    check_op(
        "empty narrow", {kBase},
        [&](const std::vector<Tensor>& x) { return narrow(x[0], p, 1, 0); }, s);
    check_op(
        "empty slice", {kBase}, [&](const std::vector<Tensor>& x) { return slice(x[0], p, 2, 1); },
        s);
    // Joins: an empty piece beside a nonempty one (whose gradient is ones).
    Shape both = kBase;
    check_op("cat empty + full", {s, kBase},
             [&](const std::vector<Tensor>& x) {
               return cat({x[0], x[1]}, p);
             },
             both, Fill::Any, {1});
    Shape twice = s;
    twice[q] *= 2;
    check_op(
        "cat empty + empty", {s, s},
        [&](const std::vector<Tensor>& x) {
          return cat({x[0], x[1]}, q);
        },
        twice);
    Shape stacked = s;
    stacked.insert(0, 2);
    check_op(
        "stack", {s, s},
        [](const std::vector<Tensor>& x) {
          return stack({x[0], x[1]}, 0);
        },
        stacked);
    // Splitting an empty dim: split gives one empty piece, chunk gives
    // `chunks` of them (torch.split / torch.chunk).
    Tensor e = ops::zeros(s);
    CHECK(split(e, 2, p).size() == 1);
    CHECK(chunk(e, 3, p).size() == 3);
    for (const Tensor& piece : chunk(e, 3, p))
      CHECK(piece.shape() == s);
    check_op(
        "chunk then cat", {s},
        [&](const std::vector<Tensor>& x) { return cat(chunk(x[0], 3, p), p); }, s);
    check_op(
        "split_sizes with empty parts", {kBase},
        [&](const std::vector<Tensor>& x) {
          return split_sizes(x[0], {0, kBase[p], 0}, p)[0];
        },
        s);
  }
}

TEST_CASE("reshape's -1 with zero elements is refused only when ambiguous", "[empty]") {
  Tensor e = ops::zeros({2, 0, 32});
  // As in PyTorch: other extents whose product is nonzero fix the -1 ...
  CHECK(ops::reshape(ops::zeros({0, 4}), {-1, 2}).shape() == Shape{0, 2});
  CHECK(ops::reshape(e, {-1, 32}).shape() == Shape{0, 32});
  // ... a 0 beside it does not, and the error says why.
  CHECK_THROWS_WITH(
      ops::reshape(e, {2, 0, -1, 8}),
      Catch::Contains("[tensor::reshape] expected a shape whose -1 can be inferred") &&
          Catch::Contains("any size"));
  CHECK(ops::reshape(e, {2, 0, 4, 8}).shape() == Shape{2, 0, 4, 8});
}

TEST_CASE("matmul and linear with a zero extent in each of B, M, K, N", "[empty]") {
  const int64_t full[4] = {2, 3, 4, 5};  // B, M, K, N
  for (int p = 0; p < 4; ++p) {
    int64_t e[4] = {full[0], full[1], full[2], full[3]};
    e[p] = 0;
    const int64_t B = e[0], M = e[1], K = e[2], N = e[3];
    INFO("B=" << B << " M=" << M << " K=" << K << " N=" << N);
    // A sum over K == 0 is 0: a nonempty output of zeros, zero gradients.
    const Fn mm = [](const std::vector<Tensor>& x) { return matmul(x[0], x[1]); };
    if (p != 0) check_op("matmul 2-D", {{M, K}, {K, N}}, mm, {M, N});
    check_op("matmul folded batch", {{B, M, K}, {K, N}}, mm, {B, M, N});
    check_op("matmul batched", {{B, M, K}, {B, K, N}}, mm, {B, M, N});
    check_op("matmul broadcast batch", {{B, M, K}, {1, K, N}}, mm, {B, M, N});
    if (p != 1) check_op("matmul vector", {{K}, {B, K, N}}, mm, {B, N});
    check_op("matmul transposed view", {{B, K, M}, {N, K}},
             [](const std::vector<Tensor>& x) {
               return matmul(transpose(x[0], 1, 2), transpose(x[1], 0, 1));
             },
             {B, M, N});
    // linear(x, w, b) = x w^T + b: with K == 0 the output is the bias and its
    // gradient counts the rows; otherwise a zero extent leaves zeros.
    const Fn lin = [](const std::vector<Tensor>& x) { return linear(x[0], x[1], x[2]); };
    if (p == 2) {
      std::vector<Tensor> in = {test::leaf({B, M, K}, 1), test::leaf({N, K}, 2),
                                test::leaf({N}, 3)};
      Tensor y = lin(in);
      CHECK(ops::allclose(y, ops::expand(detach(in[2]), {B, M, N})));
      backward({y}, {ops::ones_like(y)});
      CHECK(all_are(grad(in[2]), static_cast<double>(B * M)));
      CHECK(grad(in[1]).shape() == Shape{N, 0});
      CHECK(grad(in[0]).shape() == Shape{B, M, 0});
    } else {
      check_op("linear", {{B, M, K}, {N, K}, {N}}, lin, {B, M, N});
    }
    check_op("linear without bias", {{B, M, K}, {N, K}},
             [](const std::vector<Tensor>& x) { return linear(x[0], x[1]); }, {B, M, N});
    if (p == 2) {
      // The reproduction: a 3-D input with an empty weight shard.
      check_op("linear 3-D, no bias", {{2, 3, K}, {12, K}},
               [](const std::vector<Tensor>& x) { return linear(x[0], x[1]); }, {2, 3, 12});
    }
  }
}

TEST_CASE("normalisation and indexing ops on zero-size dims", "[empty]") {
  for (int p = 0; p < 3; ++p) {
    const Shape s = zero_at(kBase, p);
    const int64_t D = s[2];
    check_op(
        "layer_norm", {s, {D}, {D}},
        [](const std::vector<Tensor>& x) { return layer_norm(x[0], x[1], x[2]); }, s);
    check_op(
        "rms_norm", {s, {D}}, [](const std::vector<Tensor>& x) { return rms_norm(x[0], x[1]); }, s);
    // index_select with an empty index, and of an empty dim by an empty index.
    for (int d = 0; d < 3; ++d) {
      Shape out = s;
      out[d] = 0;
      Tensor none = ops::zeros({0}, DType::I64);
      check_op(
          fmt::format("index_select dim {}", d), {s},
          [&](const std::vector<Tensor>& x) { return index_select(x[0], d, none); }, out);
      check_op(
          fmt::format("gather dim {}", d), {s},
          [&](const std::vector<Tensor>& x) {
            return gather(x[0], d, ops::zeros(out, DType::I64));
          },
          out);
    }
    // topk: k == 0 of a nonempty dim, or k == 0 of the empty one.
    Shape k0 = s;
    k0[2] = 0;
    check_op(
        "topk k=0", {s}, [](const std::vector<Tensor>& x) { return topk(x[0], 0, -1).first; }, k0);
  }
  // scatter_add of nothing leaves t as it is (its gradient passes through).
  check_op("scatter_add of nothing", {{3, 4}, {3, 0}},
           [](const std::vector<Tensor>& x) {
             return scatter_add(x[0], 1, ops::zeros({3, 0}, DType::I64), x[1]);
           },
           {3, 4}, Fill::Any, {0});
  // embedding: no indices, or rows of width 0.
  Tensor none = ops::zeros({2, 0}, DType::I64);
  check_op("embedding of no indices", {{7, 5}},
           [&](const std::vector<Tensor>& x) { return embedding(x[0], none); }, {2, 0, 5});
  Tensor idx = ops::from_vector<int64_t>({1, 6, 0}, {3});
  check_op("embedding of width 0", {{7, 0}},
           [&](const std::vector<Tensor>& x) { return embedding(x[0], idx); }, {3, 0});
}

TEST_CASE("attention with a zero extent in each of B, H, Sq, Sk, D", "[empty]") {
  const int64_t full[5] = {2, 4, 3, 5, 8};  // B, H, Sq, Sk, D
  for (int p = 0; p < 5; ++p) {
    for (bool causal : {false, true}) {
      int64_t e[5] = {full[0], full[1], full[2], full[3], full[4]};
      e[p] = 0;
      const int64_t B = e[0], H = e[1], Sq = e[2], Sk = e[3], D = e[4];
      INFO("B=" << B << " H=" << H << " Sq=" << Sq << " Sk=" << Sk << " D=" << D
                << " causal=" << causal);
      AttentionOptions o;
      o.causal = causal;
      // No keys: softmax over nothing times nothing, zeros (PyTorch's math path).
      check_op("scaled_dot_product_attention", {{B, H, Sq, D}, {B, H, Sk, D}, {B, H, Sk, D}},
               [&](const std::vector<Tensor>& x) {
                 return scaled_dot_product_attention(x[0], x[1], x[2], o).out;
               },
               {B, H, Sq, D});
      // The log-sum-exp: -inf for rows that see no key; log(keys seen) with D == 0.
      AttentionResult r = ops::scaled_dot_product_attention(
          ops::zeros({B, H, Sq, D}), ops::zeros({B, H, Sk, D}), ops::zeros({B, H, Sk, D}), o);
      CHECK(r.lse.shape() == Shape{B, H, Sq});
      if (Sk == 0) CHECK(all_are(r.lse, -INFINITY));
      if (D == 0) {
        Vec lse = values(r.lse);
        for (size_t i = 0; i < lse.size(); ++i) {
          const int64_t row = static_cast<int64_t>(i) % Sq;
          const double seen = causal ? std::min<double>(row + 1, Sk) : Sk;
          CHECK(lse[i] == Approx(std::log(seen)));
        }
      }
    }
  }
}

TEST_CASE("nn layers on zero-size inputs and with zero-size features", "[empty]") {
  Generator gen(5);
  // Seeds backward with ones of y's shape; checks grad(x) and that every
  // parameter got a gradient of its shape (zeros unless `nonzero` names it).
  auto run = [](Module& m, const Tensor& x_in, const Shape& want,
                const std::vector<std::string>& nonzero = {}) {
    Tensor x = x_in;
    if (is_floating(x.dtype())) set_requires_grad(x);
    std::vector<Tensor> outs;
    REQUIRE_NOTHROW(outs = m.call(Args{x}));
    const Tensor& y = outs[0];
    CHECK(y.shape() == want);
    REQUIRE_NOTHROW(backward({y}, {ops::ones_like(y)}));
    if (is_floating(x.dtype())) {
      REQUIRE(grad(x).defined());
      CHECK(grad(x).shape() == x.shape());
      if (x.numel() > 0 && y.numel() == 0) CHECK(all_are(grad(x), 0.0));
    }
    for (auto& [name, p] : m.named_parameters()) {
      INFO("parameter " << name);
      REQUIRE(grad(p).defined());
      CHECK(grad(p).shape() == p.shape());
      if (std::find(nonzero.begin(), nonzero.end(), name) == nonzero.end()) {
        CHECK(all_are(grad(p), 0.0));
      }
    }
    return y;
  };
  for (int p = 0; p < 2; ++p) {
    const Shape s = zero_at({2, 3, 8}, p);
    INFO("input " << s.str());
    {
      nn::Linear l({.in_features = 8, .out_features = 6}, gen);
      run(l, ops::ones(s), {s[0], s[1], 6});
    }
    {
      nn::LayerNorm n({.dim = 8});
      run(n, ops::ones(s), s);
      nn::RMSNorm r({.dim = 8});
      run(r, ops::ones(s), s);
    }
    {
      nn::SwiGLU mlp({.d_model = 8, .hidden = 12}, gen);
      run(mlp, ops::ones(s), s);
    }
    {
      nn::Embedding emb({.num_embeddings = 10, .dim = 8}, gen);
      run(emb, ops::zeros({s[0], s[1]}, DType::I64), s);
    }
    {
      // The reproduction: SelfAttention on zeros({2, 0, 32}), and
      // the empty batch; grouped and causal.
      Shape x = zero_at({2, 3, 32}, p);
      nn::SelfAttention attn({.d_model = 32, .n_heads = 4, .n_kv_heads = 2, .causal = true}, gen);
      run(attn, ops::zeros(x), x);
    }
    for (bool moe : {false, true}) {
      nn::TransformerBlockConfig cfg;
      cfg.d_model = 16;
      cfg.n_heads = 4;
      cfg.n_kv_heads = 2;
      cfg.hidden = 24;
      cfg.experts = moe ? 4 : 0;
      Shape x = zero_at({2, 3, 16}, p);
      nn::TransformerBlock block(cfg, gen);
      INFO("moe " << moe);
      Tensor xl = ops::ones(x);
      set_requires_grad(xl);
      std::vector<Tensor> outs = block.call(Args{xl});
      CHECK(outs[0].shape() == x);
      if (moe) {
        // No token, no imbalance: the load-balancing loss is 0, not NaN.
        REQUIRE(outs.size() == 2);
        CHECK(all_are(outs[1], 0.0));
      }
      std::vector<Tensor> seeds;
      for (const Tensor& o : outs)
        seeds.push_back(ops::ones_like(o));
      backward(outs, seeds);
      CHECK(grad(xl).shape() == x);
      for (auto& [name, prm] : block.named_parameters()) {
        INFO("parameter " << name);
        // Experts that receive no token take no part, so (as in PyTorch)
        // they get no gradient; every other parameter gets zeros.
        if (name.find("experts.") != std::string::npos) {
          CHECK(!grad(prm).defined());
          continue;
        }
        REQUIRE(grad(prm).defined());
        CHECK(all_are(grad(prm), 0.0));
      }
    }
  }
  // Zero-size features, as a tensor-parallel rank's empty shard holds them.
  {
    // in_features == 0: the output is the bias, whose gradient counts rows.
    nn::Linear l({.in_features = 0, .out_features = 5}, gen);
    CHECK(l.weight().shape() == Shape{5, 0});
    Tensor y = run(l, ops::ones({2, 3, 0}), {2, 3, 5}, {"bias"});
    CHECK(ops::allclose(y, ops::expand(detach(l.bias()), {2, 3, 5})));
    CHECK(all_are(grad(l.bias()), 6.0));
    nn::Linear nb({.in_features = 0, .out_features = 5, .bias = false}, gen);
    Tensor z = run(nb, ops::ones({2, 3, 0}), {2, 3, 5});
    CHECK(all_are(z, 0.0));
  }
  {
    nn::Linear l({.in_features = 4, .out_features = 0}, gen);
    run(l, ops::ones({2, 3, 4}), {2, 3, 0});
  }
  {
    // A SwiGLU of hidden 0 adds nothing: zeros out, zero input gradient.
    nn::SwiGLU mlp({.d_model = 8, .hidden = 0}, gen);
    Tensor y = run(mlp, ops::ones({2, 3, 8}), {2, 3, 8});
    CHECK(all_are(y, 0.0));
  }
}
