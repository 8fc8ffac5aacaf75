// Tensor parallelism and DTensor sharding propagation: every result is
// compared with the same computation on full tensors on one rank.
//
// References are computed on the CPU; the ranks compute on test_device()
// (tests/support/test_device.h), with modules moved there before they are
// sharded, and their results are read back on the CPU.
#include <catch2/catch.hpp>

#include "tandem/autograd/nn/transformer.h"
#include "tandem/autograd/ops.h"
#include "tandem/comm/threads/threads_backend.h"
#include "tandem/parallel/dtensor_ops.h"
#include "tandem/parallel/sequence_layout.h"
#include "tandem/parallel/tensor_parallel.h"
#include "tandem/tensor/kernels.h"
#include "tests/support/rank_checks.h"
#include "tests/support/test_device.h"

using namespace tandem;

namespace {

// `got`, a rank's result, must be on test_device() and close to `want`, a
// CPU reference.
bool close(const Tensor& got, const Tensor& want, double rtol = 1e-5, double atol = 1e-6) {
  return got.device() == test::test_device() && got.shape() == want.shape() &&
         ops::allclose(test::on_cpu(got), want, rtol, atol);
}

ParallelizePlan megatron_plan() {
  return {{"attn.q_proj", colwise()}, {"attn.k_proj", colwise()}, {"attn.v_proj", colwise()},
          {"attn.o_proj", rowwise()}, {"mlp.w1", colwise()},      {"mlp.w3", colwise()},
          {"mlp.w2", rowwise()}};
}

// The local shard of a reference gradient under the style that owns `name`.
Tensor expected_local_grad(const std::string& name, const Tensor& full, const DeviceMesh& mesh) {
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  if (has("q_proj") || has("k_proj") || has("v_proj") || has("w1") || has("w3")) {
    return DTensor::distribute(full, mesh, {Shard(0)}).to_local();
  }
  if (has("o_proj") || has("w2")) return DTensor::distribute(full, mesh, {Shard(1)}).to_local();
  return full;
}

// The single-rank reference: one block (seed 1) on a copy of x, forward and
// backward of sum(y^2); its output, input gradient and parameters.
struct ReferenceStep {
  Tensor xr, yr;
  std::vector<std::pair<std::string, Tensor>> params;
};
ReferenceStep reference_step(const nn::TransformerBlockConfig& cfg, const Tensor& x) {
  Generator init(1);
  auto ref = std::make_shared<nn::TransformerBlock>(cfg, init);
  ReferenceStep r;
  r.xr = ops::clone(x);
  set_requires_grad(r.xr);
  r.yr = ref->call(Args{r.xr})[0];
  backward(sum(mul(r.yr, r.yr)));
  r.params = ref->named_parameters();
  return r;
}

}  // namespace

TEST_CASE("tensor-parallel transformer block equals the single-rank block", "[tp]") {
  for (nn::NormKind norm : {nn::NormKind::Layer, nn::NormKind::Rms}) {
    nn::TransformerBlockConfig cfg;
    cfg.d_model = 32;
    cfg.n_heads = 4;
    cfg.n_kv_heads = 4;
    cfg.hidden = 64;
    cfg.causal = true;
    cfg.norm = norm;
    Generator data(7);
    Tensor x = ops::randn({2, 8, 32}, data);
    const ReferenceStep ref = reference_step(cfg, x);
    const Tensor &xr = ref.xr, &yr = ref.yr;
    const auto& ref_params = ref.params;

    for (int tp : {2, 4}) {
      SECTION("tp=" + std::to_string(tp) + (norm == nn::NormKind::Layer ? " layer" : " rms")) {
        std::vector<int> failures(static_cast<size_t>(tp), -1);
        run_ranks(tp, [&](ProcessGroupPtr pg) {
          DeviceMesh mesh(pg, {tp}, {"tp"}, {}, test::test_device());
          Generator g(1);
          auto block = std::make_shared<nn::TransformerBlock>(cfg, g);
          block->to(test::test_device());
          parallelize_module(block, mesh, megatron_plan());
          Tensor xl = test::on_test_device(x);
          set_requires_grad(xl);
          Tensor y = block->call(Args{xl})[0];
          backward(sum(mul(y, y)));
          int bad = 0;
          bad += close(y, yr) ? 0 : 1;
          bad += close(grad(xl), grad(xr), 1e-5, 1e-5) ? 0 : 1;
          auto params = block->named_parameters();
          for (size_t i = 0; i < params.size(); ++i) {
            Tensor want = expected_local_grad(params[i].first, grad(ref_params[i].second), mesh);
            bad += close(grad(params[i].second), want, 1e-5, 1e-5) ? 0 : 1;
          }
          failures[pg->rank()] = bad;
        });
        for (int f : failures)
          CHECK(f == 0);
      }
    }
  }
}

