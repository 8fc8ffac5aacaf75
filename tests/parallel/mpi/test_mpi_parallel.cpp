// DTensor redistribution and context parallelism under `mpirun -n 4`: the
// subset of the threads-backend suites that proves the same code runs with
// one rank per process. Every rank computes the single-rank reference itself.
#include <catch2/catch.hpp>

#include "tandem/autograd/nn/attention.h"
#include "tandem/autograd/nn/linear.h"
#include "tandem/autograd/nn/transformer.h"
#include "tandem/autograd/ops.h"
#include "tandem/autograd/optim.h"
#include "tandem/comm/backend.h"
#include "tandem/parallel/context_parallel.h"
#include "tandem/parallel/data_parallel.h"
#include "tandem/parallel/ddp.h"
#include "tandem/parallel/dtensor.h"
#include "tandem/parallel/dual_pipe.h"
#include "tandem/parallel/fsdp.h"
#include "tandem/parallel/placement.h"
#include "tandem/parallel/zero.h"
#include "tests/comm/mpi/mpi_test_util.h"

using namespace tandem;

namespace {

ProcessGroupPtr world() {
  static ProcessGroupPtr w = create_world("mpi");
  return w;
}

}  // namespace

TEST_CASE("redistribution between placements matches slicing (MPI)", "[mpi][redistribute]") {
  ProcessGroupPtr pg = world();
  REQUIRE(pg->size() == 4);
  DeviceMesh mesh1(pg, {4}, {"x"});
  DeviceMesh mesh2(pg, {2, 2}, {"a", "b"});
  for (int64_t rows : {8, 7, 3}) {
    Generator gen(5);
    Tensor full = ops::randn({rows, 6}, gen);
    // 1-D mesh
    std::vector<Placements> one = {{Shard(0)}, {Shard(1)}, {Replicate()}, {Partial()}};
    for (const auto& from : one) {
      for (const auto& to : one) {
        DTensor y = DTensor::distribute(full, mesh1, from).redistribute(to);
        CHECK(y.local_shape() == DTensor::local_shape_for(full.shape(), to, mesh1));
        CHECK(ops::allclose(y.full_tensor(), full, 1e-6, 1e-6));
      }
    }
    // 2-D mesh, nested and crossed shards
    std::vector<Placements> two = {{Shard(0), Shard(1)},
                                   {Shard(0), Shard(0)},
                                   {Replicate(), Partial()},
                                   {Shard(1), Replicate()},
                                   {Partial(), Shard(0)}};
    for (const auto& from : two) {
      for (const auto& to : two) {
        DTensor y = DTensor::distribute(full, mesh2, from).redistribute(to);
        CHECK(y.local_shape() == DTensor::local_shape_for(full.shape(), to, mesh2));
        CHECK(ops::allclose(y.full_tensor(), full, 1e-6, 1e-6));
      }
    }
  }
  // Backward of Shard -> Replicate is a local chunk of the (replicated) gradient.
  Generator gen(6);
  Tensor full = ops::randn({8, 4}, gen), weight = ops::randn({8, 4}, gen);
  Tensor local = DTensor::distribute(full, mesh1, {Shard(0)}).to_local();
  set_requires_grad(local);
  DTensor x = DTensor::make(local, mesh1, {Shard(0)}, full.shape());
  backward(sum(mul(x.redistribute({Replicate()}).to_local(), weight)));
  CHECK(ops::allclose(grad(local), DTensor::distribute(weight, mesh1, {Shard(0)}).to_local()));
  tandem::test::check_all_ranks_passed();
}

TEST_CASE("context parallel modes equal single-rank attention (MPI)", "[mpi][cp]") {
  ProcessGroupPtr pg = world();
  DeviceMesh mesh(pg, {4}, {"cp"});
  const int r = pg->rank();
  struct Mode {
    int ds;
    bool ring;
    bool lb;
  };
  for (Mode m : {Mode{4, false, false}, Mode{1, false, false}, Mode{1, true, false},
                 Mode{1, false, true}, Mode{1, true, true}, Mode{2, false, false}}) {
    INFO("ds=" << m.ds << " ring=" << m.ring << " lb=" << m.lb);
    Generator gen(8);
    const int64_t S = 14;
    Tensor q = ops::randn({1, S, 4, 8}, gen), k = ops::randn({1, S, 4, 8}, gen),
           v = ops::randn({1, S, 4, 8}, gen), w = ops::randn({1, S, 4, 8}, gen);
    AttentionOptions options;
    options.causal = true;
    auto ref = std::make_shared<nn::CoreAttention>(options);
    Tensor qr = ops::clone(q), kr = ops::clone(k), vr = ops::clone(v);
    for (Tensor* t : {&qr, &kr, &vr})
      set_requires_grad(*t);
    Tensor out_ref = ref->call(Args{qr, kr, vr})[0];
    backward(sum(mul(out_ref, w)));

    auto core = std::make_shared<nn::CoreAttention>(options);
    ContextParallel config;
    config.ulysses_degree = m.ds;
    config.mode = m.ring ? CPMode::Ring : CPMode::Auto;
    config.load_balance = m.lb;
    config.apply(core, mesh);
    auto shard = [&](const Tensor& t) { return shard_sequence(t, 1, 4, r, m.lb); };
    Tensor ql = shard(q), kl = shard(k), vl = shard(v);
    for (Tensor* t : {&ql, &kl, &vl})
      set_requires_grad(*t);
    Tensor out = core->call(Args{ql, kl, vl})[0];
    backward(sum(mul(out, shard(w))));
    CHECK(ops::allclose(out, shard(out_ref), 1e-5, 1e-5));
    CHECK(ops::allclose(grad(ql), shard(grad(qr)), 1e-5, 1e-5));
    CHECK(ops::allclose(grad(kl), shard(grad(kr)), 1e-5, 1e-5));
    CHECK(ops::allclose(grad(vl), shard(grad(vr)), 1e-5, 1e-5));
  }
  tandem::test::check_all_ranks_passed();
}

