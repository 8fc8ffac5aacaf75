// Parameter placements (Note [Parameter placements]) and the step-end work
// that reads them: gradient reduction over data dims, the global gradient
// norm, checkpoint pieces and the mesh's list of groups.
//
// Meshes, modules, parameters and gradients live on test_device()
// (tests/support/test_device.h); expected values are computed on the CPU and
// results are read back there.
#include <catch2/catch.hpp>

#include <cmath>

#include "tandem/autograd/nn/moe.h"
#include "tandem/autograd/nn/transformer.h"
#include "tandem/autograd/ops.h"
#include "tandem/comm/threads/threads_backend.h"
#include "tandem/parallel/data_parallel.h"
#include "tandem/parallel/expert_parallel.h"
#include "tandem/parallel/param_placement.h"
#include "tandem/parallel/tensor_parallel.h"
#include "tests/support/rank_checks.h"
#include "tests/support/test_device.h"

using namespace tandem;

namespace {

// A parameter-like leaf of zeros on test_device().
Tensor leaf(const Shape& shape) {
  Tensor t = ops::zeros(shape, DType::F32, test::test_device());
  set_requires_grad(t);
  return t;
}

Tensor filled(const Shape& shape, double value) {
  return ops::full(shape, value, DType::F32, test::test_device());
}

// `t` is on test_device() and every element is `value`.
bool all_equal(const Tensor& t, double value) {
  return t.defined() && t.device() == test::test_device() &&
         ops::equal(test::on_cpu(t), ops::full(t.shape(), value, t.dtype()));
}

// `got` is on test_device() and equals `want`, a CPU tensor, exactly.
bool equal_on_cpu(const Tensor& got, const Tensor& want) {
  return got.defined() && got.device() == test::test_device() &&
         ops::equal(test::on_cpu(got), want);
}

}  // namespace

TEST_CASE("parallel styles record each parameter's placement", "[placement]") {
  tandem::testing::RankChecks rc;
  run_ranks(4, [&](ProcessGroupPtr world) {
    DeviceMesh mesh(world, {2, 2}, {"dp", "tp"}, {}, test::test_device());
    nn::TransformerBlockConfig cfg;
    cfg.d_model = 10;  // 10 features over tp 2: chunks of 5
    cfg.n_heads = 2;
    cfg.hidden = 12;
    Generator init(1);
    auto block = std::make_shared<nn::TransformerBlock>(cfg, init);
    block->to(test::test_device());
    parallelize_module(block, mesh.slice("tp"),
                       {{"attn.q_proj", colwise()}, {"attn.o_proj", rowwise()}});
    block->to(DType::F64);  // Module::to keeps the records
    const int tp = mesh.get_local_rank("tp");
    for (auto& [name, p] : block->named_parameters()) {
      const auto placement = param_placement(p);
      if (name == "attn.q_proj.weight") {
        RANK_CHECK(rc, placement && placement->splits.size() == 1 &&
                           placement->splits[0].mesh_dim == "tp" &&
                           placement->splits[0].tensor_dim == 0 &&
                           placement->global_shape == Shape{10, 10} &&
                           placement->offsets == std::vector<int64_t>{5 * tp, 0});
      } else if (name == "attn.o_proj.weight") {
        RANK_CHECK(rc, placement && placement->split_over("tp") && !placement->split_over("dp") &&
                           placement->splits[0].tensor_dim == 1 &&
                           placement->offsets == std::vector<int64_t>{0, 5 * tp});
      } else {
        RANK_CHECK(rc, placement == nullptr);  // replicated: norms, the other projections
      }
    }
    // A second split along the same tensor dim, and a record on a non-leaf.
    const Tensor q = block->get_submodule("attn.q_proj")->named_parameters()[0].second;
    rc.throws_with(
        [&] {
          record_shard(q, mesh.slice("dp"), 0, Shape{10, 10});
        },
        "expected tensor dim 0 not yet sharded", "second shard along dim 0");
    rc.throws_with([&] { record_owned(q, "tp"); }, "not yet split over mesh dim \"tp\"",
                   "owned over a dim it is sharded over");
    rc.throws_with([&] { record_owned(mul(q, 2.0), "dp"); }, "expected a leaf that requires grad",
                   "record on a non-leaf");
  });
  rc.report();
}

