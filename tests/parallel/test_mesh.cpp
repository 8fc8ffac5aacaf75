// DeviceMesh on the threads backend (DESIGN §6, Note [Mesh groups]): shapes,
// coordinates, the members of every group, slicing, flattening, group reuse
// and the errors of the front end.
//
// Expected values come from the test's own row-major arithmetic over the
// mesh's rank list, never from DeviceMesh itself. A group's members are
// checked through real data movement: an all_gather of every member's world
// rank (which also gives their order) and an all_reduce of (1 << world rank).
// Rank functions run on the rank threads of run_ranks, where Catch2's
// assertions must not be used: each rank records what it found in a Failures
// list, and the test thread asserts that it is empty. Meshes are built on
// test_device() and the collectives that check their groups move data there
// (tests/support/test_device.h).
#include <catch2/catch.hpp>

#include <fmt/ranges.h>

#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include "tandem/comm/threads/threads_backend.h"
#include "tandem/parallel/device_mesh.h"
#include "tests/support/rank_checks.h"
#include "tests/support/test_device.h"
#include "tests/support/test_util.h"

namespace tandem {
namespace {

using tandem::testing::Failures;

using test::ravel;
using test::unravel;
using test::values_of;

// A list of dim names. A bare slice({"a", "c"}) does not compile: two string
// literals also match std::string's (first, last) iterator constructor, so
// the call is ambiguous between slice(string) and slice(vector<string>).
using Names = std::vector<std::string>;

// A mesh to build: shape, names and the world rank at each row-major position
// (empty: identity).
struct MeshCase {
  std::vector<int64_t> shape;
  std::vector<std::string> names;
  std::vector<int> ranks;

