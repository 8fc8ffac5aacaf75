// parallel/collectives.h: the launchers along any dim with uneven and empty
// lengths against references built from every rank's tensor on the test
// thread, the gradients of the differentiable forms by the adjoint identity,
// the Exchange's three nodes, and the errors for bad lengths (raised before
// any collective is issued, so no rank hangs).
#include <catch2/catch.hpp>

#include <numeric>

#include "tandem/autograd/node.h"
#include "tandem/autograd/ops.h"
#include "tandem/comm/threads/threads_backend.h"
#include "tandem/parallel/collectives.h"
#include "tests/support/rank_checks.h"
#include "tests/support/test_device.h"

using namespace tandem;

namespace {

// Rank r's tensor: `shape` with extent lengths[r] along `dim`.
Tensor rank_tensor(int r, Shape shape, int64_t dim, const std::vector<int64_t>& lengths) {
  shape[static_cast<int>(dim)] = lengths[static_cast<size_t>(r)];
  Generator gen(static_cast<uint64_t>(100 + r));
  return ops::randn(shape, gen);
}

bool same(const Tensor& got, const Tensor& want) {
  return got.shape() == want.shape() && ops::equal(test::on_cpu(got), want);
}

// The length lists the cases try on n ranks: even, uneven, and with empty
// ranks (the last ones, as chunk semantics make them).
std::vector<std::vector<int64_t>> length_cases(int n) {
  std::vector<std::vector<int64_t>> cases;
  cases.push_back(std::vector<int64_t>(static_cast<size_t>(n), 2));
  std::vector<int64_t> uneven;
  for (int r = 0; r < n; ++r)
    uneven.push_back(3 - r % 3);
  cases.push_back(uneven);
  std::vector<int64_t> empty_tail(static_cast<size_t>(n), 0);
  empty_tail[0] = 1;
  cases.push_back(empty_tail);
  return cases;
}

}  // namespace

TEST_CASE("launch_all_gather joins every rank's block along any dim", "[collectives]") {
  const Shape base{2, 3, 4};
  for (int n : {1, 2, 3, 4}) {
    for (const std::vector<int64_t>& lengths : length_cases(n)) {
      for (int64_t dim : {0, 1, 2}) {
        INFO("n=" << n << " dim=" << dim << " lengths=" << lengths[0] << "," << lengths.back());
        std::vector<Tensor> all;
        for (int r = 0; r < n; ++r)
          all.push_back(rank_tensor(r, base, dim, lengths));
        const Tensor want = ops::cat(all, dim);
        tandem::testing::RankChecks rc;
        run_ranks(n, [&](ProcessGroupPtr pg) {
          Tensor x = test::on_test_device(all[static_cast<size_t>(pg->rank())]);
          RANK_CHECK(rc, same(launch_all_gather(x, pg, dim, lengths).wait(), want));
          // The differentiable form gives the same values.
          RANK_CHECK(rc, same(all_gather_dim(x, pg, dim, lengths), want));
        });
        rc.report();
      }
    }
  }
}

TEST_CASE("launch_reduce_scatter keeps this rank's block of the sum", "[collectives]") {
  const Shape base{2, 3, 4};
  for (int n : {1, 2, 3, 4}) {
    for (const std::vector<int64_t>& lengths : length_cases(n)) {
      const int64_t total = std::accumulate(lengths.begin(), lengths.end(), int64_t{0});
      for (int64_t dim : {0, 1, 2}) {
        INFO("n=" << n << " dim=" << dim);
        Shape full = base;
        full[static_cast<int>(dim)] = total;
        std::vector<Tensor> inputs;
        Tensor sum = ops::zeros(full);
        for (int r = 0; r < n; ++r) {
          Generator gen(static_cast<uint64_t>(7 + r));
          inputs.push_back(ops::randn(full, gen));
          sum = ops::add(sum, inputs.back());
        }
        tandem::testing::RankChecks rc;
        run_ranks(n, [&](ProcessGroupPtr pg) {
          const int r = pg->rank();
          int64_t offset = 0;
          for (int i = 0; i < r; ++i)
            offset += lengths[static_cast<size_t>(i)];
          Tensor want =
              ops::contiguous(ops::narrow(sum, dim, offset, lengths[static_cast<size_t>(r)]));
          Tensor x = test::on_test_device(inputs[static_cast<size_t>(r)]);
          Tensor got = launch_reduce_scatter(x, pg, dim, lengths).wait();
          RANK_CHECK(rc, got.shape() == want.shape() &&
                             ops::allclose(test::on_cpu(got), want, 1e-6, 1e-6));
        });
        rc.report();
      }
    }
  }
}

