// Bucketed, overlapped data parallelism (parallel/ddp.h, Note [DDP buckets]):
// the gradients equal reduce_gradients()'s bit for bit and the single-rank
// model's within rounding; buckets launch during the backward, in backward
// order; accumulation over micro-batches reduces once; unused parameters and
// misuse are handled. Ranks train on test_device().
#include <catch2/catch.hpp>

#include <memory>
#include <string>
#include <vector>

#include "tandem/autograd/grad_ready.h"
#include "tandem/autograd/nn/container.h"
#include "tandem/autograd/nn/linear.h"
#include "tandem/autograd/ops.h"
#include "tandem/comm/threads/threads_backend.h"
#include "tandem/parallel/data_parallel.h"
#include "tandem/parallel/ddp.h"
#include "tests/support/rank_checks.h"
#include "tests/support/test_device.h"

using namespace tandem;
using Catch::Matchers::Contains;

namespace {

constexpr int kRanks = 4;
constexpr int64_t kWidth = 32, kBatch = 3;

// Four Linear layers applied in turn (8 parameters: weights of 4 KiB,
// biases of 128 bytes).
class Mlp final : public Module {
 public:
  explicit Mlp(Generator& gen) : Module("Mlp") {
    for (int i = 0; i < 4; ++i) {
      layers_.push_back(register_module(
          "l" + std::to_string(i),
          nn::make<nn::Linear>({.in_features = kWidth, .out_features = kWidth}, gen)));
    }
  }
  nn::Linear& layer(int i) { return *layers_[static_cast<size_t>(i)]; }

 protected:
  std::vector<Tensor> forward(Args& args) override {
    Tensor h = nn::single_input(args, "Mlp");
    for (auto& l : layers_)
      h = (*l)(h);
    return {h};
  }

 private:
  std::vector<std::shared_ptr<nn::Linear>> layers_;
};

// The same weights on every rank.
std::shared_ptr<Mlp> make_model() {
  Generator gen(3);
  auto m = std::make_shared<Mlp>(gen);
  m->to(test::test_device());
  return m;
}

// Rank r's batch (its rows of the global batch of kRanks * kBatch).
Tensor batch_of(int rank, int micro = 0) {
  Generator gen(100 + static_cast<uint64_t>(micro));
  Tensor all = ops::randn({kRanks * kBatch, kWidth}, gen);
  return test::on_test_device(ops::narrow(all, 0, rank * kBatch, kBatch));
}

Tensor loss_of(Mlp& m, const Tensor& x) {
  return sum(mul(tanh((m)(x)), 0.5));
}

std::vector<Tensor> params_of(const Mlp& m) {
  std::vector<Tensor> out;
  for (const auto& [name, p] : m.named_parameters())
    out.push_back(p);
  return out;
}

}  // namespace

TEST_CASE("DDP gives reduce_gradients' bits and the one-rank gradient", "[ddp]") {
  // The one-rank model on the whole batch.
  auto whole = make_model();
  backward(loss_of(
      *whole, test::on_test_device(ops::cat({test::on_cpu(batch_of(0)), test::on_cpu(batch_of(1)),
                                             test::on_cpu(batch_of(2)), test::on_cpu(batch_of(3))},
                                            0))));
  std::vector<Tensor> want;
  for (const Tensor& p : params_of(*whole))
    want.push_back(test::on_cpu(grad(p)));

  for (int64_t bucket_bytes : {int64_t{1} << 30, int64_t{4224}, int64_t{1}}) {
    INFO("bucket bytes " << bucket_bytes);
    tandem::testing::RankChecks rc;
    run_ranks(kRanks, [&](ProcessGroupPtr pg) {
      DeviceMesh mesh(pg, {kRanks}, {"dp"}, {}, test::test_device());
      auto model = make_model(), reference = make_model();
      DistributedDataParallel ddp(model->named_parameters(), mesh, {"dp"},
                                  {.bucket_bytes = bucket_bytes});
      // All in one; a layer's bias and weight (128 + 4096 bytes) per bucket;
      // one parameter per bucket.
      const int expected_buckets = bucket_bytes > 100000 ? 1 : bucket_bytes == 1 ? 8 : 4;
      RANK_CHECK(rc, ddp.num_buckets() == expected_buckets);
      backward(loss_of(*model, batch_of(pg->rank())));
      // Every bucket launched during the backward: every parameter was used.
      RANK_CHECK(rc, ddp.launched() == ddp.num_buckets());
      ddp.finish();
      backward(loss_of(*reference, batch_of(pg->rank())));
      reduce_gradients(params_of(*reference), mesh, {"dp"});
      const std::vector<Tensor> got = params_of(*model), ref = params_of(*reference);
      for (size_t i = 0; i < got.size(); ++i) {
        RANK_CHECK(rc, ops::equal(test::on_cpu(grad(got[i])), test::on_cpu(grad(ref[i]))));
        RANK_CHECK(rc, ops::allclose(test::on_cpu(grad(got[i])), want[i], 1e-5, 1e-6));
      }
    });
    rc.report();
  }
}

