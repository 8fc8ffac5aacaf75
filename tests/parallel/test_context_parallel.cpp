// Context parallelism: every mode's outputs and Q/K/V gradients equal
// single-rank attention on the whole sequence. The references run on the CPU;
// the rank threads compute on test::test_device() (tests/support/test_device.h).
#include <catch2/catch.hpp>
#include <optional>

#include "tandem/autograd/nn/attention.h"
#include "tandem/autograd/ops.h"
#include "tandem/comm/threads/threads_backend.h"
#include "tandem/parallel/context_parallel.h"
#include "tandem/parallel/tensor_parallel.h"
#include "tandem/runtime/logging.h"
#include "tests/support/rank_checks.h"
#include "tests/support/test_device.h"

using namespace tandem;

namespace {

struct Case {
  std::string name;
  int cp;
  int ds;
  bool ring;
  bool load_balance;
  bool causal;
  int64_t seq;
  int64_t heads;
  int64_t kv_heads;
};

std::string describe(const Case& c) {
  return fmt::format("{} cp={} ds={} causal={} lb={} S={} H={} Hkv={}", c.name, c.cp, c.ds,
                     c.causal, c.load_balance, c.seq, c.heads, c.kv_heads);
}

// `documents`: packed sequences (Note [Packed sequences]), declared with a
// DocumentScope on the reference and on every rank.
void check_case(const Case& c, std::shared_ptr<const DocumentBounds> documents = nullptr) {
  INFO(describe(c) << (documents ? " packed" : ""));
  const int64_t B = 2, D = 8;
  Generator gen(42);
  Tensor q = ops::randn({B, c.seq, c.heads, D}, gen);
  Tensor k = ops::randn({B, c.seq, c.kv_heads, D}, gen);
  Tensor v = ops::randn({B, c.seq, c.kv_heads, D}, gen);
  Tensor w = ops::randn({B, c.seq, c.heads, D}, gen);  // loss weights
  AttentionOptions options;
  options.causal = c.causal;

  // Reference: one rank, whole sequence.
  auto ref = std::make_shared<nn::CoreAttention>(options);
  Tensor qr = ops::clone(q), kr = ops::clone(k), vr = ops::clone(v);
  for (Tensor* t : {&qr, &kr, &vr})
    set_requires_grad(*t);
  Tensor out_ref;
  {
    nn::DocumentScope scope(documents);
    out_ref = ref->call(Args{qr, kr, vr})[0];
  }
  backward(sum(mul(out_ref, w)));

  std::vector<std::string> errors(static_cast<size_t>(c.cp));
  run_ranks(c.cp, [&](ProcessGroupPtr pg) {
    const int r = pg->rank();
    DeviceMesh mesh(pg, {c.cp}, {"cp"}, {}, test::test_device());
    auto core = std::make_shared<nn::CoreAttention>(options);
    ContextParallel config;
    config.ulysses_degree = c.ds;
    config.load_balance = c.load_balance;
    config.mode = c.ring ? CPMode::Ring : CPMode::Auto;
    config.apply(core, mesh);
    auto shard = [&](const Tensor& t) { return shard_sequence(t, 1, c.cp, r, c.load_balance); };
    Tensor ql = test::on_test_device(shard(q)), kl = test::on_test_device(shard(k)),
           vl = test::on_test_device(shard(v));
    for (Tensor* t : {&ql, &kl, &vl})
      set_requires_grad(*t);
    nn::DocumentScope scope(documents);
    Tensor out = core->call(Args{ql, kl, vl})[0];
    backward(sum(mul(out, test::on_test_device(shard(w)))));
    std::string e;
    auto same = [&](const char* what, const Tensor& on_device, const Tensor& want) {
      const Tensor got = test::on_cpu(on_device);
      if (got.shape() != want.shape() || !ops::allclose(got, want, 1e-5, 1e-5)) {
        e += fmt::format("{} differs on rank {} ({} vs {}); ", what, r, got.shape(), want.shape());
      }
    };
    same("output", out, shard(out_ref));
    same("dq", grad(ql), shard(grad(qr)));
    same("dk", grad(kl), shard(grad(kr)));
    same("dv", grad(vl), shard(grad(vr)));
    errors[r] = e;
  });
  for (const std::string& e : errors)
    CHECK(e.empty());
  for (const std::string& e : errors) {
    if (!e.empty()) WARN(e);
  }
}

// Self-attention with something computed between a projection and the core
// attention (a gelu standing in for a rotary embedding) on the slots set in
// `bent` (bit 0: q, 1: k, 2: v).
class BentAttention final : public Module {
 public:
  BentAttention(std::shared_ptr<nn::SelfAttention> attn, int bent)
      : Module("BentAttention"), bent_(bent) {
    attn_ = register_module("attn", std::move(attn));
  }
  const std::shared_ptr<nn::SelfAttention>& attn() const { return attn_; }

