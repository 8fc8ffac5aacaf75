// ZeRO-1 (parallel/zero.h, Note [ZeRO-1]): the optimizer state of each
// parameter lives once over the data ranks, and the parameters after its
// steps are the bits of a plain AdamW's on the same reduced gradients,
// uneven, empty and 0-d row blocks included. Ranks run on test_device().
#include <catch2/catch.hpp>

#include <map>
#include <string>
#include <vector>

#include "tandem/autograd/ops.h"
#include "tandem/comm/threads/threads_backend.h"
#include "tandem/parallel/data_parallel.h"
#include "tandem/parallel/zero.h"
#include "tests/support/rank_checks.h"
#include "tests/support/test_device.h"

using namespace tandem;
using Catch::Matchers::Contains;

namespace {

// Shapes whose rows split over 4 ranks as 3/3/3/1, 1/1/1/0, 1/1/0/0 and a
// 0-d scalar on rank 0 alone.
const std::vector<Shape> kShapes = {{10, 3}, {3}, {2, 5}, {}};

optim::NamedParams make_params() {
  Generator gen(5);  // the same values on every rank
  optim::NamedParams params;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    Tensor p = test::on_test_device(ops::randn(kShapes[i], gen));
    set_requires_grad(p);
    params.emplace_back("p" + std::to_string(i), p);
  }
  return params;
}

// Rank r's gradients at step s, summed over the ranks by reduce_gradients.
void set_gradients(const optim::NamedParams& params, int rank, int step) {
  Generator gen(1000 + 17 * static_cast<uint64_t>(rank) + static_cast<uint64_t>(step));
  for (const auto& [name, p] : params)
    set_grad(p, test::on_test_device(ops::randn(p.shape(), gen)));
}

}  // namespace

TEST_CASE("ZeRO-1 updates the parameters bit-identically to AdamW, with 1/N of its state",
          "[zero]") {
  constexpr int kRanks = 4, kSteps = 3;
  tandem::testing::RankChecks rc;
  run_ranks(kRanks, [&](ProcessGroupPtr pg) {
    DeviceMesh mesh(pg, {kRanks}, {"dp"}, {}, test::test_device());
    const optim::NamedParams sharded = make_params(), plain = make_params();
    const optim::AdamWOptions options{.lr = 1e-2, .weight_decay = 0.1};
    ZeroRedundancyOptimizer zero(sharded, mesh, "dp", options);
    optim::AdamW reference(plain, options);
    for (int s = 0; s < kSteps; ++s) {
      for (const optim::NamedParams* params : {&sharded, &plain}) {
        set_gradients(*params, pg->rank(), s);
        std::vector<Tensor> tensors;
        for (const auto& [name, p] : *params)
          tensors.push_back(p);
        reduce_gradients(tensors, mesh, {"dp"});
      }
      zero.step();
      zero.zero_grad();
      reference.step();
      reference.zero_grad();
    }
    for (size_t i = 0; i < plain.size(); ++i)
      RANK_CHECK(rc, ops::equal(test::on_cpu(sharded[i].second), test::on_cpu(plain[i].second)));
    // This rank's rows: 3 + 1 + 1 + 1 of 10 + 3 + 2 + 1 rows on rank 0.
    const auto [start, length] = zero.rows_of("p0");
    RANK_CHECK(rc, start == 3 * pg->rank() && length == (pg->rank() < 3 ? 3 : 1));
    int64_t full_state = 0;
    for (const auto& [key, t] : reference.state_dict())
      full_state += static_cast<int64_t>(t.nbytes());
    RANK_CHECK(rc, zero.state_bytes() < full_state / 2);
    WorkPtr total = pg->all_reduce(
        ops::from_vector(std::vector<double>{static_cast<double>(zero.state_bytes())}, Shape{1}));
    total->wait();
    // Every moment buffer once over the ranks; each rank also has its step
    // counters (one per parameter) and the learning rate.
    const double moments = total->result().to_vector<double>()[0];
    RANK_CHECK(rc, moments >= 2.0 * 4 * (30 + 3 + 10 + 1));
    RANK_CHECK(rc, moments <= 2.0 * 4 * (30 + 3 + 10 + 1) + kRanks * (4 * 8 + 8));
  });
  rc.report();
}

TEST_CASE("ZeRO-1 refuses what it cannot shard", "[zero]") {
  tandem::testing::RankChecks rc;
  run_ranks(2, [&](ProcessGroupPtr pg) {
    DeviceMesh mesh(pg, {2}, {"dp"}, {}, test::test_device());
    optim::NamedParams params = make_params();
    RANK_CHECK_THROWS_WITH(rc, ZeroRedundancyOptimizer(params, mesh, "tp", {}), "dp");
    Tensor frozen = test::on_test_device(ops::zeros({2}));
    RANK_CHECK_THROWS_WITH(rc, ZeroRedundancyOptimizer({{"frozen", frozen}}, mesh, "dp", {}),
                           "'frozen' without");
  });
  rc.report();
}
