// Empty shards in the parallel layers: chunk semantics give the last ranks
// nothing when a sequence is shorter than cp (context parallel; tensor
// parallel's cases are in test_tensor_parallel.cpp). Those ranks must still run
// every collective and give the single-rank results: the non-empty shards of
// the output and of the gradients, and empty (or zero) ones where they hold
// nothing. Plus the DTensor and context-parallel friction fixes that came
// with them (issue 15, part 4). The references run on the CPU; the rank
// threads compute on test::test_device() (tests/support/test_device.h).
#include <catch2/catch.hpp>

#include <cmath>

#include "tandem/autograd/nn/attention.h"
#include "tandem/autograd/ops.h"
#include "tandem/comm/threads/threads_backend.h"
#include "tandem/parallel/context_parallel.h"
#include "tandem/parallel/dtensor_ops.h"
#include "tests/support/rank_checks.h"
#include "tests/support/test_device.h"

using namespace tandem;

namespace {

// `a` from the ranks (on the test device), `b` a CPU reference.
bool close(const Tensor& a, const Tensor& b, double rtol = 1e-5, double atol = 1e-5) {
  return a.shape() == b.shape() && ops::allclose(test::on_cpu(a), b, rtol, atol);
}

struct CPCase {
  std::string name;
  int cp;
  int ds;
  bool ring;
  bool load_balance;
  bool async;
  int64_t seq;
  int64_t heads;
  int64_t kv_heads;
};

std::string describe(const CPCase& c) {
  return fmt::format("{}{} cp={} ds={} lb={} S={} H={} Hkv={}", c.async ? "async " : "", c.name,
                     c.cp, c.ds, c.load_balance, c.seq, c.heads, c.kv_heads);
}

// nn::SelfAttention under context parallelism against the same layer on one
// rank: outputs, input gradients and (summed over the CP group) weight
// gradients, on every rank including those that hold no token.
void check_cp(const CPCase& c, bool causal) {
  INFO(describe(c) << " causal=" << causal);
  const int64_t B = 2, head = 4, d = c.heads * head;
  Generator gen(13);
  Tensor x = ops::randn({B, c.seq, d}, gen);
  Tensor w = ops::randn({B, c.seq, d}, gen);  // loss weights
  Generator init(1);
  auto ref = nn::make<nn::SelfAttention>(
      {.d_model = d, .n_heads = c.heads, .n_kv_heads = c.kv_heads, .causal = causal}, init);
  Tensor xr = ops::clone(x);
  set_requires_grad(xr);
  Tensor out_ref = (*ref)(xr);
  backward(sum(mul(out_ref, w)));
  auto ref_params = ref->named_parameters();

  tandem::testing::RankChecks rc;
  int empty_ranks = 0;
  run_ranks(c.cp, [&](ProcessGroupPtr pg) {
    const int r = pg->rank();
    DeviceMesh mesh(pg, {c.cp}, {"cp"}, {}, test::test_device());
    Generator g(1);
    auto attn = nn::make<nn::SelfAttention>(
        {.d_model = d, .n_heads = c.heads, .n_kv_heads = c.kv_heads, .causal = causal}, g);
    attn->to(test::test_device());
    ContextParallel config;
    config.ulysses_degree = c.ds;
    config.load_balance = c.load_balance;
    config.mode = c.ring ? CPMode::Ring : CPMode::Auto;
    apply_context_parallel(*attn, config, mesh, c.async);
    auto shard = [&](const Tensor& t) { return shard_sequence(t, 1, c.cp, r, c.load_balance); };
    Tensor xl = test::on_test_device(shard(x));
    if (xl.shape()[1] == 0 && r == c.cp - 1) empty_ranks = 1;  // the case is what it says
    set_requires_grad(xl);
    Tensor out = (*attn)(xl);
    backward(sum(mul(out, test::on_test_device(shard(w)))));
    RANK_CHECK(rc, close(out, shard(out_ref)));
    RANK_CHECK(rc, grad(xl).defined() && close(grad(xl), shard(grad(xr))));
    auto params = attn->named_parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      // Partial over the sequence shards (the header's documented all-reduce).
      Tensor gp = grad(params[i].second);
      RANK_CHECK(rc, gp.defined());
      WorkPtr sum_w = mesh.get_group()->all_reduce(gp);
      sum_w->wait();
      RANK_CHECK(rc, close(sum_w->result(), grad(ref_params[i].second)));
    }
  });
  rc.report();
  CHECK(empty_ranks == 1);
}

}  // namespace

TEST_CASE("context parallel SelfAttention with ranks that hold no token", "[cp][empty]") {
  std::vector<CPCase> cases;
  for (bool async : {false, true}) {
    // S=5 on cp=4 gives [2,2,1,0]; S=2 gives [1,1,0,0]; S=4 on cp=3 gives [2,2,0].
    for (int64_t seq : {5, 2}) {
      cases.push_back({"ulysses", 4, 4, false, false, async, seq, 4, 2});
      cases.push_back({"allgather", 4, 1, false, false, async, seq, 4, 2});
      cases.push_back({"hybrid", 4, 2, false, false, async, seq, 4, 4});
      cases.push_back({"hybrid-gqa", 4, 2, false, false, async, seq, 4, 1});
      cases.push_back({"ring", 4, 1, true, false, async, seq, 4, 2});
    }
    // Load balance: S=3 on 2cp=8 pieces leaves rank 3 with none.
    for (int64_t seq : {3, 2}) {
      cases.push_back({"allgather-lb", 4, 1, false, true, async, seq, 4, 4});
      cases.push_back({"ring-lb", 4, 1, true, true, async, seq, 4, 4});
    }
    cases.push_back({"ulysses", 3, 3, false, false, async, 4, 6, 3});
    cases.push_back({"allgather", 3, 1, false, false, async, 4, 6, 3});
    cases.push_back({"ring", 3, 1, true, false, async, 4, 6, 3});
  }
  for (const CPCase& c : cases) {
    SECTION(describe(c)) {
      for (bool causal : {true, false})
        check_cp(c, causal);
    }
  }
}

