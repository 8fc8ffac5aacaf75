// Fully sharded data parallelism (parallel/fsdp.h, Note [FSDP]): each rank
// holds its Shard(0) rows of every parameter (uneven and empty shards
// included); the reduced shard gradients and a few AdamW steps equal the
// one-rank model's within rounding, flat and HSDP; the gathered parameters'
// memory is released after the forward and comes back for the backward;
// all-gathers are prefetched and reduce-scatters launched during the
// backward; misuse is refused by name. Ranks train on test_device().
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tandem/autograd/nn/container.h"
#include "tandem/autograd/nn/linear.h"
#include "tandem/autograd/ops.h"
#include "tandem/autograd/optim.h"
#include "tandem/comm/ledger.h"
#include "tandem/comm/threads/threads_backend.h"
#include "tandem/parallel/fsdp.h"
#include "tandem/parallel/param_placement.h"
#include "tandem/parallel/placement.h"
#include "tandem/runtime/allocator.h"
#include "tandem/runtime/trace.h"
#include "tandem/tensor/storage.h"
#include "tests/support/rank_checks.h"
#include "tests/support/test_device.h"

using namespace tandem;
using Catch::Matchers::Contains;

namespace {

constexpr int64_t kIn = 32, kBatch = 3;

// Linear layers 32 -> w[0] -> w[1] -> ..., then tanh and a scale of the
// last width owned by the root itself: weights of 30, 5 and 3 rows over 4
// ranks give shards of 8/8/8/6, 2/2/1/0 and 1/1/1/0 rows. With `unused`, the
// root also owns a parameter the forward never reads (an expert without
// tokens, say): it gets no gradient.
class Stack final : public Module {
 public:
  Stack(const std::vector<int64_t>& widths, Generator& gen, bool unused = false) : Module("Stack") {
    if (unused) {
      unused_ = ops::rand({6, 2}, gen);
      register_parameter("unused", &unused_);
    }
    int64_t in = kIn;
    for (size_t i = 0; i < widths.size(); ++i) {
      layers_.push_back(register_module(
          "l" + std::to_string(i),
          nn::make<nn::Linear>({.in_features = in, .out_features = widths[i]}, gen)));
      in = widths[i];
    }
    scale_ = ops::add(ops::rand({in}, gen), 0.5);
    register_parameter("scale", &scale_);
  }
  std::vector<std::shared_ptr<Module>> blocks() const { return {layers_.begin(), layers_.end()}; }

 protected:
  std::vector<Tensor> forward(Args& args) override {
    Tensor h = nn::single_input(args, "Stack");
    for (auto& l : layers_)
      h = (*l)(h);
    return {mul(tanh(h), scale_)};
  }

 private:
  std::vector<std::shared_ptr<nn::Linear>> layers_;
  Tensor scale_, unused_;
};

const std::vector<int64_t> kWidths = {30, 5, 3};

std::shared_ptr<Stack> make_model(const std::vector<int64_t>& widths = kWidths,
                                  bool unused = false) {
  Generator gen(3);  // the same weights on every rank
  auto m = std::make_shared<Stack>(widths, gen, unused);
  m->to(test::test_device());
  return m;
}

// Data rank r's rows of a global batch of ranks * kBatch rows.
Tensor batch_of(int rank, int ranks, int step = 0) {
  Generator gen(100 + static_cast<uint64_t>(step));
  Tensor all = ops::randn({ranks * kBatch, kIn}, gen);
  return test::on_test_device(ops::narrow(all, 0, rank * kBatch, kBatch));
}

Tensor loss_of(Module& m, const Tensor& x) {
  return sum(m(x));
}

// The one-rank model's parameters after `steps` AdamW steps on the whole
// batch (and its gradients of the last step), by name, on the CPU.
struct Reference {
  std::map<std::string, Tensor> params, grads;
};
Reference one_rank(int ranks, int steps, const std::vector<int64_t>& widths = kWidths) {
  auto model = make_model(widths);
  optim::AdamW opt(model->named_parameters(), {.lr = 1e-2});
  Reference r;
  for (int s = 0; s < steps; ++s) {
    std::vector<Tensor> rows;
    for (int q = 0; q < ranks; ++q)
      rows.push_back(test::on_cpu(batch_of(q, ranks, s)));
    opt.zero_grad();
    backward(loss_of(*model, test::on_test_device(ops::cat(rows, 0))));
    for (const auto& [name, p] : model->named_parameters())
      r.grads[name] = test::on_cpu(grad(p));
    opt.step();
  }
  for (const auto& [name, p] : model->named_parameters())
    r.params[name] = test::on_cpu(p);
  return r;
}

// This rank's rows (chunk semantics over `parts` ranks) of a whole tensor.
Tensor rows_of(const Tensor& whole, int64_t parts, int64_t index) {
  const auto [start, length] = chunk_range(whole.shape()[0], parts, index);
  return ops::narrow(whole, 0, start, length);
}

}  // namespace