TEST_CASE("dual-pipe schedule with expert parallel is bit-identical to sequential (MPI)",
          "[mpi][dualpipe]") {
  ProcessGroupPtr pg = world();
  std::vector<std::vector<double>> losses;
  std::vector<std::vector<Tensor>> grads;
  for (bool overlap : {false, true}) {
    DeviceMesh mesh(pg, {4}, {"ep"});
    auto coordinator = std::make_shared<HookCoordinator>(
        HookCoordinatorOptions{std::chrono::milliseconds(60000), false});
    nn::TransformerLMConfig c;
    c.vocab = 17;
    c.d_model = 16;
    c.layers = 2;
    c.heads = 2;
    c.hidden = 32;
    c.max_seq = 8;
    c.experts = 4;
    Generator init(3);
    auto model = std::make_shared<nn::TransformerLM>(c, init);
    int layers = install_dual_pipe(model, mesh, coordinator);
    DualPipeSchedule schedule(coordinator);
    auto forward = [&](int i) {
      Generator g(1000 + 31 * pg->rank() + i);
      Tensor t = ops::to(ops::mul(ops::rand({2, 9}, g), 17.0), DType::I64);
      Tensor x = ops::contiguous(ops::narrow(t, 1, 0, 8)),
             y = ops::contiguous(ops::narrow(t, 1, 1, 8));
      std::vector<Tensor> out = model->call(Args{x});
      return add(nn::lm_loss(out[0], y), mul(out[1], 0.01));
    };
    losses.push_back(schedule.run(3, forward, overlap, layers).losses);
    std::vector<Tensor> g;
    for (auto& [name, p] : model->named_parameters())
      g.push_back(grad(p));
    grads.push_back(g);
  }
  CHECK(losses[0] == losses[1]);
  for (size_t i = 0; i < grads[0].size(); ++i)
    CHECK(ops::equal(grads[0][i], grads[1][i]));
  tandem::test::check_all_ranks_passed();
}

TEST_CASE("bucketed DDP equals reduce_gradients and the one-rank gradient (MPI)", "[mpi][ddp]") {
  ProcessGroupPtr pg = world();
  DeviceMesh mesh(pg, {4}, {"dp"});
  Generator gen(8);
  const Tensor w1_init = ops::randn({16, 16}, gen), w2_init = ops::randn({16, 16}, gen);
  const Tensor b_init = ops::randn({16}, gen), batch = ops::randn({8, 16}, gen);
  auto make = [&] {
    std::vector<std::pair<std::string, Tensor>> p = {
        {"w1", ops::clone(w1_init)}, {"w2", ops::clone(w2_init)}, {"b", ops::clone(b_init)}};
    for (auto& [name, t] : p)
      set_requires_grad(t);
    return p;
  };
  auto loss = [](const std::vector<std::pair<std::string, Tensor>>& p, const Tensor& x) {
    return sum(add(tanh(matmul(tanh(matmul(x, p[0].second)), p[1].second)), p[2].second));
  };
  const Tensor mine = ops::narrow(batch, 0, 2 * pg->rank(), 2);
  auto ddp_params = make(), ref_params = make(), whole = make();
  DistributedDataParallel ddp(ddp_params, mesh, {"dp"}, {.bucket_bytes = 1});
  backward(loss(ddp_params, mine));
  CHECK(ddp.launched() == 3);  // every bucket went out during the backward
  ddp.finish();
  backward(loss(ref_params, mine));
  reduce_gradients({ref_params[0].second, ref_params[1].second, ref_params[2].second}, mesh,
                   {"dp"});
  backward(loss(whole, batch));
  for (size_t i = 0; i < 3; ++i) {
    INFO(ddp_params[i].first);
    CHECK(ops::allclose(grad(ddp_params[i].second), grad(ref_params[i].second), 1e-6, 1e-6));
    CHECK(ops::allclose(grad(ddp_params[i].second), grad(whole[i].second), 1e-5, 1e-5));
  }
}