TEST_CASE("launch_all_to_all scatters one dim and gathers another, uneven both ways",
          "[collectives]") {
  // Rank r holds (recv[r] along gd) x (the whole scattered dim sd); it sends
  // rank j its piece send[j] of sd, and gets back every rank's block of gd.
  const Shape base{2, 3, 4};
  for (int n : {1, 2, 3, 4}) {
    for (const std::vector<int64_t>& send : length_cases(n)) {
      for (const std::vector<int64_t>& recv : length_cases(n)) {
        for (auto [sd, gd] : std::vector<std::pair<int64_t, int64_t>>{
                 {0, 1}, {1, 0}, {2, 1}, {1, 2}, {0, 2}, {2, 0}}) {
          INFO("n=" << n << " sd=" << sd << " gd=" << gd);
          const int64_t scattered = std::accumulate(send.begin(), send.end(), int64_t{0});
          Shape shape = base;
          shape[static_cast<int>(sd)] = scattered;
          std::vector<Tensor> inputs;
          for (int r = 0; r < n; ++r)
            inputs.push_back(rank_tensor(r, shape, gd, recv));
          tandem::testing::RankChecks rc;
          run_ranks(n, [&](ProcessGroupPtr pg) {
            const int me = pg->rank();
            int64_t my_offset = 0;
            for (int j = 0; j < me; ++j)
              my_offset += send[static_cast<size_t>(j)];
            std::vector<Tensor> parts;
            for (int r = 0; r < n; ++r)
              parts.push_back(ops::narrow(inputs[static_cast<size_t>(r)], sd, my_offset,
                                          send[static_cast<size_t>(me)]));
            const Tensor want = ops::cat(parts, gd);
            Tensor x = test::on_test_device(inputs[static_cast<size_t>(me)]);
            RANK_CHECK(rc, same(launch_all_to_all(x, pg, sd, gd, send, recv).wait(), want));
            RANK_CHECK(rc, same(all_to_all_dims(x, pg, sd, gd, send, recv), want));
            // A non-contiguous input packs the same.
            Tensor t = ops::transpose(ops::contiguous(ops::transpose(x, 0, 2)), 0, 2);
            RANK_CHECK(rc, same(launch_all_to_all(t, pg, sd, gd, send, recv).wait(), want));
          });
          rc.report();
        }
      }
    }
  }
}

TEST_CASE("launch_all_to_all with one dim both ways sends rows", "[collectives]") {
  for (int n : {1, 2, 3}) {
    tandem::testing::RankChecks rc;
    // rows[s][d]: rows rank s sends rank d.
    auto rows = [](int s, int d) { return static_cast<int64_t>((s + 2 * d) % 3); };
    run_ranks(n, [&](ProcessGroupPtr pg) {
      const int me = pg->rank();
      std::vector<int64_t> send, recv;
      for (int r = 0; r < n; ++r) {
        send.push_back(rows(me, r));
        recv.push_back(rows(r, me));
      }
      const int64_t total = std::accumulate(send.begin(), send.end(), int64_t{0});
      // Row value: 100 * sender + destination.
      std::vector<float> values;
      for (int d = 0; d < n; ++d)
        for (int64_t i = 0; i < rows(me, d); ++i)
          values.insert(values.end(), {100.f * me + d, 100.f * me + d});
      Tensor x = test::on_test_device(ops::from_vector(values, Shape{total, 2}));
      std::vector<float> expected;
      for (int s = 0; s < n; ++s)
        for (int64_t i = 0; i < rows(s, me); ++i)
          expected.insert(expected.end(), {100.f * s + me, 100.f * s + me});
      const int64_t got_rows = std::accumulate(recv.begin(), recv.end(), int64_t{0});
      RANK_CHECK(rc, same(launch_all_to_all(x, pg, 0, 0, send, recv).wait(),
                          ops::from_vector(expected, Shape{got_rows, 2})));
    });
    rc.report();
  }
}

