#include "tandem/parallel/expert_parallel.h"

#include <numeric>
#include <utility>
#include <vector>

#include "tandem/autograd/function.h"
#include "tandem/autograd/ops.h"
#include "tandem/parallel/collectives.h"
#include "tandem/parallel/param_placement.h"
#include "tandem/runtime/error.h"

namespace tandem {
namespace {

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

    // Note [Exchange windows]: each all-to-all is issued and waited inside
    // the windows of the phase hooks, in forward and in backward.
    auto dispatch = std::make_shared<Exchange>();
    dispatch->what = "the expert dispatch";
    rows = exchange_open(dispatch, rows);
    rows = run_hook(hooks_.before_dispatch, "A", layer_, rows);

    // [A] → [B]: split sizes, then the tokens.
    std::vector<int64_t> counts = exchange_counts(plan.counts, tokens.device());
    std::vector<int64_t> send_rows, recv_rows;
    for (int r = 0; r < ep; ++r) {
      send_rows.push_back(sum_range(plan.counts, r * per_rank_, per_rank_));
      recv_rows.push_back(sum_range(counts, r * per_rank_, per_rank_));
    }
    *dispatch = row_exchange(send_rows, recv_rows, "ep dispatch", dispatch->what);
    Tensor received = exchange_launch(dispatch, rows);
    received = run_hook(hooks_.before_experts, "B", layer_, received);
    received = exchange_wait(dispatch, received);

    // [B] → [C]: the local experts.
    ReceivedOrder order = received_order(counts, ep, per_rank_, tokens.device());
    Tensor sorted = index_select(received, 0, order.to_expert_major);
    Tensor expert_out = moe.run_experts(sorted, order.per_expert);
    Tensor back = index_select(expert_out, 0, order.to_source_major);

    auto combine = std::make_shared<Exchange>(
        row_exchange(recv_rows, send_rows, "ep combine", "the expert combine"));
    back = exchange_open(combine, back);
    back = run_hook(hooks_.before_combine, "C", layer_, back);

    // [C] → [D]: the rows go home.
    Tensor returned = exchange_launch(combine, back);
    returned = run_hook(hooks_.after_combine, "D", layer_, returned);
    returned = exchange_wait(combine, returned);

    // After [D]: the weighted sum, as in the local MoE.
    return nn::combine_tokens(returned, routing.weights, plan);
  }

 private:
  // Rows to and from every rank (dim 0 both ways); backward sends them back.
  Exchange row_exchange(const std::vector<int64_t>& send, const std::vector<int64_t>& recv,
                        const char* tag, std::string what) const {
    Exchange ex;
    ProcessGroupPtr group = group_;
    ex.forward = [=](const Tensor& x) {
      return launch_all_to_all(x, group, 0, 0, send, recv, tag);
    };
    ex.backward = [=](const Tensor& g) {
      return launch_all_to_all(g, group, 0, 0, recv, send, tag);
    };
    ex.what = std::move(what);
    return ex;
  }

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