 protected:
  std::vector<Tensor> forward(Args& args) override {
    const Tensor& x = args.positional.at(0);
    const int64_t B = x.shape()[0], S = x.shape()[1], hs = attn_->head_dim();
    std::vector<Tensor> qkv;
    int slot = 0;
    for (const auto& proj : {attn_->q_proj(), attn_->k_proj(), attn_->v_proj()}) {
      Tensor y = (*proj)(x);
      if (bent_ & (1 << slot++)) y = gelu(y);
      qkv.push_back(reshape(y, Shape{B, S, y.shape()[2] / hs, hs}));
    }
    Tensor o = attn_->core()->call(Args{qkv[0], qkv[1], qkv[2]})[0];
    return {(*attn_->o_proj())(reshape(o, Shape{B, S, o.shape()[2] * hs}))};
  }

 private:
  std::shared_ptr<nn::SelfAttention> attn_;
  int bent_;
};

}  // namespace

TEST_CASE("context parallel modes equal single-rank attention", "[cp]") {
  std::vector<Case> cases;
  for (bool causal : {false, true}) {
    for (int cp : {2, 4}) {
      cases.push_back({"ulysses", cp, cp, false, false, causal, 16, 4, 4});
      cases.push_back({"allgather", cp, 1, false, false, causal, 16, 4, 2});
      cases.push_back({"ring", cp, 1, true, false, causal, 16, 4, 2});
      if (causal) {
        cases.push_back({"allgather-lb", cp, 1, false, true, causal, 16, 4, 4});
        cases.push_back({"ring-lb", cp, 1, true, true, causal, 16, 4, 4});
      }
    }
    cases.push_back({"hybrid", 4, 2, false, false, causal, 16, 4, 4});
  }
  for (const Case& c : cases) {
    SECTION(describe(c)) {
      check_case(c);
    }
  }
}

TEST_CASE("context parallel with grouped-query heads and uneven lengths", "[cp]") {
  std::vector<Case> cases = {
      // fewer KV heads than the Ulysses degree: replicated before the all-to-all
      {"ulysses-gqa", 4, 4, false, false, true, 16, 8, 2},
      {"hybrid-gqa", 4, 2, false, false, true, 16, 4, 1},
      // sequence lengths that do not divide cp or 2cp
      {"ulysses-uneven", 4, 4, false, false, true, 13, 4, 4},
      {"allgather-uneven", 4, 1, false, false, true, 13, 4, 2},
      {"ring-uneven", 4, 1, true, false, true, 11, 4, 2},
      {"allgather-lb-uneven", 2, 1, false, true, true, 13, 4, 4},
      {"ring-lb-uneven", 4, 1, true, true, true, 19, 4, 2},
      {"hybrid-uneven", 4, 2, false, false, true, 14, 4, 4},
  };
  for (const Case& c : cases) {
    SECTION(describe(c)) {
      check_case(c);
    }
  }
}