TEST_CASE("the differentiable collectives' gradients are their adjoints", "[collectives]") {
  // <A x, w> summed over ranks equals <x, A^T w> summed over ranks, where
  // A^T w is the gradient backward computes.
  const int n = 3;
  const std::vector<int64_t> lengths = {2, 0, 3};
  using Op = std::function<Tensor(const Tensor&, const ProcessGroupPtr&)>;
  struct Case {
    const char* name;
    Shape shape;  // of rank r's input with extent lengths[r] along dim 1
    Op op;
  };
  std::vector<Case> cases = {
      {"all_gather_dim",
       {2, 0, 3},
       [&](const Tensor& x, const ProcessGroupPtr& g) { return all_gather_dim(x, g, 1, lengths); }},
      {"reduce_scatter_dim",
       {2, 5, 3},
       [&](const Tensor& x, const ProcessGroupPtr& g) {
         return reduce_scatter_dim(x, g, 1, lengths);
       }},
      {"all_to_all_dims",
       {2, 0, 6},
       [&](const Tensor& x, const ProcessGroupPtr& g) {
         return all_to_all_dims(x, g, 2, 1, {}, lengths);
       }},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    std::vector<double> forward(n), adjoint(n);
    run_ranks(n, [&](ProcessGroupPtr pg) {
      const int r = pg->rank();
      Shape shape = c.shape;
      if (shape[1] == 0) shape[1] = lengths[static_cast<size_t>(r)];
      Generator gen(static_cast<uint64_t>(50 + r));
      Tensor x = test::on_test_device(ops::randn(shape, gen));
      set_requires_grad(x);
      Tensor y = c.op(x, pg);
      Tensor w = test::on_test_device(ops::randn(y.shape(), gen));
      backward(sum(mul(y, w)));
      forward[static_cast<size_t>(r)] =
          ops::sum(ops::mul(test::on_cpu(y), test::on_cpu(w))).to_vector<float>()[0];
      adjoint[static_cast<size_t>(r)] =
          ops::sum(ops::mul(test::on_cpu(x), test::on_cpu(grad(x)))).to_vector<float>()[0];
    });
    const double f = std::accumulate(forward.begin(), forward.end(), 0.0);
    const double a = std::accumulate(adjoint.begin(), adjoint.end(), 0.0);
    CHECK(f == Approx(a).epsilon(1e-5));
    CHECK(std::abs(f) > 1e-3);  // the identity is not vacuous
  }
}

TEST_CASE("an Exchange launches in forward and backward where its nodes sit", "[collectives]") {
  const int n = 2;
  const std::vector<int64_t> lengths = {3, 1};
  tandem::testing::RankChecks rc;
  run_ranks(n, [&](ProcessGroupPtr pg) {
    const int r = pg->rank();
    Generator gen(static_cast<uint64_t>(9 + r));
    Tensor x = test::on_test_device(ops::randn(Shape{2, lengths[static_cast<size_t>(r)], 4}, gen));
    Tensor w = test::on_test_device(ops::randn(Shape{2, 4, 2}, gen));

    // Reference: the differentiable all-to-all.
    Tensor xr = ops::clone(x);
    set_requires_grad(xr);
    Tensor yr = all_to_all_dims(xr, pg, 2, 1, {}, lengths);
    backward(sum(mul(yr, w)));

    auto ex = std::make_shared<Exchange>();
    ex->what = "the test exchange";
    ex->forward = [&](const Tensor& t) { return launch_all_to_all(t, pg, 2, 1, {}, lengths); };
    ex->backward = [&](const Tensor& g) { return launch_all_to_all(g, pg, 1, 2, lengths, {}); };
    Tensor xe = ops::clone(x);
    set_requires_grad(xe);
    Tensor opened = exchange_open(ex, xe);
    const uint64_t before = pg->ledger().size();
    Tensor in_flight = exchange_launch(ex, opened);
    RANK_CHECK(rc, pg->ledger().size() == before + 1);  // issued by Launch, not by Wait
    Tensor y = exchange_wait(ex, in_flight);
    RANK_CHECK(rc, same(y, test::on_cpu(yr)));
    backward(sum(mul(y, w)));
    RANK_CHECK(rc, pg->ledger().size() == before + 2);  // the reverse one
    RANK_CHECK(rc, same(grad(xe), test::on_cpu(grad(xr))));

    // Misuse is named: a wait without launch, a second start.
    auto idle = std::make_shared<Exchange>(*ex);
    idle->forward_pending = {};
    RANK_CHECK_THROWS_WITH(rc, exchange_wait(idle, in_flight), "launched before its wait");
    NoGradGuard no_grad;
    exchange_start(idle, x);
    RANK_CHECK_THROWS_WITH(rc, exchange_start(idle, x), "started once");
    idle->forward_pending.wait();
  });
  rc.report();
}