TEST_CASE("FSDP shards every parameter and reduces the one-rank gradients", "[fsdp]") {
  constexpr int kRanks = 4, kSteps = 3;
  const Reference want = one_rank(kRanks, kSteps);
  for (bool reshard : {true, false}) {
    INFO("reshard_after_forward " << reshard);
    tandem::testing::RankChecks rc;
    run_ranks(kRanks, [&](ProcessGroupPtr pg) {
      DeviceMesh mesh(pg, {kRanks}, {"dp"}, {}, test::test_device());
      auto model = make_model();
      FullyShardedDataParallel fsdp(model, model->blocks(), mesh,
                                    {.reshard_after_forward = reshard, .op = RedOp::Sum});
      RANK_CHECK(rc, fsdp.num_groups() == 4);  // l0, l1, l2 and the root's scale
      // Each parameter is this rank's rows, recorded as Shard(0) over "dp".
      for (const auto& [name, p] : model->named_parameters()) {
        const Tensor whole = want.params.at(name);
        RANK_CHECK(rc, p.shape()[0] == chunk_range(whole.shape()[0], kRanks, pg->rank()).second);
        auto placed = param_placement(p);
        RANK_CHECK(rc, placed != nullptr && placed->split_over("dp") &&
                           placed->global_shape == whole.shape());
      }
      optim::AdamW opt(model->named_parameters(), {.lr = 1e-2});
      for (int s = 0; s < kSteps; ++s) {
        opt.zero_grad();
        backward(loss_of(*model, batch_of(pg->rank(), kRanks, s)));
        fsdp.finish();
        if (s == kSteps - 1) {
          for (const auto& [name, p] : model->named_parameters()) {
            const Tensor g = grad(p);
            RANK_CHECK(rc, g.defined() && g.shape() == p.shape());
            if (g.defined()) {
              RANK_CHECK(
                  rc, ops::allclose(test::on_cpu(g),
                                    rows_of(want.grads.at(name), kRanks, pg->rank()), 1e-5, 1e-6));
            }
          }
        }
        opt.step();
      }
      // Between steps every module holds its shards again.
      for (const auto& [name, p] : model->named_parameters()) {
        RANK_CHECK(rc,
                   ops::allclose(test::on_cpu(p), rows_of(want.params.at(name), kRanks, pg->rank()),
                                 1e-5, 1e-6));
      }
    });
    rc.report();
  }
}

