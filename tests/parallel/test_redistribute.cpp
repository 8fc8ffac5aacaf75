// DTensor redistribution on the threads backend (DESIGN §6): every pair of
// placements on 1-D and 2-D meshes, forward and backward, on even and uneven
// shapes; the other reductions of Partial; the all_to_all path; the planner's
// steps and the collectives they launch; the async form; from_local's shape
// inference; the local shape/offset helpers (the front end's errors:
// test_redistribute_errors.cpp).
//
// Expected values never come from the code under test: every rank computes,
// with its own chunk arithmetic, which block of the global tensor it holds
// (Block below), and what the pending addends of a Partial tensor are. Values
// are small integers, exact in f32, so results are compared exactly.
//
// Gradients follow Note [Redistribute gradients]: each rank takes
// loss = sum(out_local * W_local), W_local being the block of one global W
// under the output's gradient placements (Partial read as Replicate). The
// gradient of the output is then W with those placements, and the source's
// local gradient must be the block of W under the source's gradient
// placements: its shard of W, or all of W along a Partial mesh dim.
//
// Rank functions run on the rank threads of run_ranks, where Catch2's
// assertions must not be used: each rank records what it found in a Failures
// list, and the test thread asserts that it is empty.
//
// Meshes, sources and loss weights live on test_device()
// (tests/support/test_device.h); results must stay there and are read back
// on the CPU. Redistribution only moves and adds data, so CUDA results are
// compared exactly too.
#include <catch2/catch.hpp>

#include <fmt/ranges.h>

#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include "tandem/autograd/engine.h"
#include "tandem/autograd/ops.h"
#include "tandem/comm/threads/threads_backend.h"
#include "tandem/parallel/dtensor.h"
#include "tests/support/rank_checks.h"
#include "tests/support/test_device.h"
#include "tests/support/test_util.h"

namespace tandem {
namespace {

using tandem::testing::Failures;

using test::numel_of;
using test::ravel;
using test::tensor_of;
using test::unravel;
using test::values_of;
using Values = std::vector<double>;

// Records a failure unless `got` is on test_device() and has `shape` and
// exactly the values `want`.
void expect_tensor(Failures& failures, int rank, const std::string& what, const Tensor& got,
                   const std::vector<int64_t>& shape, const Values& want) {
  if (!got.defined()) {
    failures.add(fmt::format("rank {}: {}: undefined", rank, what));
    return;
  }
  if (got.device() != test::test_device()) {
    failures.add(fmt::format("rank {}: {}: expected a tensor on {}, got one on {}", rank, what,
                             test::test_device(), got.device()));
    return;
  }
  if (got.shape().vec() != shape) {
    failures.add(fmt::format("rank {}: {}: expected shape [{}], got {}", rank, what,
                             fmt::join(shape, ","), got.shape().str()));
    return;
  }
  Values values = values_of(test::on_cpu(got));
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i] != want[i]) {
      failures.add(fmt::format("rank {}: {}: expected {} at flat index {}, got {} (shape [{}])",
                               rank, what, want[i], i, values[i], fmt::join(shape, ",")));
      return;
    }
  }
}

// Zeros on test_device(): a local tensor whose values do not matter.
Tensor device_zeros(const Shape& shape) {
  return ops::zeros(shape, DType::F32, test::test_device());
}

// Runs one case on a rank; an exception is rethrown with the case named (so
// the test thread sees which one), except the "aborted by rank r" errors it
// induced in the other ranks.
template <class F>
void in_case(const std::string& name, F&& fn) {
  try {
    fn();
  } catch (const CommAbortedError&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(fmt::format("{}: {}", name, e.what()));
  }
}

// ---- meshes, placements and blocks, computed by the test ----

using MeshShape = std::vector<int64_t>;

// `ranks`: the world rank at each row-major position (empty: identity).
DeviceMesh make_mesh(const ProcessGroupPtr& world, const MeshShape& shape,
                     const std::vector<int>& ranks = {}) {
  std::vector<std::string> names =
      shape.size() == 1 ? std::vector<std::string>{"x"} : std::vector<std::string>{"a", "b"};
  return DeviceMesh(world, shape, names, ranks, test::test_device());
}

std::vector<int64_t> coordinate_of(int rank, const MeshShape& shape,
                                   const std::vector<int>& ranks) {
  if (ranks.empty()) return unravel(rank, shape);
  return unravel(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin(), shape);
}

