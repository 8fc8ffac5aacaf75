#include "tandem/autograd/nn/moe.h"

#include "tandem/autograd/ops.h"
#include "tandem/runtime/error.h"

namespace tandem::nn {
namespace {

// The "experts" child after keep_experts(): the local experts under their
// global indices, so names read "experts.5.w1.weight" on the owning rank only.
class ExpertShard final : public Module {
 public:
  ExpertShard() : Module("ExpertShard") {}
  void add(int64_t index, std::shared_ptr<SwiGLU> expert) {
    register_module(std::to_string(index), std::move(expert));
  }

 protected:
  std::vector<Tensor> forward(Args&) override {
    TANDEM_FAIL("[nn::MoE] expected a call on one of the experts, got a call on their container");
  }
};

}  // namespace

MoERouting route(const Tensor& logits, int64_t top_k) {
  TANDEM_CHECK(logits.dim() == 2 && top_k >= 1 && top_k <= logits.shape()[1],
               "[nn::moe_route] expected logits (T, E) and 1 <= top_k <= E, got {} and top_k={}",
               logits.shape(), top_k);
  MoERouting r;
  r.probs = softmax(logits, -1);
  auto [values, indices] = topk(r.probs, top_k, -1);
  r.weights = div(values, sum(values, Dims{-1}, true));
  r.indices = indices;
  return r;
}

MoEDispatchPlan plan_dispatch(const Tensor& expert_indices, int64_t num_experts) {
  TANDEM_CHECK(expert_indices.dim() == 2 && !is_floating(expert_indices.dtype()) &&
                   expert_indices.dtype() != DType::Bool,
               "[nn::plan_dispatch] expected integer expert indices (T, k), got {} {}",
               dtype_name(expert_indices.dtype()), expert_indices.shape());
  MoEDispatchPlan plan;
  plan.num_tokens = expert_indices.shape()[0];
  plan.top_k = expert_indices.shape()[1];
  plan.num_experts = num_experts;
  const int64_t n = plan.num_tokens * plan.top_k;
  const Device dev = expert_indices.device();
  Tensor flat = ops::reshape(ops::to(expert_indices, DType::I64), Shape{n});

  plan.counts.assign(static_cast<size_t>(num_experts), 0);
  for (int64_t e : flat.to_vector<int64_t>()) {
    TANDEM_CHECK(e >= 0 && e < num_experts,
                 "[nn::plan_dispatch] expected expert indices in [0, {}), got {}", num_experts, e);
    ++plan.counts[static_cast<size_t>(e)];
  }
  // Stable: rows of one expert keep token order, so the plan is deterministic.
  plan.order = ops::argsort(flat, 0);
  plan.inverse = ops::argsort(plan.order, 0);
  // Token of assignment a is a / k: [0,0,…,1,1,…] (k each), gathered by order.
  Tensor token_of_assignment = ops::reshape(
      ops::expand(ops::unsqueeze(
                      ops::arange(0, static_cast<double>(plan.num_tokens), 1, DType::I64, dev), 1),
                  Shape{plan.num_tokens, plan.top_k}),
      Shape{n});
  plan.token_index = ops::index_select(token_of_assignment, 0, plan.order);
  return plan;
}

Tensor dispatch_tokens(const Tensor& x, const MoEDispatchPlan& plan) {
  TANDEM_CHECK(x.dim() == 2 && x.shape()[0] == plan.num_tokens,
               "[nn::dispatch_tokens] expected x of shape ({}, D), got {}", plan.num_tokens,
               x.shape());
  return index_select(x, 0, plan.token_index);
}

Tensor combine_tokens(const Tensor& expert_out, const Tensor& weights,
                      const MoEDispatchPlan& plan) {
  const int64_t n = plan.num_tokens * plan.top_k;
  TANDEM_CHECK(expert_out.dim() == 2 && expert_out.shape()[0] == n,
               "[nn::combine_tokens] expected expert outputs of shape ({}, D), got {}", n,
               expert_out.shape());
  TANDEM_CHECK(weights.shape() == Shape({plan.num_tokens, plan.top_k}),
               "[nn::combine_tokens] expected weights of shape ({}, {}), got {}", plan.num_tokens,
               plan.top_k, weights.shape());
  const int64_t d = expert_out.shape()[1];
  // Back to assignment order (t major, choice minor), then mix the k choices.
  Tensor per_choice =
      reshape(index_select(expert_out, 0, plan.inverse), Shape{plan.num_tokens, plan.top_k, d});
  Tensor w = unsqueeze(to(weights, expert_out.dtype()), -1);
  return sum(mul(per_choice, w), Dims{1});
}

Tensor load_balancing_loss(const Tensor& probs, const MoEDispatchPlan& plan) {
  TANDEM_CHECK(probs.shape() == Shape({plan.num_tokens, plan.num_experts}),
               "[nn::load_balancing_loss] expected probs of shape ({}, {}), got {}",
               plan.num_tokens, plan.num_experts, probs.shape());
  const double assignments = static_cast<double>(plan.num_tokens * plan.top_k);
  // No token (an empty sequence shard): no imbalance. 0, kept on the graph
  // (with a zero gradient), where the formula would give 0 / 0.
  if (assignments == 0) return mul(sum(probs), 0.0);
  std::vector<double> fraction;
  for (int64_t c : plan.counts)
    fraction.push_back(static_cast<double>(c) / assignments);
  Tensor f = ops::to(ops::to(ops::from_vector(fraction, Shape{plan.num_experts}), probs.device()),
                     probs.dtype());
  Tensor mean_prob = mean(probs, Dims{0});  // (E)
  return mul(sum(mul(mean_prob, f)), static_cast<double>(plan.num_experts));
}

MoE::MoE(const MoEOptions& options, Generator& gen)
    : Module("MoE"),
      d_model_(options.d_model),
      num_experts_(options.num_experts),
      top_k_(options.top_k) {
  const int64_t d_model = d_model_, hidden = options.hidden, num_experts = num_experts_,
                top_k = top_k_;
  TANDEM_CHECK(num_experts >= 1 && top_k >= 1 && top_k <= num_experts,
               "[nn::MoE] expected 1 <= top_k <= num_experts, got top_k={}, num_experts={}", top_k,
               num_experts);
  router_ = register_module(
      options.router_name,
      nn::make<nn::Linear>({.in_features = d_model, .out_features = num_experts, .bias = false},
                           gen));
  auto list = register_module("experts", std::make_shared<ModuleList>());
  for (int64_t e = 0; e < num_experts; ++e) {
    experts_.push_back(
        list->append(nn::make<nn::SwiGLU>({.d_model = d_model, .hidden = hidden}, gen)));
  }
}

const std::shared_ptr<SwiGLU>& MoE::expert(int64_t e) const {
  TANDEM_CHECK(is_local_expert(e), "[nn::MoE] expected a local expert in [{}, {}), got {}",
               first_local_, first_local_ + num_local_experts(), e);
  return experts_[static_cast<size_t>(e - first_local_)];
}

void MoE::keep_experts(int64_t first, int64_t count) {
  TANDEM_CHECK(num_local_experts() == num_experts_,
               "[nn::MoE] expected keep_experts once, on the full set of {} experts, got {} local",
               num_experts_, num_local_experts());
  TANDEM_CHECK(count >= 1 && first >= 0 && first + count <= num_experts_,
               "[nn::MoE] expected a range of experts inside [0, {}), got [{}, {})", num_experts_,
               first, first + count);
  auto shard = std::make_shared<ExpertShard>();
  std::vector<std::shared_ptr<SwiGLU>> kept;
  for (int64_t e = first; e < first + count; ++e) {
    kept.push_back(experts_[static_cast<size_t>(e)]);
    shard->add(e, kept.back());
  }
  replace_module("experts", shard);
  experts_ = std::move(kept);
  first_local_ = first;
}

void MoE::set_dispatcher(std::shared_ptr<MoEDispatcher> dispatcher) {
  dispatcher_ = std::move(dispatcher);
}

Tensor MoE::run_experts(const Tensor& rows, const std::vector<int64_t>& counts) {
  TANDEM_CHECK(counts.size() == experts_.size(),
               "[nn::MoE] expected {} per-expert counts (one per local expert), got {}",
               experts_.size(), counts.size());
  std::vector<Tensor> slices = split_sizes(rows, counts, 0);
  std::vector<Tensor> outputs;
  for (size_t e = 0; e < experts_.size(); ++e) {
    if (counts[e] > 0) outputs.push_back((*experts_[e])(slices[e]));
  }
  if (outputs.empty()) return rows;
  return outputs.size() == 1 ? outputs[0] : cat(outputs, 0);
}

std::vector<Tensor> MoE::forward(Args& args) {
  const Tensor& x = single_input(args, "MoE");
  TANDEM_CHECK(x.dim() >= 2 && x.shape().back() == d_model_,
               "[nn::MoE] expected an input of shape (…, {}), got {}", d_model_, x.shape());
  int64_t T = 1;  // spelled out, not -1: a shard may hold no token
  for (int i = 0; i + 1 < x.dim(); ++i)
    T *= x.shape()[i];
  Tensor tokens = reshape(x, Shape{T, d_model_});  // (T, D)
  MoERouting routing = route((*router_)(tokens), top_k_);
  MoEDispatchPlan plan = plan_dispatch(routing.indices, num_experts_);
  Tensor y;
  if (dispatcher_) {
    y = dispatcher_->run(*this, tokens, routing, plan);
  } else {
    TANDEM_CHECK(num_local_experts() == num_experts_,
                 "[nn::MoE] expected all {} experts on this rank or a dispatcher (expert "
                 "parallelism), got {} local experts and no dispatcher",
                 num_experts_, num_local_experts());
    Tensor rows = dispatch_tokens(tokens, plan);
    Tensor expert_out = run_experts(rows, plan.counts);
    y = combine_tokens(expert_out, routing.weights, plan);
  }
  return {reshape(y, x.shape()), load_balancing_loss(routing.probs, plan)};
}

AuxOutput call_with_aux(Module& module, Args args) {
  std::vector<Tensor> out = module.call(std::move(args));
  TANDEM_CHECK(out.size() == 1 || out.size() == 2,
               "[nn::{}] expected outputs {{out}} or {{out, aux_loss}}, got {} tensors",
               module.type_name(), out.size());
  return {out[0], out.size() == 2 ? out[1] : Tensor()};
}

}  // namespace tandem::nn