TEST_CASE("column- then row-parallel linears with a bias", "[tp]") {
  Generator data(3);
  Tensor x = ops::randn({4, 6}, data);
  Generator init(5);
  auto a = nn::make<nn::Linear>({.in_features = 6, .out_features = 8, .bias = true}, init);
  auto b = nn::make<nn::Linear>({.in_features = 8, .out_features = 6, .bias = true}, init);
  Tensor xr = ops::clone(x);
  set_requires_grad(xr);
  Tensor yr = (*b)((*a)(xr));
  backward(sum(mul(yr, yr)));
  tandem::testing::RankChecks rc;
  run_ranks(2, [&](ProcessGroupPtr pg) {
    DeviceMesh mesh(pg, {2}, {"tp"}, {}, test::test_device());
    Generator g(5);
    auto la = nn::make<nn::Linear>({.in_features = 6, .out_features = 8, .bias = true}, g);
    auto lb = nn::make<nn::Linear>({.in_features = 8, .out_features = 6, .bias = true}, g);
    la->to(test::test_device());
    lb->to(test::test_device());
    colwise()->apply(*la, mesh);
    rowwise()->apply(*lb, mesh);
    Tensor xl = test::on_test_device(x);
    set_requires_grad(xl);
    Tensor y = (*lb)((*la)(xl));
    backward(sum(mul(y, y)));
    RANK_CHECK(rc, close(y, yr));
    RANK_CHECK(rc, close(grad(xl), grad(xr), 1e-5, 1e-5));
    RANK_CHECK(
        rc, close(grad(la->bias()),
                  DTensor::distribute(grad(a->bias()), mesh, {Shard(0)}).to_local(), 1e-5, 1e-5));
    RANK_CHECK(rc, close(grad(lb->bias()), grad(b->bias())));  // added once, after the reduction
    RANK_CHECK(
        rc, close(grad(lb->weight()),
                  DTensor::distribute(grad(b->weight()), mesh, {Shard(1)}).to_local(), 1e-5, 1e-6));
  });
  rc.report();
}

