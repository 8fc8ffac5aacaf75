// Redistribution between placement lists: the execution of the plans that
// redistribute_plan.cpp makes, differentiable per Note [Redistribute
// gradients], and its asynchronous form for single-collective plans.
#include <fmt/ranges.h>

#include "tandem/autograd/function.h"
#include "tandem/parallel/collectives.h"
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

// Every rank's extent of a dim of `extent` cut into k chunks (chunk semantics).
std::vector<int64_t> chunk_lengths(int64_t extent, int64_t k) {
  std::vector<int64_t> lengths;
  for (int64_t r = 0; r < k; ++r)
    lengths.push_back(chunk_range(extent, k, r).second);
  return lengths;
}

// A communication step as one launcher of parallel/collectives.h, so that
// single-step plans can run asynchronously.
PendingTensor launch_step(const Step& s, const Tensor& x, const Shape& global,
                          const Placements& cur, const DeviceMesh& mesh) {
  ProcessGroupPtr group = mesh.get_group(s.mesh_dim);
  const int64_t k = mesh.size(s.mesh_dim);
  switch (s.kind) {
    case Step::Kind::AllGather:
      return launch_all_gather(x, group, s.dim,
                               chunk_lengths(extent_at(global, cur, mesh, s.mesh_dim, s.dim), k),
                               "redistribute");
    case Step::Kind::AllReduce:
      return launch_all_reduce(x, group, s.op, "redistribute");
    case Step::Kind::ReduceScatter:
      return launch_reduce_scatter(x, group, s.dim, chunk_lengths(x.shape()[s.dim], k), s.op,
                                   "redistribute");
    case Step::Kind::AllToAll:
      // Shard(dim) -> Shard(dim2): scatter dim2 into chunks, gather every
      // rank's block of dim.
      return launch_all_to_all(x, group, s.dim2, s.dim, chunk_lengths(x.shape()[s.dim2], k),
                               chunk_lengths(extent_at(global, cur, mesh, s.mesh_dim, s.dim), k),
                               "redistribute");
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
  return launch_step(s, x, global, cur, mesh).wait();
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
  return pending_.ready();
}

DTensor PendingDTensor::wait() {
  if (!pending_.launched()) return source_;  // already complete (synchronous path)
  Tensor local = pending_.wait();
  pending_ = {};
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
  pending.pending_ = launch_step(plan[0], x.to_local(), x.shape(), x.placements(), x.mesh());
  return pending;
}

}  // namespace tandem
