// Expert parallelism (DESIGN §1, §8): the experts of an nn::MoE are split
// over the ranks of an `ep` mesh dim and tokens travel to the rank that owns
// their expert and back. It is a parallel style on the one MoE layer of the
// autograd suite, not a second implementation: the style keeps the local
// experts (keep_experts) and installs a dispatcher in place of the local
// dispatch → experts → combine.
//
// With ep ranks and E experts (E % ep == 0), rank r owns experts
// [r*E/ep, (r+1)*E/ep). One forward, in four windows bounded by the dual-pipe
// sync points (the hooks of MoEPhaseHooks):
//
//   router, top-k, plan, local permutation to expert-major order (compute)
//   [A] before dispatch
//       counts all-to-all (no gradient; host ints: the split sizes), then the
//       token all-to-all with uneven splits, launched asynchronously
//   [B] before experts
//       wait, permutation to expert-major order among the received rows
//       (rows from every source rank for one local expert together), local
//       experts, inverse permutation (compute)
//   [C] before combine
//       combine all-to-all (the reverse splits), launched asynchronously
//   [D] after combine
//       wait, the weighted sum over top-k exactly as in the local MoE (compute)
//
// Backward mirrors it: the reverse combine all-to-all is launched between [D]
// and [C], the reverse dispatch all-to-all between [B] and [A], each waited
// just past the next hook (Note [Exchange windows], parallel/collectives.h).
//
// Gradient convention. Expert parameters are sharded over ep: the owner's
// gradient already sums the contributions of every rank's tokens, so they
// must not be all-reduced over ep. Replicated parameters (the router) see only
// the local batch; like any data-parallel parameter, their gradients are
// summed (or averaged) over the ep ranks by the data-parallel reduction, and
// that sum equals the single-rank gradient over all the ranks' batches. The
// aux (load-balancing) loss is this rank's, over its own batch.
//
// Per-call state (split sizes, permutations, pending collectives) lives in
// locals and in the autograd nodes of that forward, never in the module or
// the dispatcher (Note [MoE per-call state]), so the forward of one
// micro-batch and the backward of another can run on two threads.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "tandem/autograd/nn/moe.h"
#include "tandem/parallel/device_mesh.h"
#include "tandem/parallel/tensor_parallel.h"

namespace tandem {

// The dual-pipe sync points of one MoE layer (DESIGN §8). Each hook gets the
// layer index and the tensor that flows through that point, and returns the
// tensor to continue with: typically the same tensor through an identity
// autograd Function (the sync hook), which then also fires in backward. An
// empty hook passes the tensor through.
//
// The tensors at [B] and [D] are the outputs of collectives still in flight:
// a hook may wrap them in autograd nodes but must not read their values. In
// backward, likewise, the gradients passing [A] and [C] are in flight.
struct MoEPhaseHooks {
  using Hook = std::function<Tensor(int64_t layer, const Tensor& x)>;
  Hook before_dispatch;  // [A] the local rows (T*k, D), expert-major
  Hook before_experts;   // [B] the received rows, in source-rank order
  Hook before_combine;   // [C] the expert outputs, back in source-rank order
  Hook after_combine;    // [D] the returned rows (T*k, D), expert-major
};

struct ExpertParallel final : ParallelStyle {
  MoEPhaseHooks hooks;
  int64_t layer = 0;  // passed to the hooks
  // `module` must be an nn::MoE with all its experts; `mesh` is 1-D, or has a
  // dim named "ep". Drops the experts other ranks own and installs the
  // expert-parallel dispatcher. Every forward is then collective over ep.
  void apply(Module& module, const DeviceMesh& mesh) const override;
};

void expert_parallel(const std::shared_ptr<nn::MoE>& moe, const DeviceMesh& ep_mesh,
                     MoEPhaseHooks hooks = {}, int64_t layer = 0);

}  // namespace tandem
