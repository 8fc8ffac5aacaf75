// Fully sharded data parallelism (FSDP2-style; DESIGN §10): every parameter
// of a model is stored as this rank's Shard(0) chunk over a mesh dim, and
// gathered whole only around the forward and the backward of the block that
// uses it.
//
//   FullyShardedDataParallel fsdp(model, {layer0, layer1, ...}, mesh.slice("dp"));
//   optim::AdamW opt(model->named_parameters(), ...);   // the shards
//   backward(loss(model));
//   fsdp.finish();                          // the shards' gradients, reduced
//   clip_grad_norm(model->named_parameters(), mesh, 1.0);
//   opt.step();
//
// Note [FSDP]
// ~~~~~~~~~~~
// Groups. Each block given (a decoder layer, say) is one group: the
// parameters of it and its children, less those of blocks inside it; the
// root's remaining parameters (embeddings, final norm, head) are the last.
// A parameter of full shape (n, ...) becomes, on shard-dim rank r, the
// chunk_range() rows of chunk semantics: ceil(n / W) rows from r * ceil(n / W)
// on, possibly fewer or none (an empty shard). It is installed as the
// module's parameter and recorded as Shard(0) on the shard dim (Note
// [Parameter placements]), so optimizers, clip_grad_norm, reduce_gradients
// over the other dims and sharded checkpoints see it as what it is, with no
// name matching.
//
// Forward. A group's forward pre-hook waits for its all-gather (one
// collective: every parameter's shard padded to ceil(n / W) rows, packed),
// copies each parameter's rows out into a whole tensor, installs it as a
// fresh leaf in place of the shard, and launches the all-gather of the next
// group in the forward order recorded by the first step (prefetch). With
// reshard_after_forward (the default), the forward hook puts the shard back
// and releases the whole tensor's memory (Note [Released storage]): the
// graph keeps views of it, whose data come back before they are needed.
// Once the order is known, the last group to finish its forward keeps its
// parameters: the backward needs them first.
//
// Backward. A group's backward pre-hook (before any node of the block runs
// backward) waits for its all-gather again, restores the whole tensors'
// memory and copies the gathered rows into it, then launches the all-gather
// of the group before it in the forward order. The whole leaves accumulate
// their gradients; when every one of a group's has its gradient (gradient-
// ready hooks, Note [Gradient-ready hooks]), the group's gradients are packed
// by destination rank and reduce-scattered, the whole tensors released and
// the shards reinstalled. Groups launch their reduce-scatters strictly in
// reverse forward order on every rank, so every rank issues the same
// collectives in the same order (a group whose parameter got no gradient
// holds it and every later one until finish(), which reduces zeros for it,
// as DDP does). Each backward is one round of reduce-scatters; the first
// forward pre-hook after a backward ends its round (launching what it holds)
// before that group's whole leaves are replaced, so micro-batches may run
// forward and backward in turn before one finish(). finish() ends the round,
// waits, sums each group's rounds, all-reduces the sum over the replicate
// dim (HSDP on a 2-D mesh) and adds each shard's part to its grad(). With a
// reduce_dtype (f32 under bf16 mixed precision), the packed gradients are
// widened before the reduce-scatter and every sum is taken in it: each
// shard's gradient is rounded into the parameter's dtype once, at the end.
//
// Over tensor parallelism. A parameter the colwise style already split
// along dim 0 is sharded again: each FSDP rank takes its chunk of this tp
// rank's rows, a block of the global tensor that is still contiguous
// (record_nested_shard: the tp offset plus the chunk's start), so
// checkpoints, clipping and the reductions read it like any other record;
// the gathered whole is the tp shard the style's forward expects.
//
// Not (yet) covered: the dual-pipe schedule's two workers, and recompute
// inside a group (a re-run forward finds the group gathered and leaves it
// so).
#pragma once

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tandem/autograd/module.h"
#include "tandem/comm/types.h"
#include "tandem/comm/work.h"
#include "tandem/parallel/device_mesh.h"

namespace tandem {

struct FSDPOptions {
  // The mesh dim parameters are sharded over and the one they are
  // replicated over (HSDP); empty: a 1-D mesh's only dim, or a 2-D mesh's
  // (replicate, shard) dims in that order, as PyTorch's fully_shard.
  std::string shard_dim = "", replicate_dim = "";
  bool reshard_after_forward = true;
  RedOp op = RedOp::Avg;  // of the gradients over the data ranks: Avg or Sum
  // The dtype gradients are reduce-scattered, summed over micro-batches and
  // all-reduced over the replicate dim in (mixed precision: f32 sums of bf16
  // gradients, each rounded once into its shard's grad()); nullopt: the
  // parameters' own, as DDPOptions::reduce_dtype.
  std::optional<DType> reduce_dtype = std::nullopt;
};

class FullyShardedDataParallel {
 public:
  // Shards `root`'s parameters in place: one group per module of `blocks`
  // (each inside root, none inside another), then root's remaining ones.
  FullyShardedDataParallel(std::shared_ptr<Module> root,
                           const std::vector<std::shared_ptr<Module>>& blocks,
                           const DeviceMesh& mesh, FSDPOptions options = {});
  ~FullyShardedDataParallel();
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  // Launches the reduce-scatters still held (zeros for parameters without a
  // gradient), waits for every one, all-reduces over the replicate dim, and
  // adds each shard's reduced gradient to its grad(). Collective; call once
  // per step, after the last backward (micro-batches accumulate before it).
  void finish();

  int num_groups() const;
  // Inspection (tests): the group names in forward order once the first
  // forward recorded it, and how many all-gathers were launched ahead of
  // the hook that needed them (prefetches) since construction.
  std::vector<std::string> forward_order() const;
  int prefetches() const;
  // Groups whose reduce-scatter the last backward launched in order during
  // it (0 after finish()).
  int launched() const;

  struct Group;  // fsdp.cpp

 private:
  void build_group(const std::string& name, const std::shared_ptr<Module>& module,
                   const std::vector<Module*>& blocks);
  // The hooks of Note [FSDP], each under mu_.
  void before_forward(Group& g);
  void after_forward(Group& g);
  void before_backward(Group& g);
  void on_ready(Group& g, size_t param);
  // Under mu_.
  void launch_gather(Group& g);
  void prefetch(Group* g);
  void wait_gather(Group& g, bool fresh);
  void launch_ready_reduces();
  void launch_reduce(Group& g);
  void flush_round();

  std::shared_ptr<Module> root_;
  FSDPOptions options_;
  DeviceMesh shard_mesh_;
  ProcessGroupPtr shard_group_, replicate_group_;
  std::vector<std::unique_ptr<Group>> groups_;
  std::vector<HookHandle> handles_;
  // The order of the groups' forward pre-hooks and forward hooks in the
  // first forward; the reduce-scatters launch in reverse pre-hook order.
  std::vector<Group*> pre_order_, post_order_;
  size_t next_reduce_ = 0;     // groups launched in order in this round
  bool round_active_ = false;  // a backward since the round began
  int prefetches_ = 0;
  mutable std::mutex mu_;
};

}  // namespace tandem
