// fuzz-redistribute: random DTensor redistributions (parallel/redistribute.cpp)
// on the threads backend against slices of the full tensor. The input bytes
// choose a 1-D or 2-D mesh of at most 6 ranks, a global shape of 1-3 small
// dims (uneven, empty or smaller than the mesh), a source and a target
// placement list (sometimes invalid: a Shard dim out of range, a Partial
// turned into another Partial, a list of the wrong length) and how the source
// is built: distribute() (a Partial(sum) value sits at coordinate 0), or
// from_local() with addends that differ per rank and per element, so that a
// wrong combination shows.
//
// Checks, with chunk arithmetic written here (outer mesh dims split first):
//   - the planner: redistribute_plan() is empty exactly when nothing changes,
//     has at most two steps per mesh dim, and replayed step by step is legal
//     (each step applies to what the mesh dim holds) and ends at the target;
//     local_shape_for/local_offset_for agree with the chunk arithmetic for
//     every coordinate in every state the plan passes through;
//   - each rank's source and result hold the block of the full tensor at
//     their offset (the result exactly, when it has no Partial left);
//   - full_tensor() of the result is the full tensor; redistribute_async()
//     gives what redistribute() gave.
// Valid input must not throw; invalid input must throw tandem::Error on every
// rank. Any other outcome (an internal assert, a timeout, a crash) is a
// finding. Values are small integers, exact in f32, compared exactly.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tandem/autograd/engine.h"
#include "tandem/comm/threads/threads_backend.h"
#include "tandem/comm/work.h"
#include "tandem/parallel/dtensor.h"
#include "tandem/tensor/ops.h"