TEST_CASE("sequence-parallel layouts: a sequence shard in, a sequence shard out", "[tp]") {
  // Megatron's sequence parallelism around an MLP: the input arrives sharded
  // along the sequence (dim 1), the colwise linear all-gathers it, the
  // rowwise linear reduce-scatters its output back to sequence shards.
  // S = 5: uneven shards under chunk semantics (3, 2 on 2 ranks; 2, 2, 1 on
  // 3).
  for (int n : {2, 3}) {
    INFO("ranks " << n);
    Generator data(4);
    Tensor x = ops::randn({2, 5, 6}, data);
    Generator init(6);
    auto a = nn::make<nn::Linear>({.in_features = 6, .out_features = 9, .bias = true}, init);
    auto b = nn::make<nn::Linear>({.in_features = 9, .out_features = 6, .bias = true}, init);
    Tensor xr = ops::clone(x);
    set_requires_grad(xr);
    Tensor yr = (*b)((*a)(xr));
    backward(sum(mul(yr, yr)));
    tandem::testing::RankChecks rc;
    run_ranks(n, [&](ProcessGroupPtr pg) {
      DeviceMesh mesh(pg, {n}, {"tp"}, {}, test::test_device());
      Generator g(6);
      auto la = nn::make<nn::Linear>({.in_features = 6, .out_features = 9, .bias = true}, g);
      auto lb = nn::make<nn::Linear>({.in_features = 9, .out_features = 6, .bias = true}, g);
      la->to(test::test_device());
      lb->to(test::test_device());
      colwise(Shard(1), Shard(-1))->apply(*la, mesh);
      rowwise(Shard(-1), Shard(1))->apply(*lb, mesh);
      auto seq_shard = [&](const Tensor& t) {
        return DTensor::distribute(t, mesh, {Shard(1)}).to_local();
      };
      // Declared (Note [Sequence layout as data]) and undeclared: the same
      // results, and the declared forward makes one collective fewer (the
      // colwise input's extent is not summed over the group).
      uint64_t forward_collectives[2] = {0, 0};
      for (bool declared : {false, true}) {
        Tensor xl = test::on_test_device(seq_shard(x));
        set_requires_grad(xl);
        const uint64_t before = mesh.get_group()->ledger().size();
        Tensor y;
        {
          std::optional<SequenceLayoutScope> layout;
          if (declared) layout.emplace(mesh, SequenceLayout::chunked(5, n));
          y = (*lb)((*la)(xl));
        }
        forward_collectives[declared] = mesh.get_group()->ledger().size() - before;
        backward(sum(mul(y, y)));
        RANK_CHECK(rc, close(y, seq_shard(detach(yr)), 1e-5, 1e-5));
        RANK_CHECK(rc, close(grad(xl), seq_shard(grad(xr)), 1e-5, 1e-5));
        RANK_CHECK(rc, close(grad(la->weight()),
                             DTensor::distribute(grad(a->weight()), mesh, {Shard(0)}).to_local(),
                             1e-5, 1e-5));
        la->zero_grad();
        lb->zero_grad();
      }
      RANK_CHECK(rc, forward_collectives[1] + 1 == forward_collectives[0]);
      // A declared layout that is not this shard's, or not chunk semantics,
      // is refused with the numbers.
      Tensor xl = test::on_test_device(seq_shard(x));
      std::vector<int64_t> wrong = SequenceLayout::chunked(5, n).lengths;
      std::swap(wrong.front(), wrong.back());
      SequenceLayoutScope layout(mesh, SequenceLayout{.lengths = wrong});
      rc.throws_with([&] { (*la)(xl); }, "declared", "a wrong declared layout");
    });
    rc.report();
  }
}

