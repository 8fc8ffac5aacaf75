// Context parallelism on BNSD tensors (batch, heads, sequence, head dim — the
// order PyTorch's scaled_dot_product_attention takes): a CoreAttention built
// with QKVLayout::BNSD and a ContextParallel with seq_dim 2 and head_dim 1
// give, in every mode and in the async variant, what single-rank BSHD
// attention gives, transposed.
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

struct Mode {
  const char* name;
  int cp, ds;
  bool ring, load_balance;
  int64_t seq, kv_heads;
};

const std::vector<Mode> kModes = {
    {"ulysses", 4, 4, false, false, 16, 2},     {"allgather", 4, 1, false, false, 13, 2},
    {"allgather-lb", 4, 1, false, true, 16, 4}, {"hybrid", 4, 2, false, false, 14, 1},
    {"ring", 4, 1, true, false, 11, 2},         {"ring-lb", 2, 1, true, true, 16, 4},
};

ContextParallel bnsd_config(const Mode& m) {
  ContextParallel config;
  config.seq_dim = 2;
  config.head_dim = 1;
  config.ulysses_degree = m.ds;
  config.load_balance = m.load_balance;
  config.mode = m.ring ? CPMode::Ring : CPMode::Auto;
  return config;
}

// (B, S, H, D) <-> (B, H, S, D).
Tensor swap(const Tensor& t) {
  return ops::contiguous(ops::transpose(t, 1, 2));
}

// Self-attention written against BNSD, as a model ported from PyTorch is:
// the projections of `attn`, whose outputs are reshaped and transposed to
// (B, H, S, D), and a core attention of that layout.
class BnsdAttention final : public Module {
 public:
  explicit BnsdAttention(std::shared_ptr<nn::SelfAttention> attn) : Module("BnsdAttention") {
    attn_ = register_module("attn", std::move(attn));
    core_ = register_module(
        "core", std::make_shared<nn::CoreAttention>(attn_->core()->options(), nn::QKVLayout::BNSD));
  }
  const std::shared_ptr<nn::SelfAttention>& attn() const { return attn_; }
  const std::shared_ptr<nn::CoreAttention>& core() const { return core_; }

 protected:
  std::vector<Tensor> forward(Args& args) override {
    const Tensor& x = args.positional.at(0);
    const int64_t B = x.shape()[0], S = x.shape()[1], hs = attn_->head_dim();
    std::vector<Tensor> qkv;
    for (const auto& proj : {attn_->q_proj(), attn_->k_proj(), attn_->v_proj()}) {
      Tensor y = (*proj)(x);
      qkv.push_back(transpose(reshape(y, Shape{B, S, y.shape()[2] / hs, hs}), 1, 2));
    }
    Tensor o = transpose(core_->call(Args{qkv[0], qkv[1], qkv[2]})[0], 1, 2);
    return {(*attn_->o_proj())(reshape(o, Shape{B, S, o.shape()[2] * hs}))};
  }

 private:
  std::shared_ptr<nn::SelfAttention> attn_;
  std::shared_ptr<nn::CoreAttention> core_;
};

}  // namespace

TEST_CASE("context parallel on BNSD tensors equals single-rank attention", "[cp][bnsd]") {
  for (const Mode& m : kModes) {
    DYNAMIC_SECTION(m.name) {
      const int64_t B = 2, H = 4, D = 8;
      Generator gen(7);
      Tensor q = ops::randn({B, m.seq, H, D}, gen);
      Tensor k = ops::randn({B, m.seq, m.kv_heads, D}, gen);
      Tensor v = ops::randn({B, m.seq, m.kv_heads, D}, gen);
      Tensor w = ops::randn({B, m.seq, H, D}, gen);
      AttentionOptions options;
      options.causal = true;
      auto ref = std::make_shared<nn::CoreAttention>(options);  // BSHD, one rank
      Tensor qr = ops::clone(q), kr = ops::clone(k), vr = ops::clone(v);
      for (Tensor* t : {&qr, &kr, &vr})
        set_requires_grad(*t);
      Tensor out_ref = ref->call(Args{qr, kr, vr})[0];
      backward(sum(mul(out_ref, w)));

      tandem::testing::RankChecks rc;
      run_ranks(m.cp, [&](ProcessGroupPtr pg) {
        const int r = pg->rank();
        DeviceMesh mesh(pg, {m.cp}, {"cp"}, {}, test::test_device());
        auto core = std::make_shared<nn::CoreAttention>(options, nn::QKVLayout::BNSD);
        bnsd_config(m).apply(core, mesh);
        // This rank's tokens, BNSD: sharded along dim 2.
        auto shard = [&](const Tensor& bshd) {
          return shard_sequence(swap(bshd), 2, m.cp, r, m.load_balance);
        };
        Tensor ql = test::on_test_device(shard(q)), kl = test::on_test_device(shard(k)),
               vl = test::on_test_device(shard(v));
        for (Tensor* t : {&ql, &kl, &vl})
          set_requires_grad(*t);
        Tensor out = core->call(Args{ql, kl, vl})[0];
        backward(sum(mul(out, test::on_test_device(shard(w)))));
        auto same = [&](const char* what, const Tensor& got, const Tensor& want_bshd) {
          const Tensor g = test::on_cpu(got), want = shard(want_bshd);
          rc.check(g.shape() == want.shape() && ops::allclose(g, want, 1e-5, 1e-5),
                   fmt::format("{} on rank {} ({} vs {})", what, r, g.shape(), want.shape()));
        };
        same("output", out, out_ref);
        same("dq", grad(ql), grad(qr));
        same("dk", grad(kl), grad(kr));
        same("dv", grad(vl), grad(vr));
      });
      rc.report();
    }
  }
}