namespace tandem {
namespace {

using Vec = std::vector<int64_t>;

// The input, read front to back; zeros once it is used up.
class Bytes {
 public:
  Bytes(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  uint8_t next() { return p_ == end_ ? 0 : *p_++; }
  int64_t pick(int64_t n) { return n <= 0 ? 0 : next() % n; }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
};

int64_t numel_of(const Vec& shape) {
  int64_t n = 1;
  for (int64_t e : shape)
    n *= e;
  return n;
}

Vec unravel(int64_t flat, const Vec& shape) {
  Vec idx(shape.size(), 0);
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    idx[i] = flat % shape[i];
    flat /= shape[i];
  }
  return idx;
}

int64_t ravel(const Vec& idx, const Vec& shape) {
  int64_t flat = 0;
  for (size_t i = 0; i < shape.size(); ++i)
    flat = flat * shape[i] + idx[i];
  return flat;
}

// ---- the reference: chunk arithmetic of placement.h, written again ----

// torch.chunk: ceil(n / k) to the first ranks, the rest to the next, then none.
std::pair<int64_t, int64_t> chunk(int64_t n, int64_t k, int64_t i) {
  const int64_t size = (n + k - 1) / k;
  const int64_t start = std::min(n, i * size);
  return {start, std::max<int64_t>(0, std::min(size, n - start))};
}

struct Block {
  Vec offset, shape;
};

// The block of the global tensor the rank at `coord` holds (Partial and
// Replicate hold everything; Shards nest, outer mesh dims first).
Block block_of(const Vec& global, const Placements& p, const Vec& mesh, const Vec& coord) {
  Block b{Vec(global.size(), 0), global};
  for (size_t m = 0; m < p.size(); ++m) {
    if (!p[m].is_shard()) continue;
    const size_t d = static_cast<size_t>(p[m].dim);
    auto [start, len] = chunk(b.shape[d], mesh[m], coord[m]);
    b.offset[d] += start;
    b.shape[d] = len;
  }
  return b;
}

std::vector<float> slice_of(const std::vector<float>& full, const Vec& global, const Block& b) {
  std::vector<float> out(static_cast<size_t>(numel_of(b.shape)));
  for (int64_t i = 0; i < static_cast<int64_t>(out.size()); ++i) {
    Vec idx = unravel(i, b.shape);
    for (size_t d = 0; d < idx.size(); ++d)
      idx[d] += b.offset[d];
    out[i] = full[ravel(idx, global)];
  }
  return out;
}

// What the rank at `coord` holds before sharding when the source is built
// with spread addends: along each Partial mesh dim the values differ per rank
// and per element, and `op` over that dim gives back the value.
std::vector<float> addends_of(const std::vector<float>& full, const Placements& p, const Vec& mesh,
                              const Vec& coord) {
  std::vector<float> v = full;
  for (size_t m = 0; m < p.size(); ++m) {
    if (!p[m].is_partial()) continue;
    const int64_t k = mesh[m], c = coord[m];
    for (int64_t i = 0; i < static_cast<int64_t>(v.size()); ++i) {
      const float a = static_cast<float>((i * 3 + static_cast<int64_t>(m) * 5) % 7 - 3);
      const float spread = static_cast<float>((c + i) % k);
      switch (p[m].op) {
        case RedOp::Sum:
          v[i] = c == 0 ? v[i] - static_cast<float>(k - 1) * a : a;
          break;
        case RedOp::Max:
          v[i] -= spread;
          break;
        case RedOp::Min:
          v[i] += spread;
          break;
        case RedOp::Avg:
          v[i] += static_cast<float>(2 * c - (k - 1));
          break;
      }
    }
  }
  return v;
}

// ---- decoding ----

struct Case {
  Vec mesh;
  Vec global;
  Placements from, to;      // as decoded (dims may be negative or out of range)
  bool spread = false;      // from_local with addends instead of distribute
  bool valid = true;        // whether redistribute must succeed
  Placements from_n, to_n;  // normalised (valid cases)
};

Placement placement_arg(Bytes& in, int ndim) {
  const uint8_t b = in.next();
  switch (b % 4) {
    case 0:
    case 1: {
      const uint8_t d = in.next();
      if (d >= 248) return Shard(d % 2 ? ndim : -ndim - 1);  // out of range
      const int64_t dim = d % ndim;
      return Shard(d & 0x40 ? dim - ndim : dim);
    }
    case 2:
      return Replicate();
    default: {
      static const RedOp ops[] = {RedOp::Sum, RedOp::Sum, RedOp::Avg, RedOp::Max, RedOp::Min};
      return Partial(ops[(b / 4) % 5]);
    }
  }
}

std::optional<Placements> normalised(const Placements& p, int ndim, size_t mesh_ndim) {
  if (p.size() != mesh_ndim) return std::nullopt;
  Placements out = p;
  for (Placement& x : out) {
    if (!x.is_shard()) continue;
    if (x.dim < -ndim || x.dim >= ndim) return std::nullopt;
    if (x.dim < 0) x.dim += ndim;
  }
  return out;
}

Case decode(Bytes& in) {
  static const Vec meshes[] = {{1},    {2},    {3},    {4},    {5},    {6},
                               {1, 1}, {1, 2}, {2, 1}, {2, 2}, {1, 3}, {3, 1},
                               {2, 3}, {3, 2}, {1, 4}, {4, 1}, {2, 2}, {2, 3}};
  Case c;
  c.mesh = meshes[in.pick(18)];
  c.global.resize(static_cast<size_t>(1 + in.pick(3)));
  static const int64_t extents[] = {1, 2, 3, 4, 5, 6, 7, 2, 3, 4, 5, 1, 3, 5, 7, 0};
  for (int64_t& e : c.global)
    e = extents[in.pick(16)];
  const int ndim = static_cast<int>(c.global.size());
  for (size_t m = 0; m < c.mesh.size(); ++m)
    c.from.push_back(placement_arg(in, ndim));
  for (size_t m = 0; m < c.mesh.size(); ++m)
    c.to.push_back(placement_arg(in, ndim));
  const uint8_t mode = in.next();
  c.spread = mode & 1;
  if (mode == 255) c.to.push_back(Replicate());
  if (mode == 253) c.to.pop_back();
  auto from = normalised(c.from, ndim, c.mesh.size());
  auto to = normalised(c.to, ndim, c.mesh.size());
  c.valid = from && to;
  if (!c.valid) return c;
  c.from_n = *from;
  c.to_n = *to;
  for (size_t m = 0; m < c.mesh.size(); ++m) {
    if (c.from_n[m].is_partial() && c.to_n[m].is_partial() && c.from_n[m] != c.to_n[m]) {
      c.valid = false;  // documented: a Partial cannot become another Partial
    }
  }
  return c;
}

std::string describe(const Case& c) {
  return fmt::format("mesh [{}] global [{}] {} -> {} (source by {})", fmt::join(c.mesh, ","),
                     fmt::join(c.global, ","), placements_str(c.from), placements_str(c.to),
                     c.spread ? "from_local with addends" : "distribute");
}

[[noreturn]] void finding(const Case& c, const std::string& what) {
  std::fprintf(stderr, "fuzz-redistribute: FINDING for %s\n  %s\n", describe(c).c_str(),
               what.c_str());
  std::abort();  // a crash is how a libFuzzer target reports
}

// ---- checks ----

// What each rank found wrong, reported on the calling thread.
class Failures {
 public:
  void add(std::string what) {
    std::lock_guard<std::mutex> lock(mu_);
    list_.push_back(std::move(what));
  }
  std::string str() const {
    std::lock_guard<std::mutex> lock(mu_);
    return fmt::format("{}", fmt::join(list_, "\n  "));
  }
  bool empty() const {
    std::lock_guard<std::mutex> lock(mu_);
    return list_.empty();
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::string> list_;
};

std::vector<float> values_of(const Tensor& t) {
  return ops::contiguous(t).to_vector<float>();
}

// One step of a plan as text, applied to `cur`; an error text when the step
// does not fit what mesh dim holds.
std::optional<std::string> replay(const std::string& step, Placements& cur) {
  const std::string name = step.substr(0, step.find('('));
  std::string args = step.substr(step.find('(') + 1);
  for (char& ch : args) {
    if (ch == ',' || ch == ')' || ch == '>' || ch == '-') ch = ' ';
  }
  std::istringstream is(args);
  std::string word;
  int m = -1;
  is >> word >> word >> m;  // "mesh dim M"
  if (m < 0 || m >= static_cast<int>(cur.size())) return "bad mesh dim";
  auto op_of = [](const std::string& s) -> std::optional<RedOp> {
    for (RedOp op : {RedOp::Sum, RedOp::Avg, RedOp::Max, RedOp::Min}) {
      if (s == red_op_name(op)) return op;
    }
    return std::nullopt;
  };
  int64_t d = -1, d2 = -1;
  std::string op_text;
  if (name == "all_gather" || name == "chunk") {
    is >> word >> d;
    if (name == "all_gather" ? !cur[m].is_shard(d) : !cur[m].is_replicate()) return "illegal";
    cur[m] = name == "all_gather" ? Replicate() : Shard(d);
  } else if (name == "all_reduce" || name == "make_partial") {
    is >> op_text;
    auto op = op_of(op_text);
    if (!op) return "bad op";
    if (name == "all_reduce" ? cur[m] != Partial(*op) : !cur[m].is_replicate()) return "illegal";
    cur[m] = name == "all_reduce" ? Replicate() : Partial(*op);
  } else if (name == "reduce_scatter") {
    is >> word >> d >> op_text;
    auto op = op_of(op_text);
    if (!op || cur[m] != Partial(*op)) return "illegal";
    cur[m] = Shard(d);
  } else if (name == "all_to_all") {
    is >> word >> d >> d2;
    if (!cur[m].is_shard(d) || d2 < 0) return "illegal";
    cur[m] = Shard(d2);
  } else {
    return "unknown step";
  }
  return std::nullopt;
}

// The planner and the shape helpers, for every coordinate (no communication).
void check_plan(const Case& c, const DeviceMesh& mesh, Failures& failures) {
  const Shape global{c.global};
  std::vector<std::string> plan = redistribute_plan(global, c.from_n, c.to_n, mesh);
  const std::string label = fmt::format("plan [{}]", fmt::join(plan, "; "));
  if (plan.empty() != (c.from_n == c.to_n)) failures.add(label + ": empty iff nothing changes");
  if (plan.size() > 2 * c.mesh.size()) failures.add(label + ": more than two steps per mesh dim");
  std::vector<Placements> states{c.from_n};
  Placements cur = c.from_n;
  for (const std::string& step : plan) {
    if (auto error = replay(step, cur)) {
      failures.add(
          fmt::format("{}: step {} on {}: {}", label, step, placements_str(states.back()), *error));
      return;
    }
    states.push_back(cur);
  }
  if (cur != c.to_n) failures.add(label + ": ends at " + placements_str(cur));
  for (const Placements& p : states) {
    for (int64_t r = 0; r < numel_of(c.mesh); ++r) {
      const Vec coord = unravel(r, c.mesh);
      const Block b = block_of(c.global, p, c.mesh, coord);
      const Vec shape = DTensor::local_shape_for(global, p, mesh, coord).vec();
      const Vec offset = DTensor::local_offset_for(global, p, mesh, coord);
      if (shape != b.shape || offset != b.offset) {
        failures.add(fmt::format("{} at [{}]: local shape [{}] offset [{}], expected [{}] [{}]",
                                 placements_str(p), fmt::join(coord, ","), fmt::join(shape, ","),
                                 fmt::join(offset, ","), fmt::join(b.shape, ","),
                                 fmt::join(b.offset, ",")));
      }
    }
  }
}

bool has_partial(const Placements& p) {
  return std::any_of(p.begin(), p.end(), [](const Placement& x) { return x.is_partial(); });
}

void rank_main(const Case& c, const ProcessGroupPtr& world, Failures& failures) {
  const std::vector<std::string> names =
      c.mesh.size() == 1 ? std::vector<std::string>{"x"} : std::vector<std::string>{"a", "b"};
  DeviceMesh mesh(world, c.mesh, names);
  const int rank = world->rank();
  const Vec coord = unravel(rank, c.mesh);
  auto fail = [&](const std::string& what) {
    failures.add(fmt::format("rank {}: {}", rank, what));
  };
  NoGradGuard no_grad;

  std::vector<float> full(static_cast<size_t>(numel_of(c.global)));
  for (size_t i = 0; i < full.size(); ++i)
    full[i] = static_cast<float>(i + 1);
  const Shape global{c.global};
  DTensor x;
  if (c.spread && c.valid) {
    const Block b = block_of(c.global, c.from_n, c.mesh, coord);
    std::vector<float> local = slice_of(addends_of(full, c.from_n, c.mesh, coord), c.global, b);
    x = DTensor::from_local(ops::from_vector(local, Shape{b.shape}), mesh, c.from, global);
  } else {
    x = DTensor::distribute(ops::from_vector(full, global), mesh, c.from);
  }
  DTensor y = x.redistribute(c.to);
  if (!c.valid) return;  // the caller reports that no error came

  if (rank == 0) check_plan(c, mesh, failures);
  const Block src = block_of(c.global, c.from_n, c.mesh, coord);
  if (x.to_local().shape().vec() != src.shape) fail("source local shape");
  if (!has_partial(c.from_n) && values_of(x.to_local()) != slice_of(full, c.global, src)) {
    fail("source values");
  }
  const Block dst = block_of(c.global, c.to_n, c.mesh, coord);
  if (y.placements() != c.to_n) fail("result placements " + placements_str(y.placements()));
  if (y.shape().vec() != c.global) fail(fmt::format("result global shape {}", y.shape()));
  if (y.to_local().shape().vec() != dst.shape) {
    fail(fmt::format("result local shape {}, expected [{}]", y.to_local().shape(),
                     fmt::join(dst.shape, ",")));
  } else if (!has_partial(c.to_n) && values_of(y.to_local()) != slice_of(full, c.global, dst)) {
    fail(fmt::format("result values [{}], expected [{}]", fmt::join(values_of(y.to_local()), ","),
                     fmt::join(slice_of(full, c.global, dst), ",")));
  }
  const Tensor whole = y.full_tensor();
  if (whole.shape().vec() != c.global || values_of(whole) != full) {
    fail(fmt::format("full_tensor() [{}], expected [{}]", fmt::join(values_of(whole), ","),
                     fmt::join(full, ",")));
  }
  DTensor async = redistribute_async(x, c.to).wait();
  if (async.placements() != c.to_n || async.to_local().shape() != y.to_local().shape() ||
      values_of(async.to_local()) != values_of(y.to_local())) {
    fail("redistribute_async differs from redistribute");
  }
}

void run(const uint8_t* data, size_t size) {
  Bytes in(data, size);
  const Case c = decode(in);
  Failures failures;
  ProcessGroupOptions options;
  options.timeout = std::chrono::seconds(20);  // a hang is a finding, reported as a timeout
  try {
    run_ranks(
        static_cast<int>(numel_of(c.mesh)),
        [&](ProcessGroupPtr world) { rank_main(c, world, failures); }, options);
  } catch (const Error& e) {
    const std::string what = e.what();
    if (c.valid) finding(c, "unexpected error: " + what);
    if (what.find("[internal]") != std::string::npos) finding(c, what);
    if (dynamic_cast<const TimeoutError*>(&e) || dynamic_cast<const CommAbortedError*>(&e)) {
      finding(c, "invalid input, but a timeout or abort instead of its error: " + what);
    }
    return;
  }
  if (!c.valid) finding(c, "expected an error");
  if (!failures.empty()) finding(c, failures.str());
}

}  // namespace
}  // namespace tandem

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::run(data, size);
  return 0;
}