TEST_CASE("expert parallelism records its experts as owned by one ep rank", "[placement]") {
  tandem::testing::RankChecks rc;
  run_ranks(2, [&](ProcessGroupPtr world) {
    DeviceMesh mesh(world, {2}, {"ep"}, {}, test::test_device());
    Generator init(2);
    auto moe = std::make_shared<nn::MoE>(
        nn::MoEOptions{.d_model = 8, .hidden = 8, .num_experts = 4, .top_k = 2}, init);
    moe->to(test::test_device());
    expert_parallel(moe, mesh);
    int owned = 0;
    for (auto& [name, p] : moe->named_parameters()) {
      const auto placement = param_placement(p);
      const bool expert = name.rfind("experts.", 0) == 0;
      RANK_CHECK(rc, (placement != nullptr) == expert);
      if (placement) {
        owned += 1;
        RANK_CHECK(rc, placement->splits.size() == 1 && placement->splits[0].tensor_dim == -1 &&
                           placement->split_over("ep") && placement->global_shape == p.shape());
      }
    }
    RANK_CHECK(rc, owned > 0);
  });
  rc.report();
}

TEST_CASE("reduce_gradients reduces over the data dims each parameter is replicated over",
          "[data-parallel]") {
  tandem::testing::RankChecks rc;
  run_ranks(4, [&](ProcessGroupPtr world) {
    DeviceMesh mesh(world, {2, 2}, {"dp", "ep"}, {}, test::test_device());  // rank = 2 dp + ep
    const int rank = world->rank(), ep = mesh.get_local_rank("ep");
    Tensor dense = leaf({3}), expert = leaf({2, 2});
    Tensor idle = leaf({2}), idle_expert = leaf({1});
    record_owned(expert, "ep");
    record_owned(idle_expert, "ep");
    for (RedOp op : {RedOp::Sum, RedOp::Avg}) {
      set_grad(dense, filled({3}, rank + 1));
      set_grad(expert, filled({2, 2}, 10.0 * (rank + 1)));
      zero_grad(idle);
      zero_grad(idle_expert);
      reduce_gradients({dense, idle, expert, idle_expert}, mesh, {"dp", "ep"}, op);
      // dense: ranks 1..4 → 10; expert: the ranks of its ep column, ep+1 and ep+3.
      const double n_dense = op == RedOp::Avg ? 4 : 1, n_expert = op == RedOp::Avg ? 2 : 1;
      RANK_CHECK(rc, all_equal(grad(dense), 10.0 / n_dense));
      RANK_CHECK(rc, all_equal(grad(expert), 10.0 * (2 * ep + 4) / n_expert));
      RANK_CHECK(rc, all_equal(grad(idle), 0.0) && all_equal(grad(idle_expert), 0.0));
    }
    // Reducing over dp only leaves the ep dim alone.
    set_grad(dense, filled({3}, rank + 1));
    reduce_gradients({dense}, mesh, {"dp"});
    RANK_CHECK(rc, all_equal(grad(dense), (ep + 1) + (ep + 3)));
    rc.throws_with(
        [&] {
          reduce_gradients({dense}, mesh, {"dp", "cp"});
        },
        "got \"cp\"", "unknown data dim");
    rc.throws_with([&] { reduce_gradients({dense}, mesh, {"dp"}, RedOp::Max); },
                   "expected RedOp Sum or Avg", "max");
  });
  rc.report();
}

TEST_CASE("clip_grad_norm counts every element of the global parameters once", "[data-parallel]") {
  tandem::testing::RankChecks rc;
  run_ranks(4, [&](ProcessGroupPtr world) {
    DeviceMesh mesh(world, {2, 2}, {"dp", "tp"}, {}, test::test_device());
    const DeviceMesh tp_mesh = mesh.slice("tp");
    const int tp = mesh.get_local_rank("tp");
    // The whole gradients, the same on every rank: a tp-sharded 5x3 weight
    // (chunks of 3 and 2 rows) and a replicated vector.
    const Tensor whole = ops::reshape(ops::arange(1, 16, 1, DType::F32), Shape{5, 3});
    const Tensor vector = ops::from_vector(std::vector<float>{2, -1, 4}, Shape{3});
    const auto [start, length] = chunk_range(5, 2, tp);
    Tensor w = leaf({length, 3}), v = leaf({3});
    record_shard(w, tp_mesh, 0, Shape{5, 3});
    const Tensor w_grad = ops::contiguous(ops::narrow(whole, 0, start, length));
    auto reset = [&] {
      set_grad(w, test::on_test_device(w_grad));
      set_grad(v, test::on_test_device(vector));
    };
    const double expected = std::sqrt(ops::sum(ops::mul(whole, whole)).item_double() +
                                      ops::sum(ops::mul(vector, vector)).item_double());
    reset();
    const double norm = clip_grad_norm({w, v}, mesh, 0);  // 0: measure only
    RANK_CHECK(rc, std::abs(norm - expected) < 1e-9 * expected);
    RANK_CHECK(rc, equal_on_cpu(grad(w), w_grad) && equal_on_cpu(grad(v), vector));
    reset();
    const double clipped_norm = clip_grad_norm({w, v}, mesh, expected / 2);
    const double scale = (expected / 2) / (expected + 1e-6);
    RANK_CHECK(rc, clipped_norm == norm);
    RANK_CHECK(rc, grad(w).device() == test::test_device() &&
                       ops::allclose(test::on_cpu(grad(w)), ops::mul(w_grad, scale), 1e-6, 0) &&
                       ops::allclose(test::on_cpu(grad(v)), ops::mul(vector, scale), 1e-6, 0));
    // Below the bound nothing changes.
    reset();
    clip_grad_norm({w, v}, mesh, expected * 2);
    RANK_CHECK(rc, equal_on_cpu(grad(w), w_grad));
  });
  rc.report();
}