TEST_CASE("DDP launches each bucket during the backward, last layer first", "[ddp]") {
  tandem::testing::RankChecks rc;
  run_ranks(kRanks, [&](ProcessGroupPtr pg) {
    DeviceMesh mesh(pg, {kRanks}, {"dp"}, {}, test::test_device());
    auto model = make_model();
    const auto named = model->named_parameters();
    // One bucket per parameter; the first layer's weight is the last
    // gradient the backward produces.
    std::vector<int> launched_before;
    DistributedDataParallel* ddp_ptr = nullptr;
    const int h = register_grad_ready_hook(named.front().second, [&](const Tensor&) {
      launched_before.push_back(ddp_ptr->launched());
    });
    {
      DistributedDataParallel ddp(named, mesh, {"dp"}, {.bucket_bytes = 1});
      ddp_ptr = &ddp;
      Ledger& ledger = mesh.group_over({"dp"})->ledger();
      const uint64_t ledger_before = ledger.size();
      backward(loss_of(*model, batch_of(pg->rank())));
      // When the first layer's weight was ready, every other bucket (the 7
      // later parameters) had launched: the reductions ran behind the rest
      // of the backward.
      RANK_CHECK(rc, launched_before == std::vector<int>{7});
      RANK_CHECK(rc, ledger.size() - ledger_before == 8);
      ddp.finish();
      RANK_CHECK(rc, ledger.size() - ledger_before == 8);  // nothing left for finish
    }
    remove_grad_ready_hook(h);
  });
  rc.report();
}

TEST_CASE("DDP reduces accumulated micro-batches once, unused parameters as zeros", "[ddp]") {
  tandem::testing::RankChecks rc;
  run_ranks(kRanks, [&](ProcessGroupPtr pg) {
    DeviceMesh mesh(pg, {kRanks}, {"dp"}, {}, test::test_device());
    auto model = make_model(), reference = make_model();
    DistributedDataParallel ddp(model->named_parameters(), mesh, {"dp"}, {.bucket_bytes = 4224});
    Ledger& ledger = mesh.group_over({"dp"})->ledger();
    const uint64_t before = ledger.size();
    ddp.set_sync(false);
    backward(loss_of(*model, batch_of(pg->rank(), 0)));
    RANK_CHECK(rc, ddp.launched() == 0);
    RANK_CHECK(rc, ledger.size() == before);  // accumulating: no collective
    ddp.set_sync(true);
    backward(loss_of(*model, batch_of(pg->rank(), 1)));
    ddp.finish();
    RANK_CHECK(rc, ledger.size() - before == static_cast<uint64_t>(ddp.num_buckets()));
    backward(loss_of(*reference, batch_of(pg->rank(), 0)));
    backward(loss_of(*reference, batch_of(pg->rank(), 1)));
    reduce_gradients(params_of(*reference), mesh, {"dp"});
    const std::vector<Tensor> got = params_of(*model), ref = params_of(*reference);
    for (size_t i = 0; i < got.size(); ++i)
      RANK_CHECK(rc, ops::equal(test::on_cpu(grad(got[i])), test::on_cpu(grad(ref[i]))));

    // Only the last two layers used: the first layers' buckets (launched
    // last) wait for finish(), which reduces zeros for them.
    for (const Tensor& p : got)
      zero_grad(p);
    const Tensor x = batch_of(pg->rank());
    backward(sum(model->layer(3)(model->layer(2)(x))));
    RANK_CHECK(rc, ddp.launched() > 0 && ddp.launched() < ddp.num_buckets());
    ddp.finish();
    RANK_CHECK(rc, ops::equal(test::on_cpu(grad(got[0])), ops::zeros_like(test::on_cpu(got[0]))));
    RANK_CHECK(rc, grad(got[7]).defined());

    // A second sync backward before finish(): its gradients would miss the
    // reductions already launched.
    backward(loss_of(*model, x));
    RANK_CHECK_THROWS_WITH(rc, backward(loss_of(*model, x)),
                           "arrived after its bucket was reduced");
  });
  rc.report();
}

TEST_CASE("DDP sums bf16 gradients in f32 when asked, rounding once", "[ddp][bf16]") {
  constexpr int kN = 64;
  tandem::testing::RankChecks rc;
  run_ranks(kRanks, [&](ProcessGroupPtr pg) {
    DeviceMesh mesh(pg, {kRanks}, {"dp"}, {}, test::test_device());
    Tensor p = test::on_test_device(ops::zeros({kN}, DType::BF16));
    set_requires_grad(p);
    DistributedDataParallel ddp({{"p", p}}, mesh, {"dp"}, {.reduce_dtype = DType::F32});
    // Each rank's gradient: 1 + r/256, exact in bf16; their sum in f32,
    // rounded once, differs from a bf16 running sum.
    std::vector<Tensor> mine;
    for (int r = 0; r < kRanks; ++r)
      mine.push_back(ops::full({kN}, 1.0 + r / 256.0, DType::F32));
    backward(sum(mul(p, test::on_test_device(ops::to(mine[pg->rank()], DType::BF16)))));
    ddp.finish();
    Tensor want =
        ops::to(ops::add(ops::add(mine[0], mine[1]), ops::add(mine[2], mine[3])), DType::BF16);
    RANK_CHECK(rc, grad(p).dtype() == DType::BF16);
    RANK_CHECK(rc, ops::equal(test::on_cpu(grad(p)), want));
  });
  rc.report();
}