TEST_CASE("FSDP accumulates micro-batches before one finish()", "[fsdp]") {
  constexpr int kRanks = 4, kMicro = 3;
  // The one-rank gradient of the micro-batches' summed losses. The root's
  // unused parameter holds the root's group (kept gathered after each
  // forward: the backward needs it first) until the next forward.
  auto whole = make_model(kWidths, /*unused=*/true);
  for (int m = 0; m < kMicro; ++m) {
    std::vector<Tensor> rows;
    for (int q = 0; q < kRanks; ++q)
      rows.push_back(test::on_cpu(batch_of(q, kRanks, m)));
    backward(loss_of(*whole, test::on_test_device(ops::cat(rows, 0))));
  }
  tandem::testing::RankChecks rc;
  run_ranks(kRanks, [&](ProcessGroupPtr pg) {
    DeviceMesh mesh(pg, {kRanks}, {"dp"}, {}, test::test_device());
    auto model = make_model(kWidths, /*unused=*/true);
    FullyShardedDataParallel fsdp(model, model->blocks(), mesh, {.op = RedOp::Sum});
    for (int step = 0; step < 3; ++step) {
      model->zero_grad();
      for (int m = 0; m < kMicro; ++m)
        backward(loss_of(*model, batch_of(pg->rank(), kRanks, m)));
      fsdp.finish();
    }
    const auto want = whole->named_parameters();
    const auto got = model->named_parameters();
    for (size_t i = 0; i < got.size(); ++i) {
      const Tensor g = grad(want[i].second);
      const Tensor expected = rows_of(
          g.defined() ? test::on_cpu(g) : ops::zeros(want[i].second.shape()), kRanks, pg->rank());
      RANK_CHECK(rc, ops::allclose(test::on_cpu(grad(got[i].second)), expected, 1e-5, 1e-6));
    }
  });
  rc.report();
}

TEST_CASE("FSDP on a 2-D mesh (HSDP) reduces over both dims", "[fsdp]") {
  constexpr int kRanks = 4, kSteps = 2;
  const Reference want = one_rank(kRanks, kSteps);
  tandem::testing::RankChecks rc;
  run_ranks(kRanks, [&](ProcessGroupPtr pg) {
    // (replicate, shard) = (2, 2): data rank = the global rank.
    DeviceMesh mesh(pg, {2, 2}, {"rep", "shard"}, {}, test::test_device());
    auto model = make_model();
    FullyShardedDataParallel fsdp(model, model->blocks(), mesh, {.op = RedOp::Sum});
    const int shard = mesh.get_local_rank("shard");
    optim::AdamW opt(model->named_parameters(), {.lr = 1e-2});
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      backward(loss_of(*model, batch_of(pg->rank(), kRanks, s)));
      fsdp.finish();
      opt.step();
    }
    for (const auto& [name, p] : model->named_parameters()) {
      RANK_CHECK(rc, ops::allclose(test::on_cpu(grad(p)), rows_of(want.grads.at(name), 2, shard),
                                   1e-5, 1e-6));
      RANK_CHECK(
          rc, ops::allclose(test::on_cpu(p), rows_of(want.params.at(name), 2, shard), 1e-5, 1e-6));
    }
  });
  rc.report();
}

// One bf16 parameter of kRows elements scaling its input: its gradient is
// the input.
class Scale final : public Module {
 public:
  static constexpr int64_t kRows = 8;
  Scale() : Module("Scale") {
    p_ = ops::zeros({kRows}, DType::BF16, test::test_device());
    register_parameter("p", &p_);
  }

 protected:
  std::vector<Tensor> forward(Args& args) override {
    return {mul(nn::single_input(args, "Scale"), p_)};
  }

 private:
  Tensor p_;
};

TEST_CASE("FSDP sums bf16 gradients in f32 when asked, rounding once", "[fsdp][bf16]") {
  constexpr int kRanks = 4;
  // Rank r's gradient: 1 + r/256, exact in bf16. Their sum in f32 (4.0234375),
  // rounded once, is 4.03125; a bf16 running sum in rank order gives 4.
  auto input = [](int r) { return 1.0 + r / 256.0; };
  double total = 0;
  for (int r = 0; r < kRanks; ++r)
    total += input(r);
  const Tensor want = ops::to(ops::full({Scale::kRows / kRanks}, total, DType::F32), DType::BF16);
  tandem::testing::RankChecks rc;
  run_ranks(kRanks, [&](ProcessGroupPtr pg) {
    DeviceMesh mesh(pg, {kRanks}, {"dp"}, {}, test::test_device());
    auto model = std::make_shared<Scale>();
    FullyShardedDataParallel fsdp(model, {}, mesh, {.op = RedOp::Sum, .reduce_dtype = DType::F32});
    const Tensor x =
        test::on_test_device(ops::full({Scale::kRows}, input(pg->rank()), DType::BF16));
    backward(sum((*model)(x)));
    fsdp.finish();
    const Tensor g = grad(model->named_parameters().at(0).second);
    RANK_CHECK(rc, g.dtype() == DType::BF16);
    RANK_CHECK(rc, ops::equal(test::on_cpu(g), want));
  });
  rc.report();
}

