// Expert parallelism: on every rank, the expert-parallel MoE's output, aux
// loss and input gradient equal the local MoE (same seed, all experts) on
// that rank's batch; the router's gradient equals the local one on the same
// batch (it is replicated: the data-parallel reduction sums it, and that sum
// equals the local MoE's gradient summed over all batches); each expert's
// gradient on its owner equals the local MoE's gradient summed over every
// rank's batch (its tokens came from all of them). The references run on the
// CPU; the rank threads compute on test::test_device()
// (tests/support/test_device.h).
#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tandem/autograd/function.h"
#include "tandem/autograd/nn/moe.h"
#include "tandem/autograd/ops.h"
#include "tandem/comm/threads/threads_backend.h"
#include "tandem/parallel/expert_parallel.h"
#include "tests/support/rank_checks.h"
#include "tests/support/test_device.h"

using namespace tandem;
using tandem::testing::RankChecks;

namespace {

constexpr int64_t kModel = 8, kHidden = 12, kBatch = 2, kSeq = 5;
constexpr double kAuxScale = 0.25;
constexpr uint64_t kSeed = 7;

struct Config {
  int ep;
  int64_t experts;
  int64_t top_k;
  bool skewed;  // routing forced so that some ranks send or receive nothing
};

std::string describe(const Config& c) {
  return fmt::format("ep={} E={} top_k={}{}", c.ep, c.experts, c.top_k, c.skewed ? " skewed" : "");
}

// The router weight of the skewed configurations: logit e = 4 x[e], so the
// features of a token pick its experts.
Tensor skewed_router(int64_t experts) {
  std::vector<double> w(static_cast<size_t>(experts * kModel), 0.0);
  for (int64_t e = 0; e < experts; ++e)
    w[static_cast<size_t>(e * kModel + e)] = 4.0;
  return ops::from_vector(w, Shape{experts, kModel});
}

std::shared_ptr<nn::MoE> make_moe(const Config& c) {
  Generator gen(kSeed);
  auto moe = nn::make<nn::MoE>(
      {.d_model = kModel, .hidden = kHidden, .num_experts = c.experts, .top_k = c.top_k}, gen);
  moe->to(DType::F64);
  if (c.skewed) moe->router()->set_parameter("weight", skewed_router(c.experts));
  return moe;
}

// Rank r's batch (B, S, d). Skewed: every token of rank r prefers expert
// first[r % 4] (then second[r % 4]), all among experts 0..2, so with E = 8
// and ep = 4 the ranks owning experts 4..7 receive no rows at all, and rank
// 0 sends rows to itself only.
Tensor batch(const Config& c, int rank, uint64_t salt = 0) {
  Generator gen(100 + static_cast<uint64_t>(rank) + 31 * salt);
  Tensor x = ops::randn({kBatch, kSeq, kModel}, gen, DType::F64);
  if (!c.skewed) return x;
  const int64_t first[] = {0, 2, 1, 2}, second[] = {1, 0, 0, 1};
  std::vector<double> bump(static_cast<size_t>(kBatch * kSeq * kModel), 0.0);
  for (int64_t t = 0; t < kBatch * kSeq; ++t) {
    int64_t a = first[rank % 4], b = second[rank % 4];
    if (rank == 1 && t % 2 == 1) std::swap(a, b);  // two preferences on one rank
    bump[static_cast<size_t>(t * kModel + a)] = 1.0;
    bump[static_cast<size_t>(t * kModel + b)] = 0.6;
  }
  return ops::add(ops::mul(x, 0.02), ops::from_vector(bump, Shape{kBatch, kSeq, kModel}));
}

Tensor loss_weights(int rank, uint64_t salt = 0) {
  Generator gen(500 + static_cast<uint64_t>(rank) + 31 * salt);
  return ops::randn({kBatch, kSeq, kModel}, gen, DType::F64);
}

Tensor loss_of(const std::vector<Tensor>& out, const Tensor& w) {
  return add(sum(mul(out[0], w)), mul(out[1], kAuxScale));
}

// What the local MoE computes on one batch.
struct Reference {
  Tensor y, aux, dx;
  std::map<std::string, Tensor> grads;  // by parameter name; zeros where none
};

Tensor grad_or_zeros(const Tensor& p) {
  Tensor g = grad(p);
  return g.defined() ? ops::clone(g) : ops::zeros(p.shape(), p.dtype());
}

Reference run_local(nn::MoE& moe, const Tensor& input, const Tensor& w) {
  moe.zero_grad();
  Tensor x = ops::clone(input);
  set_requires_grad(x);
  std::vector<Tensor> out = moe.call(Args{x});
  backward(loss_of(out, w));
  Reference ref{ops::clone(out[0]), ops::clone(out[1]), grad_or_zeros(x), {}};
  for (auto& [name, p] : moe.named_parameters())
    ref.grads[name] = grad_or_zeros(p);
  return ref;
}

// Either side may be on the test device.
bool close(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && ops::allclose(test::on_cpu(a), test::on_cpu(b), 1e-9, 1e-11);
}

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.rfind(prefix, 0) == 0;
}