namespace {

// Packed documents over `seq` positions for two batch rows: row 0 has
// documents of 5, 0 (empty) and 8 tokens, then the rest; row 1 one token,
// then documents of 3. Boundaries fall inside rank shards, on their edges and
// across the load balance's head and tail chunks.
std::shared_ptr<const DocumentBounds> packed_documents(int64_t seq) {
  const std::vector<int64_t> head{5, 0, 8};
  std::vector<std::vector<int64_t>> rows(2);
  for (size_t r = 0; r < 2; ++r) {
    int64_t left = seq;
    for (size_t i = 0; left > 0; ++i) {
      const int64_t want = r == 0 ? (i < head.size() ? head[i] : left) : (i == 0 ? 1 : 3);
      rows[r].push_back(std::min(want, left));
      left -= rows[r].back();
    }
  }
  return DocumentBounds::from_lengths(rows);
}

}  // namespace

TEST_CASE("context parallel with packed sequences equals single-rank packed attention",
          "[cp][packed]") {
  std::vector<Case> cases;
  for (bool causal : {false, true}) {
    cases.push_back({"ulysses", 4, 4, false, false, causal, 16, 4, 4});
    cases.push_back({"allgather", 4, 1, false, false, causal, 16, 4, 2});
    cases.push_back({"ring", 4, 1, true, false, causal, 16, 4, 2});
    cases.push_back({"hybrid", 4, 2, false, false, causal, 16, 4, 2});
  }
  cases.push_back({"allgather-lb", 4, 1, false, true, true, 16, 4, 4});
  cases.push_back({"ring-lb", 2, 1, true, true, true, 16, 4, 2});
  cases.push_back({"ulysses-gqa", 4, 4, false, false, true, 16, 8, 2});
  cases.push_back({"ring-lb-uneven", 4, 1, true, true, true, 19, 4, 2});
  cases.push_back({"hybrid-uneven", 4, 2, false, false, true, 14, 4, 4});
  // Ranks with no tokens: 3 tokens on 4 ranks, 6 on the 8 load-balanced chunks.
  cases.push_back({"allgather-empty-ranks", 4, 1, false, false, true, 3, 4, 2});
  cases.push_back({"ring-lb-empty-chunks", 4, 1, true, true, true, 6, 4, 2});
  for (const Case& c : cases) {
    SECTION(describe(c)) {
      check_case(c, packed_documents(c.seq));
    }
  }
}

TEST_CASE("load balance evens out causal attention work", "[cp]") {
  for (int cp : {2, 4, 8}) {
    for (int64_t seq : {64, 1024, 1000}) {
      int64_t lo = INT64_MAX, hi = 0, plain_lo = INT64_MAX, plain_hi = 0;
      for (int r = 0; r < cp; ++r) {
        int64_t w = causal_attention_pairs(seq, cp, r, true);
        lo = std::min(lo, w);
        hi = std::max(hi, w);
        int64_t p = causal_attention_pairs(seq, cp, r, false);
        plain_lo = std::min(plain_lo, p);
        plain_hi = std::max(plain_hi, p);
      }
      INFO("cp=" << cp << " seq=" << seq);
      CHECK(static_cast<double>(hi) / static_cast<double>(lo) <= 1.05);
      CHECK(static_cast<double>(plain_hi) / static_cast<double>(plain_lo) > 2.0);
    }
  }
}

TEST_CASE("shard_sequence and unshard_sequence are inverse", "[cp]") {
  Generator gen(3);
  for (bool lb : {false, true}) {
    for (int64_t seq : {16, 13}) {
      Tensor x = ops::randn({2, seq, 3}, gen);
      tandem::testing::RankChecks rc;
      run_ranks(4, [&](ProcessGroupPtr pg) {
        Tensor local = shard_sequence(test::on_test_device(x), 1, 4, pg->rank(), lb);
        Tensor back = unshard_sequence(local, 1, pg, lb);
        RANK_CHECK(rc, ops::equal(test::on_cpu(back), x));
      });
      rc.report();
    }
  }
}