int world_of(const MeshShape& shape) {
  return static_cast<int>(numel_of(shape));
}

std::string mesh_label(const MeshShape& shape) {
  return fmt::format("mesh {}", fmt::join(shape, "x"));
}

// Chunk semantics (torch.chunk): ceil(n / k) to the first ranks, the
// remainder to the next one, nothing to the rest.
std::pair<int64_t, int64_t> chunk_of(int64_t n, int64_t k, int64_t i) {
  const int64_t size = (n + k - 1) / k;
  const int64_t start = std::min(n, i * size);
  return {start, std::max<int64_t>(0, std::min(size, n - start))};
}

// The block of the global tensor a rank at `coord` holds: the outer mesh dims
// split first (nested shards of one tensor dim split the outer piece).
struct Block {
  std::vector<int64_t> offset, shape;
};

Block block_of(const std::vector<int64_t>& global, const Placements& p, const MeshShape& mesh,
               const std::vector<int64_t>& coord) {
  Block b{std::vector<int64_t>(global.size(), 0), global};
  for (size_t m = 0; m < p.size(); ++m) {
    if (!p[m].is_shard()) continue;
    const size_t d = static_cast<size_t>(p[m].dim);
    auto [start, len] = chunk_of(b.shape[d], mesh[m], coord[m]);
    b.offset[d] += start;
    b.shape[d] = len;
  }
  return b;
}

Values take(const Values& full, const std::vector<int64_t>& global, const Block& b) {
  Values out;
  test::for_each_index(b.shape, [&](const std::vector<int64_t>& idx) {
    std::vector<int64_t> at = idx;
    for (size_t d = 0; d < at.size(); ++d)
      at[d] += b.offset[d];
    out.push_back(full[static_cast<size_t>(ravel(at, global))]);
  });
  return out;
}

// Note [Redistribute gradients]: the gradient of a Partial tensor is Replicate.
Placements grad_placements(Placements p) {
  for (Placement& x : p) {
    if (x.is_partial()) x = Replicate();
  }
  return p;
}

// ---- values ----