TEST_CASE("DTensor ops over a dim that some ranks hold none of", "[dtensor][empty]") {
  // 5 rows and 3 columns on 4 ranks: shards of [2,2,1,0] and [1,1,1,0].
  Generator gen(8);
  Tensor A = ops::randn({5, 3}, gen), B = ops::randn({3, 4}, gen);
  tandem::testing::RankChecks rc;
  run_ranks(4, [&](ProcessGroupPtr pg) {
    DeviceMesh mesh(pg, {4}, {"tp"}, {}, test::test_device());
    auto dist = [&](const Tensor& t, Placement p) {
      return DTensor::distribute(test::on_test_device(t), mesh, {p});
    };
    RANK_CHECK(rc, close(sum(dist(A, Shard(0)), {0}).full_tensor(), ops::sum(A, {0})));
    RANK_CHECK(rc, close(mean(dist(A, Shard(0)), {0}).full_tensor(), ops::mean(A, {0})));
    RANK_CHECK(rc, close(mean(dist(A, Shard(1)), {1}).full_tensor(), ops::mean(A, {1})));
    // K sharded [1,1,1,0]: the last rank's partial product is zeros.
    RANK_CHECK(
        rc, close(matmul(dist(A, Shard(1)), dist(B, Shard(0))).full_tensor(), ops::matmul(A, B)));
    RANK_CHECK(rc, close(softmax(dist(A, Shard(1)), -1).full_tensor(), ops::softmax(A, -1)));
    // A mean over a globally empty dim is NaN, as the local one.
    Tensor none = ops::zeros({0, 3});
    DTensor m = mean(dist(none, Shard(1)), {0});
    RANK_CHECK(rc, m.full_tensor().shape() == Shape{3});
    for (double v : ops::to(test::on_cpu(m.full_tensor()), DType::F64).to_vector<double>())
      RANK_CHECK(rc, std::isnan(v));
  });
  rc.report();
}

TEST_CASE("DTensor::distribute keeps requires_grad, as PyTorch's distribute_tensor",
          "[dtensor][empty]") {
  Generator gen(4);
  Tensor full = test::on_test_device(ops::randn({5, 3}, gen));  // 5 rows on 4 ranks: [2,2,1,0]
  set_requires_grad(full);
  Tensor plain = test::on_test_device(ops::randn({5, 3}, gen));
  tandem::testing::RankChecks rc;
  run_ranks(4, [&](ProcessGroupPtr pg) {
    DeviceMesh mesh(pg, {4}, {"tp"}, {}, test::test_device());
    for (Placement p : {Placement(Shard(0)), Placement(Replicate())}) {
      DTensor d = DTensor::distribute(full, mesh, {p});
      RANK_CHECK(rc, requires_grad(d.to_local()));
      RANK_CHECK(rc, is_leaf(d.to_local()));
      // backward through the DTensor reaches the local leaf (empty on rank 3).
      backward(sum(mul(d.full_tensor(), 2.0)));
      Tensor g = grad(d.to_local());
      RANK_CHECK(rc, g.defined() && g.shape() == d.to_local().shape() &&
                         ops::allclose(test::on_cpu(g), ops::full(g.shape(), 2.0)));
    }
    // A tensor that does not require grad gives one that does not either.
    RANK_CHECK(rc, !requires_grad(DTensor::distribute(plain, mesh, {Shard(0)}).to_local()));
    // A non-leaf would silently lose its graph: refused, saying what to do.
    Tensor derived = mul(full, 2.0);
    RANK_CHECK_THROWS_WITH(rc, DTensor::distribute(derived, mesh, {Shard(0)}), "from_local");
  });
  rc.report();
}

TEST_CASE("context parallel refusals name what they refuse", "[cp]") {
  tandem::testing::RankChecks rc;
  run_ranks(2, [&](ProcessGroupPtr pg) {
    DeviceMesh mesh(pg, {2}, {"cp"}, {}, test::test_device());
    Generator g(1);
    auto attn = nn::make<nn::SelfAttention>(
        {.d_model = 24, .n_heads = 6, .n_kv_heads = 3, .causal = true}, g);
    attn->to(test::test_device());
    // Async ring is ring's own layer, with its checks: a Ulysses degree is refused.
    AsyncContextParallel a;
    a.config.mode = CPMode::Ring;
    a.config.ulysses_degree = 2;
    a.head_size = 4;
    RANK_CHECK_THROWS_WITH(
        rc, a.apply(attn->core(), attn->q_proj(), attn->k_proj(), attn->v_proj(), mesh),
        "expected ulysses_degree 1 with ring, got 2");
    // 3 KV heads on a Ulysses degree of 2: neither divides the other.
    ContextParallel u;
    u.ulysses_degree = 2;
    u.apply(attn->core(), mesh);
    RANK_CHECK_THROWS_WITH(rc, (*attn)(ops::zeros({1, 4, 24}, DType::F32, test::test_device())),
                           "divide one another");
  });
  rc.report();
}