TEST_CASE("context parallel rejects impossible layouts", "[cp]") {
  tandem::testing::RankChecks rc;
  run_ranks(4, [&](ProcessGroupPtr pg) {
    DeviceMesh mesh(pg, {4}, {"cp"}, {}, test::test_device());
    auto core = std::make_shared<nn::CoreAttention>();
    ContextParallel c;
    c.ulysses_degree = 3;
    RANK_CHECK_THROWS_WITH(rc, c.apply(core, mesh), "Ulysses degree to divide cp=4");
    c.ulysses_degree = 4;
    c.load_balance = true;
    RANK_CHECK_THROWS_WITH(rc, c.apply(core, mesh), "load balance only");
    DeviceMesh mesh2(pg, {2, 2}, {"a", "b"}, {}, test::test_device());
    c.load_balance = false;
    c.ulysses_degree = 2;
    RANK_CHECK_THROWS_WITH(rc, c.apply(core, mesh2), "named (co, ds)");
    DeviceMesh mesh3(pg, {1, 2, 2}, {"x", "y", "z"}, {}, test::test_device());
    RANK_CHECK_THROWS_WITH(rc, c.apply(core, mesh3), "3-D mesh");

    // Heads not divisible by the Ulysses degree, and missing Q/K/V.
    auto core2 = std::make_shared<nn::CoreAttention>();
    ContextParallel u;
    u.ulysses_degree = 4;
    u.apply(core2, mesh);
    Tensor t = ops::zeros({1, 2, 6, 4}, DType::F32, test::test_device());
    RANK_CHECK_THROWS_WITH(rc, core2->call(Args{t, t, t}), "query heads divisible");
    RANK_CHECK_THROWS_WITH(rc, core2->call(Args{t}), "expected k in the attention");
  });
  rc.report();
}

TEST_CASE("context parallel reads a declared sequence layout instead of gathering it", "[cp]") {
  // Each mode, declared (Note [Sequence layout as data]) and not: the same
  // output bits, one collective fewer in the declared forward (the lengths
  // all-gather), and a declared layout that is not this shard's is refused.
  const std::vector<Case> cases = {
      {"ulysses", 4, 4, false, false, true, 16, 4, 4},
      {"allgather-uneven", 4, 1, false, false, true, 13, 4, 2},
      {"allgather-lb-uneven", 2, 1, false, true, true, 13, 4, 4},
      {"ring-lb-uneven", 4, 1, true, true, true, 19, 4, 2},
      {"hybrid-uneven", 4, 2, false, false, true, 14, 4, 4},
  };
  for (const Case& c : cases) {
    INFO(describe(c));
    const int64_t B = 2, D = 8;
    Generator gen(5);
    Tensor q = ops::randn({B, c.seq, c.heads, D}, gen);
    Tensor k = ops::randn({B, c.seq, c.kv_heads, D}, gen);
    Tensor v = ops::randn({B, c.seq, c.kv_heads, D}, gen);
    tandem::testing::RankChecks rc;
    run_ranks(c.cp, [&](ProcessGroupPtr pg) {
      const int r = pg->rank();
      // The hybrid case on a (co, ds) mesh: the layout is declared on that
      // 2-D mesh, which stands for the group over both dims.
      DeviceMesh mesh =
          c.ds > 1 && c.ds < c.cp
              ? DeviceMesh(pg, {c.cp / c.ds, c.ds}, {"co", "ds"}, {}, test::test_device())
              : DeviceMesh(pg, {c.cp}, {"cp"}, {}, test::test_device());
      AttentionOptions options;
      options.causal = c.causal;
      auto core = std::make_shared<nn::CoreAttention>(options);
      ContextParallel config;
      config.ulysses_degree = c.ds;
      config.load_balance = c.load_balance;
      config.mode = c.ring ? CPMode::Ring : CPMode::Auto;
      config.apply(core, mesh);
      auto shard = [&](const Tensor& t) {
        return test::on_test_device(shard_sequence(t, 1, c.cp, r, c.load_balance));
      };
      const Tensor ql = shard(q), kl = shard(k), vl = shard(v);
      std::vector<Tensor> outs;
      std::vector<uint64_t> collectives;
      for (bool declared : {false, true}) {
        std::optional<SequenceLayoutScope> layout;
        if (declared) layout.emplace(mesh, shard_sequence_layout(c.seq, c.cp, c.load_balance));
        uint64_t before = 0;
        for (const ProcessGroupPtr& g : mesh.all_groups())
          before += g->ledger().size();
        outs.push_back(test::on_cpu(core->call(Args{ql, kl, vl})[0]));
        uint64_t after = 0;
        for (const ProcessGroupPtr& g : mesh.all_groups())
          after += g->ledger().size();
        collectives.push_back(after - before);
      }
      RANK_CHECK(rc, ops::equal(outs[0], outs[1]));
      RANK_CHECK(rc, collectives[1] + 1 == collectives[0]);
      std::vector<int64_t> wrong = shard_sequence_layout(c.seq, c.cp, c.load_balance).lengths;
      wrong[static_cast<size_t>(r)] += 1;
      SequenceLayoutScope layout(mesh, SequenceLayout{.lengths = wrong});
      rc.throws_with(
          [&] {
            core->call(Args{ql, kl, vl});
          },
          "declared layout gives it", "a wrong declared layout");
    });
    rc.report();
  }
}

