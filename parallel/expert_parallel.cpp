#include "tandem/parallel/expert_parallel.h"

#include <numeric>
#include <utility>
#include <vector>

#include "tandem/autograd/function.h"
#include "tandem/autograd/ops.h"
#include "tandem/parallel/param_placement.h"
#include "tandem/runtime/error.h"

namespace tandem {
namespace {

// Note [Expert-parallel exchange windows]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A dual-pipe window pairs one thread's collectives with the other thread's
// compute (DESIGN §8), so a collective must be *issued* inside its window, in
// backward as in forward: forward [A] launch [B] wait…, backward [B] launch
// [A] wait…. One differentiable all-to-all is therefore three nodes around
// the two hooks of its window:
//
//   x → Open → [A or C] → Launch → [B or D] → Wait → y
//
//               forward               backward
//   Open        identity              wait for the reverse all-to-all
//   Launch      issue the all-to-all  issue the reverse all-to-all
//   Wait        wait for it           identity
//
// Launch returns the collective's output buffer before it is filled (and its
// backward the reverse one's); only the hooks see a buffer in flight, and
// they pass it on without reading it. The three nodes share one RowExchange
// made for this call: it is the per-call state (split sizes, pending works)
// and the nodes of this forward own it (Note [MoE per-call state]). All three
// are recorded whenever grad mode is on, even on a rank whose rows do not
// require grad, so every rank runs the same collectives in backward.
struct RowExchange {
  ProcessGroupPtr group;
  std::vector<int64_t> send_rows;  // rows to each rank (forward)
  std::vector<int64_t> recv_rows;  // rows from each rank (forward)
  const char* tag = "";
  WorkPtr forward;   // issued by Launch::forward, waited by Wait::forward
  WorkPtr backward;  // issued by Launch::backward, waited by Open::backward
};

struct ExchangeOpen final : Function {
  std::shared_ptr<RowExchange> ex;
  const char* name() const override { return "ExpertExchangeOpenBackward"; }
  bool always_record() const override { return true; }
  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>& in) override {
    return {in[0]};
  }
  std::vector<Tensor> backward(FunctionCtx&, const std::vector<Tensor>& g) override {
    if (!ex->backward) return {g[0]};
    ex->backward->wait();
    Tensor received = ex->backward->result();
    ex->backward.reset();
    return {received};
  }
};

struct ExchangeLaunch final : Function {
  std::shared_ptr<RowExchange> ex;
  const char* name() const override { return "ExpertExchangeLaunchBackward"; }
  bool always_record() const override { return true; }
  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>& in) override {
    ex->forward = ex->group->all_to_all_single(in[0], {ex->send_rows, ex->recv_rows, ex->tag});
    return {ex->forward->result()};  // in flight until Wait
  }
  std::vector<Tensor> backward(FunctionCtx&, const std::vector<Tensor>& g) override {
    ex->backward = ex->group->all_to_all_single(ops::contiguous(g[0]),
                                                {ex->recv_rows, ex->send_rows, ex->tag});
    return {ex->backward->result()};  // in flight until Open
  }
};

struct ExchangeWait final : Function {
  std::shared_ptr<RowExchange> ex;
  const char* name() const override { return "ExpertExchangeWaitBackward"; }
  bool always_record() const override { return true; }
  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>& in) override {
    TANDEM_INTERNAL_ASSERT(ex->forward != nullptr, "expert exchange waited before its launch");
    ex->forward->wait();
    Tensor received = ex->forward->result();
    ex->forward.reset();
    TANDEM_CHECK(in[0].shape() == received.shape(),
                 "[parallel::ExpertParallel] expected a phase hook to pass the exchanged rows "
                 "{} on, got {}",
                 received.shape(), in[0].shape());
    return {received};
  }
  std::vector<Tensor> backward(FunctionCtx&, const std::vector<Tensor>& g) override {
    return {g[0]};
  }
};

template <class F>
Tensor apply_exchange(const std::shared_ptr<RowExchange>& ex, const Tensor& x) {
  auto fn = std::make_shared<F>();
  fn->ex = ex;
  return Function::apply(fn, {x})[0];
}