TEST_CASE("DTensor ops derive placements and match the full computation", "[tp][dtensor-ops]") {
  Generator gen(11);
  Tensor A = ops::randn({6, 4}, gen), B = ops::randn({4, 5}, gen), v = ops::randn({4}, gen);
  Tensor w = ops::randn({4}, gen), bias = ops::randn({4}, gen);
  Tensor table = ops::randn({7, 4}, gen);
  // Every rank reads these; none draws random numbers of its own.
  tandem::testing::RankChecks rc;
  run_ranks(2, [&](ProcessGroupPtr pg) {
    DeviceMesh mesh(pg, {2}, {"tp"}, {}, test::test_device());
    auto dist = [&](const Tensor& t, Placement p) {
      return DTensor::distribute(test::on_test_device(t), mesh, {p});
    };

    // Elementwise with broadcasting: a row-sharded matrix plus a replicated vector.
    DTensor s = add(dist(A, Shard(0)), dist(v, Replicate()));
    RANK_CHECK(rc, s.placements()[0] == Shard(0));
    RANK_CHECK(rc, close(s.full_tensor(), ops::add(A, v)));
    // Partial + Partial stays Partial; Partial * Replicate stays Partial.
    DTensor p = add(dist(A, Partial()), dist(A, Partial()));
    RANK_CHECK(rc, p.placements()[0].is_partial());
    RANK_CHECK(rc, close(p.full_tensor(), ops::mul(A, 2.0)));
    DTensor pm = mul(dist(A, Partial()), dist(v, Replicate()));
    RANK_CHECK(rc, pm.placements()[0].is_partial());
    RANK_CHECK(rc, close(pm.full_tensor(), ops::mul(A, v)));

    // matmul rules.
    DTensor m1 = matmul(dist(A, Shard(0)), dist(B, Replicate()));
    RANK_CHECK(rc, m1.placements()[0] == Shard(0));
    DTensor m2 = matmul(dist(A, Replicate()), dist(B, Shard(1)));
    RANK_CHECK(rc, m2.placements()[0] == Shard(1));
    DTensor m3 = matmul(dist(A, Shard(1)), dist(B, Shard(0)));
    RANK_CHECK(rc, m3.placements()[0].is_partial());
    for (const DTensor& m : {m1, m2, m3})
      RANK_CHECK(rc, close(m.full_tensor(), ops::matmul(A, B)));
    // No rule (row-sharded a with column-sharded b): b is gathered, result still right.
    DTensor m4 = matmul(dist(A, Shard(0)), dist(B, Shard(1)));
    RANK_CHECK(rc, close(m4.full_tensor(), ops::matmul(A, B)));

    // Reductions over a sharded dim become Partial; other shards are kept.
    DTensor r1 = sum(dist(A, Shard(0)), {0});
    RANK_CHECK(rc, r1.placements()[0].is_partial());
    RANK_CHECK(rc, close(r1.full_tensor(), ops::sum(A, {0})));
    DTensor r2 = mean(dist(A, Shard(0)), {1});
    RANK_CHECK(rc, r2.placements()[0] == Shard(0));
    RANK_CHECK(rc, close(r2.full_tensor(), ops::mean(A, {1})));
    DTensor r3 = mean(dist(A, Shard(0)), {0});
    RANK_CHECK(rc, close(r3.full_tensor(), ops::mean(A, {0})));

    // softmax and norms over the last dim: a shard of that dim is gathered first.
    RANK_CHECK(rc, close(softmax(dist(A, Shard(0)), -1).full_tensor(), ops::softmax(A, -1)));
    DTensor sm = softmax(dist(A, Shard(1)), -1);
    RANK_CHECK(rc, sm.placements()[0].is_replicate());
    RANK_CHECK(rc, close(sm.full_tensor(), ops::softmax(A, -1)));
    RANK_CHECK(rc,
               close(layer_norm(dist(A, Shard(0)), dist(w, Replicate()), dist(bias, Replicate()))
                         .full_tensor(),
                     ops::layer_norm(A, w, bias).out, 1e-5, 1e-5));
    RANK_CHECK(rc, close(rms_norm(dist(A, Shard(0)), dist(w, Replicate())).full_tensor(),
                         ops::rms_norm(A, w).out, 1e-5, 1e-5));

    // Embedding: replicated table with sharded indices, column- and vocab-parallel tables.
    Tensor idx = ops::from_vector<int64_t>({6, 0, 3, 3, 5, 1}, {6});
    Tensor want = ops::embedding(table, idx);
    DTensor e1 = embedding(dist(table, Replicate()), dist(idx, Shard(0)));
    RANK_CHECK(rc, e1.placements()[0] == Shard(0));
    DTensor e2 = embedding(dist(table, Shard(1)), dist(idx, Replicate()));
    RANK_CHECK(rc, e2.placements()[0] == Shard(1));
    DTensor e3 = embedding(dist(table, Shard(0)), dist(idx, Replicate()));
    RANK_CHECK(rc, e3.placements()[0].is_partial());
    for (const DTensor& e : {e1, e2, e3})
      RANK_CHECK(rc, close(e.full_tensor(), want));

    // reshape keeps a shard whose dim survives; transpose moves it.
    DTensor t3 =
        DTensor::distribute(test::on_test_device(ops::reshape(A, {6, 2, 2})), mesh, {Shard(0)});
    DTensor flat = reshape(t3, {6, 4});
    RANK_CHECK(rc, flat.placements()[0] == Shard(0));
    RANK_CHECK(rc, close(flat.full_tensor(), A));
    DTensor tr = transpose(dist(A, Shard(0)), 0, 1);
    RANK_CHECK(rc, tr.placements()[0] == Shard(1));
    RANK_CHECK(rc, close(tr.full_tensor(), ops::transpose(A, 0, 1)));
  });
  rc.report();
}

TEST_CASE("every unary op of the table has a DTensor form that keeps or resolves Partial",
          "[tp][dtensor-ops]") {
  // Positive inputs, so that log, sqrt and rsqrt are defined everywhere.
  Generator gen(17);
  Tensor A = ops::add(ops::abs(ops::randn({6, 4}, gen)), 0.5);
  struct Op {
    const char* name;
    bool linear;
    DTensor (*dtensor)(const DTensor&);
    Tensor (*local)(const Tensor&);
  };
  const std::vector<Op> table = {
#define TANDEM_UNARY_ROW(E, name, linear)                   \
  {#name, linear, [](const DTensor& x) { return name(x); }, \
   [](const Tensor& x) { return ops::name(x); }},
      TANDEM_UNARY_OPS(TANDEM_UNARY_ROW)
#undef TANDEM_UNARY_ROW
  };
  REQUIRE(table.size() + 2 == static_cast<size_t>(kUnaryOpCount));  // + gelu's two kernels
  tandem::testing::RankChecks rc;
  run_ranks(2, [&](ProcessGroupPtr pg) {
    DeviceMesh mesh(pg, {2}, {"tp"}, {}, test::test_device());
    for (const Op& op : table) {
      // Sharded: applied to the local shard, the placement kept.
      DTensor s = op.dtensor(DTensor::distribute(test::on_test_device(A), mesh, {Shard(0)}));
      RANK_CHECK(rc, s.placements()[0] == Shard(0));
      RANK_CHECK(rc, close(s.full_tensor(), op.local(A)));
      // Partial (sum of A on rank 0 and 0 elsewhere): a linear op stays
      // Partial, any other is applied to the resolved sum.
      DTensor p = op.dtensor(DTensor::distribute(test::on_test_device(A), mesh, {Partial()}));
      RANK_CHECK(rc, p.placements()[0].is_partial() == op.linear);
      RANK_CHECK(rc, close(p.full_tensor(), op.local(A)));
    }
  });
  rc.report();
}