TEST_CASE("async context parallel equals the sync variant and single-rank attention",
          "[cp][async]") {
  struct AsyncCase {
    int cp;
    int ds;
    bool load_balance;
    int64_t seq;
    int64_t kv_heads;
    bool packed = false;  // packed documents (Note [Packed sequences])
  };
  for (AsyncCase c :
       {AsyncCase{2, 2, false, 16, 4}, AsyncCase{4, 4, false, 16, 2}, AsyncCase{4, 4, false, 13, 4},
        AsyncCase{2, 1, false, 16, 2}, AsyncCase{4, 1, true, 16, 4}, AsyncCase{4, 1, false, 11, 2},
        AsyncCase{4, 4, false, 16, 2, true}, AsyncCase{4, 1, true, 13, 2, true},
        // hybrid: q over the ds group, K/V in one all-to-all over cp (Note
        // [Async hybrid in one collective]); KV heads replicated, uneven,
        // packed
        AsyncCase{4, 2, false, 16, 4}, AsyncCase{4, 2, false, 14, 1},
        AsyncCase{4, 2, false, 13, 2, true}}) {
    INFO("cp=" << c.cp << " ds=" << c.ds << " lb=" << c.load_balance << " S=" << c.seq
               << " Hkv=" << c.kv_heads << " packed=" << c.packed);
    const std::shared_ptr<const DocumentBounds> documents =
        c.packed ? packed_documents(c.seq) : nullptr;
    const int64_t B = 2, d = 32, H = 4;
    Generator gen(9);
    Tensor x = ops::randn({B, c.seq, d}, gen);
    Tensor w = ops::randn({B, c.seq, d}, gen);
    Generator init(1);
    auto ref = nn::make<nn::SelfAttention>(
        {.d_model = d, .n_heads = H, .n_kv_heads = c.kv_heads, .causal = true}, init);
    Tensor xr = ops::clone(x);
    set_requires_grad(xr);
    Tensor out_ref;
    {
      nn::DocumentScope scope(documents);
      out_ref = (*ref)(xr);
    }
    backward(sum(mul(out_ref, w)));
    auto ref_params = ref->named_parameters();

    std::vector<int> bad(static_cast<size_t>(c.cp), 0);
    run_ranks(c.cp, [&](ProcessGroupPtr pg) {
      const int r = pg->rank();
      DeviceMesh mesh(pg, {c.cp}, {"cp"}, {}, test::test_device());
      std::vector<Tensor> outs, dxs;
      std::vector<std::vector<Tensor>> grads;
      for (bool async : {false, true}) {
        Generator g(1);
        auto attn = nn::make<nn::SelfAttention>(
            {.d_model = d, .n_heads = H, .n_kv_heads = c.kv_heads, .causal = true}, g);
        attn->to(test::test_device());
        ContextParallel config;
        config.ulysses_degree = c.ds;
        config.load_balance = c.load_balance;
        if (async) {
          AsyncContextParallel a;
          a.config = config;
          a.head_size = d / H;
          a.apply(attn->core(), attn->q_proj(), attn->k_proj(), attn->v_proj(), mesh);
        } else {
          config.apply(attn->core(), mesh);
        }
        Tensor xl = test::on_test_device(shard_sequence(x, 1, c.cp, r, c.load_balance));
        set_requires_grad(xl);
        nn::DocumentScope scope(documents);
        Tensor out = (*attn)(xl);
        backward(
            sum(mul(out, test::on_test_device(shard_sequence(w, 1, c.cp, r, c.load_balance)))));
        outs.push_back(test::on_cpu(out));
        dxs.push_back(test::on_cpu(grad(xl)));
        std::vector<Tensor> pg_grads;
        for (auto& [name, p] : attn->named_parameters()) {
          WorkPtr sum_w = pg->all_reduce(grad(p));  // CP ranks hold partial weight gradients
          sum_w->synchronize();
          pg_grads.push_back(test::on_cpu(sum_w->result()));
        }
        grads.push_back(pg_grads);
      }
      int b = 0;
      b += ops::equal(outs[0], outs[1]) ? 0 : 1;
      // Hybrid sums the K/V gradient's co tiles in another order than the
      // sync reduce-scatter: equal up to rounding; the others bit for bit.
      const bool hybrid = c.ds > 1 && c.ds < c.cp;
      b +=
          (hybrid ? ops::allclose(dxs[0], dxs[1], 1e-6, 1e-6) : ops::equal(dxs[0], dxs[1])) ? 0 : 1;
      b += ops::allclose(outs[1], shard_sequence(out_ref, 1, c.cp, r, c.load_balance), 1e-5, 1e-5)
               ? 0
               : 1;
      for (size_t i = 0; i < grads[0].size(); ++i) {
        b += ops::allclose(grads[0][i], grads[1][i], 1e-6, 1e-7) ? 0 : 1;
        b += ops::allclose(grads[1][i], grad(ref_params[i].second), 1e-5, 1e-5) ? 0 : 1;
      }
      b += ops::allclose(dxs[1], shard_sequence(grad(xr), 1, c.cp, r, c.load_balance), 1e-5, 1e-5)
               ? 0
               : 1;
      bad[r] = b;
    });
    for (int b : bad)
      CHECK(b == 0);
  }
}

