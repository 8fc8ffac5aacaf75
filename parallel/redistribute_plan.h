// What the redistribution planner (redistribute_plan.cpp) hands its executor
// (redistribute.cpp): the steps a plan is made of and the cached plan of a
// pair of placement lists. Private to parallel/; not installed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tandem/parallel/placement.h"

namespace tandem::redistribute_detail {

struct Step {
  enum class Kind : uint8_t { AllGather, AllReduce, ReduceScatter, AllToAll, Chunk, MakePartial };
  // For str()'s name table: the last value + 1, not an enumerator (switches
  // stay exhaustive).
  static constexpr int kKindCount = static_cast<int>(Kind::MakePartial) + 1;
  Kind kind;
  int mesh_dim;
  int64_t dim = 0;   // tensor dim (AllToAll: the source shard dim)
  int64_t dim2 = 0;  // AllToAll: the target shard dim
  RedOp op = RedOp::Sum;

  std::string str() const;
};

// The plan from `from` to `to`, made on first use and kept.
const std::vector<Step>& cached_plan(const Placements& from, const Placements& to);

// The placements `cur` becomes after step `s`.
Placements apply_step(Placements cur, const Step& s);

}  // namespace tandem::redistribute_detail