// The global tensor: 1, 2, 3, ... (every element distinct).
Values global_x(int64_t n) {
  return test::iota_values(n, 1.0);
}
// The loss weights: small integers, not proportional to x.
Values global_w(int64_t n) {
  Values w(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    w[static_cast<size_t>(i)] = static_cast<double>((i * 5) % 11 - 5);
  return w;
}
// The pending addend a Partial(sum) on mesh dim m moves around.
Values addend(int64_t n, int m) {
  Values b(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    b[static_cast<size_t>(i)] = static_cast<double>((i * 3 + m * 5) % 7 - 3);
  return b;
}

// What the rank at `coord` holds of a tensor whose value is `x` when placed
// with `p`, before sharding (global shape): along each Partial mesh dim the
// ranks hold values that `op` combines into the value, different on each rank
// and per element, so that a wrong combination shows.
Values partial_values(const Values& x, const Placements& p, const MeshShape& mesh,
                      const std::vector<int64_t>& coord) {
  Values v = x;
  const int64_t n = static_cast<int64_t>(x.size());
  for (size_t m = 0; m < p.size(); ++m) {
    if (!p[m].is_partial()) continue;
    const int64_t k = mesh[m], c = coord[m];
    const Values b = addend(n, static_cast<int>(m));
    for (int64_t i = 0; i < n; ++i) {
      double& e = v[static_cast<size_t>(i)];
      const double spread = static_cast<double>((c + i) % k);
      switch (p[m].op) {
        case RedOp::Sum:
          e = c == 0 ? e - static_cast<double>(k - 1) * b[i] : b[i];
          break;
        case RedOp::Max:
          e -= spread;
          break;  // the max is e, on a different rank per element
        case RedOp::Min:
          e += spread;
          break;
        case RedOp::Avg:
          e += static_cast<double>(2 * c - (k - 1));
          break;  // the offsets cancel
      }
    }
  }
  return v;
}

// What the rank at `coord` must hold (global shape, before sharding) after
// `from` -> `to` with only Partial(sum): a mesh dim that stops being Partial
// sums the addends along it; one that becomes Partial keeps the value on
// coordinate 0 and zeros elsewhere (as distribute() does); one that stays
// Partial keeps its addends.
Values expected_values(const Values& x, const Placements& from, const Placements& to,
                       const MeshShape& mesh, const std::vector<int64_t>& coord) {
  const size_t n = mesh.size();
  for (size_t m = 0; m < n; ++m) {
    if (!from[m].is_partial() && to[m].is_partial() && coord[m] != 0) return Values(x.size(), 0.0);
  }
  Values out(x.size(), 0.0);
  for (int64_t p = 0; p < numel_of(mesh); ++p) {
    std::vector<int64_t> c = unravel(p, mesh);
    bool summed = true;
    for (size_t m = 0; m < n; ++m) {
      const bool reduced = from[m].is_partial() && !to[m].is_partial();
      if (!reduced && c[m] != coord[m]) summed = false;
    }
    if (!summed) continue;
    Values v = partial_values(x, from, mesh, c);
    for (size_t i = 0; i < out.size(); ++i)
      out[i] += v[i];
  }
  return out;
}

// A source DTensor whose value is the global x, requiring grad; `leaf` is the
// local tensor whose gradient the test reads.
struct Source {
  Tensor leaf;
  DTensor dt;
};

Source make_source(const std::vector<int64_t>& global, const Placements& from,
                   const DeviceMesh& mesh, const MeshShape& ms, const std::vector<int64_t>& coord) {
  const Block b = block_of(global, from, ms, coord);
  Values local = take(partial_values(global_x(numel_of(global)), from, ms, coord), global, b);
  Tensor leaf = requires_grad_(test::on_test_device(tensor_of(local, Shape(b.shape))));
  return {leaf, DTensor::from_local(leaf, mesh, from, Shape(global))};
}

// Forward, full_tensor() and backward of one redistribution, all checked.
void check_redistribute(Failures& failures, int rank, const std::string& what,
                        const std::vector<int64_t>& global, const Placements& from,
                        const Placements& to, const DeviceMesh& mesh, const MeshShape& ms,
                        const std::vector<int64_t>& coord, bool sum_only_partials) {
  const int64_t n = numel_of(global);
  const Values x = global_x(n), w = global_w(n);
  Source src = make_source(global, from, mesh, ms, coord);
  DTensor out = src.dt.redistribute(to);

  failures.expect_eq(rank, what + " placements", placements_str(out.placements()),
                     placements_str(to));
  failures.expect_eq(rank, what + " global shape", out.shape().vec(), global);
  const Block ob = block_of(global, to, ms, coord);
  if (sum_only_partials) {
    expect_tensor(failures, rank, what + " forward", out.to_local(), ob.shape,
                  take(expected_values(x, from, to, ms, coord), global, ob));
  } else {
    failures.expect_eq(rank, what + " local shape", out.to_local().shape().vec(), ob.shape);
  }
  {
    NoGradGuard no_grad;
    expect_tensor(failures, rank, what + " full_tensor()", out.full_tensor(), global, x);
  }

  const Block wb = block_of(global, grad_placements(to), ms, coord);
  Tensor w_local = test::on_test_device(tensor_of(take(w, global, wb), Shape(wb.shape)));
  backward(sum(mul(out.to_local(), w_local)));
  const Block gb = block_of(global, grad_placements(from), ms, coord);
  expect_tensor(failures, rank, what + " backward: source gradient", grad(src.leaf), gb.shape,
                take(w, global, gb));
}

// ---- the placement lists of the sweeps ----

// Every list of one placement per mesh dim out of Shard(d) for d in
// `shard_dims`, Replicate() and Partial(sum), nested shards included.
std::vector<Placements> all_placements(size_t mesh_ndim,
                                       const std::vector<int64_t>& shard_dims = {0, 1}) {
  std::vector<Placement> choices;
  for (int64_t d : shard_dims)
    choices.push_back(Shard(d));
  choices.push_back(Replicate());
  choices.push_back(Partial());
  std::vector<Placements> out = {{}};
  for (size_t m = 0; m < mesh_ndim; ++m) {
    std::vector<Placements> next;
    for (const Placements& p : out) {
      for (const Placement& q : choices) {
        Placements r = p;
        r.push_back(q);
        next.push_back(r);
      }
    }
    out = next;
  }
  return out;
}

const std::vector<std::vector<int64_t>> kShapes = {{6, 4}, {7, 5}, {2, 3}, {0, 3}, {1, 1}};

std::string shape_label(const std::vector<int64_t>& s) {
  return fmt::format("({})", fmt::join(s, ","));
}

std::string pair_label(const Placements& from, const Placements& to) {
  return placements_str(from) + " -> " + placements_str(to);
}

// Every target from `from`, on one mesh and global shape.
void sweep_targets(const MeshShape& ms, const std::vector<int64_t>& global, const Placements& from,
                   const std::vector<int64_t>& shard_dims = {0, 1},
                   const std::vector<int>& ranks = {}) {
  Failures failures;
  run_ranks(world_of(ms), [&](ProcessGroupPtr world) {
    DeviceMesh mesh = make_mesh(world, ms, ranks);
    const int rank = world->rank();
    const std::vector<int64_t> coord = coordinate_of(rank, ms, ranks);
    failures.expect_eq(rank, "mesh coordinate", mesh.coordinate(), coord);
    for (const Placements& to : all_placements(ms.size(), shard_dims)) {
      const std::string what = pair_label(from, to);
      in_case(what, [&] {
        check_redistribute(failures, rank, what, global, from, to, mesh, ms, coord, true);
      });
    }
  });
  REQUIRE_NO_FAILURES(failures);
}

TEST_CASE("redistribute: every pair of placements on 1-D meshes of 1 to 5 ranks",
          "[redistribute]") {
  for (int64_t k = 1; k <= 5; ++k) {
    for (const auto& global : kShapes) {
      for (const Placements& from : all_placements(1)) {
        DYNAMIC_SECTION(mesh_label({k})
                        << " " << shape_label(global) << " from " << placements_str(from)) {
          sweep_targets({k}, global, from);
        }
      }
    }
  }
}

TEST_CASE("redistribute: every pair of placements on 2x2 and 2x3 meshes", "[redistribute]") {
  for (const MeshShape& ms : {MeshShape{2, 2}, MeshShape{2, 3}}) {
    for (const auto& global : kShapes) {
      for (const Placements& from : all_placements(2)) {
        DYNAMIC_SECTION(mesh_label(ms)
                        << " " << shape_label(global) << " from " << placements_str(from)) {
          sweep_targets(ms, global, from);
        }
      }
    }
  }
}

TEST_CASE("redistribute: every pair on a 2x3 mesh with permuted ranks", "[redistribute]") {
  // Shards follow mesh coordinates, not world ranks.
  const std::vector<int> ranks = {3, 1, 5, 0, 4, 2};
  for (const Placements& from : all_placements(2)) {
    DYNAMIC_SECTION("mesh 2x3 (7,5) from " << placements_str(from)) {
      sweep_targets({2, 3}, {7, 5}, from, {0, 1}, ranks);
    }
  }
}

TEST_CASE("redistribute: every pair on 3-D tensors sharded along dims 0 and 2", "[redistribute]") {
  for (const MeshShape& ms : {MeshShape{3}, MeshShape{4}, MeshShape{2, 2}, MeshShape{3, 2}}) {
    for (const std::vector<int64_t>& global :
         {std::vector<int64_t>{3, 5, 4}, std::vector<int64_t>{4, 1, 7}}) {
      for (const Placements& from : all_placements(ms.size(), {0, 2})) {
        DYNAMIC_SECTION(mesh_label(ms)
                        << " " << shape_label(global) << " from " << placements_str(from)) {
          sweep_targets(ms, global, from, {0, 2});
        }
      }
    }
  }
}

// Backward follows the Note's convention for every op: the gradient of a
// Partial source is the output's gradient, unscaled (Avg included).
TEST_CASE("redistribute: Partial(max/min/avg) to Replicate and Shard", "[redistribute]") {
  struct Case {
    MeshShape mesh;
    Placements from, to;
  };
  std::vector<Case> cases;
  for (int64_t k = 1; k <= 5; ++k) {
    for (RedOp op : {RedOp::Max, RedOp::Min, RedOp::Avg}) {
      for (const Placement& to : {Replicate(), Shard(0), Shard(1)})
        cases.push_back({{k}, {Partial(op)}, {to}});
    }
  }
  cases.push_back({{2, 3}, {Partial(RedOp::Max), Shard(1)}, {Replicate(), Shard(1)}});
  cases.push_back({{2, 3}, {Shard(0), Partial(RedOp::Avg)}, {Shard(0), Replicate()}});
  cases.push_back({{2, 3}, {Partial(RedOp::Min), Replicate()}, {Shard(0), Shard(0)}});
  cases.push_back({{2, 2}, {Replicate(), Partial(RedOp::Max)}, {Shard(1), Shard(0)}});
  for (const Case& c : cases) {
    for (const auto& global : kShapes) {
      DYNAMIC_SECTION(mesh_label(c.mesh)
                      << " " << shape_label(global) << " " << pair_label(c.from, c.to)) {
        Failures failures;
        run_ranks(world_of(c.mesh), [&](ProcessGroupPtr world) {
          DeviceMesh mesh = make_mesh(world, c.mesh);
          in_case(pair_label(c.from, c.to), [&] {
            const int rank = world->rank();
            const std::vector<int64_t> coord = unravel(rank, c.mesh);
            check_redistribute(failures, rank, pair_label(c.from, c.to), global, c.from, c.to, mesh,
                               c.mesh, coord, false);
            // The target has no Partial left: its block of x, exactly.
            Source src = make_source(global, c.from, mesh, c.mesh, coord);
            NoGradGuard no_grad;
            const Block b = block_of(global, c.to, c.mesh, coord);
            expect_tensor(failures, rank, "forward", src.dt.redistribute(c.to).to_local(), b.shape,
                          take(global_x(numel_of(global)), global, b));
          });
        });
        REQUIRE_NO_FAILURES(failures);
      }
    }
  }
}

// ---- the collectives a plan launches ----

// Launches of the groups of `mesh` and of the world so far.
uint64_t launches(const DeviceMesh& mesh, const ProcessGroupPtr& world) {
  uint64_t n = world->ledger().size();
  for (int m = 0; m < mesh.ndim(); ++m)
    n += mesh.get_group(m)->ledger().size();
  return n;
}

TEST_CASE("redistribute: Shard(i) -> Shard(j) is one all_to_all, uneven shapes included",
          "[redistribute]") {
  const std::vector<std::vector<int64_t>> shapes = {{7, 5}, {5, 7}, {2, 3}, {3, 5, 4}, {5, 2, 7}};
  for (int64_t k = 1; k <= 5; ++k) {
    for (const auto& global : shapes) {
      DYNAMIC_SECTION(mesh_label({k}) << " " << shape_label(global)) {
        Failures failures;
        run_ranks(static_cast<int>(k), [&](ProcessGroupPtr world) {
          DeviceMesh mesh = make_mesh(world, {k});
          const int rank = world->rank();
          const int64_t nd = static_cast<int64_t>(global.size());
          for (int64_t i = 0; i < nd; ++i) {
            for (int64_t j = 0; j < nd; ++j) {
              if (i == j) continue;
              const Placements from = {Shard(i)}, to = {Shard(j)};
              const std::string what = pair_label(from, to);
              in_case(what, [&] {
                failures.expect_eq(rank, what + " plan",
                                   redistribute_plan(Shape(global), from, to, mesh),
                                   std::vector<std::string>{
                                       fmt::format("all_to_all(mesh dim 0, dim {} -> {})", i, j)});
                ProcessGroupPtr g = mesh.get_group();
                const uint64_t before = g->ledger().size();
                {
                  NoGradGuard no_grad;
                  Source src = make_source(global, from, mesh, {k}, {rank});
                  src.dt.redistribute(to);
                }
                failures.expect_eq(rank, what + " collectives launched", g->ledger().size(),
                                   before + 1);
                failures.expect_eq(rank, what + " the collective", g->ledger().tail(1).at(0).op,
                                   std::string("all_to_all"));
                check_redistribute(failures, rank, what, global, from, to, mesh, {k}, {rank}, true);
              });
            }
          }
        });
        REQUIRE_NO_FAILURES(failures);
      }
    }
  }
  SECTION("2x3 mesh, the inner mesh dim moves its shard") {
    Failures failures;
    run_ranks(6, [&](ProcessGroupPtr world) {
      DeviceMesh mesh = make_mesh(world, {2, 3});
      const int rank = world->rank();
      for (const auto& [global, from, to] :
           {std::tuple{std::vector<int64_t>{4, 7, 5}, Placements{Shard(0), Shard(1)},
                       Placements{Shard(0), Shard(2)}},
            std::tuple{std::vector<int64_t>{5, 7}, Placements{Replicate(), Shard(0)},
                       Placements{Replicate(), Shard(1)}},
            std::tuple{std::vector<int64_t>{5, 7}, Placements{Partial(), Shard(1)},
                       Placements{Partial(), Shard(0)}}}) {
        const std::string what = pair_label(from, to);
        in_case(what, [&] {
          failures.expect_eq(rank, what + " plan", redistribute_plan(Shape(global), from, to, mesh),
                             std::vector<std::string>{fmt::format(
                                 "all_to_all(mesh dim 1, dim {} -> {})", from[1].dim, to[1].dim)});
          check_redistribute(failures, rank, what, global, from, to, mesh, {2, 3},
                             unravel(rank, {2, 3}), true);
        });
      }
    });
    REQUIRE_NO_FAILURES(failures);
  }
}

TEST_CASE("redistribute_plan: the steps of a few transitions", "[redistribute]") {
  Failures failures;
  run_ranks(4, [&](ProcessGroupPtr world) {
    const int rank = world->rank();
    DeviceMesh line = make_mesh(world, {4});
    DeviceMesh grid = make_mesh(world, {2, 2});
    using Steps = std::vector<std::string>;
    const Shape shape{8, 6};
    auto expect_plan = [&](const DeviceMesh& mesh, const Placements& from, const Placements& to,
                           const Steps& want) {
      failures.expect_eq(rank, pair_label(from, to), redistribute_plan(shape, from, to, mesh),
                         want);
    };
    expect_plan(line, {Shard(0)}, {Replicate()}, {"all_gather(mesh dim 0, dim 0)"});
    expect_plan(line, {Partial()}, {Shard(0)}, {"reduce_scatter(mesh dim 0, dim 0, sum)"});
    expect_plan(line, {Partial()}, {Replicate()}, {"all_reduce(mesh dim 0, sum)"});
    expect_plan(line, {Shard(0)}, {Shard(1)}, {"all_to_all(mesh dim 0, dim 0 -> 1)"});
    expect_plan(line, {Replicate()}, {Shard(0)}, {"chunk(mesh dim 0, dim 0)"});
    expect_plan(line, {Replicate()}, {Partial()}, {"make_partial(mesh dim 0, sum)"});
    expect_plan(line, {Shard(1)}, {Shard(1)}, {});
    // Avg cannot reduce-scatter: all-reduce, then a local chunk.
    expect_plan(line, {Partial(RedOp::Avg)}, {Shard(0)},
                {"all_reduce(mesh dim 0, avg)", "chunk(mesh dim 0, dim 0)"});
    expect_plan(line, {Partial(RedOp::Max)}, {Shard(1)},
                {"reduce_scatter(mesh dim 0, dim 1, max)"});
    // Nested shards of one tensor dim: the inner one is gathered first.
    expect_plan(grid, {Shard(0), Shard(0)}, {Replicate(), Replicate()},
                {"all_gather(mesh dim 1, dim 0)", "all_gather(mesh dim 0, dim 0)"});
    expect_plan(grid, {Replicate(), Shard(0)}, {Shard(0), Replicate()},
                {"all_gather(mesh dim 1, dim 0)", "chunk(mesh dim 0, dim 0)"});
    expect_plan(
        grid, {Partial(), Partial()}, {Shard(0), Shard(1)},
        {"reduce_scatter(mesh dim 0, dim 0, sum)", "reduce_scatter(mesh dim 1, dim 1, sum)"});
    // Once the inner shard is gathered, the outer one moves by all_to_all.
    expect_plan(grid, {Shard(0), Shard(1)}, {Shard(1), Shard(0)},
                {"all_gather(mesh dim 1, dim 1)", "all_to_all(mesh dim 0, dim 0 -> 1)",
                 "chunk(mesh dim 1, dim 0)"});
  });
  REQUIRE_NO_FAILURES(failures);
}

TEST_CASE("redistribute: each single-step plan launches exactly its collective", "[redistribute]") {
  struct Case {
    Placements from, to;
    const char* op;  // the one collective, or nullptr for none
  };
  const std::vector<Case> cases = {
      {{Shard(0)}, {Replicate()}, "all_gather"},   {{Partial()}, {Replicate()}, "all_reduce"},
      {{Partial()}, {Shard(0)}, "reduce_scatter"}, {{Shard(0)}, {Shard(1)}, "all_to_all"},
      {{Replicate()}, {Shard(0)}, nullptr},        {{Replicate()}, {Shard(1)}, nullptr},
      {{Replicate()}, {Partial()}, nullptr},
  };
  for (const std::vector<int64_t>& global :
       {std::vector<int64_t>{8, 6}, std::vector<int64_t>{7, 5}}) {
    DYNAMIC_SECTION("mesh 4 " << shape_label(global)) {
      Failures failures;
      run_ranks(4, [&](ProcessGroupPtr world) {
        DeviceMesh mesh = make_mesh(world, {4});
        const int rank = world->rank();
        ProcessGroupPtr group = mesh.get_group();
        NoGradGuard no_grad;
        for (const Case& c : cases) {
          const std::string what = pair_label(c.from, c.to);
          in_case(what, [&] {
            Source src = make_source(global, c.from, mesh, {4}, {rank});
            const uint64_t group_before = group->ledger().size();
            const uint64_t all_before = launches(mesh, world);
            src.dt.redistribute(c.to);
            const uint64_t launched = launches(mesh, world) - all_before;
            failures.expect_eq(rank, what + " collectives launched", launched,
                               uint64_t{c.op != nullptr ? 1u : 0u});
            if (c.op != nullptr && group->ledger().size() == group_before + 1) {
              failures.expect_eq(rank, what + " the collective", group->ledger().tail(1).at(0).op,
                                 std::string(c.op));
            }
          });
        }
      });
      REQUIRE_NO_FAILURES(failures);
    }
  }
}

TEST_CASE("redistribute_async: the pending result equals the synchronous one", "[redistribute]") {
  const std::vector<std::pair<Placements, Placements>> pairs = {
      {{Shard(0)}, {Replicate()}}, {{Partial()}, {Replicate()}}, {{Partial()}, {Shard(0)}},
      {{Partial()}, {Shard(1)}},   {{Shard(0)}, {Shard(1)}},     {{Shard(1)}, {Shard(0)}},
      {{Replicate()}, {Shard(0)}}, {{Replicate()}, {Partial()}}, {{Shard(1)}, {Shard(1)}},
  };
  for (int64_t k : {1, 3, 4}) {
    for (const auto& global : kShapes) {
      DYNAMIC_SECTION(mesh_label({k}) << " " << shape_label(global)) {
        Failures failures;
        run_ranks(static_cast<int>(k), [&](ProcessGroupPtr world) {
          DeviceMesh mesh = make_mesh(world, {k});
          const int rank = world->rank();
          NoGradGuard no_grad;
          for (const auto& [from, to] : pairs) {
            const std::string what = pair_label(from, to);
            in_case(what, [&] {
              Source src = make_source(global, from, mesh, {k}, {rank});
              DTensor sync = src.dt.redistribute(to);
              const uint64_t before = launches(mesh, world);
              PendingDTensor pending = redistribute_async(src.dt, to);
              const uint64_t launched = launches(mesh, world) - before;
              const bool communicates = from != to && !from[0].is_replicate();
              failures.expect_eq(rank, what + " launched on return", launched,
                                 uint64_t{communicates ? 1u : 0u});
              if (!communicates) failures.expect(rank, what + " ready at once", pending.ready());
              DTensor got = pending.wait();
              failures.expect(rank, what + " ready after wait", pending.ready());
              failures.expect_eq(rank, what + " placements", placements_str(got.placements()),
                                 placements_str(to));
              failures.expect_eq(rank, what + " shape", got.shape().vec(), global);
              expect_tensor(failures, rank, what + " value", got.to_local(),
                            sync.to_local().shape().vec(),
                            values_of(test::on_cpu(sync.to_local())));
            });
          }
        });
        REQUIRE_NO_FAILURES(failures);
      }
    }
  }
}

TEST_CASE("from_local: without a global shape, uneven shards are summed up", "[redistribute]") {
  std::vector<std::pair<MeshShape, Placements>> cases;
  for (int64_t k = 1; k <= 5; ++k) {
    for (const Placement& p : {Shard(0), Shard(1), Replicate(), Partial()})
      cases.push_back({{k}, {p}});
  }
  for (const MeshShape& ms : {MeshShape{2, 2}, MeshShape{2, 3}}) {
    for (const Placements& p : all_placements(2))
      cases.push_back({ms, p});
  }
  for (const auto& [ms, placements] : cases) {
    DYNAMIC_SECTION(mesh_label(ms) << " " << placements_str(placements)) {
      Failures failures;
      run_ranks(world_of(ms), [&](ProcessGroupPtr world) {
        DeviceMesh mesh = make_mesh(world, ms);
        const int rank = world->rank();
        for (const std::vector<int64_t>& global :
             {std::vector<int64_t>{6, 4}, std::vector<int64_t>{7, 5}, std::vector<int64_t>{2, 3},
              std::vector<int64_t>{1, 11}}) {
          in_case(shape_label(global), [&] {
            const Block b = block_of(global, placements, ms, unravel(rank, ms));
            DTensor t = DTensor::from_local(device_zeros(Shape(b.shape)), mesh, placements);
            failures.expect_eq(rank, shape_label(global) + " inferred global shape",
                               t.shape().vec(), global);
          });
        }
      });
      REQUIRE_NO_FAILURES(failures);
    }
  }
}

TEST_CASE("local_shape_for and local_offset_for follow chunk arithmetic", "[redistribute]") {
  for (const MeshShape& ms : {MeshShape{1}, MeshShape{2}, MeshShape{3}, MeshShape{4}, MeshShape{5},
                              MeshShape{2, 2}, MeshShape{2, 3}}) {
    DYNAMIC_SECTION(mesh_label(ms)) {
      Failures failures;
      run_ranks(world_of(ms), [&](ProcessGroupPtr world) {
        DeviceMesh mesh = make_mesh(world, ms);
        const int rank = world->rank();
        for (const std::vector<int64_t>& global :
             {std::vector<int64_t>{6, 4}, std::vector<int64_t>{7, 5}, std::vector<int64_t>{2, 3},
              std::vector<int64_t>{0, 3}, std::vector<int64_t>{13, 1}}) {
          for (const Placements& p : all_placements(ms.size())) {
            const std::string what = shape_label(global) + " " + placements_str(p);
            // Every coordinate (any rank may ask about any other), and this
            // rank's own when none is given.
            for (int64_t pos = 0; pos < numel_of(ms); ++pos) {
              const std::vector<int64_t> coord = unravel(pos, ms);
              const Block b = block_of(global, p, ms, coord);
              const std::string at = fmt::format("{} at [{}]", what, fmt::join(coord, ","));
              failures.expect_eq(rank, at + " local_shape_for",
                                 DTensor::local_shape_for(Shape(global), p, mesh, coord).vec(),
                                 b.shape);
              failures.expect_eq(rank, at + " local_offset_for",
                                 DTensor::local_offset_for(Shape(global), p, mesh, coord),
                                 b.offset);
            }
            const Block mine = block_of(global, p, ms, unravel(rank, ms));
            failures.expect_eq(rank, what + " local_shape_for (own)",
                               DTensor::local_shape_for(Shape(global), p, mesh).vec(), mine.shape);
            failures.expect_eq(rank, what + " local_offset_for (own)",
                               DTensor::local_offset_for(Shape(global), p, mesh), mine.offset);
          }
        }
      });
      REQUIRE_NO_FAILURES(failures);
    }
  }
}

TEST_CASE("distribute: shards slice the full tensor, Partial(sum) keeps it on coordinate 0",
          "[redistribute]") {
  for (const MeshShape& ms :
       {MeshShape{1}, MeshShape{3}, MeshShape{4}, MeshShape{5}, MeshShape{2, 2}, MeshShape{2, 3}}) {
    DYNAMIC_SECTION(mesh_label(ms)) {
      Failures failures;
      run_ranks(world_of(ms), [&](ProcessGroupPtr world) {
        DeviceMesh mesh = make_mesh(world, ms);
        const int rank = world->rank();
        const std::vector<int64_t> coord = unravel(rank, ms);
        const Placements replicated(ms.size(), Replicate());
        for (const auto& global : kShapes) {
          const Values x = global_x(numel_of(global));
          Tensor full = test::on_test_device(tensor_of(x, Shape(global)));
          std::vector<Placements> lists = all_placements(ms.size());
          lists.push_back(Placements(ms.size(), Partial(RedOp::Max)));
          for (const Placements& p : lists) {
            const std::string what = shape_label(global) + " " + placements_str(p);
            in_case(what, [&] {
              DTensor t = DTensor::distribute(full, mesh, p);
              const Block b = block_of(global, p, ms, coord);
              // Partial(max) of equal values is the value: every rank keeps it.
              const Values want = p[0].is_partial() && p[0].op == RedOp::Max
                                      ? x
                                      : expected_values(x, replicated, p, ms, coord);
              expect_tensor(failures, rank, what + " local", t.to_local(), b.shape,
                            take(want, global, b));
              failures.expect_eq(rank, what + " global shape", t.shape().vec(), global);
              NoGradGuard no_grad;
              expect_tensor(failures, rank, what + " full_tensor()", t.full_tensor(), global, x);
            });
          }
        }
      });
      REQUIRE_NO_FAILURES(failures);
    }
  }
}

}  // namespace
}  // namespace tandem