TEST_CASE("async context parallel falls back to the synchronous collectives where it must",
          "[cp][async]") {
  // How the async layer is given its projections.
  enum class Given { Separate, Null, Fused };
  struct FallbackCase {
    int cp;
    int ds;
    bool load_balance;
    int64_t kv_heads;
    int bent;  // slots with a tensor computed after the projection
    Given given;
    const char* said;  // in the one debug line per rank
  };
  const char* per_tensor = "runs the collectives of {} synchronously";
  for (FallbackCase c : {
           FallbackCase{2, 2, false, 4, 0b011, Given::Separate, "q, k"},
           FallbackCase{4, 4, false, 2, 0b010, Given::Separate, "k"},
           FallbackCase{4, 1, true, 4, 0b100, Given::Separate, "v"},
           FallbackCase{2, 1, false, 2, 0b111, Given::Separate, "k, v"},
           FallbackCase{2, 2, false, 4, 0b111, Given::Separate, "q, k, v"},
           FallbackCase{2, 2, false, 4, 0, Given::Null, "no q projection was given"},
           FallbackCase{4, 1, true, 2, 0b001, Given::Fused, "k and v come from one projection"},
       }) {
    const std::string said = c.given == Given::Separate
                                 ? fmt::format(fmt::runtime(per_tensor), c.said)
                                 : std::string(c.said);
    INFO("cp=" << c.cp << " ds=" << c.ds << " lb=" << c.load_balance << " bent=" << c.bent
               << " expecting: " << said);
    const int64_t B = 2, S = 13, d = 32, H = 4;
    Generator gen(5);
    Tensor x = ops::randn({B, S, d}, gen);
    Tensor w = ops::randn({B, S, d}, gen);
    LogCapture log;
    std::vector<int> bad(static_cast<size_t>(c.cp), 0);
    run_ranks(c.cp, [&](ProcessGroupPtr pg) {
      const int r = pg->rank();
      DeviceMesh mesh(pg, {c.cp}, {"cp"}, {}, test::test_device());
      std::vector<std::vector<Tensor>> results;  // per variant: outputs, dx, weight grads
      for (bool async : {false, true}) {
        Generator g(1);
        auto model = std::make_shared<BentAttention>(
            nn::make<nn::SelfAttention>(
                {.d_model = d, .n_heads = H, .n_kv_heads = c.kv_heads, .causal = true}, g),
            c.bent);
        model->to(test::test_device());
        const auto& attn = model->attn();
        ContextParallel config;
        config.ulysses_degree = c.ds;
        config.load_balance = c.load_balance;
        if (async) {
          AsyncContextParallel a;
          a.config = config;
          a.head_size = d / H;
          std::shared_ptr<Module> q = attn->q_proj(), k = attn->k_proj(), v = attn->v_proj();
          if (c.given == Given::Null) q = k = v = nullptr;
          if (c.given == Given::Fused) k = v;
          a.apply(attn->core(), q, k, v, mesh);
        } else {
          config.apply(attn->core(), mesh);
        }
        std::vector<Tensor> got;
        for (int step = 0; step < 2; ++step) {  // the second forward says nothing new
          Tensor xl = test::on_test_device(shard_sequence(x, 1, c.cp, r, c.load_balance));
          set_requires_grad(xl);
          Tensor out = (*model)(xl);
          backward(
              sum(mul(out, test::on_test_device(shard_sequence(w, 1, c.cp, r, c.load_balance)))));
          got.push_back(test::on_cpu(out));
          got.push_back(test::on_cpu(grad(xl)));
        }
        for (auto& [name, p] : model->named_parameters())
          got.push_back(test::on_cpu(grad(p)));  // two steps' partial sums
        results.push_back(got);
      }
      int b = results[0].size() == results[1].size() ? 0 : 100;
      for (size_t i = 0; i < results[0].size() && b == 0; ++i) {
        b += i < 4 ? (ops::equal(results[0][i], results[1][i]) ? 0 : 1)
                   : (ops::allclose(results[0][i], results[1][i], 1e-6, 1e-7) ? 0 : 1);
      }
      bad[r] = b;
    });
    for (int b : bad)
      CHECK(b == 0);
    // One line per rank for the layer, however many forwards it ran.
    CHECK(log.matching(said).size() == static_cast<size_t>(c.cp));
    CHECK(log.matching("[parallel]").size() ==
          static_cast<size_t>(c.cp) + log.matching("gathers every rank").size());
  }
}