void check_config(const Config& c) {
  INFO(describe(c));
  // Reference: one local MoE on each rank's batch.
  auto local = make_moe(c);
  std::vector<Reference> refs;
  std::map<std::string, Tensor> summed;  // local grads summed over every batch
  for (int r = 0; r < c.ep; ++r) {
    refs.push_back(run_local(*local, batch(c, r), loss_weights(r)));
    for (auto& [name, g] : refs.back().grads) {
      summed[name] = summed.count(name) ? ops::add(summed[name], g) : g;
    }
  }

  RankChecks checks;
  std::vector<Tensor> router_grads(static_cast<size_t>(c.ep));
  run_ranks(c.ep, [&](ProcessGroupPtr pg) {
    const int r = pg->rank();
    const Reference& ref = refs[static_cast<size_t>(r)];
    DeviceMesh mesh(pg, {c.ep}, {"ep"}, {}, test::test_device());
    auto moe = make_moe(c);
    moe->to(test::test_device());
    expert_parallel(moe, mesh);

    const int64_t per_rank = c.experts / c.ep;
    RANK_CHECK(checks, moe->first_local_expert() == r * per_rank);
    RANK_CHECK(checks, moe->num_local_experts() == per_rank);
    std::vector<std::string> names;
    for (auto& [name, p] : moe->named_parameters())
      names.push_back(name);
    std::vector<std::string> want = {"router.weight"};
    for (int64_t e = r * per_rank; e < (r + 1) * per_rank; ++e) {
      for (const char* w : {"w1", "w2", "w3"})
        want.push_back(fmt::format("experts.{}.{}.weight", e, w));
    }
    std::sort(names.begin(), names.end());
    std::sort(want.begin(), want.end());
    RANK_CHECK(checks, names == want);

    Tensor x = test::on_test_device(batch(c, r));
    set_requires_grad(x);
    std::vector<Tensor> out = moe->call(Args{x});
    backward(loss_of(out, test::on_test_device(loss_weights(r))));

    RANK_CHECK(checks, close(out[0], ref.y));
    RANK_CHECK(checks, close(out[1], ref.aux));
    RANK_CHECK(checks, close(grad_or_zeros(x), ref.dx));
    for (auto& [name, p] : moe->named_parameters()) {
      const Tensor& expected = starts_with(name, "experts.") ? summed.at(name) : ref.grads.at(name);
      checks.check(close(grad_or_zeros(p), expected),
                   fmt::format("{}: gradient of {} on rank {}", describe(c), name, r));
    }
    router_grads[static_cast<size_t>(r)] = test::on_cpu(grad_or_zeros(moe->router()->weight()));
  });
  checks.report();

  // The data-parallel sum of the replicated router's gradients.
  Tensor router_sum = router_grads[0];
  for (int r = 1; r < c.ep; ++r)
    router_sum = ops::add(router_sum, router_grads[static_cast<size_t>(r)]);
  CHECK(close(router_sum, summed.at("router.weight")));

  if (c.skewed) {
    // The routing really is uneven: some rank sends nothing to some expert,
    // and (E = 8, ep = 4) the last two ranks receive nothing at all.
    NoGradGuard no_grad;
    std::vector<int64_t> total(static_cast<size_t>(c.experts), 0);
    for (int r = 0; r < c.ep; ++r) {
      Tensor logits = (*local->router())(reshape(batch(c, r), Shape{-1, kModel}));
      std::vector<int64_t> counts =
          nn::plan_dispatch(nn::route(logits, c.top_k).indices, c.experts).counts;
      for (int64_t e = 0; e < c.experts; ++e)
        total[static_cast<size_t>(e)] += counts[static_cast<size_t>(e)];
      if (r == 0) {
        for (int64_t e = c.experts / c.ep; e < c.experts; ++e)
          CHECK(counts[static_cast<size_t>(e)] == 0);
      }
    }
    if (c.experts == 8 && c.ep == 4) {
      for (int64_t e = 4; e < 8; ++e)
        CHECK(total[static_cast<size_t>(e)] == 0);
    }
  }
}