  int world() const {
    return static_cast<int>(
        std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>()));
  }
  std::vector<int> rank_list() const {
    if (!ranks.empty()) return ranks;
    std::vector<int> r(static_cast<size_t>(world()));
    std::iota(r.begin(), r.end(), 0);
    return r;
  }
  int rank_at(const std::vector<int64_t>& coord) const {
    return rank_list()[static_cast<size_t>(ravel(coord, shape))];
  }
  std::vector<int64_t> coordinate_of(int world_rank) const {
    std::vector<int> r = rank_list();
    int64_t position = std::find(r.begin(), r.end(), world_rank) - r.begin();
    return unravel(position, shape);
  }
  // World ranks of the group through `coord` spanning the root dims `dims`,
  // row-major over `dims` in the order given.
  std::vector<int> members(std::vector<int64_t> coord, const std::vector<int>& dims) const {
    std::vector<int64_t> sub_shape;
    for (int d : dims)
      sub_shape.push_back(shape[d]);
    std::vector<int> out;
    for (int64_t m = 0; m < test::numel_of(sub_shape); ++m) {
      std::vector<int64_t> idx = unravel(m, sub_shape);
      for (size_t i = 0; i < dims.size(); ++i)
        coord[dims[i]] = idx[i];
      out.push_back(rank_at(coord));
    }
    return out;
  }
  DeviceMesh build(const ProcessGroupPtr& world) const {
    return DeviceMesh(world, shape, names, ranks, test::test_device());
  }
  std::string label() const {
    std::string s =
        fmt::format("shape [{}] names [{}]", fmt::join(shape, ","), fmt::join(names, ","));
    if (!ranks.empty()) s += fmt::format(" ranks [{}]", fmt::join(ranks, ","));
    return s;
  }
};

const std::vector<MeshCase> kMeshes = {
    {{4}, {"x"}, {}},
    {{5}, {"x"}, {2, 4, 1, 0, 3}},
    {{2, 2}, {"dp", "tp"}, {}},
    {{2, 3}, {"dp", "tp"}, {}},
    {{3, 2}, {"dp", "tp"}, {}},
    {{2, 3}, {"dp", "tp"}, {3, 1, 5, 0, 4, 2}},
    {{2, 2, 2}, {"a", "b", "c"}, {}},
    {{2, 2, 2}, {"a", "b", "c"}, {7, 0, 6, 1, 5, 2, 4, 3}},
};

// Checks `group` against the expected members (world ranks in group order)
// and this rank's place among them, by metadata and by moving data.
void check_group(Failures& failures, int world_rank, const std::string& what,
                 const ProcessGroupPtr& group, const std::vector<int>& members) {
  if (group == nullptr) {
    failures.add(fmt::format("rank {}: {}: no group", world_rank, what));
    return;
  }
  const int want_rank =
      static_cast<int>(std::find(members.begin(), members.end(), world_rank) - members.begin());
  failures.expect_eq(world_rank, what + " size", group->size(), static_cast<int>(members.size()));
  failures.expect_eq(world_rank, what + " rank", group->rank(), want_rank);
  failures.expect_eq(world_rank, what + " world_ranks", group->world_ranks(), members);

  WorkPtr gathered = group->all_gather(
      test::on_test_device(ops::full(Shape{1}, static_cast<double>(world_rank), DType::I64)));
  gathered->synchronize();
  std::vector<double> want_gather(members.begin(), members.end());
  failures.expect_eq(world_rank, what + " all_gather on the test device",
                     gathered->result().device().str(), test::test_device().str());
  failures.expect_eq(world_rank, what + " all_gather of world ranks",
                     values_of(test::on_cpu(gathered->result())), want_gather);

  WorkPtr bits = group->all_reduce(test::on_test_device(
      ops::full(Shape{1}, static_cast<double>(int64_t{1} << world_rank), DType::I64)));
  bits->synchronize();
  int64_t want_bits = 0;
  for (int m : members)
    want_bits |= int64_t{1} << m;
  failures.expect_eq(world_rank, what + " all_reduce of 1 << world rank",
                     test::on_cpu(bits->result()).item<int64_t>(), want_bits);
}

std::vector<int> iota_dims(int n) {
  std::vector<int> d(static_cast<size_t>(n));
  std::iota(d.begin(), d.end(), 0);
  return d;
}

TEST_CASE("DeviceMesh: shape, names, coordinate and local ranks", "[mesh]") {
  for (const MeshCase& mc : kMeshes) {
    DYNAMIC_SECTION(mc.label()) {
      Failures failures;
      run_ranks(mc.world(), [&](ProcessGroupPtr world) {
        const int r = world->rank();
        DeviceMesh mesh = mc.build(world);
        const std::vector<int64_t> coord = mc.coordinate_of(r);
        failures.expect_eq(r, "ndim", mesh.ndim(), static_cast<int>(mc.shape.size()));
        failures.expect_eq(r, "size()", mesh.size(), static_cast<int64_t>(mc.world()));
        failures.expect_eq(r, "shape", mesh.shape(), mc.shape);
        failures.expect_eq(r, "dim_names", mesh.dim_names(), mc.names);
        failures.expect_eq(r, "coordinate", mesh.coordinate(), coord);
        failures.expect_eq(r, "device", mesh.device().str(), test::test_device().str());
        for (int d = 0; d < mesh.ndim(); ++d) {
          const std::string& name = mc.names[d];
          failures.expect_eq(r, "dim_index " + name, mesh.dim_index(name), d);
          failures.expect_eq(r, "size(" + name + ")", mesh.size(name), mc.shape[d]);
          failures.expect_eq(r, fmt::format("size({})", d), mesh.size(d), mc.shape[d]);
          failures.expect_eq(r, "get_local_rank(" + name + ")", mesh.get_local_rank(name),
                             static_cast<int>(coord[d]));
          failures.expect_eq(r, fmt::format("get_local_rank({})", d), mesh.get_local_rank(d),
                             static_cast<int>(coord[d]));
        }
        failures.expect_eq(r, "rank_at(coordinate)", mesh.rank_at(coord), r);
        for (int64_t p = 0; p < mc.world(); ++p) {
          std::vector<int64_t> c = unravel(p, mc.shape);
          failures.expect_eq(r, fmt::format("rank_at([{}])", fmt::join(c, ",")), mesh.rank_at(c),
                             mc.rank_at(c));
        }
      });
      REQUIRE_NO_FAILURES(failures);
    }
  }
}

TEST_CASE("DeviceMesh: the group of every dim has the right members", "[mesh]") {
  for (const MeshCase& mc : kMeshes) {
    DYNAMIC_SECTION(mc.label()) {
      Failures failures;
      run_ranks(mc.world(), [&](ProcessGroupPtr world) {
        const int r = world->rank();
        DeviceMesh mesh = mc.build(world);
        const std::vector<int64_t> coord = mc.coordinate_of(r);
        for (int d = 0; d < mesh.ndim(); ++d) {
          const std::vector<int> members = mc.members(coord, {d});
          check_group(failures, r, "get_group(" + mc.names[d] + ")", mesh.get_group(mc.names[d]),
                      members);
          check_group(failures, r, fmt::format("get_group({})", d), mesh.get_group(d), members);
        }
        if (mesh.ndim() == 1) {
          check_group(failures, r, "get_group()", mesh.get_group(), mc.members(coord, {0}));
        }
      });
      REQUIRE_NO_FAILURES(failures);
    }
  }
}

// Checks a sub-mesh spanning the root dims `dims` (in that order).
void check_sub_mesh(Failures& failures, int r, const std::string& what, const DeviceMesh& root,
                    const DeviceMesh& sub, const MeshCase& mc, const std::vector<int>& dims) {
  const std::vector<int64_t> coord = mc.coordinate_of(r);
  std::vector<int64_t> want_shape, want_coord;
  std::vector<std::string> want_names;
  for (int d : dims) {
    want_shape.push_back(mc.shape[d]);
    want_coord.push_back(coord[d]);
    want_names.push_back(mc.names[d]);
  }
  failures.expect_eq(r, what + " shape", sub.shape(), want_shape);
  failures.expect_eq(r, what + " dim_names", sub.dim_names(), want_names);
  failures.expect_eq(r, what + " coordinate", sub.coordinate(), want_coord);
  failures.expect_eq(r, what + " size()", sub.size(), test::numel_of(want_shape));
  failures.expect_eq(r, what + " device", sub.device().str(), test::test_device().str());
  for (size_t i = 0; i < dims.size(); ++i) {
    const int d = dims[i];
    failures.expect_eq(r, what + " get_local_rank(" + mc.names[d] + ")",
                       sub.get_local_rank(mc.names[d]), static_cast<int>(coord[d]));
    ProcessGroupPtr g = sub.get_group(static_cast<int>(i));
    failures.expect(r, what + " get_group(" + mc.names[d] + ") is the root mesh's group",
                    g == root.get_group(mc.names[d]));
    check_group(failures, r, what + " get_group(" + mc.names[d] + ")", g, mc.members(coord, {d}));
  }
  // Every position of the sub-mesh maps to the rank of the root mesh there.
  for (int64_t p = 0; p < test::numel_of(want_shape); ++p) {
    std::vector<int64_t> sub_coord = unravel(p, want_shape);
    std::vector<int64_t> root_coord = coord;
    for (size_t i = 0; i < dims.size(); ++i)
      root_coord[dims[i]] = sub_coord[i];
    failures.expect_eq(r, fmt::format("{} rank_at([{}])", what, fmt::join(sub_coord, ",")),
                       sub.rank_at(sub_coord), mc.rank_at(root_coord));
  }
}

TEST_CASE("DeviceMesh: slice by one name and by an ordered tuple", "[mesh]") {
  for (const MeshCase& mc : kMeshes) {
    if (mc.shape.size() < 2) continue;
    DYNAMIC_SECTION(mc.label()) {
      Failures failures;
      run_ranks(mc.world(), [&](ProcessGroupPtr world) {
        const int r = world->rank();
        DeviceMesh mesh = mc.build(world);
        const std::vector<int64_t> coord = mc.coordinate_of(r);
        for (int d = 0; d < mesh.ndim(); ++d) {
          DeviceMesh sub = mesh.slice(mc.names[d]);
          const std::string what = "slice(" + mc.names[d] + ")";
          check_sub_mesh(failures, r, what, mesh, sub, mc, {d});
          failures.expect(r, what + ".get_group() is the root's group",
                          sub.get_group() == mesh.get_group(d));
        }
        // Every ordered tuple of two distinct dims (non-adjacent ones on 3-D).
        for (int d0 = 0; d0 < mesh.ndim(); ++d0) {
          for (int d1 = 0; d1 < mesh.ndim(); ++d1) {
            if (d0 == d1) continue;
            DeviceMesh sub = mesh.slice(Names{mc.names[d0], mc.names[d1]});
            check_sub_mesh(failures, r, fmt::format("slice({{{},{}}})", mc.names[d0], mc.names[d1]),
                           mesh, sub, mc, {d0, d1});
            // Slicing a slice lands on the same sub-mesh as slicing the root.
            failures.expect(r, "slice of a slice",
                            sub.slice(mc.names[d1]) == mesh.slice(mc.names[d1]));
          }
        }
        failures.expect(r, "slice of every dim == root", mesh.slice(mc.names) == mesh);
        if (mesh.ndim() == 3) {
          // slice({"a","c"}) skips the middle dim; its flattened group is
          // row-major over (a, c), and over (c, a) for the reversed tuple.
          DeviceMesh ac = mesh.slice(Names{"a", "c"});
          failures.expect_eq(r, "slice({a,c}) coordinate", ac.coordinate(),
                             std::vector<int64_t>{coord[0], coord[2]});
          DeviceMesh flat_ac = ac.flatten("ac");
          failures.expect_eq(r, "slice({a,c}).flatten coordinate", flat_ac.coordinate(),
                             std::vector<int64_t>{coord[0] * 2 + coord[2]});
          check_group(failures, r, "slice({a,c}).flatten(ac)", flat_ac.get_group(),
                      mc.members(coord, {0, 2}));
          DeviceMesh flat_ca = mesh.slice(Names{"c", "a"}).flatten("ca");
          failures.expect_eq(r, "slice({c,a}).flatten coordinate", flat_ca.coordinate(),
                             std::vector<int64_t>{coord[2] * 2 + coord[0]});
          check_group(failures, r, "slice({c,a}).flatten(ca)", flat_ca.get_group(),
                      mc.members(coord, {2, 0}));
        }
      });
      REQUIRE_NO_FAILURES(failures);
    }
  }
}

TEST_CASE("DeviceMesh: flatten, then get_group and slice by the new name", "[mesh]") {
  for (const MeshCase& mc : kMeshes) {
    DYNAMIC_SECTION(mc.label()) {
      Failures failures;
      run_ranks(mc.world(), [&](ProcessGroupPtr world) {
        const int r = world->rank();
        DeviceMesh mesh = mc.build(world);
        const std::vector<int64_t> coord = mc.coordinate_of(r);
        const std::vector<int> all = mc.members(coord, iota_dims(mesh.ndim()));
        DeviceMesh flat = mesh.flatten("flat");
        failures.expect_eq(r, "flatten shape", flat.shape(),
                           std::vector<int64_t>{static_cast<int64_t>(mc.world())});
        failures.expect_eq(r, "flatten dim_names", flat.dim_names(),
                           std::vector<std::string>{"flat"});
        failures.expect_eq(r, "flatten coordinate", flat.coordinate(),
                           std::vector<int64_t>{ravel(coord, mc.shape)});
        check_group(failures, r, "flatten(flat).get_group()", flat.get_group(), all);
        failures.expect_eq(r, "flatten device", flat.device().str(), test::test_device().str());
        failures.expect(r, "root get_group(flat) is the flattened group",
                        mesh.get_group("flat") == flat.get_group());
        failures.expect(r, "root slice(flat) == flatten(flat)", mesh.slice("flat") == flat);
        failures.expect(r, "slice(flat).get_group() is the flattened group",
                        mesh.slice("flat").get_group() == flat.get_group());
        failures.expect(r, "flatten(flat) again reuses its group",
                        mesh.flatten("flat").get_group() == flat.get_group());
        if (mesh.ndim() == 3) {
          // Flatten two dims of a slice; the name then works on the root too.
          DeviceMesh bc = mesh.slice(Names{"b", "c"}).flatten("bc");
          check_group(failures, r, "slice({b,c}).flatten(bc)", bc.get_group(),
                      mc.members(coord, {1, 2}));
          failures.expect(r, "root get_group(bc)", mesh.get_group("bc") == bc.get_group());
          DeviceMesh a_bc = mesh.slice(Names{"a", "bc"});
          failures.expect_eq(r, "slice({a,bc}) shape", a_bc.shape(), std::vector<int64_t>{2, 4});
          failures.expect_eq(r, "slice({a,bc}) coordinate", a_bc.coordinate(),
                             std::vector<int64_t>{coord[0], coord[1] * 2 + coord[2]});
          failures.expect(r, "slice({a,bc}).get_group(1) is the bc group",
                          a_bc.get_group(1) == bc.get_group());
          check_group(failures, r, "slice({a,bc}).get_group(a)", a_bc.get_group("a"),
                      mc.members(coord, {0}));
        }
      });
      REQUIRE_NO_FAILURES(failures);
    }
  }
}

TEST_CASE("DeviceMesh: groups are created once and reused", "[mesh]") {
  const MeshCase mc = {{2, 2, 2}, {"a", "b", "c"}, {7, 0, 6, 1, 5, 2, 4, 3}};
  Failures failures;
  run_ranks(mc.world(), [&](ProcessGroupPtr world) {
    const int r = world->rank();
    DeviceMesh mesh = mc.build(world);
    const uint64_t world_seq = world->ledger().size();
    for (int d = 0; d < mesh.ndim(); ++d) {
      ProcessGroupPtr g = mesh.get_group(d);
      const std::string what = "dim " + mc.names[d];
      failures.expect(r, what + ": get_group(d) twice", mesh.get_group(d) == g);
      failures.expect(r, what + ": get_group(name)", mesh.get_group(mc.names[d]) == g);
      failures.expect(r, what + ": slice(name).get_group()",
                      mesh.slice(mc.names[d]).get_group() == g);
      failures.expect(r, what + ": copy of the mesh", DeviceMesh(mesh).get_group(d) == g);
      // Collectives issued through either handle land in one ledger.
      const uint64_t before = g->ledger().size();
      mesh.get_group(d)->barrier()->synchronize();
      mesh.get_group(mc.names[d])->barrier()->synchronize();
      failures.expect_eq(r, what + ": ledger entries after two barriers", g->ledger().size(),
                         before + 2);
    }
    ProcessGroupPtr ab = mesh.slice(Names{"a", "b"}).flatten("ab").get_group();
    failures.expect(
        r, "flattened group reused",
        mesh.slice(Names{"a", "b"}).flatten("ab").get_group() == ab && mesh.get_group("ab") == ab);
    // Building, slicing and flattening ran no collective on the world group.
    failures.expect_eq(r, "world ledger untouched", world->ledger().size(), world_seq);
    // A second root mesh has its own cache: new groups, same members.
    DeviceMesh other = mc.build(world);
    failures.expect(r, "a second root mesh creates its own groups",
                    other.get_group(0) != mesh.get_group(0));
    failures.expect(r, "meshes of different roots differ", !(other == mesh));
    check_group(failures, r, "second root get_group(a)", other.get_group("a"),
                mc.members(mc.coordinate_of(r), {0}));
  });
  REQUIRE_NO_FAILURES(failures);
}

using Catch::Matchers::Contains;

TEST_CASE("DeviceMesh: errors name what was expected", "[mesh]") {
  auto on_2x2 = [](const std::function<void(const DeviceMesh&)>& fn) {
    run_ranks(4, [&](ProcessGroupPtr world) { fn(DeviceMesh(world, {2, 2}, {"dp", "tp"})); });
  };
  SECTION("unknown dim name lists the known dims") {
    // (Catch2 v2 combined matchers hold pointers to their parts: build them
    // inside each assertion, never in a variable.)
    REQUIRE_THROWS_WITH(on_2x2([](const DeviceMesh& m) { m.get_group("pp"); }),
                        Contains("[dp,tp]") && Contains("\"pp\""));
    REQUIRE_THROWS_WITH(on_2x2([](const DeviceMesh& m) { m.size("pp"); }),
                        Contains("[dp,tp]") && Contains("\"pp\""));
    REQUIRE_THROWS_WITH(on_2x2([](const DeviceMesh& m) { m.get_local_rank("pp"); }),
                        Contains("[dp,tp]") && Contains("\"pp\""));
    REQUIRE_THROWS_WITH(on_2x2([](const DeviceMesh& m) { m.slice("pp"); }),
                        Contains("[dp,tp]") && Contains("\"pp\""));
    REQUIRE_THROWS_WITH(on_2x2([](const DeviceMesh& m) {
                          m.slice(Names{"dp", "pp"});
                        }),
                        Contains("[dp,tp]") && Contains("\"pp\""));
  }
  SECTION("get_group() without a dim on a 2-D mesh is ambiguous") {
    REQUIRE_THROWS_WITH(on_2x2([](const DeviceMesh& m) { m.get_group(); }),
                        Contains("ambiguous") && Contains("2-D"));
  }
  SECTION("a dim index out of range") {
    REQUIRE_THROWS_WITH(on_2x2([](const DeviceMesh& m) { m.get_group(2); }),
                        Contains("expected dim in [0, 2), got 2"));
  }
  SECTION("slicing one dim twice") {
    REQUIRE_THROWS_WITH(on_2x2([](const DeviceMesh& m) {
                          m.slice(Names{"dp", "dp"});
                        }),
                        Contains("each dim once"));
  }
  SECTION("the rank list must be a permutation of the world") {
    for (const std::vector<int>& ranks :
         {std::vector<int>{0, 1, 1, 3}, std::vector<int>{0, 1, 2}, std::vector<int>{0, 1, 2, 3, 0},
          std::vector<int>{0, 1, 2, 4}}) {
      INFO(fmt::format("ranks [{}]", fmt::join(ranks, ",")));
      REQUIRE_THROWS_WITH(
          run_ranks(4,
                    [&](ProcessGroupPtr w) {
                      DeviceMesh(w, {2, 2}, {"dp", "tp"}, ranks);
                    }),
          Contains("permutation of 0..3") && Contains(fmt::format("[{}]", fmt::join(ranks, ","))));
    }
  }
  SECTION("the shape must cover the world") {
    REQUIRE_THROWS_WITH(run_ranks(4,
                                  [](ProcessGroupPtr w) {
                                    DeviceMesh(w, {2, 3}, {"dp", "tp"});
                                  }),
                        Contains("world's 4 ranks") && Contains("[2,3]"));
  }
  SECTION("one distinct name per dim") {
    REQUIRE_THROWS_WITH(run_ranks(4,
                                  [](ProcessGroupPtr w) {
                                    DeviceMesh(w, {2, 2}, {"dp", "dp"});
                                  }),
                        Contains("distinct") && Contains("[dp,dp]"));
    REQUIRE_THROWS_WITH(run_ranks(4,
                                  [](ProcessGroupPtr w) {
                                    DeviceMesh(w, {2, 2}, {"dp"});
                                  }),
                        Contains("one name per dim"));
  }
  SECTION("flatten with the name of an existing dim") {
    REQUIRE_THROWS_WITH(on_2x2([](const DeviceMesh& m) { m.flatten("tp"); }),
                        Contains("a dim of the mesh") && Contains("\"tp\""));
    REQUIRE_THROWS_WITH(on_2x2([](const DeviceMesh& m) { m.slice("dp").flatten("dp"); }),
                        Contains("a dim of the mesh"));
  }
  SECTION("flatten reusing a name flattened from other dims") {
    REQUIRE_THROWS_WITH(on_2x2([](const DeviceMesh& m) {
                          m.flatten("f");
                          m.slice("tp").flatten("f");
                        }),
                        Contains("already flattened") && Contains("\"f\""));
  }
}

}  // namespace
}  // namespace tandem