TEST_CASE("context parallel composes with tensor parallel on a (cp, tp) mesh", "[cp][tp]") {
  // The async variant too: the column-parallel projections give each rank its
  // tp shard of the heads, which the projections' hooks send on.
  for (auto [ds, async] : {std::pair{1, false}, {2, false}, {1, true}, {2, true}}) {
    INFO("ulysses_degree=" << ds << " async=" << async);
    const int64_t B = 2, S = 12, d = 32, H = 8;
    Generator gen(21);
    Tensor x = ops::randn({B, S, d}, gen);
    Tensor w = ops::randn({B, S, d}, gen);
    Generator init(1);
    auto ref = nn::make<nn::SelfAttention>(
        {.d_model = d, .n_heads = H, .n_kv_heads = 4, .causal = true}, init);
    Tensor xr = ops::clone(x);
    set_requires_grad(xr);
    Tensor out_ref = (*ref)(xr);
    backward(sum(mul(out_ref, w)));
    auto ref_params = ref->named_parameters();

    std::vector<int> bad(4, -1);
    run_ranks(4, [&](ProcessGroupPtr pg) {
      DeviceMesh mesh(pg, {2, 2}, {"cp", "tp"}, {}, test::test_device());
      DeviceMesh tp = mesh.slice("tp"), cp = mesh.slice("cp");
      const int c = static_cast<int>(mesh.coordinate()[0]);
      Generator g(1);
      auto attn = nn::make<nn::SelfAttention>(
          {.d_model = d, .n_heads = H, .n_kv_heads = 4, .causal = true}, g);
      attn->to(test::test_device());
      parallelize_module(attn, tp,
                         {{"q_proj", colwise()},
                          {"k_proj", colwise()},
                          {"v_proj", colwise()},
                          {"o_proj", rowwise()}});
      ContextParallel config;
      config.ulysses_degree = ds;
      if (async) {
        AsyncContextParallel a{.config = config, .head_size = d / H};
        a.apply(attn->core(), attn->q_proj(), attn->k_proj(), attn->v_proj(), cp);
      } else {
        config.apply(attn->core(), cp);
      }
      Tensor xl = test::on_test_device(shard_sequence(x, 1, 2, c, false));
      set_requires_grad(xl);
      Tensor out = (*attn)(xl);
      backward(sum(mul(out, test::on_test_device(shard_sequence(w, 1, 2, c, false)))));
      int b = 0;
      b += ops::allclose(test::on_cpu(out), shard_sequence(out_ref, 1, 2, c, false), 1e-5, 1e-5)
               ? 0
               : 1;
      b += ops::allclose(test::on_cpu(grad(xl)), shard_sequence(grad(xr), 1, 2, c, false), 1e-5,
                         1e-5)
               ? 0
               : 1;
      auto params = attn->named_parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        // Weight gradients: a tensor-parallel shard, partial over the sequence shards.
        WorkPtr sum_cp = cp.get_group()->all_reduce(grad(params[i].second));
        sum_cp->synchronize();
        const std::string& name = params[i].first;
        Placement p = name.rfind("o_proj", 0) == 0 ? Shard(1) : Shard(0);
        Tensor want = DTensor::distribute(grad(ref_params[i].second), tp, {p}).to_local();
        b += ops::allclose(test::on_cpu(sum_cp->result()), want, 1e-5, 1e-5) ? 0 : 1;
      }
      bad[pg->rank()] = b;
    });
    for (int b : bad)
      CHECK(b == 0);
  }
}

