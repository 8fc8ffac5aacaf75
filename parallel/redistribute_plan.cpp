// Planning of a redistribution between placement lists: a short list of
// steps, cached per (from, to), which redistribute.cpp executes.
//
// The planner works in three phases, which keep nested shards (several mesh
// dims sharding one tensor dim) in their canonical order — outer mesh dims
// split first:
//   1. from the last mesh dim to the first, a Shard that must change is
//      gathered (all_gather) or, when nothing else shards either tensor dim,
//      moved to its new dim directly (all_to_all);
//   2. a Partial that must change is reduce-scattered into its target Shard
//      when that is its final place, else all-reduced to Replicate;
//   3. from the first mesh dim to the last, a Replicate becomes its target
//      Shard (a local chunk) or Partial (no communication).
#include "tandem/parallel/redistribute_plan.h"

#include <fmt/format.h>

#include <iterator>
#include <map>
#include <mutex>

#include "tandem/parallel/dtensor.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/logging.h"

namespace tandem {
namespace redistribute_detail {

std::string Step::str() const {
  static const char* names[] = {"all_gather", "all_reduce", "reduce_scatter",
                                "all_to_all", "chunk",      "make_partial"};
  static_assert(std::size(names) == kKindCount, "one name per Step::Kind");
  std::string s = fmt::format("{}(mesh dim {}", names[static_cast<int>(kind)], mesh_dim);
  if (kind == Kind::AllToAll) s += fmt::format(", dim {} -> {}", dim, dim2);
  if (kind == Kind::AllGather || kind == Kind::ReduceScatter || kind == Kind::Chunk) {
    s += fmt::format(", dim {}", dim);
  }
  if (kind == Kind::AllReduce || kind == Kind::ReduceScatter || kind == Kind::MakePartial) {
    s += fmt::format(", {}", red_op_name(op));
  }
  return s + ")";
}

namespace {

bool shards_elsewhere(const Placements& p, int except, int64_t d) {
  for (int m = 0; m < static_cast<int>(p.size()); ++m) {
    if (m != except && p[m].is_shard(d)) return true;
  }
  return false;
}

std::vector<Step> make_plan(const Placements& from, const Placements& to) {
  const int n = static_cast<int>(from.size());
  Placements cur = from;
  std::vector<Step> steps;
  // Shards that keep their place but sit inside a shard that will be newly
  // made at an outer mesh dim must be gathered first (canonical nesting).
  // Likewise an inner shard of a dim whose outer shard is about to change.
  std::vector<bool> regather(static_cast<size_t>(n), false);
  for (int m2 = 0; m2 < n; ++m2) {
    if (!cur[m2].is_shard()) continue;
    for (int m = 0; m < m2; ++m) {
      if (cur[m] == to[m]) continue;
      if (to[m].is_shard(cur[m2].dim) || cur[m].is_shard(cur[m2].dim)) regather[m2] = true;
    }
  }
  for (int m = n - 1; m >= 0; --m) {
    if (!cur[m].is_shard() || (cur[m] == to[m] && !regather[m])) continue;
    const int64_t d = cur[m].dim;
    if (to[m].is_shard() && to[m].dim != d && !regather[m] && !shards_elsewhere(cur, m, d) &&
        !shards_elsewhere(cur, m, to[m].dim) && !shards_elsewhere(to, m, to[m].dim)) {
      steps.push_back({Step::Kind::AllToAll, m, d, to[m].dim});
      cur[m] = to[m];
    } else {
      steps.push_back({Step::Kind::AllGather, m, d});
      cur[m] = Replicate();
    }
  }
  for (int m = 0; m < n; ++m) {
    if (!cur[m].is_partial() || cur[m] == to[m]) continue;
    TANDEM_CHECK(!to[m].is_partial(),
                 "[parallel::redistribute] expected Partial({}) to become Replicate or Shard, got "
                 "{} on mesh dim {} (partial ops cannot be converted)",
                 red_op_name(cur[m].op), to[m].str(), m);
    // A reduce-scatter makes the shard at this level now: only valid when no
    // inner mesh dim shards that tensor dim yet and every outer one that will
    // shard it already does (canonical nesting); else all-reduce, chunk later.
    bool nesting_ok = to[m].is_shard();
    for (int m2 = 0; m2 < n && nesting_ok; ++m2) {
      if (m2 > m && cur[m2].is_shard(to[m].dim)) nesting_ok = false;
      if (m2 < m && to[m2].is_shard(to[m].dim) && cur[m2] != to[m2]) nesting_ok = false;
    }
    if (nesting_ok && cur[m].op != RedOp::Avg) {
      steps.push_back({Step::Kind::ReduceScatter, m, to[m].dim, 0, cur[m].op});
      cur[m] = to[m];
    } else {
      steps.push_back({Step::Kind::AllReduce, m, 0, 0, cur[m].op});
      cur[m] = Replicate();
    }
  }
  for (int m = 0; m < n; ++m) {
    if (cur[m] == to[m]) continue;
    TANDEM_INTERNAL_ASSERT(cur[m].is_replicate(), "planner left {} on mesh dim {}", cur[m].str(),
                           m);
    if (to[m].is_shard()) {
      steps.push_back({Step::Kind::Chunk, m, to[m].dim});
    } else {
      steps.push_back({Step::Kind::MakePartial, m, 0, 0, to[m].op});
    }
    cur[m] = to[m];
  }
  return steps;
}

// A compact key: kind, dim and op of every placement, from then to.
std::string plan_key(const Placements& from, const Placements& to) {
  std::string key;
  key.reserve(3 * (from.size() + to.size()) + 1);
  for (const Placements* list : {&from, &to}) {
    for (const Placement& p : *list) {
      key += static_cast<char>('0' + static_cast<int>(p.kind));
      key += static_cast<char>(p.is_shard() ? 'a' + p.dim : 'a');
      key += static_cast<char>('0' + static_cast<int>(p.op));
    }
    key += '|';
  }
  return key;
}

}  // namespace

const std::vector<Step>& cached_plan(const Placements& from, const Placements& to) {
  static std::mutex mu;
  static std::map<std::string, std::vector<Step>> cache;
  std::string key = plan_key(from, to);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it == cache.end()) {
    it = cache.emplace(key, make_plan(from, to)).first;
    log_debug("[parallel::redistribute] plan {} -> {}: {} steps", placements_str(from),
              placements_str(to), it->second.size());
  }
  return it->second;
}

Placements apply_step(Placements cur, const Step& s) {
  switch (s.kind) {
    case Step::Kind::AllGather:
    case Step::Kind::AllReduce:
      cur[s.mesh_dim] = Replicate();
      break;
    case Step::Kind::ReduceScatter:
    case Step::Kind::Chunk:
      cur[s.mesh_dim] = Shard(s.dim);
      break;
    case Step::Kind::AllToAll:
      cur[s.mesh_dim] = Shard(s.dim2);
      break;
    case Step::Kind::MakePartial:
      cur[s.mesh_dim] = Partial(s.op);
      break;
  }
  return cur;
}

}  // namespace redistribute_detail

std::vector<std::string> redistribute_plan(const Shape& global, const Placements& from,
                                           const Placements& to, const DeviceMesh& mesh) {
  std::vector<std::string> out;
  for (const redistribute_detail::Step& s : redistribute_detail::cached_plan(from, to))
    out.push_back(s.str());
  (void)global;
  (void)mesh;
  return out;
}

}  // namespace tandem
