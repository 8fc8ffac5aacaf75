// DTensor redistribution's front end on the threads backend: bad placements
// and shapes are errors that say what was expected (test_redistribute.cpp has
// the redistributions themselves). Meshes and local tensors live on
// test_device() (tests/support/test_device.h).
#include <catch2/catch.hpp>

#include <functional>

#include "tandem/comm/threads/threads_backend.h"
#include "tandem/parallel/dtensor.h"
#include "tests/support/test_device.h"

namespace tandem {
namespace {

using Catch::Matchers::Contains;

// Zeros on test_device(): a local tensor whose values do not matter.
Tensor device_zeros(const Shape& shape) {
  return ops::zeros(shape, DType::F32, test::test_device());
}

DeviceMesh make_mesh(const ProcessGroupPtr& world, const std::vector<int64_t>& shape) {
  return DeviceMesh(world, shape, {"x"}, {}, test::test_device());
}

TEST_CASE("redistribute: errors name what was expected", "[redistribute]") {
  // Every rank fails the same way; run_ranks rethrows it on this thread.
  auto on_line = [](const std::function<void(const DeviceMesh&)>& fn) {
    run_ranks(2, [&](ProcessGroupPtr world) { fn(make_mesh(world, {2})); });
  };
  SECTION("wrong number of placements") {
    REQUIRE_THROWS_WITH(
        on_line([](const DeviceMesh& mesh) {
          DTensor t = DTensor::from_local(device_zeros({3, 4}), mesh, {Shard(0)}, Shape{6, 4});
          t.redistribute({Replicate(), Replicate()});
        }),
        Contains("one placement per mesh dim (1)"));
    REQUIRE_THROWS_WITH(
        on_line([](const DeviceMesh& mesh) {
          DTensor::from_local(device_zeros({3, 4}), mesh, {Shard(0), Shard(1)}, Shape{6, 4});
        }),
        Contains("one placement per mesh dim (1)"));
    REQUIRE_THROWS_WITH(on_line([](const DeviceMesh& mesh) {
                          DTensor::distribute(device_zeros({6, 4}), mesh, {});
                        }),
                        Contains("one placement per mesh dim (1)"));
  }
  SECTION("Partial(sum) -> Partial(max)") {
    REQUIRE_THROWS_WITH(
        on_line([](const DeviceMesh& mesh) {
          DTensor t = DTensor::from_local(device_zeros({6, 4}), mesh, {Partial()}, Shape{6, 4});
          t.redistribute({Partial(RedOp::Max)});
        }),
        Contains("Partial(sum)") && Contains("Partial(max)") && Contains("cannot be converted"));
  }
  SECTION("a shard dim beyond the tensor") {
    REQUIRE_THROWS(on_line([](const DeviceMesh& mesh) {
      DTensor t = DTensor::from_local(device_zeros({6, 4}), mesh, {Replicate()}, Shape{6, 4});
      t.redistribute({Shard(2)});
    }));
  }
  SECTION("a local tensor that does not fit the global shape") {
    REQUIRE_THROWS_WITH(on_line([](const DeviceMesh& mesh) {
                          DTensor::from_local(device_zeros({4, 4}), mesh, {Shard(0)}, Shape{6, 4});
                        }),
                        Contains("expected a local tensor of shape"));
  }
}

}  // namespace
}  // namespace tandem