// An identity node that records where it fired and how many collectives the
// group had issued by then, in forward and in backward. It does not read the
// tensor: at [B] and [D] (forward) and [A] and [C] (backward) it is in flight.
struct Probe final : Function {
  std::string point;
  int64_t expected_layer = 0;
  ProcessGroupPtr group;
  std::vector<std::pair<std::string, uint64_t>>* events = nullptr;  // owned by the rank's lambda
  const char* name() const override { return "ProbeBackward"; }
  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>& in) override {
    events->emplace_back("f" + point, group->ledger().size());
    return {in[0]};
  }
  std::vector<Tensor> backward(FunctionCtx&, const std::vector<Tensor>& g) override {
    events->emplace_back("b" + point, group->ledger().size());
    return {g[0]};
  }
};

}  // namespace

TEST_CASE("expert-parallel MoE equals the local MoE on each rank's batch", "[ep]") {
  std::vector<Config> configs;
  for (int ep : {2, 4}) {
    for (int64_t experts : {4, 8}) {
      for (int64_t top_k : {1, 2})
        configs.push_back({ep, experts, top_k, false});
    }
  }
  for (const Config& c : configs) {
    SECTION(describe(c)) {
      check_config(c);
    }
  }
}

TEST_CASE("expert-parallel MoE with uneven routing: empty sends and receives", "[ep]") {
  for (const Config& c : {Config{4, 8, 1, true}, Config{4, 8, 2, true}, Config{2, 4, 2, true},
                          Config{2, 8, 1, true}}) {
    SECTION(describe(c)) {
      check_config(c);
    }
  }
}

TEST_CASE("expert-parallel MoE: two micro-batches in flight keep their own state", "[ep]") {
  // Forward of micro-batch 1, forward of micro-batch 2, then the backwards in
  // the order 1, 2: the split sizes and permutations of each live in its own
  // autograd nodes, so the result equals the local MoE on both batches.
  const Config c{4, 8, 2, false};
  auto local = make_moe(c);
  std::vector<std::vector<Reference>> refs(2);
  std::map<std::string, Tensor> summed;
  for (int mb = 0; mb < 2; ++mb) {
    for (int r = 0; r < c.ep; ++r) {
      refs[mb].push_back(run_local(*local, batch(c, r, mb), loss_weights(r, mb)));
      for (auto& [name, g] : refs[mb].back().grads) {
        summed[name] = summed.count(name) ? ops::add(summed[name], g) : g;
      }
    }
  }
  RankChecks checks;
  run_ranks(c.ep, [&](ProcessGroupPtr pg) {
    const int r = pg->rank();
    DeviceMesh mesh(pg, {c.ep}, {"ep"}, {}, test::test_device());
    auto moe = make_moe(c);
    moe->to(test::test_device());
    expert_parallel(moe, mesh);
    std::vector<Tensor> xs, losses;
    std::vector<std::vector<Tensor>> outs;
    for (int mb = 0; mb < 2; ++mb) {
      xs.push_back(test::on_test_device(batch(c, r, mb)));
      set_requires_grad(xs.back());
      outs.push_back(moe->call(Args{xs.back()}));
      losses.push_back(loss_of(outs.back(), test::on_test_device(loss_weights(r, mb))));
    }
    for (int mb = 0; mb < 2; ++mb) {
      backward(losses[mb]);
      const Reference& ref = refs[mb][static_cast<size_t>(r)];
      RANK_CHECK(checks, close(outs[mb][0], ref.y));
      RANK_CHECK(checks, close(grad_or_zeros(xs[mb]), ref.dx));
    }
    for (auto& [name, p] : moe->named_parameters()) {
      Tensor expected = starts_with(name, "experts.")
                            ? summed.at(name)
                            : ops::add(refs[0][r].grads.at(name), refs[1][r].grads.at(name));
      checks.check(close(grad_or_zeros(p), expected),
                   fmt::format("gradient of {} on rank {}", name, r));
    }
  });
  checks.report();
}