TEST_CASE("placed_piece: global geometry from the placement, one writer per copy", "[placement]") {
  tandem::testing::RankChecks rc;
  std::vector<int> writers_sharded(4), writers_replicated(4);
  run_ranks(4, [&](ProcessGroupPtr world) {
    DeviceMesh mesh(world, {2, 2}, {"dp", "tp"}, {}, test::test_device());
    const int rank = world->rank(), tp = mesh.get_local_rank("tp");
    Tensor w = leaf({2, 4}), b = leaf({4});
    record_shard(w, mesh.slice("tp"), 0, Shape{4, 4});
    const TensorPiece piece = placed_piece("w", w, w, mesh);
    RANK_CHECK(rc, piece.global_shape == Shape({4, 4}) &&
                       piece.offsets == std::vector<int64_t>{2 * tp, 0});
    writers_sharded[rank] = piece.write;
    writers_replicated[rank] = placed_piece("b", b, b, mesh).write;
    // A step count beside the parameter is whole.
    const TensorPiece step =
        placed_piece("w.step", ops::zeros({}, DType::F32, test::test_device()), w, mesh);
    RANK_CHECK(rc, step.global_shape == Shape{} && step.offsets.empty());
  });
  rc.report();
  // dp 0 writes each tp shard; rank (0, 0) alone writes the replicated one.
  CHECK(writers_sharded == std::vector<int>{1, 1, 0, 0});
  CHECK(writers_replicated == std::vector<int>{1, 0, 0, 0});
}

TEST_CASE("a mesh lists every group created from it", "[mesh]") {
  tandem::testing::RankChecks rc;
  run_ranks(4, [&](ProcessGroupPtr world) {
    DeviceMesh mesh(world, {2, 2}, {"a", "b"}, {}, test::test_device());
    const size_t before = mesh.all_groups().size();  // world + one group per dim
    RANK_CHECK(rc, before == 3 && mesh.all_groups()[0] == world);
    ProcessGroupPtr both = mesh.group_over({"a", "b"});
    RANK_CHECK(rc, both->size() == 4 && mesh.group_over({"a", "b"}) == both);
    const std::vector<ProcessGroupPtr> after = mesh.slice("a").all_groups();
    RANK_CHECK(rc, after.size() == before + 1 && after.back() == both);
    RANK_CHECK(rc, mesh.group_over({"b"}) == mesh.get_group("b"));
    rc.throws_with([&] { mesh.group_over({}); }, "expected at least one dim", "no dims");
  });
  rc.report();
}

TEST_CASE("sum_over adds host values over the named dims", "[data-parallel]") {
  tandem::testing::RankChecks rc;
  run_ranks(4, [&](ProcessGroupPtr world) {
    DeviceMesh mesh(world, {2, 2}, {"dp", "cp"}, {}, test::test_device());
    const double r = world->rank();
    const std::vector<double> all = sum_over(mesh, {"dp", "cp"}, {r, 1.0});
    const std::vector<double> dp = sum_over(mesh, {"dp"}, {r});
    RANK_CHECK(rc, all == std::vector<double>{6.0, 4.0});
    // rank = 2 dp + cp: the dp column of cp c holds c and c + 2.
    RANK_CHECK(rc, dp == std::vector<double>{2.0 * mesh.get_local_rank("cp") + 2});
  });
  rc.report();
}