TEST_CASE("async context parallel on BNSD tensors equals the sync variant", "[cp][bnsd][async]") {
  for (const Mode& m : kModes) {
    DYNAMIC_SECTION(m.name) {
      const int64_t B = 2, d = 32, H = 4;
      Generator gen(11);
      Tensor x = ops::randn({B, m.seq, d}, gen);
      Tensor w = ops::randn({B, m.seq, d}, gen);
      LogCapture log;
      tandem::testing::RankChecks rc;
      run_ranks(m.cp, [&](ProcessGroupPtr pg) {
        const int r = pg->rank();
        DeviceMesh mesh(pg, {m.cp}, {"cp"}, {}, test::test_device());
        std::vector<Tensor> outs, dxs;
        for (bool async : {false, true}) {
          Generator g(1);
          auto model = std::make_shared<BnsdAttention>(nn::make<nn::SelfAttention>(
              {.d_model = d, .n_heads = H, .n_kv_heads = m.kv_heads, .causal = true}, g));
          model->to(test::test_device());
          if (async) {
            AsyncContextParallel a{.config = bnsd_config(m), .head_size = d / H};
            const auto& attn = model->attn();
            a.apply(model->core(), attn->q_proj(), attn->k_proj(), attn->v_proj(), mesh);
          } else {
            bnsd_config(m).apply(model->core(), mesh);
          }
          Tensor xl = test::on_test_device(shard_sequence(x, 1, m.cp, r, m.load_balance));
          set_requires_grad(xl);
          Tensor out = (*model)(xl);
          backward(
              sum(mul(out, test::on_test_device(shard_sequence(w, 1, m.cp, r, m.load_balance)))));
          outs.push_back(test::on_cpu(out));
          dxs.push_back(test::on_cpu(grad(xl)));
        }
        rc.check(ops::allclose(outs[0], outs[1], 1e-6, 1e-6), fmt::format("output, rank {}", r));
        rc.check(ops::allclose(dxs[0], dxs[1], 1e-6, 1e-6), fmt::format("dx, rank {}", r));
      });
      rc.report();
      // The async collectives ran: nothing fell back to the synchronous ones.
      CHECK(log.matching("synchronous").empty());
    }
  }
}

TEST_CASE("context parallel refuses dims its core attention's layout does not have", "[cp][bnsd]") {
  tandem::testing::RankChecks rc;
  run_ranks(2, [&](ProcessGroupPtr pg) {
    DeviceMesh mesh(pg, {2}, {"cp"}, {}, test::test_device());
    const Mode allgather{"allgather", 2, 1, false, false, 8, 2};
    auto bshd_core = std::make_shared<nn::CoreAttention>();
    RANK_CHECK_THROWS_WITH(rc, bnsd_config(allgather).apply(bshd_core, mesh),
                           "expected seq_dim 1 and head_dim 2 to match the core attention's "
                           "layout BSHD, got seq_dim 2 and head_dim 1");
    auto bnsd_core = std::make_shared<nn::CoreAttention>(AttentionOptions{}, nn::QKVLayout::BNSD);
    RANK_CHECK_THROWS_WITH(rc, ContextParallel{}.apply(bnsd_core, mesh),
                           "layout BNSD, got seq_dim 1 and head_dim 2");
    ContextParallel odd;
    odd.seq_dim = 3;
    RANK_CHECK_THROWS_WITH(rc, odd.apply(bshd_core, mesh), "got seq_dim 3 and head_dim 2");
  });
  rc.report();
}
