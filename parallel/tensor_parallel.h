// Tensor parallelism as module styles (DESIGN §6), Megatron-style:
//
//   ColwiseParallel   Linear weight split by output features (Shard(0) of the
//                     (out, in) weight); input Replicate, output Shard(-1).
//   RowwiseParallel   Linear weight split by input features (Shard(1));
//                     input Shard(-1), output Partial reduced to Replicate
//                     (all_reduce) or to Shard(seq) (reduce_scatter); the bias
//                     is added once, after the reduction.
//   SequenceParallel  a norm (or any elementwise module) run on sequence
//                     shards; its replicated parameters get their gradients
//                     all-reduced over the mesh.
//   PrepareModuleInput / PrepareModuleOutput  redistribute a module's
//                     positional inputs / outputs between layouts.
//
// Modules keep exchanging plain local tensors; the styles install local
// shards of the parameters (Module::set_parameter) and forward (pre-)hooks that
// interpret and redistribute the local tensors, so `use_local_output` is the
// only mode. Gradients follow Note [Redistribute gradients].
//
//   parallelize_module(block, tp_mesh, {
//       {"attn.q_proj", colwise()}, {"attn.k_proj", colwise()},
//       {"attn.v_proj", colwise()}, {"attn.o_proj", rowwise()},
//       {"mlp.w1", colwise()}, {"mlp.w3", colwise()}, {"mlp.w2", rowwise()}});
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tandem/autograd/module.h"
#include "tandem/parallel/dtensor.h"

namespace tandem {

class ParallelStyle {
 public:
  virtual ~ParallelStyle() = default;
  // `mesh` is 1-D (the tensor-parallel dim).
  virtual void apply(Module& module, const DeviceMesh& mesh) const = 0;
};

struct ColwiseParallel final : ParallelStyle {
  Placement input_layout = Replicate();  // how the incoming local tensor is laid out
  Placement output_layout = Shard(-1);
  void apply(Module& module, const DeviceMesh& mesh) const override;
};

struct RowwiseParallel final : ParallelStyle {
  Placement input_layout = Shard(-1);
  Placement output_layout = Replicate();
  void apply(Module& module, const DeviceMesh& mesh) const override;
};

struct SequenceParallel final : ParallelStyle {
  int64_t sequence_dim = 1;
  void apply(Module& module, const DeviceMesh& mesh) const override;
};

struct PrepareModuleInput final : ParallelStyle {
  // Per positional input: its current layout and the layout forward wants
  // (nullopt leaves that input alone).
  std::vector<std::optional<Placement>> input_layouts;
  std::vector<std::optional<Placement>> desired_input_layouts;
  void apply(Module& module, const DeviceMesh& mesh) const override;
};

struct PrepareModuleOutput final : ParallelStyle {
  std::vector<std::optional<Placement>> output_layouts;
  std::vector<std::optional<Placement>> desired_output_layouts;
  void apply(Module& module, const DeviceMesh& mesh) const override;
};

std::shared_ptr<ParallelStyle> colwise(Placement input = Replicate(), Placement output = Shard(-1));
std::shared_ptr<ParallelStyle> rowwise(Placement input = Shard(-1), Placement output = Replicate());
std::shared_ptr<ParallelStyle> sequence_parallel(int64_t sequence_dim = 1);

using ParallelizePlan = std::map<std::string, std::shared_ptr<ParallelStyle>>;

// Applies each style to the submodule at its dotted path (error if absent).
// `mesh` must be 1-D.
void parallelize_module(const std::shared_ptr<Module>& module, const DeviceMesh& mesh,
                        const ParallelizePlan& plan);

}  // namespace tandem
