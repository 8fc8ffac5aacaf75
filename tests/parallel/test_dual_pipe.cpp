// Dual-pipe overlap: the forward of micro-batch i+1 and the backward of
// micro-batch i run in tandem under the hook coordinator, with expert-parallel
// MoE layers whose all-to-alls pair with the other side's compute. Results
// must be bit-identical to the sequential schedule, and every failure must
// end in a clear error, not a hang. The rank threads compute on
// test::test_device() (tests/support/test_device.h).
#include <catch2/catch.hpp>

#include <chrono>
#include <cstring>

#include "tandem/autograd/checkpoint.h"
#include "tandem/autograd/nn/transformer.h"
#include "tandem/autograd/ops.h"
#include "tandem/comm/threads/threads_backend.h"
#include "tandem/parallel/dual_pipe.h"
#include "tests/support/rank_checks.h"
#include "tests/support/test_device.h"

using namespace tandem;

namespace {

nn::TransformerLMConfig moe_config(int layers, int experts) {
  nn::TransformerLMConfig c;
  c.vocab = 17;
  c.d_model = 16;
  c.layers = layers;
  c.heads = 2;
  c.hidden = 32;
  c.max_seq = 8;
  c.experts = experts;
  c.top_k = 2;
  return c;
}

// Micro-batch i of rank r: deterministic tokens, on the test device.
std::pair<Tensor, Tensor> batch(int rank, int i, int64_t seq) {
  Generator g(1000 + 31 * rank + i);
  Tensor t = ops::to(ops::mul(ops::rand({2, seq + 1}, g), 17.0), DType::I64);
  return {test::on_test_device(ops::contiguous(ops::narrow(t, 1, 0, seq))),
          test::on_test_device(ops::contiguous(ops::narrow(t, 1, 1, seq)))};
}

struct Run {
  std::vector<double> losses;
  std::vector<Tensor> grads;
  uint64_t ledger = 0;
};

Run train_step(ProcessGroupPtr pg, int layers, bool overlap, int micro_batches,
               const std::function<void(int, bool)>& inject = {}, bool recompute = false) {
  DeviceMesh mesh(pg, {pg->size()}, {"ep"}, {}, test::test_device());
  // With recompute the backward starts by re-running the whole forward (its
  // hooks are no-ops); the forward gate parks the forward thread meanwhile, so
  // the re-run's collectives never interleave with the forward's.
  Generator init(3);
  auto model = std::make_shared<nn::TransformerLM>(moe_config(layers, 4), init);
  model->to(test::test_device());
  DualPipe pipe(model, mesh, test::test_device(),
                HookCoordinatorOptions{std::chrono::milliseconds(20000), recompute});
  pipe.abort_on_failure(mesh);
  auto forward = [&](int i) {
    if (inject) inject(i, false);
    auto [x, y] = batch(pg->rank(), i, 8);
    std::vector<Tensor> out =
        recompute
            ? checkpoint(
                  [&model](const std::vector<Tensor>& in) { return model->call(Args{in[0]}); }, {x})
            : model->call(Args{x});
    Tensor loss = add(nn::lm_loss(out[0], y), mul(out[1], 0.01));
    loss = div(loss, static_cast<double>(micro_batches));
    if (inject) {
      // A failure in this micro-batch's backward (raised on the backward worker).
      register_hook(loss, [inject, i](const Tensor& g) {
        inject(i, true);
        return g;
      });
    }
    return loss;
  };
  Run r;
  r.losses = pipe.run(micro_batches, forward, overlap).losses;
  for (auto& [name, p] : model->named_parameters())
    r.grads.push_back(grad(p));
  r.ledger = mesh.get_group()->ledger().history_fingerprint();
  return r;
}

}  // namespace

TEST_CASE("dual-pipe role tables pair COMM with COMPUTE", "[dualpipe]") {
  for (int layers : {1, 2, 4}) {
    std::vector<HookRole> f = hook_sequence(layers, false), b = hook_sequence(layers, true);
    CHECK(f.size() == static_cast<size_t>(4 * layers - 1));
    CHECK(b.size() == f.size());
    for (size_t i = 0; i < f.size(); ++i)
      CHECK(f[i] != b[i]);
    CHECK_NOTHROW(check_pairing(layers, layers));
  }
  // Unequal layer counts: the shorter side departs, the longer runs solo.
  CHECK_THAT(check_pairing(2, 4), Catch::Contains("forward side departs"));
  CHECK_THAT(check_pairing(4, 2), Catch::Contains("backward side departs"));
}

TEST_CASE("overlapped schedule is bit-identical to the sequential one", "[dualpipe]") {
  for (int layers : {2, 4}) {
    for (int ep : {2, 4}) {
      INFO("layers=" << layers << " ep=" << ep);
      tandem::testing::RankChecks rc;
      std::vector<uint64_t> ledgers(static_cast<size_t>(ep));
      run_ranks(ep, [&](ProcessGroupPtr pg) {
        Run seq = train_step(pg, layers, false, 4);
        Run ovl = train_step(pg, layers, true, 4);
        RANK_CHECK(rc, seq.losses.size() == ovl.losses.size());
        for (size_t i = 0; i < seq.losses.size(); ++i) {
          RANK_CHECK(rc, std::memcmp(&seq.losses[i], &ovl.losses[i], sizeof(double)) == 0);
        }
        RANK_CHECK(rc, seq.grads.size() == ovl.grads.size());
        for (size_t i = 0; i < seq.grads.size(); ++i) {
          RANK_CHECK(rc, seq.grads[i].defined() && ops::equal(seq.grads[i], ovl.grads[i]));
        }
        ledgers[pg->rank()] = ovl.ledger;
      });
      rc.report();
      // Every rank launched the same collectives in the same order.
      for (uint64_t l : ledgers)
        CHECK(l == ledgers[0]);
    }
  }
}

