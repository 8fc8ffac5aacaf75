// Mixture of experts: a router picks top_k of num_experts SwiGLU experts per
// token, tokens are permuted to expert-major order, each expert runs on its
// contiguous slice of rows, and the outputs are permuted back and mixed with
// the renormalised router weights.
//
// The steps are separate functions because expert parallelism replaces the
// middle of the pipeline: route → plan_dispatch → dispatch_tokens
// → [experts] → combine_tokens. In the expert-parallel MoE the plan's counts
// become the all-to-all split sizes and the local permutation is followed by
// an all-to-all (DESIGN §8: the dispatch [A], experts [B] and combine [C]
// hooks sit between these steps). The replacement is an MoEDispatcher that
// the ExpertParallel style (parallel/expert_parallel.h) installs, together
// with keep_experts(), which drops the experts other ranks own.
//
// Note [MoE per-call state]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// The routing, the permutation and the split sizes of one forward live in
// local variables and in the autograd nodes of that forward, never in module
// members: in the dual-pipe schedule the forward of micro-batch i+1 runs while
// the backward of micro-batch i replays its own tape. For the same reason the
// load-balancing loss is returned as the second output of forward rather than
// kept for an accessor.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tandem/autograd/module.h"
#include "tandem/autograd/nn/container.h"
#include "tandem/autograd/nn/linear.h"

namespace tandem::nn {

// The outputs of a layer that adds an auxiliary loss: nn::MoE, a
// TransformerBlock with an MoE layer, a TransformerLM or any model with MoE
// blocks (Note [Module outputs] in autograd/module.h).
struct AuxOutput {
  Tensor out;       // the layer's output
  Tensor aux_loss;  // scalar load-balancing loss; undefined when the module has none
};

// The router's decision for T tokens over E experts.
struct MoERouting {
  Tensor probs;    // (T, E) softmax of the router logits
  Tensor weights;  // (T, k) top-k probabilities renormalised to sum to 1 per token
  Tensor indices;  // (T, k) i64 chosen experts, by decreasing probability
};

// softmax → topk → renormalise. Differentiable in `logits` (T, E).
MoERouting route(const Tensor& logits, int64_t top_k);

// The token permutation for one forward. Assignment a = t * k + j is token
// t's j-th choice; "rows" are the T*k assignments sorted stably by expert, so
// expert e owns rows [offset_e, offset_e + counts[e]) and, within an expert,
// tokens keep their order.
struct MoEDispatchPlan {
  int64_t num_tokens = 0;       // T
  int64_t top_k = 0;            // k
  int64_t num_experts = 0;      // E
  Tensor order;                 // (T*k) i64: row p holds assignment order[p]
  Tensor inverse;               // (T*k) i64: assignment a sits in row inverse[a]
  Tensor token_index;           // (T*k) i64: the token of row p (order[p] / k)
  std::vector<int64_t> counts;  // (E) rows per expert, on the host
};

// Builds the plan from the chosen experts (T, k) integer. Reads the indices on
// the host (synchronises their stream) to compute `counts`, which become
// split sizes.
MoEDispatchPlan plan_dispatch(const Tensor& expert_indices, int64_t num_experts);
// (T, D) tokens → (T*k, D) rows in expert-major order.
Tensor dispatch_tokens(const Tensor& x, const MoEDispatchPlan& plan);
// (T*k, D) expert outputs in row order → (T, D): un-permute and sum the k
// choices of each token weighted by `weights` (T, k).
Tensor combine_tokens(const Tensor& expert_out, const Tensor& weights, const MoEDispatchPlan& plan);
// Switch-Transformer load-balancing loss E * sum_e f_e * P_e, where f_e is the
// fraction of the T*k assignments routed to expert e (constant) and P_e the
// mean router probability of e over the tokens (differentiable). Equals 1
// for perfectly uniform routing; 0 without tokens. A 0-d tensor of probs' dtype.
Tensor load_balancing_loss(const Tensor& probs, const MoEDispatchPlan& plan);

class MoE;

// What runs between the plan and the output of one forward: dispatch →
// experts → combine. Without one, MoE runs every expert on this rank; expert
// parallelism installs one that exchanges tokens between ranks. It is
// configuration, set once; per-call state stays in locals and autograd nodes
// (Note [MoE per-call state]).
class MoEDispatcher {
 public:
  virtual ~MoEDispatcher() = default;
  // tokens (T, D), routing and plan of this call → y (T, D), as combine_tokens.
  virtual Tensor run(MoE& moe, const Tensor& tokens, const MoERouting& routing,
                     const MoEDispatchPlan& plan) = 0;
};

// Input x (…, d_model); outputs {y of x's shape, aux_loss (0-d)}: aux_loss is
// load_balancing_loss of this call (Note [MoE per-call state]); scale it and
// add it to the training loss. Children: router (Linear d_model → E, no
// bias), experts (ModuleList of SwiGLU(d_model, hidden)).
struct MoEOptions {
  int64_t d_model = 0;
  int64_t hidden = 0;  // per expert
  int64_t num_experts = 0;
  int64_t top_k = 2;
  // The router's name among the children: Mixtral's checkpoints call it "gate".
  std::string router_name = "router";
};

class MoE final : public Module {
 public:
  using Options = MoEOptions;
  MoE(const MoEOptions& options, Generator& gen);

  int64_t num_experts() const { return num_experts_; }
  int64_t top_k() const { return top_k_; }
  const std::shared_ptr<Linear>& router() const { return router_; }
  // Expert e by global index; it must be local (see keep_experts).
  const std::shared_ptr<SwiGLU>& expert(int64_t e) const;

  // Experts [first_local_expert(), + num_local_experts()) live on this rank:
  // all of them unless keep_experts() was called.
  int64_t first_local_expert() const { return first_local_; }
  int64_t num_local_experts() const { return static_cast<int64_t>(experts_.size()); }
  bool is_local_expert(int64_t e) const {
    return e >= first_local_ && e < first_local_ + num_local_experts();
  }
  // Keeps experts [first, first + count) and drops the other experts' modules
  // and parameters; the kept ones keep their global names
  // ("experts.5.w1.weight"). Once only, and only with a dispatcher installed
  // (forward refuses to run a partial expert set locally).
  void keep_experts(int64_t first, int64_t count);

  void set_dispatcher(std::shared_ptr<MoEDispatcher> dispatcher);
  const std::shared_ptr<MoEDispatcher>& dispatcher() const { return dispatcher_; }

  // Runs local expert i on rows [offset_i, offset_i + counts[i]) of `rows`
  // (N, D), counts per local expert, and concatenates the results in row
  // order. Experts without rows are skipped; with no rows at all the (0, D)
  // result is `rows` itself, so the graph stays connected.
  Tensor run_experts(const Tensor& rows, const std::vector<int64_t>& counts);

 protected:
  std::vector<Tensor> forward(Args& args) override;

 private:
  int64_t d_model_;
  int64_t num_experts_;
  int64_t top_k_;
  std::shared_ptr<Linear> router_;
  std::vector<std::shared_ptr<SwiGLU>> experts_;  // the local experts
  int64_t first_local_ = 0;
  std::shared_ptr<MoEDispatcher> dispatcher_;
};

// Calls `module` and names its outputs: {out} or {out, aux_loss}; throws
// naming the module when forward returned another count.
AuxOutput call_with_aux(Module& module, Args args);

}  // namespace tandem::nn