Tensor run_hook(const MoEPhaseHooks::Hook& hook, const char* point, int64_t layer,
                const Tensor& x) {
  if (!hook) return x;
  Tensor y = hook(layer, x);
  TANDEM_CHECK(y.defined() && y.shape() == x.shape(),
               "[parallel::ExpertParallel] expected the [{}] hook of layer {} to return a tensor "
               "of shape {}, got {}",
               point, layer, x.shape(), y.defined() ? fmt::format("{}", y.shape()) : "none");
  return y;
}

int64_t sum_range(const std::vector<int64_t>& v, int64_t first, int64_t count) {
  return std::accumulate(v.begin() + first, v.begin() + first + count, int64_t{0});
}

// The received rows are source-rank major ([from 0: local expert 0, 1, …],
// [from 1: …]); experts want them expert major ([expert 0: from 0, 1, …], …).
struct ReceivedOrder {
  Tensor to_expert_major;           // row p of the sorted rows is received row [p]
  Tensor to_source_major;           // its inverse
  std::vector<int64_t> per_expert;  // rows per local expert
};

ReceivedOrder received_order(const std::vector<int64_t>& counts, int ep, int64_t per_rank,
                             Device device) {
  // counts[s * per_rank + e]: rows from source s for local expert e.
  std::vector<int64_t> offset(counts.size(), 0);
  int64_t total = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    offset[i] = total;
    total += counts[i];
  }
  ReceivedOrder order;
  order.per_expert.assign(static_cast<size_t>(per_rank), 0);
  std::vector<int64_t> perm, inverse(static_cast<size_t>(total));
  perm.reserve(static_cast<size_t>(total));
  for (int64_t e = 0; e < per_rank; ++e) {
    for (int s = 0; s < ep; ++s) {
      const size_t i = static_cast<size_t>(s * per_rank + e);
      for (int64_t j = 0; j < counts[i]; ++j) {
        inverse[static_cast<size_t>(offset[i] + j)] = static_cast<int64_t>(perm.size());
        perm.push_back(offset[i] + j);
      }
      order.per_expert[static_cast<size_t>(e)] += counts[i];
    }
  }
  order.to_expert_major = ops::from_vector(perm, Shape{total}, device);
  order.to_source_major = ops::from_vector(inverse, Shape{total}, device);
  return order;
}

class ExpertParallelDispatcher final : public nn::MoEDispatcher {
 public:
  ExpertParallelDispatcher(ProcessGroupPtr group, int64_t per_rank, MoEPhaseHooks hooks,
                           int64_t layer)
      : group_(std::move(group)), per_rank_(per_rank), hooks_(std::move(hooks)), layer_(layer) {}

  Tensor run(nn::MoE& moe, const Tensor& tokens, const nn::MoERouting& routing,
             const nn::MoEDispatchPlan& plan) override {
    const int ep = group_->size();
    // Expert-major rows are destination-major too: each rank's experts are a
    // contiguous range.
    Tensor rows = nn::dispatch_tokens(tokens, plan);  // (T*k, D)

    auto dispatch = std::make_shared<RowExchange>();
    dispatch->group = group_;
    dispatch->tag = "ep dispatch";
    rows = apply_exchange<ExchangeOpen>(dispatch, rows);
    rows = run_hook(hooks_.before_dispatch, "A", layer_, rows);

    // [A] → [B]: split sizes, then the tokens.
    std::vector<int64_t> counts = exchange_counts(plan.counts, tokens.device());
    for (int r = 0; r < ep; ++r) {
      dispatch->send_rows.push_back(sum_range(plan.counts, r * per_rank_, per_rank_));
      dispatch->recv_rows.push_back(sum_range(counts, r * per_rank_, per_rank_));
    }
    Tensor received = apply_exchange<ExchangeLaunch>(dispatch, rows);
    received = run_hook(hooks_.before_experts, "B", layer_, received);
    received = apply_exchange<ExchangeWait>(dispatch, received);

    // [B] → [C]: the local experts.
    ReceivedOrder order = received_order(counts, ep, per_rank_, tokens.device());
    Tensor sorted = index_select(received, 0, order.to_expert_major);
    Tensor expert_out = moe.run_experts(sorted, order.per_expert);
    Tensor back = index_select(expert_out, 0, order.to_source_major);

    auto combine = std::make_shared<RowExchange>();
    combine->group = group_;
    combine->tag = "ep combine";
    combine->send_rows = dispatch->recv_rows;
    combine->recv_rows = dispatch->send_rows;
    back = apply_exchange<ExchangeOpen>(combine, back);
    back = run_hook(hooks_.before_combine, "C", layer_, back);

    // [C] → [D]: the rows go home.
    Tensor returned = apply_exchange<ExchangeLaunch>(combine, back);
    returned = run_hook(hooks_.after_combine, "D", layer_, returned);
    returned = apply_exchange<ExchangeWait>(combine, returned);

    // After [D]: the weighted sum, as in the local MoE.
    return nn::combine_tokens(returned, routing.weights, plan);
  }