TEST_CASE("pairs of micro-batches with unequal MoE layer counts", "[dualpipe]") {
  // Even micro-batches run a 2-layer model, odd ones a 4-layer model: each
  // pair [B(i-1) || F(i)] fires 7 and 15 rendezvous (or the reverse); the
  // shorter side departs and the longer one runs on solo.
  CHECK_THAT(check_pairing(2, 4), Catch::Contains("7 paired rounds"));
  tandem::testing::RankChecks rc;
  std::vector<uint64_t> ledgers(2);
  run_ranks(2, [&](ProcessGroupPtr pg) {
    std::vector<std::vector<double>> losses;
    std::vector<std::vector<Tensor>> grads;
    for (bool overlap : {false, true}) {
      DeviceMesh mesh(pg, {2}, {"ep"}, {}, test::test_device());
      auto coordinator = std::make_shared<HookCoordinator>(
          HookCoordinatorOptions{std::chrono::milliseconds(20000), false});
      Generator init(3);
      auto small = std::make_shared<nn::TransformerLM>(moe_config(2, 4), init);
      auto large = std::make_shared<nn::TransformerLM>(moe_config(4, 4), init);
      small->to(test::test_device());
      large->to(test::test_device());
      install_dual_pipe(small, mesh, coordinator);
      install_dual_pipe(large, mesh, coordinator);
      DualPipeSchedule schedule(coordinator, test::test_device());
      schedule.abort_on_failure({mesh.get_group()});
      auto forward = [&](int i) {
        auto [x, y] = batch(pg->rank(), i, 8);
        auto& model = i % 2 == 0 ? small : large;
        std::vector<Tensor> out = model->call(Args{x});
        return add(nn::lm_loss(out[0], y), mul(out[1], 0.01));
      };
      losses.push_back(schedule.run(4, forward, overlap).losses);
      std::vector<Tensor> g;
      for (auto& m : {small, large}) {
        for (auto& [name, p] : m->named_parameters())
          g.push_back(grad(p));
      }
      grads.push_back(g);
      if (overlap) ledgers[pg->rank()] = mesh.get_group()->ledger().history_fingerprint();
    }
    RANK_CHECK(rc, losses[0] == losses[1]);
    for (size_t i = 0; i < grads[0].size(); ++i)
      RANK_CHECK(rc, ops::equal(grads[0][i], grads[1][i]));
  });
  rc.report();
  CHECK(ledgers[0] == ledgers[1]);
}

TEST_CASE("recompute under the dual-pipe schedule is bit-identical too", "[dualpipe]") {
  tandem::testing::RankChecks rc;
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Run plain = train_step(pg, 2, false, 3);
    Run recomputed = train_step(pg, 2, true, 3, {}, true);
    for (size_t i = 0; i < plain.losses.size(); ++i) {
      RANK_CHECK(rc, plain.losses[i] == recomputed.losses[i]);
    }
    for (size_t i = 0; i < plain.grads.size(); ++i) {
      RANK_CHECK(rc, recomputed.grads[i].defined() == plain.grads[i].defined());
      RANK_CHECK(rc, ops::equal(plain.grads[i], recomputed.grads[i]));
    }
  });
  rc.report();
}

TEST_CASE("dual-pipe failures end in an error on the caller, never a hang", "[dualpipe]") {
  for (bool in_backward : {false, true}) {
    INFO("failure in " << (in_backward ? "backward" : "forward"));
    auto start = std::chrono::steady_clock::now();
    std::string message;
    try {
      run_ranks(2, [&](ProcessGroupPtr pg) {
        // Micro-batch 2's forward (or micro-batch 1's backward, through a
        // hook on the loss) throws on rank 1 while the other side runs.
        const int rank = pg->rank();
        train_step(pg, 2, true, 3, [rank, in_backward](int i, bool backward_side) {
          if (rank == 1 && i == 1 && backward_side == in_backward) {
            throw Error(backward_side ? "injected failure in backward"
                                      : "injected failure in forward");
          }
        });
      });
    } catch (const std::exception& e) {
      message = e.what();
    }
    double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CHECK_THAT(message, Catch::Contains("injected failure"));
    CHECK(seconds < 15.0);
  }
}

TEST_CASE("a coordinator timeout reaches the caller with both sides' last hooks", "[dualpipe]") {
  auto coordinator = std::make_shared<HookCoordinator>(
      HookCoordinatorOptions{std::chrono::milliseconds(200), false});
  coordinator->enable();
  WorkerPair pair;
  std::string message;
  try {
    pair.run(
        [&] {
          coordinator->rendezvous(HookRole::Comm, HookInfo{"A:dispatch", 0, false, 1});
        },
        [&] {
          // The backward side never arrives at the barrier.
          std::this_thread::sleep_for(std::chrono::milliseconds(600));
        },
        [&] { coordinator->disable(); });
  } catch (const std::exception& e) {
    message = e.what();
  }
  CHECK_THAT(message, Catch::Contains("A:dispatch"));
}