TEST_CASE("gradients through DTensor ops follow the convention", "[tp][dtensor-ops]") {
  Generator gen(13);
  Tensor X = ops::randn({4, 6}, gen), W = ops::randn({6, 8}, gen);
  Tensor xr = ops::clone(X), wr = ops::clone(W);
  set_requires_grad(xr);
  set_requires_grad(wr);
  backward(sum(tandem::tanh(tandem::matmul(xr, wr))));
  for (Placement pw : {Shard(0), Shard(1), Replicate()}) {
    tandem::testing::RankChecks rc;
    run_ranks(2, [&](ProcessGroupPtr pg) {
      DeviceMesh mesh(pg, {2}, {"tp"}, {}, test::test_device());
      Placement px = pw.is_shard(0) ? Shard(1) : Replicate();  // contract K when W is row-split
      Tensor xl = DTensor::distribute(test::on_test_device(X), mesh, {px}).to_local();
      Tensor wl = DTensor::distribute(test::on_test_device(W), mesh, {pw}).to_local();
      set_requires_grad(xl);
      set_requires_grad(wl);
      DTensor x = DTensor::make(xl, mesh, {px}, X.shape());
      DTensor w = DTensor::make(wl, mesh, {pw}, W.shape());
      DTensor y = tanh(matmul(x, w));
      Tensor full = y.full_tensor();
      backward(sum(full));
      // Each rank's loss is the whole loss; the gradients of the local pieces
      // are the matching pieces of the full gradients.
      RANK_CHECK(rc,
                 close(grad(xl), DTensor::distribute(grad(xr), mesh, {px}).to_local(), 1e-5, 1e-6));
      RANK_CHECK(rc,
                 close(grad(wl), DTensor::distribute(grad(wr), mesh, {pw}).to_local(), 1e-5, 1e-6));
    });
    rc.report();
  }
}

TEST_CASE("parallel styles reject what they cannot shard", "[tp]") {
  tandem::testing::RankChecks rc;
  run_ranks(2, [&](ProcessGroupPtr pg) {
    DeviceMesh mesh(pg, {2}, {"tp"}, {}, test::test_device());
    Generator g(1);
    auto norm = nn::make<nn::LayerNorm>({.dim = 4});
    norm->to(test::test_device());
    RANK_CHECK_THROWS_WITH(rc, colwise()->apply(*norm, mesh), "expected an nn::Linear");
    auto lin = nn::make<nn::Linear>({.in_features = 4, .out_features = 4}, g);
    lin->to(test::test_device());
    RANK_CHECK_THROWS_WITH(rc, parallelize_module(lin, mesh, {{"nope", colwise()}}),
                           "no such module");
    DeviceMesh mesh2(pg, {1, 2}, {"dp", "tp"}, {}, test::test_device());
    RANK_CHECK_THROWS_WITH(rc, colwise()->apply(*lin, mesh2), "expected a 1-D mesh");
  });
  rc.report();
}