TEST_CASE("FSDP prefetches all-gathers and reduce-scatters during the backward", "[fsdp]") {
  constexpr int kRanks = 2;
  tandem::testing::RankChecks rc;
  run_ranks(kRanks, [&](ProcessGroupPtr pg) {
    DeviceMesh mesh(pg, {kRanks}, {"dp"}, {}, test::test_device());
    auto model = make_model();
    FullyShardedDataParallel fsdp(model, model->blocks(), mesh);
    const int groups = fsdp.num_groups();
    for (int s = 0; s < 2; ++s) {
      backward(loss_of(*model, batch_of(pg->rank(), kRanks, s)));
      // Every group's reduce-scatter left during the backward.
      RANK_CHECK(rc, fsdp.launched() == groups);
      fsdp.finish();
      RANK_CHECK(rc, fsdp.launched() == 0);
      model->zero_grad();
      if (s == 0) {
        RANK_CHECK(rc,
                   (fsdp.forward_order() == std::vector<std::string>{"root", "l0", "l1", "l2"}));
        // The first forward records the order; its backward already
        // prefetches every group but the first it meets.
        RANK_CHECK(rc, fsdp.prefetches() == groups - 1);
      }
    }
    // The second step prefetches in both directions.
    RANK_CHECK(rc, fsdp.prefetches() == 3 * (groups - 1));
  });
  rc.report();
}

// Issue 19: every group's reduction launched before the backward finished,
// checked twice: in the ledger (the order every rank launched them in, and
// none left for finish()) and in the trace (each launch instant inside its
// rank thread's backward span).
TEST_CASE("FSDP's reduce-scatters launch during the backward: ledger order and trace",
          "[fsdp][trace]") {
  constexpr int kRanks = 2;
  tandem::testing::RankChecks rc;
  trace_start();
  run_ranks(kRanks, [&](ProcessGroupPtr pg) {
    DeviceMesh mesh(pg, {kRanks}, {"dp"}, {}, test::test_device());
    auto model = make_model();
    FullyShardedDataParallel fsdp(model, model->blocks(), mesh);
    Ledger& ledger = mesh.get_group("dp")->ledger();
    for (int s = 0; s < 2; ++s) {
      const uint64_t before = ledger.size();
      backward(loss_of(*model, batch_of(pg->rank(), kRanks, s)));
      const uint64_t after_backward = ledger.size();
      fsdp.finish();
      model->zero_grad();
      // The reduce-scatters of this step, in launch order.
      std::vector<std::string> launched, in_finish;
      const std::vector<LedgerEntry> step = ledger.tail(ledger.size() - before);
      for (const LedgerEntry& e : step) {
        if (e.op != "reduce_scatter") continue;
        (e.seq < after_backward ? launched : in_finish).push_back(e.tag);
      }
      std::vector<std::string> want;
      for (const std::string& g : fsdp.forward_order())
        want.insert(want.begin(), "fsdp reduce_scatter " + g);
      RANK_CHECK(rc, launched == want);
      RANK_CHECK(rc, in_finish.empty());
    }
  });
  trace_stop();
  rc.report();
  // Per thread: its backward spans, and its reduce-scatter launches.
  const nlohmann::json doc = nlohmann::json::parse(trace_json());
  std::map<std::pair<int64_t, int64_t>, std::vector<std::pair<int64_t, int64_t>>> spans;
  std::map<std::pair<int64_t, int64_t>, std::vector<int64_t>> issues;
  for (const auto& e : doc["traceEvents"]) {
    const auto lane = std::make_pair(e.value("pid", int64_t{0}), e.value("tid", int64_t{0}));
    const std::string name = e.value("name", "");
    if (e.value("ph", "") == "X" && name == "backward") {
      const int64_t ts = e["ts"].get<int64_t>();
      spans[lane].emplace_back(ts, ts + e["dur"].get<int64_t>());
    } else if (e.value("ph", "") == "i" && name.rfind("issue reduce_scatter", 0) == 0) {
      issues[lane].push_back(e["ts"].get<int64_t>());
    }
  }
  REQUIRE(issues.size() == kRanks);  // the rank threads
  for (const auto& [lane, times] : issues) {
    CHECK(times.size() == 2 * 4);  // two steps of four groups
    for (int64_t t : times) {
      INFO("launch at " << t << " us on thread " << lane.second);
      bool inside = false;
      for (const auto& [start, end] : spans[lane])
        inside = inside || (start <= t && t <= end);
      CHECK(inside);
    }
  }
}

