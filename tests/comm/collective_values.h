// Test values and expectations shared by the collective suites on the
// threads backend (test_collectives.cpp, test_rounds.cpp): small integers,
// exact in f32, bf16 and i64, so sums in any order are exact and results are
// compared exactly; failures go to a Failures list, since Catch2 assertions
// must not run on rank threads.
#pragma once

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include <fmt/ranges.h>

#include "tandem/comm/process_group.h"
#include "tests/support/rank_checks.h"
#include "tests/support/test_util.h"

namespace tandem::collective_test {

using tandem::testing::Failures;
using test::stored_value;
using test::tensor_of;
using test::values_of;

inline const std::vector<int> kWorldSizes = {1, 2, 3, 4, 5, 6, 7, 8};
inline const std::vector<DType> kDtypes = {DType::F32, DType::BF16, DType::I64};

// Records a failure unless `got` has `shape` and exactly the `expected` values.
inline void expect_tensor(Failures& failures, int rank, const std::string& what, const Tensor& got,
                          const std::vector<int64_t>& shape, const std::vector<double>& expected) {
  std::string where = fmt::format("rank {}: {}", rank, what);
  if (!got.defined()) {
    failures.add(where + ": result undefined");
    return;
  }
  if (got.shape().vec() != shape) {
    failures.add(fmt::format("{}: expected shape [{}], got {}", where, fmt::join(shape, ","),
                             got.shape().str()));
    return;
  }
  std::vector<double> values = values_of(got);
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i] != expected[i]) {
      failures.add(fmt::format("{}: expected {} at flat index {}, got {}", where, expected[i], i,
                               values[i]));
      return;
    }
  }
}

// Element i of rank r's test data: a small integer in [-8, 8].
inline double value(int rank, int64_t i) {
  return static_cast<double>((rank * 7 + i * 3) % 17 - 8);
}

inline std::vector<double> rank_values(int rank, int64_t n) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[static_cast<size_t>(i)] = value(rank, i);
  return v;
}

inline Tensor rank_tensor(int rank, const Shape& shape, DType dtype) {
  return tensor_of(rank_values(rank, shape.numel()), shape, dtype);
}

// op over the values of element i of every rank, as `dtype` stores it.
inline double reduce_value(RedOp op, int world, DType dtype,
                           const std::function<double(int)>& of_rank) {
  double acc = of_rank(0);
  for (int r = 1; r < world; ++r) {
    double x = of_rank(r);
    acc = op == RedOp::Max ? std::max(acc, x) : op == RedOp::Min ? std::min(acc, x) : acc + x;
  }
  return op == RedOp::Avg ? stored_value(dtype, acc / world) : acc;
}

inline std::vector<RedOp> ops_for(DType dtype) {
  if (is_integral(dtype)) return {RedOp::Sum, RedOp::Max, RedOp::Min};
  return {RedOp::Sum, RedOp::Avg, RedOp::Max, RedOp::Min};
}

// Options with one field set (brace-initialising only some fields warns).
inline AllReduceOptions reduce_with(RedOp op) {
  AllReduceOptions o;
  o.op = op;
  return o;
}
inline BroadcastOptions from_root(int root) {
  BroadcastOptions o;
  o.root = root;
  return o;
}
inline AllGatherOptions gather_along(int64_t dim) {
  AllGatherOptions o;
  o.dim = dim;
  return o;
}
inline ReduceScatterOptions scatter_along(int64_t dim, RedOp op) {
  ReduceScatterOptions o;
  o.dim = dim;
  o.op = op;
  return o;
}
inline P2POptions with_peer(int peer) {
  P2POptions o;
  o.peer = peer;
  return o;
}

inline std::string case_name(int world, DType dtype) {
  return fmt::format("world {} {}", world, dtype_name(dtype));
}

}  // namespace tandem::collective_test