namespace {

// Two Linear layers (10 and 3 output rows: uneven and empty shards over 4).
class TwoLayers final : public Module {
 public:
  TwoLayers() : Module("TwoLayers") {
    Generator gen(9);
    l0_ = register_module("l0", nn::make<nn::Linear>({.in_features = 16, .out_features = 10}, gen));
    l1_ = register_module("l1", nn::make<nn::Linear>({.in_features = 10, .out_features = 3}, gen));
  }
  std::vector<std::shared_ptr<Module>> blocks() const { return {l0_, l1_}; }

 protected:
  std::vector<Tensor> forward(Args& args) override {
    return {sum(tanh((*l1_)(tanh((*l0_)(nn::single_input(args, "TwoLayers"))))))};
  }

 private:
  std::shared_ptr<nn::Linear> l0_, l1_;
};

}  // namespace

TEST_CASE("FSDP and HSDP train like the one-rank model (MPI)", "[mpi][fsdp]") {
  ProcessGroupPtr pg = world();
  Generator gen(10);
  const Tensor batch = ops::randn({8, 16}, gen);
  const Tensor mine = ops::narrow(batch, 0, 2 * pg->rank(), 2);
  auto whole = std::make_shared<TwoLayers>();
  optim::AdamW whole_opt(whole->named_parameters(), {.lr = 1e-2});
  std::map<std::string, Tensor> want_grads;
  for (int s = 0; s < 2; ++s) {
    whole_opt.zero_grad();
    backward((*whole)(batch));
    for (const auto& [name, p] : whole->named_parameters())
      want_grads[name] = ops::clone(grad(p));
    whole_opt.step();
  }
  for (bool hybrid : {false, true}) {
    INFO((hybrid ? "HSDP (2 x 2)" : "FSDP (4)"));
    DeviceMesh mesh =
        hybrid ? DeviceMesh(pg, {2, 2}, {"rep", "shard"}) : DeviceMesh(pg, {4}, {"shard"});
    const int shards = hybrid ? 2 : 4, shard = mesh.get_local_rank("shard");
    auto model = std::make_shared<TwoLayers>();
    FullyShardedDataParallel fsdp(model, model->blocks(), mesh, {.op = RedOp::Sum});
    optim::AdamW opt(model->named_parameters(), {.lr = 1e-2});
    for (int s = 0; s < 2; ++s) {
      opt.zero_grad();
      backward((*model)(mine));
      CHECK(fsdp.launched() == 2);  // both reduce-scatters left during the backward
      fsdp.finish();
      opt.step();
    }
    const auto whole_params = whole->named_parameters();
    const auto params = model->named_parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      INFO(params[i].first);
      auto rows = [&](const Tensor& t) {
        const auto [start, length] = chunk_range(t.shape()[0], shards, shard);
        return ops::narrow(t, 0, start, length);
      };
      CHECK(
          ops::allclose(grad(params[i].second), rows(want_grads.at(params[i].first)), 1e-5, 1e-6));
      CHECK(ops::allclose(params[i].second, rows(whole_params[i].second), 1e-5, 1e-6));
    }
  }
}

TEST_CASE("ZeRO-1 steps bit-identically to AdamW (MPI)", "[mpi][zero]") {
  ProcessGroupPtr pg = world();
  DeviceMesh mesh(pg, {4}, {"dp"});
  auto make = [] {
    Generator gen(12);
    optim::NamedParams p = {{"w", ops::randn({7, 3}, gen)}, {"b", ops::randn({3}, gen)}};
    for (auto& [name, t] : p)
      set_requires_grad(t);
    return p;
  };
  const optim::NamedParams sharded = make(), plain = make();
  ZeroRedundancyOptimizer zero(sharded, mesh, "dp", {.lr = 1e-2});
  optim::AdamW reference(plain, {.lr = 1e-2});
  for (int s = 0; s < 3; ++s) {
    for (const optim::NamedParams* params : {&sharded, &plain}) {
      Generator gen(50 + 7 * static_cast<uint64_t>(pg->rank()) + static_cast<uint64_t>(s));
      std::vector<Tensor> tensors;
      for (const auto& [name, p] : *params) {
        set_grad(p, ops::randn(p.shape(), gen));
        tensors.push_back(p);
      }
      reduce_gradients(tensors, mesh, {"dp"});
    }
    zero.step();
    zero.zero_grad();
    reference.step();
    reference.zero_grad();
  }
  for (size_t i = 0; i < plain.size(); ++i)
    CHECK(ops::equal(sharded[i].second, plain[i].second));
}