// Empty shards (issue 15): chunk semantics give the last ranks nothing when a
// feature dim has fewer chunks than tp; they still run every collective.
TEST_CASE("tensor parallel with fewer feature chunks than ranks", "[tp][empty]") {
  // MLP hidden 5 and 6 on tp=4 give the last rank an empty shard of w1/w3
  // (Colwise) and w2 (Rowwise); hidden 3 gives it nothing at all.
  for (int64_t hidden : {5, 6, 3}) {
    SECTION("hidden " + std::to_string(hidden)) {
      nn::TransformerBlockConfig cfg;
      cfg.d_model = 16;
      cfg.n_heads = 4;
      cfg.n_kv_heads = 4;
      cfg.hidden = hidden;
      Generator data(7);
      Tensor x = ops::randn({2, 5, 16}, data);
      const ReferenceStep ref = reference_step(cfg, x);
      const Tensor &xr = ref.xr, &yr = ref.yr;
      const auto& ref_params = ref.params;

      tandem::testing::RankChecks rc;
      run_ranks(4, [&](ProcessGroupPtr pg) {
        DeviceMesh mesh(pg, {4}, {"tp"}, {}, test::test_device());
        Generator g(1);
        auto block = std::make_shared<nn::TransformerBlock>(cfg, g);
        block->to(test::test_device());
        parallelize_module(block, mesh, megatron_plan());
        if (pg->rank() == 3) RANK_CHECK(rc, block->mlp()->w1()->weight().shape()[0] == 0);
        Tensor xl = test::on_test_device(x);
        set_requires_grad(xl);
        Tensor y = block->call(Args{xl})[0];
        backward(sum(mul(y, y)));
        RANK_CHECK(rc, close(y, yr, 1e-5, 1e-5));
        RANK_CHECK(rc, close(grad(xl), grad(xr), 1e-5, 1e-5));
        auto params = block->named_parameters();
        for (size_t i = 0; i < params.size(); ++i) {
          Tensor want = expected_local_grad(params[i].first, grad(ref_params[i].second), mesh);
          Tensor got = grad(params[i].second);
          RANK_CHECK(rc, got.defined() && close(got, want, 1e-5, 1e-5));
        }
      });
      rc.report();
    }
  }
}

TEST_CASE("column- then row-parallel linears with biases and an empty shard", "[tp][empty]") {
  for (int64_t hidden : {5, 6}) {
    INFO("hidden " << hidden);
    Generator data(3);
    Tensor x = ops::randn({2, 3, 6}, data);
    Generator init(5);
    auto a = nn::make<nn::Linear>({.in_features = 6, .out_features = hidden, .bias = true}, init);
    auto b = nn::make<nn::Linear>({.in_features = hidden, .out_features = 6, .bias = true}, init);
    Tensor xr = ops::clone(x);
    set_requires_grad(xr);
    Tensor yr = (*b)((*a)(xr));
    backward(sum(mul(yr, yr)));
    tandem::testing::RankChecks rc;
    run_ranks(4, [&](ProcessGroupPtr pg) {
      DeviceMesh mesh(pg, {4}, {"tp"}, {}, test::test_device());
      Generator g(5);
      auto la = nn::make<nn::Linear>({.in_features = 6, .out_features = hidden, .bias = true}, g);
      auto lb = nn::make<nn::Linear>({.in_features = hidden, .out_features = 6, .bias = true}, g);
      la->to(test::test_device());
      lb->to(test::test_device());
      colwise()->apply(*la, mesh);
      rowwise()->apply(*lb, mesh);
      Tensor xl = test::on_test_device(x);
      set_requires_grad(xl);
      Tensor h = (*la)(xl);
      if (pg->rank() == 3) RANK_CHECK(rc, h.shape() == Shape{2, 3, 0});
      Tensor y = (*lb)(h);
      backward(sum(mul(y, y)));
      RANK_CHECK(rc, close(y, yr, 1e-5, 1e-5));
      RANK_CHECK(rc, close(grad(xl), grad(xr), 1e-5, 1e-5));
      RANK_CHECK(rc, close(grad(la->weight()),
                           DTensor::distribute(grad(a->weight()), mesh, {Shard(0)}).to_local(),
                           1e-5, 1e-5));
      RANK_CHECK(
          rc, close(grad(la->bias()),
                    DTensor::distribute(grad(a->bias()), mesh, {Shard(0)}).to_local(), 1e-5, 1e-5));
      RANK_CHECK(rc, close(grad(lb->weight()),
                           DTensor::distribute(grad(b->weight()), mesh, {Shard(1)}).to_local(),
                           1e-5, 1e-5));
      RANK_CHECK(rc, close(grad(lb->bias()), grad(b->bias()), 1e-5, 1e-5));
    });
    rc.report();
  }
}