TEST_CASE("collectives refuse bad lengths before issuing anything", "[collectives]") {
  tandem::testing::RankChecks rc;
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Tensor x = test::on_test_device(ops::zeros(Shape{2, 3}));
    const uint64_t before = pg->ledger().size();
    RANK_CHECK_THROWS_WITH(rc, launch_all_gather(x, pg, 1, {3}), "expected 2 lengths");
    RANK_CHECK_THROWS_WITH(rc, launch_all_gather(x, pg, 1, {4, 4}), "this rank's length");
    RANK_CHECK_THROWS_WITH(rc, launch_reduce_scatter(x, pg, 1, {1, 1}), "summing to the extent 3");
    RANK_CHECK_THROWS_WITH(rc, launch_reduce_scatter(x, pg, 1), "divisible by the group size");
    RANK_CHECK_THROWS_WITH(rc, launch_all_to_all(x, pg, 1, 0, {-1, 4}), "non-negative");
    RANK_CHECK_THROWS_WITH(rc, launch_all_to_all(x, pg, 0, 0, {1, 1}), "receive lengths");
    RANK_CHECK_THROWS_WITH(rc, all_to_all_dims(x, pg, 1, 1, {1, 2}, {1, 2}),
                           "different scatter and gather dims");
    RANK_CHECK_THROWS_WITH(rc, launch_all_gather(Tensor(), pg, 0), "defined tensor");
    RANK_CHECK_THROWS_WITH(rc, pad_dim(x, 1, 2), "size >= 3");
    RANK_CHECK(rc, pg->ledger().size() == before);
    RANK_CHECK(rc, same(pad_dim(x, 0, 3), ops::zeros(Shape{3, 3})));
  });
  rc.report();
}

// Note [Progress without a waiter]: an Exchange's collectives complete while
// every rank thread only sleeps. Work::wait_finished() drives nothing, so on
// the threads backend they would stay posted and uncopied without the comm
// thread's help, and the bounded wait would report false.
TEST_CASE("an Exchange's collectives progress while no rank waits on them", "[collectives]") {
  const int n = 3;
  const std::vector<int64_t> lengths = {2, 1, 0};
  tandem::testing::RankChecks rc;
  run_ranks(n, [&](ProcessGroupPtr pg) {
    const int r = pg->rank();
    Generator gen(static_cast<uint64_t>(30 + r));
    Tensor x = test::on_test_device(ops::randn(Shape{1, lengths[static_cast<size_t>(r)], 6}, gen));
    Tensor g = test::on_test_device(ops::randn(Shape{1, 3, 2}, gen));
    auto ex = std::make_shared<Exchange>();
    ex->what = "the background exchange";
    ex->forward = [&](const Tensor& t) { return launch_all_to_all(t, pg, 2, 1, {}, lengths); };
    ex->backward = [&](const Tensor& d) { return launch_all_to_all(d, pg, 1, 2, lengths, {}); };
    Tensor xe = ops::clone(x);
    set_requires_grad(xe);
    Tensor opened = exchange_open(ex, xe);
    Tensor in_flight = exchange_launch(ex, opened);
    RANK_CHECK(rc, ex->forward_pending.work->wait_finished(std::chrono::seconds(20)));
    Tensor y = exchange_wait(ex, in_flight);
    RANK_CHECK(rc, same(y, test::on_cpu(all_to_all_dims(x, pg, 2, 1, {}, lengths))));
    // Backward: Launch's backward issues the reverse collective and hands
    // `opened` its in-flight gradient; a hook on that gradient runs before
    // Open's backward waits, and sleeps until the collective completed.
    bool reverse_finished = false;
    register_hook(opened, [&](const Tensor&) {
      reverse_finished = ex->backward_pending.launched() &&
                         ex->backward_pending.work->wait_finished(std::chrono::seconds(20));
      return Tensor();
    });
    backward(sum(mul(y, g)));
    RANK_CHECK(rc, reverse_finished);
    Tensor xr = ops::clone(x);
    set_requires_grad(xr);
    backward(sum(mul(all_to_all_dims(xr, pg, 2, 1, {}, lengths), g)));
    RANK_CHECK(rc, same(grad(xe), test::on_cpu(grad(xr))));
  });
  rc.report();
}