TEST_CASE("expert-parallel phase hooks fire at A B C D around the right collectives", "[ep]") {
  const Config c{2, 4, 2, false};
  constexpr int64_t kLayer = 3;
  RankChecks checks;
  run_ranks(c.ep, [&](ProcessGroupPtr pg) {
    const int r = pg->rank();
    DeviceMesh mesh(pg, {c.ep}, {"ep"}, {}, test::test_device());
    ProcessGroupPtr group = mesh.get_group();
    std::vector<std::pair<std::string, uint64_t>> events;
    std::vector<int64_t> layers;
    auto probe = [&](const char* point) {
      return [&, point](int64_t layer, const Tensor& x) {
        layers.push_back(layer);
        auto fn = std::make_shared<Probe>();
        fn->point = point;
        fn->group = group;
        fn->events = &events;
        return Function::apply(fn, {x})[0];
      };
    };
    MoEPhaseHooks hooks;
    hooks.before_dispatch = probe("A");
    hooks.before_experts = probe("B");
    hooks.before_combine = probe("C");
    hooks.after_combine = probe("D");
    auto moe = make_moe(c);
    auto plain = make_moe(c);
    moe->to(test::test_device());
    plain->to(test::test_device());
    expert_parallel(moe, mesh, hooks, kLayer);
    expert_parallel(plain, mesh);

    Tensor x = test::on_test_device(batch(c, r));
    set_requires_grad(x);
    std::vector<Tensor> out = moe->call(Args{x});
    const uint64_t after_forward = group->ledger().size();
    backward(loss_of(out, test::on_test_device(loss_weights(r))));
    const uint64_t after_backward = group->ledger().size();
    std::vector<Tensor> ref = plain->call(Args{test::on_test_device(batch(c, r))});
    RANK_CHECK(checks, close(out[0], ref[0]));

    std::vector<std::string> order;
    std::map<std::string, uint64_t> at;
    for (auto& [point, issued] : events) {
      order.push_back(point);
      at[point] = issued;
    }
    RANK_CHECK(checks,
               order == std::vector<std::string>{"fA", "fB", "fC", "fD", "bD", "bC", "bB", "bA"});
    RANK_CHECK(checks, layers == std::vector<int64_t>(4, kLayer));
    // Forward: counts and tokens between A and B, nothing between B and C,
    // the combine between C and D, nothing after D.
    RANK_CHECK(checks, at["fB"] - at["fA"] == 2);
    RANK_CHECK(checks, at["fC"] - at["fB"] == 0);
    RANK_CHECK(checks, at["fD"] - at["fC"] == 1);
    RANK_CHECK(checks, after_forward - at["fD"] == 0);
    // Backward: the reverse combine between D and C, the reverse dispatch
    // between B and A, nothing else.
    RANK_CHECK(checks, at["bD"] - after_forward == 0);
    RANK_CHECK(checks, at["bC"] - at["bD"] == 1);
    RANK_CHECK(checks, at["bB"] - at["bC"] == 0);
    RANK_CHECK(checks, at["bA"] - at["bB"] == 1);
    RANK_CHECK(checks, after_backward - at["bA"] == 0);
  });
  checks.report();
}

TEST_CASE("expert parallel rejects E not divisible by ep", "[ep]") {
  RankChecks checks;
  run_ranks(4, [&](ProcessGroupPtr pg) {
    DeviceMesh mesh(pg, {4}, {"ep"}, {}, test::test_device());
    Generator gen(kSeed);
    auto moe = nn::make<nn::MoE>(
        {.d_model = kModel, .hidden = kHidden, .num_experts = 6, .top_k = 2}, gen);
    moe->to(test::test_device());
    RANK_CHECK_THROWS_WITH(checks, expert_parallel(moe, mesh),
                           "expected num_experts divisible by ep");
    // Nothing changed: all experts are still here and the local forward runs.
    RANK_CHECK(checks, moe->num_local_experts() == 6 && moe->dispatcher() == nullptr);
    RANK_CHECK(
        checks,
        moe->call(Args{ops::ones({3, kModel}, DType::F32, test::test_device())}).size() == 2);
  });
  checks.report();
}

TEST_CASE("expert parallel on a 2-D mesh uses the ep dim; sharded experts refuse local forward",
          "[ep]") {
  RankChecks checks;
  run_ranks(4, [&](ProcessGroupPtr pg) {
    const int r = pg->rank();
    DeviceMesh mesh(pg, {2, 2}, {"dp", "ep"}, {}, test::test_device());
    const Config c{2, 4, 1, false};
    auto moe = make_moe(c);
    moe->to(test::test_device());
    ExpertParallel style;
    style.apply(*moe, mesh);
    const int ep_rank = mesh.get_local_rank("ep");
    RANK_CHECK(checks, moe->first_local_expert() == 2 * ep_rank);
    // Each (dp) replica of the ep pair is its own expert-parallel group.
    Tensor x = batch(c, ep_rank, static_cast<uint64_t>(r / 2));
    auto local = make_moe(c);  // on the CPU: the reference
    RANK_CHECK(checks, close(moe->call(Args{test::on_test_device(x)})[0], local->call(Args{x})[0]));
    RANK_CHECK_THROWS_WITH(checks, style.apply(*moe, mesh), "expected an MoE with all 4 experts");
    RANK_CHECK_THROWS_WITH(checks, moe->expert(2 * (1 - ep_rank)), "expected a local expert");

    Generator gen(kSeed);
    auto partial = nn::make<nn::MoE>(
        {.d_model = kModel, .hidden = kHidden, .num_experts = 4, .top_k = 1}, gen);
    partial->to(test::test_device());
    partial->keep_experts(0, 2);
    RANK_CHECK_THROWS_WITH(
        checks, partial->call(Args{ops::ones({3, kModel}, DType::F32, test::test_device())}),
        "expected all 4 experts on this rank or a dispatcher");
  });
  checks.report();
}