TEST_CASE("FSDP releases the gathered parameters after the forward", "[fsdp]") {
  constexpr int kRanks = 2;
  // Wide layers, so that parameters dominate what a forward allocates.
  const std::vector<int64_t> widths = {512, 512, 8};
  const Device device = test::test_device();
  int64_t whole_bytes = 0;
  for (const auto& [name, p] : make_model(widths)->named_parameters())
    whole_bytes += p.numel() * 4;
  int64_t held[2] = {0, 0};  // rank 0's view of the process: after - before forward
  for (bool reshard : {false, true}) {
    tandem::testing::RankChecks rc;
    run_ranks(kRanks, [&](ProcessGroupPtr pg) {
      DeviceMesh mesh(pg, {kRanks}, {"dp"}, {}, device);
      auto model = make_model(widths);
      FullyShardedDataParallel fsdp(model, model->blocks(), mesh,
                                    {.reshard_after_forward = reshard});
      const Tensor x = batch_of(pg->rank(), kRanks);
      // Every rank's queued work done, then a host barrier (synchronize():
      // wait() only orders the stream, Note [Stream ordering]).
      auto settle = [&] {
        current_stream(device).synchronize();
        pg->barrier()->synchronize();
      };
      settle();
      const int64_t before = memory_stats(device).allocated_bytes;
      settle();
      Tensor loss = loss_of(*model, x);
      settle();
      if (pg->rank() == 0) held[reshard ? 1 : 0] = memory_stats(device).allocated_bytes - before;
      settle();
      // The backward restores what the forward released, and still works.
      backward(loss);
      fsdp.finish();
      for (const auto& [name, p] : model->named_parameters())
        RANK_CHECK(rc, grad(p).defined() && !storage_released(p));
    });
    rc.report();
  }
  // Without resharding both ranks hold every whole parameter until the
  // backward; with it, none of them.
  INFO("held after the forward: " << held[0] << " bytes kept, " << held[1]
                                  << " resharded; whole parameters " << whole_bytes);
  CHECK(held[0] - held[1] >= kRanks * whole_bytes * 9 / 10);
  CHECK(held[1] < kRanks * whole_bytes / 10);
}

TEST_CASE("FSDP refuses misuse by name", "[fsdp]") {
  tandem::testing::RankChecks rc;
  run_ranks(2, [&](ProcessGroupPtr pg) {
    DeviceMesh mesh(pg, {2}, {"dp"}, {}, test::test_device());
    auto model = make_model();
    auto stranger = make_model();
    RANK_CHECK_THROWS_WITH(rc, FullyShardedDataParallel(model, stranger->blocks(), mesh),
                           "inside the root");
    RANK_CHECK_THROWS_WITH(
        rc, FullyShardedDataParallel(model, {model->blocks()[0], model->blocks()[0]}, mesh),
        "'l0' twice");
    RANK_CHECK_THROWS_WITH(
        rc, FullyShardedDataParallel(model, model->blocks(), mesh, {.shard_dim = "tp"}), "dp");
    FullyShardedDataParallel fsdp(model, model->blocks(), mesh);
    const Tensor x = batch_of(pg->rank(), 2);
    Tensor first = loss_of(*model, x);
    RANK_CHECK_THROWS_WITH(rc, loss_of(*model, x), "before its next forward");
    // Evaluating under NoGradGuard between steps is fine.
    backward(first);
    fsdp.finish();
    NoGradGuard no_grad;
    RANK_CHECK(rc, loss_of(*model, x).defined());
    RANK_CHECK(rc, loss_of(*model, x).defined());
  });
  rc.report();
}
