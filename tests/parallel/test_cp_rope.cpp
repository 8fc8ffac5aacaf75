// Rotary embeddings under context parallelism (Note [Rotary positions]): a
// SelfAttention with RoPE (and QK-norm, biases, grouped-query heads) whose
// ranks each declare the global positions of the tokens they hold, from
// sequence_positions(), equals the single-rank layer on the whole sequence,
// output and every gradient, in every CP mode with and without the head-tail
// load balance, sync and async (whose projection hooks apply the QK-norm
// and the rotation before their collectives start: Note [Rotary before the
// exchange]; no collective falls back to the synchronous path).
#include <catch2/catch.hpp>

#include "tandem/autograd/nn/attention.h"
#include "tandem/autograd/ops.h"
#include "tandem/comm/threads/threads_backend.h"
#include "tandem/parallel/context_parallel.h"
#include "tandem/runtime/logging.h"
#include "tests/support/rank_checks.h"
#include "tests/support/test_device.h"

using namespace tandem;

namespace {

struct RopeCase {
  const char* name;
  int cp;
  int ds;
  bool ring;
  bool load_balance;
  bool async;
  int64_t seq;
};

nn::SelfAttentionOptions llama_like() {
  return {.d_model = 24,
          .n_heads = 4,
          .n_kv_heads = 2,
          .causal = true,
          .head_dim = 8,  // != d_model / n_heads
          .qkv_bias = true,
          .qk_norm = true,
          .rope = nn::RotaryOptions{.theta = 100.0}};
}

}  // namespace

TEST_CASE("a rotary attention layer under every CP mode equals the single-rank layer",
          "[cp][rope]") {
  const std::vector<RopeCase> cases = {
      {"ulysses", 2, 2, false, false, false, 16},
      {"ulysses", 4, 4, false, false, false, 13},
      {"allgather", 4, 1, false, false, false, 16},
      {"allgather-lb", 4, 1, false, true, false, 19},
      {"ring", 4, 1, true, false, false, 16},
      {"ring-lb", 4, 1, true, true, false, 19},
      {"hybrid", 4, 2, false, false, false, 14},
      {"async-ulysses", 4, 4, false, false, true, 16},
      {"async-ulysses", 2, 2, false, false, true, 15},
      {"async-allgather", 4, 1, false, false, true, 16},
      {"async-allgather-lb", 4, 1, false, true, true, 13},
      {"async-hybrid", 4, 2, false, false, true, 14},
      {"async-ring", 4, 1, true, true, true, 19},
  };
  for (const RopeCase& c : cases) {
    INFO(c.name << " cp=" << c.cp << " S=" << c.seq);
    const int64_t B = 2, d = 24;
    Generator gen(3);
    Tensor x = ops::randn({B, c.seq, d}, gen);
    Tensor w = ops::randn({B, c.seq, d}, gen);
    Generator init(1);
    auto ref = nn::make<nn::SelfAttention>(llama_like(), init);
    Tensor xr = ops::clone(x);
    set_requires_grad(xr);
    Tensor out_ref = (*ref)(xr);
    backward(sum(mul(out_ref, w)));

    tandem::testing::RankChecks rc;
    LogCapture log;
    run_ranks(c.cp, [&](ProcessGroupPtr pg) {
      const int r = pg->rank();
      DeviceMesh mesh(pg, {c.cp}, {"cp"}, {}, test::test_device());
      Generator g(1);
      auto layer = nn::make<nn::SelfAttention>(llama_like(), g);
      layer->to(test::test_device());
      ContextParallel config;
      config.ulysses_degree = c.ds;
      config.load_balance = c.load_balance;
      config.mode = c.ring ? CPMode::Ring : CPMode::Auto;
      apply_context_parallel(*layer, config, mesh, c.async);
      auto shard = [&](const Tensor& t) { return shard_sequence(t, 1, c.cp, r, c.load_balance); };
      Tensor xl = test::on_test_device(shard(x));
      set_requires_grad(xl);
      Tensor out;
      {
        nn::PositionScope positions(sequence_positions(c.seq, c.cp, r, c.load_balance));
        out = (*layer)(xl);
      }
      backward(sum(mul(out, test::on_test_device(shard(w)))));
      auto close = [](const Tensor& got, const Tensor& want) {
        const Tensor g = test::on_cpu(got);
        return g.shape() == want.shape() && ops::allclose(g, want, 1e-5, 1e-5);
      };
      RANK_CHECK(rc, close(out, shard(out_ref)));
      RANK_CHECK(rc, close(grad(xl), shard(grad(xr))));
      // Replicated weights: a rank's gradient is its tokens' part, and the
      // parts sum to the single-rank gradient.
      const auto want = ref->named_parameters();
      const auto mine = layer->named_parameters();
      RANK_CHECK(rc, mine.size() == want.size());
      for (size_t i = 0; i < mine.size() && i < want.size(); ++i) {
        WorkPtr sum_work = pg->all_reduce(grad(mine[i].second));
        sum_work->wait();
        RANK_CHECK(
            rc, mine[i].first == want[i].first && close(sum_work->result(), grad(want[i].second)));
      }
    });
    rc.report();
    CHECK(log.matching("synchronous").empty());
  }
}
