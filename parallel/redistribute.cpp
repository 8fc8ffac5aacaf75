// Redistribution between placement lists: planning (a short list of steps,
// cached per (shape, from, to, mesh shape)) and execution, differentiable per
// Note [Redistribute gradients].
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
#include <fmt/ranges.h>

#include <map>
#include <mutex>

#include "autograd/function.h"
#include "parallel/dtensor.h"
#include "runtime/error.h"
#include "runtime/logging.h"
#include "tensor/ops.h"

namespace tandem {
namespace {

struct Step {
  enum class Kind : uint8_t { AllGather, AllReduce, ReduceScatter, AllToAll, Chunk, MakePartial };
  Kind kind;
  int mesh_dim;
  int64_t dim = 0;   // tensor dim (AllToAll: the source shard dim)
  int64_t dim2 = 0;  // AllToAll: the target shard dim
  RedOp op = RedOp::Sum;

  std::string str() const {
    static const char* names[] = {"all_gather", "all_reduce", "reduce_scatter",
                                  "all_to_all", "chunk",      "make_partial"};
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
};

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

// Extent of tensor dim d at mesh level m: the global extent cut by the shards
// of mesh dims before m (this rank's coordinates).
int64_t extent_at(const Shape& global, const Placements& cur, const DeviceMesh& mesh, int m,
                  int64_t d) {
  std::vector<int64_t> coord = mesh.coordinate();
  int64_t extent = global[d];
  for (int i = 0; i < m; ++i) {
    if (cur[i].is_shard(d)) extent = chunk_range(extent, mesh.size(i), coord[i]).second;
  }
  return extent;
}

Tensor pad_dim(const Tensor& x, int64_t d, int64_t size) {
  if (x.shape()[d] == size) return x;
  Shape pad = x.shape();
  pad[d] = size - x.shape()[d];
  return ops::cat({x, ops::zeros(pad, x.dtype(), x.device())}, d);
}

// A communication step split into launch and completion, so single-step plans
// can run asynchronously.
struct Launched {
  WorkPtr work;
  std::function<Tensor(const Tensor&)> finish;  // applied to work->result()
};

Launched launch_step(const Step& s, const Tensor& x, const Shape& global, const Placements& cur,
                     const DeviceMesh& mesh) {
  ProcessGroupPtr group = mesh.get_group(s.mesh_dim);
  const int64_t k = mesh.size(s.mesh_dim);
  const int64_t me = mesh.coordinate()[s.mesh_dim];
  switch (s.kind) {
    case Step::Kind::AllGather: {
      const int64_t extent = extent_at(global, cur, mesh, s.mesh_dim, s.dim);
      const int64_t chunk = (extent + k - 1) / k;
      WorkPtr w = group->all_gather(pad_dim(x, s.dim, chunk), {s.dim, "redistribute"});
      const int64_t d = s.dim;
      return {w, [d, extent](const Tensor& y) {
                return ops::contiguous(ops::narrow(y, d, 0, extent));
              }};
    }
    case Step::Kind::AllReduce: {
      WorkPtr w = group->all_reduce(x, {s.op, "redistribute"});
      return {w, [](const Tensor& y) { return y; }};
    }
    case Step::Kind::ReduceScatter: {
      const int64_t extent = x.shape()[s.dim];
      const int64_t chunk = (extent + k - 1) / k;
      WorkPtr w =
          group->reduce_scatter(pad_dim(x, s.dim, chunk * k), {s.op, s.dim, "redistribute"});
      const int64_t len = chunk_range(extent, k, me).second, d = s.dim;
      return {w, [d, len](const Tensor& y) { return ops::contiguous(ops::narrow(y, d, 0, len)); }};
    }
    case Step::Kind::AllToAll: {
      // Shard(d) -> Shard(d2): each peer's slice of d2 is packed once into the
      // send buffer, in the tensor's own layout; the pieces that come back
      // (the senders' blocks of d, this rank's slice of d2) are joined along
      // d in source order, which for d == 0 is the received buffer itself.
      const int64_t d = s.dim, d2 = s.dim2;
      const int64_t full2 = x.shape()[d2];
      const int64_t full_d = extent_at(global, cur, mesh, s.mesh_dim, d);
      const int64_t my_rows = chunk_range(full2, k, me).second;
      // Elements per index of d2 (here), and per (d, d2) index pair: from the
      // shape, since a rank may hold an empty block.
      int64_t per_d = 1;
      for (int i = 0; i < x.dim(); ++i) {
        if (i != d && i != d2) per_d *= x.shape()[i];
      }
      const int64_t slab = per_d * x.shape()[d];
      Tensor send = empty(Shape{x.numel()}, x.dtype(), x.device());
      std::vector<int64_t> in_splits, out_splits;
      int64_t offset = 0;
      for (int64_t r = 0; r < k; ++r) {
        auto [start, len] = chunk_range(full2, k, r);
        Shape piece = x.shape();
        piece[d2] = len;
        const int64_t n = len * slab;
        if (n > 0)
          ops::copy_(ops::reshape(ops::narrow(send, 0, offset, n), piece),
                     ops::narrow(x, d2, start, len));
        in_splits.push_back(n);
        offset += n;
        out_splits.push_back(my_rows * chunk_range(full_d, k, r).second * per_d);
      }
      WorkPtr w = group->all_to_all_single(send, {in_splits, out_splits, "redistribute"});
      Shape shape = x.shape();
      shape[d2] = my_rows;
      return {w, [=](const Tensor& flat) {
                if (d == 0) {
                  Shape whole = shape;
                  whole[0] = full_d;
                  return ops::reshape(flat, whole);
                }
                std::vector<Tensor> parts;
                int64_t at = 0;
                for (int64_t r = 0; r < k; ++r) {
                  Shape piece = shape;
                  piece[d] = chunk_range(full_d, k, r).second;
                  parts.push_back(ops::reshape(ops::narrow(flat, 0, at, out_splits[r]), piece));
                  at += out_splits[r];
                }
                return ops::cat(parts, d);
              }};
    }
    default:
      TANDEM_INTERNAL_ASSERT(false, "not a communication step");
  }
  return {};
}

Tensor run_step(const Step& s, const Tensor& x, const Shape& global, const Placements& cur,
                const DeviceMesh& mesh) {
  const int64_t me = mesh.coordinate()[s.mesh_dim];
  if (s.kind == Step::Kind::Chunk) {
    auto [start, len] = chunk_range(x.shape()[s.dim], mesh.size(s.mesh_dim), me);
    return ops::contiguous(ops::narrow(x, s.dim, start, len));
  }
  if (s.kind == Step::Kind::MakePartial) {
    return s.op == RedOp::Sum && me != 0 ? ops::zeros_like(x) : x;
  }
  Launched l = launch_step(s, x, global, cur, mesh);
  l.work->wait();
  return l.finish(l.work->result());
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

Tensor execute(const Tensor& local, const Shape& global, const Placements& from,
               const Placements& to, const DeviceMesh& mesh) {
  Tensor x = local;
  Placements cur = from;
  for (const Step& s : cached_plan(from, to)) {
    x = run_step(s, x, global, cur, mesh);
    cur = apply_step(cur, s);
    TANDEM_INTERNAL_ASSERT(x.shape() == DTensor::local_shape_for(global, cur, mesh),
                           "redistribute {} -> {}: after {} the local shape is {}, expected {}",
                           placements_str(from), placements_str(to), s.str(), x.shape(),
                           DTensor::local_shape_for(global, cur, mesh));
  }
  return x;
}

Placements gradient_placements(const Placements& p) {
  Placements g = p;
  for (Placement& x : g) {
    if (x.is_partial()) x = Replicate();
  }
  return g;
}

// Note [Redistribute gradients].
struct RedistributeFunction final : Function {
  DeviceMesh mesh;
  Shape global;
  Placements from, to;
  const char* name() const override { return "RedistributeBackward"; }
  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>& in) override {
    return {execute(in[0], global, from, to, mesh)};
  }
  std::vector<Tensor> backward(FunctionCtx&, const std::vector<Tensor>& g) override {
    return {execute(g[0], global, gradient_placements(to), gradient_placements(from), mesh)};
  }
};

Placements checked_target(const DTensor& x, const Placements& placements) {
  TANDEM_CHECK(static_cast<int>(placements.size()) == x.mesh().ndim(),
               "[parallel::redistribute] expected one placement per mesh dim ({}), got {}",
               x.mesh().ndim(), placements_str(placements));
  Placements p = placements;
  for (Placement& q : p) {
    if (q.is_shard()) q.dim = wrap_dim(q.dim, x.shape().size(), "redistribute");
  }
  return p;
}

}  // namespace

DTensor DTensor::redistribute(const Placements& placements) const {
  Placements to = checked_target(*this, placements);
  if (to == placements_) return *this;
  if (!grad_mode_enabled() || !requires_grad(local_)) {
    return make(execute(local_, global_shape_, placements_, to, mesh_), mesh_, to, global_shape_);
  }
  auto fn = std::make_shared<RedistributeFunction>();
  fn->mesh = mesh_;
  fn->global = global_shape_;
  fn->from = placements_;
  fn->to = to;
  Tensor out = Function::apply(fn, {local_})[0];
  return make(out, mesh_, to, global_shape_);
}

Tensor DTensor::full_tensor() const {
  return redistribute(Placements(static_cast<size_t>(mesh_.ndim()), Replicate())).to_local();
}

std::vector<std::string> redistribute_plan(const Shape& global, const Placements& from,
                                           const Placements& to, const DeviceMesh& mesh) {
  std::vector<std::string> out;
  for (const Step& s : cached_plan(from, to))
    out.push_back(s.str());
  (void)global;
  (void)mesh;
  return out;
}

PendingDTensor::PendingDTensor(DTensor source, Placements target)
    : source_(std::move(source)), target_(std::move(target)) {}

bool PendingDTensor::ready() const {
  return !work_ || work_->is_completed();
}

DTensor PendingDTensor::wait() {
  if (!work_) return source_;  // already complete (synchronous path)
  work_->wait();
  Tensor local = finish_(work_->result());
  work_.reset();
  source_ = DTensor::make(local, source_.mesh(), target_, source_.shape());
  return source_;
}

PendingDTensor redistribute_async(const DTensor& x, const Placements& placements) {
  Placements to = checked_target(x, placements);
  const std::vector<Step>& plan = cached_plan(x.placements(), to);
  bool single_comm = plan.size() == 1 && plan[0].kind != Step::Kind::Chunk &&
                     plan[0].kind != Step::Kind::MakePartial;
  if (!single_comm) {
    NoGradGuard no_grad;
    return PendingDTensor(x.redistribute(to), to);
  }
  PendingDTensor pending(x, to);
  Launched l = launch_step(plan[0], x.to_local(), x.shape(), x.placements(), x.mesh());
  pending.work_ = l.work;
  pending.finish_ = l.finish;
  return pending;
}

}  // namespace tandem