TEST_CASE("context parallel takes DTensors and keeps their other placements", "[cp]") {
  // A (cp, tp) mesh: q/k/v sharded by sequence on cp and by heads on tp; the
  // output comes back with the same placements.
  Generator gen(17);
  const int64_t S = 12, H = 4, D = 8;
  Tensor q = ops::randn({1, S, H, D}, gen), k = ops::randn({1, S, H, D}, gen),
         v = ops::randn({1, S, H, D}, gen);
  AttentionOptions options;
  options.causal = true;
  Tensor want = nn::CoreAttention(options).call(Args{q, k, v})[0];
  tandem::testing::RankChecks rc;
  run_ranks(4, [&](ProcessGroupPtr pg) {
    DeviceMesh mesh(pg, {2, 2}, {"cp", "tp"}, {}, test::test_device());
    auto core = std::make_shared<nn::CoreAttention>(options);
    ContextParallel config;
    config.apply(core, mesh.slice("cp"));
    Placements p = {Replicate(), Shard(2)};  // replicated over cp: attend shards it
    auto distribute = [&](const Tensor& t) {
      return DTensor::distribute(test::on_test_device(t), mesh, p);
    };
    DTensor out = config.attend(core, distribute(q), distribute(k), distribute(v), "cp");
    RANK_CHECK(rc, out.placements()[0] == Shard(1) && out.placements()[1] == Shard(2));
    RANK_CHECK(rc, ops::allclose(test::on_cpu(out.full_tensor()), want, 1e-5, 1e-5));
  });
  rc.report();
}