 private:
  // Rows this rank receives from each source for each local expert:
  // result[s * per_rank + e]. Collective, without gradient; reads on the host
  // because the counts become split sizes.
  std::vector<int64_t> exchange_counts(const std::vector<int64_t>& counts, Device device) const {
    NoGradGuard no_grad;
    Tensor local = ops::from_vector(counts, Shape{static_cast<int64_t>(counts.size())}, device);
    WorkPtr w = group_->all_to_all_single(local, {{}, {}, "ep counts"});
    w->wait();
    return w->result().to_vector<int64_t>();
  }

  ProcessGroupPtr group_;
  int64_t per_rank_;
  MoEPhaseHooks hooks_;
  int64_t layer_;
};

ProcessGroupPtr ep_group(const DeviceMesh& mesh) {
  if (mesh.ndim() == 1) return mesh.get_group();
  return mesh.get_group("ep");
}

}  // namespace

void ExpertParallel::apply(Module& module, const DeviceMesh& mesh) const {
  auto* moe = dynamic_cast<nn::MoE*>(&module);
  TANDEM_CHECK(moe != nullptr, "[parallel::ExpertParallel] expected an nn::MoE, got {}",
               module.type_name());
  ProcessGroupPtr group = ep_group(mesh);
  const int64_t ep = group->size(), experts = moe->num_experts();
  TANDEM_CHECK(experts % ep == 0,
               "[parallel::ExpertParallel] expected num_experts divisible by ep, got {} experts "
               "on ep={} ({})",
               experts, ep, group->where());
  TANDEM_CHECK(moe->num_local_experts() == experts && moe->dispatcher() == nullptr,
               "[parallel::ExpertParallel] expected an MoE with all {} experts and the local "
               "dispatch, got {} local experts{}",
               experts, moe->num_local_experts(),
               moe->dispatcher() ? " and a dispatcher already installed" : "");
  const int64_t per_rank = experts / ep;
  moe->keep_experts(group->rank() * per_rank, per_rank);
  // Note [Parameter placements]: each kept expert lives on this ep rank only.
  const std::string ep_dim = mesh.ndim() == 1 ? mesh.dim_names()[0] : "ep";
  for (int64_t e = 0; e < per_rank; ++e) {
    for (const Tensor& p : moe->expert(moe->first_local_expert() + e)->parameters())
      record_owned(p, ep_dim);
  }
  moe->set_dispatcher(std::make_shared<ExpertParallelDispatcher>(group, per_rank, hooks, layer));
}

void expert_parallel(const std::shared_ptr<nn::MoE>& moe, const DeviceMesh& ep_mesh,
                     MoEPhaseHooks hooks, int64_t layer) {
  TANDEM_CHECK(moe != nullptr, "[parallel::expert_parallel] expected an MoE, got null");
  ExpertParallel style;
  style.hooks = std::move(hooks);
  style.layer = layer;
  style.apply(*moe, ep_mesh);
}

}  // namespace tandem
