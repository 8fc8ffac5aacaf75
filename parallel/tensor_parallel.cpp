#include "tandem/parallel/tensor_parallel.h"

#include <fmt/ranges.h>

#include <numeric>

#include "tandem/autograd/nn/linear.h"
#include "tandem/autograd/ops.h"
#include "tandem/parallel/dtensor_ops.h"
#include "tandem/parallel/param_placement.h"
#include "tandem/parallel/sequence_layout.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/logging.h"

namespace tandem {
namespace {

nn::Linear& as_linear(Module& module, const char* style) {
  auto* linear = dynamic_cast<nn::Linear*>(&module);
  TANDEM_CHECK(linear != nullptr, "[parallel::{}] expected an nn::Linear, got {}", style,
               module.type_name());
  return *linear;
}

void check_1d(const DeviceMesh& mesh, const char* style) {
  TANDEM_CHECK(mesh.ndim() == 1, "[parallel::{}] expected a 1-D mesh, got {}", style, mesh.str());
}

// Note [Tensor-parallel relayout]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The hooks move a local tensor between placements through one DTensor,
// built once. A Shard source needs its global extent. For the feature dim of
// a Linear's input or output the module knows it (the weight's global shape,
// captured when the style shards it), so those relayouts make no host
// synchronisation — the default styles and the feature-sharded layouts of a
// Megatron MLP or attention block. A user-declared shard of another dim (a
// sequence shard) takes its extent from the layout the caller declared for
// this group (Note [Sequence layout as data]), checked against the local
// shard; only where none is declared are the lengths gathered from the
// group (sequence_lengths), one small collective read on the host.
int64_t sequence_extent(const Tensor& local, int64_t dim, const DeviceMesh& mesh) {
  const ProcessGroupPtr group = mesh.get_group();
  const std::vector<int64_t> lengths =
      sequence_lengths(local, dim, group, "a tensor-parallel hook");
  const int64_t total = std::accumulate(lengths.begin(), lengths.end(), int64_t{0});
  TANDEM_CHECK(lengths == SequenceLayout::chunked(total, group->size()).lengths,
               "[parallel] expected the sequence layout (declared or gathered) to split {} "
               "tokens over {} ranks as Shard does (chunk semantics), got lengths {}",
               total, group->size(), fmt::join(lengths, ", "));
  return total;
}

Tensor relayout(const Tensor& local, const Placement& from, const Placement& to,
                const DeviceMesh& mesh, int64_t feature_extent = -1) {
  if (from == to) return local;
  Shape global = local.shape();
  if (from.is_shard()) {
    const bool feature = from.dim == local.dim() - 1 && feature_extent >= 0;
    global[from.dim] = feature ? feature_extent : sequence_extent(local, from.dim, mesh);
  }
  return DTensor::from_local(local, mesh, {from}, global).redistribute({to}).to_local();
}

Placement normalised(Placement p, int ndim) {
  if (p.is_shard()) p.dim = wrap_dim(p.dim, ndim, "parallelize");
  return p;
}

// Installs this rank's chunk of the parameter along `dim` and records its
// placement (Note [Parameter placements]); returns the whole shape.
Shape shard_parameter(nn::Linear& linear, const std::string& name, const DeviceMesh& mesh,
                      int64_t dim) {
  const Tensor whole = name == "weight" ? linear.weight() : linear.bias();
  linear.set_parameter(name, DTensor::distribute(whole, mesh, {Shard(dim)}).to_local());
  record_shard(name == "weight" ? linear.weight() : linear.bias(), mesh, dim, whole.shape());
  return whole.shape();
}

}  // namespace

void ColwiseParallel::apply(Module& module, const DeviceMesh& mesh) const {
  check_1d(mesh, "ColwiseParallel");
  nn::Linear& linear = as_linear(module, "ColwiseParallel");
  // Fewer features than ranks is fine: the last ranks hold empty shards
  // (chunk semantics) and produce empty outputs.
  const Shape weight = shard_parameter(linear, "weight", mesh, 0);  // (out, in)
  if (linear.bias().defined()) shard_parameter(linear, "bias", mesh, 0);
  Placement in = input_layout, out_layout = output_layout;
  const int64_t in_features = weight[1], out_features = weight[0];
  module.register_forward_pre_hook(
      [mesh, in, in_features](Module&, const Args& args) -> std::optional<Args> {
        Args a = args;
        Tensor& x = a.positional.at(0);
        x = relayout(x, normalised(in, x.dim()), Replicate(), mesh, in_features);
        x = all_reduce_grad(x, mesh.get_group());  // replicated input, sharded output
        return a;
      });
  module.register_forward_hook(
      [mesh, out_layout, out_features](
          Module&, const Args&,
          const std::vector<Tensor>& outs) -> std::optional<std::vector<Tensor>> {
        std::vector<Tensor> o = outs;
        Placement want = normalised(out_layout, o[0].dim());
        Placement have = Shard(o[0].dim() - 1);
        o[0] = relayout(o[0], have, want, mesh, out_features);
        return o;
      });
}

void RowwiseParallel::apply(Module& module, const DeviceMesh& mesh) const {
  check_1d(mesh, "RowwiseParallel");
  nn::Linear& linear = as_linear(module, "RowwiseParallel");
  const Shape weight = shard_parameter(linear, "weight", mesh, 1);  // (out, in)
  linear.set_bias_deferred(true);
  Placement in = input_layout, out_layout = output_layout;
  const int64_t in_features = weight[1];
  module.register_forward_pre_hook(
      [mesh, in, in_features](Module&, const Args& args) -> std::optional<Args> {
        Args a = args;
        Tensor& x = a.positional.at(0);
        x = relayout(x, normalised(in, x.dim()), Shard(x.dim() - 1), mesh, in_features);
        return a;
      });
  nn::Linear* lin = &linear;  // the hook belongs to this module; it outlives the hook
  module.register_forward_hook(
      [mesh, out_layout, lin](
          Module&, const Args&,
          const std::vector<Tensor>& outs) -> std::optional<std::vector<Tensor>> {
        std::vector<Tensor> o = outs;
        Placement want = normalised(out_layout, o[0].dim());
        // Partial -> want; the shape of a partial tensor is the global one.
        DTensor partial = DTensor::make(o[0], mesh, {Partial()}, o[0].shape());
        o[0] = partial.redistribute({want}).to_local();
        if (lin->bias().defined()) {
          Tensor b = lin->bias();
          if (!want.is_replicate()) b = all_reduce_grad(b, mesh.get_group());
          o[0] = add(o[0], b);
        }
        return o;
      });
}

void SequenceParallel::apply(Module& module, const DeviceMesh& mesh) const {
  check_1d(mesh, "SequenceParallel");
  // The module computes on its sequence shard as is; its replicated parameters
  // only see their shard's contribution, so their gradients are summed.
  ProcessGroupPtr group = mesh.get_group();
  for (auto& [name, p] : module.named_parameters()) {
    register_hook(p, [group](const Tensor& g) {
      WorkPtr w = group->all_reduce(g, {RedOp::Sum, "sequence-parallel grad"});
      w->wait();
      return w->result();
    });
  }
}

void PrepareModuleInput::apply(Module& module, const DeviceMesh& mesh) const {
  check_1d(mesh, "PrepareModuleInput");
  TANDEM_CHECK(input_layouts.size() == desired_input_layouts.size(),
               "[parallel::PrepareModuleInput] expected as many desired layouts as layouts, got {} "
               "and {}",
               input_layouts.size(), desired_input_layouts.size());
  auto from = input_layouts, to = desired_input_layouts;
  module.register_forward_pre_hook(
      [mesh, from, to](Module&, const Args& args) -> std::optional<Args> {
        Args a = args;
        for (size_t i = 0; i < from.size() && i < a.positional.size(); ++i) {
          if (!from[i] || !to[i]) continue;
          Tensor& x = a.positional[i];
          Placement f = normalised(*from[i], x.dim()), t = normalised(*to[i], x.dim());
          x = relayout(x, f, t, mesh);
        }
        return a;
      });
}

void PrepareModuleOutput::apply(Module& module, const DeviceMesh& mesh) const {
  check_1d(mesh, "PrepareModuleOutput");
  auto from = output_layouts, to = desired_output_layouts;
  module.register_forward_hook(
      [mesh, from, to](Module&, const Args&,
                       const std::vector<Tensor>& outs) -> std::optional<std::vector<Tensor>> {
        std::vector<Tensor> o = outs;
        for (size_t i = 0; i < from.size() && i < o.size(); ++i) {
          if (!from[i] || i >= to.size() || !to[i]) continue;
          o[i] = relayout(o[i], normalised(*from[i], o[i].dim()), normalised(*to[i], o[i].dim()),
                          mesh);
        }
        return o;
      });
}

std::shared_ptr<ParallelStyle> colwise(Placement input, Placement output) {
  auto s = std::make_shared<ColwiseParallel>();
  s->input_layout = input;
  s->output_layout = output;
  return s;
}

std::shared_ptr<ParallelStyle> rowwise(Placement input, Placement output) {
  auto s = std::make_shared<RowwiseParallel>();
  s->input_layout = input;
  s->output_layout = output;
  return s;
}

std::shared_ptr<ParallelStyle> sequence_parallel(int64_t sequence_dim) {
  auto s = std::make_shared<SequenceParallel>();
  s->sequence_dim = sequence_dim;
  return s;
}

void parallelize_module(const std::shared_ptr<Module>& module, const DeviceMesh& mesh,
                        const ParallelizePlan& plan) {
  TANDEM_CHECK(module != nullptr, "[parallel::parallelize_module] expected a module, got null");
  for (const auto& [path, style] : plan) {
    TANDEM_CHECK(style != nullptr, "[parallel::parallelize_module] expected a style for \"{}\"",
                 path);
    style->apply(*module->get_submodule(path), mesh);
  }
}

}  // namespace tandem
