// Redistribution between placement lists: the execution of the plans that
// redistribute_plan.cpp makes, differentiable per Note [Redistribute
// gradients], and its asynchronous form for single-collective plans.
#include <fmt/ranges.h>

#include "tandem/autograd/function.h"
#include "tandem/parallel/dtensor.h"
#include "tandem/parallel/redistribute_plan.h"
#include "tandem/runtime/error.h"
#include "tandem/tensor/ops.h"

namespace tandem {

using redistribute_detail::apply_step;
using redistribute_detail::cached_plan;
using redistribute_detail::Step;

namespace {

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

// The AllToAll step over `group` (k ranks, this one at `me`); full_d is the
// extent of the source shard dim at this mesh level.
Launched launch_all_to_all(const Step& s, const Tensor& x, int64_t full_d,
                           const ProcessGroupPtr& group, int64_t k, int64_t me) {
  // Shard(d) -> Shard(d2): each peer's slice of d2 is packed once into the
  // send buffer, in the tensor's own layout; the pieces that come back
  // (the senders' blocks of d, this rank's slice of d2) are joined along
  // d in source order, which for d == 0 is the received buffer itself.
  const int64_t d = s.dim, d2 = s.dim2;
  const int64_t full2 = x.shape()[d2];
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
    case Step::Kind::AllToAll:
      return launch_all_to_all(s, x, extent_at(global, cur, mesh, s.mesh_dim, s.dim), group, k, me);
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
