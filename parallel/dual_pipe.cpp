#include "tandem/parallel/dual_pipe.h"

#include <iterator>

#include "tandem/autograd/function.h"
#include "tandem/autograd/nn/moe.h"
#include "tandem/autograd/ops.h"
#include "tandem/parallel/expert_parallel.h"
#include "tandem/runtime/error.h"

namespace tandem {
namespace {

thread_local int micro_batch = -1;

struct Roles {
  HookRole prev, next;
};

Roles roles(SyncPoint p, bool backward) {
  using R = HookRole;
  static const Roles forward_table[] = {
      {R::Compute, R::Comm}, {R::Comm, R::Compute}, {R::Compute, R::Comm}, {R::Comm, R::Compute}};
  static const Roles backward_table[] = {
      {R::Comm, R::Compute}, {R::Compute, R::Comm}, {R::Comm, R::Compute}, {R::Compute, R::Comm}};
  static_assert(std::size(forward_table) == kSyncPointCount, "one forward entry per SyncPoint");
  static_assert(std::size(backward_table) == kSyncPointCount, "one backward entry per SyncPoint");
  return (backward ? backward_table : forward_table)[static_cast<int>(p)];
}

const char* point_name(SyncPoint p) {
  static const char* names[] = {"A:dispatch", "B:experts", "C:combine", "D:attention"};
  static_assert(std::size(names) == kSyncPointCount, "one name per SyncPoint");
  return names[static_cast<int>(p)];
}

struct SyncHookFunction final : Function {
  std::shared_ptr<HookCoordinator> coordinator;
  SyncPoint point = SyncPoint::A;
  int64_t layer = 0;
  bool last = false;  // D of the last MoE layer: D_LAST

  const char* name() const override { return "SyncHookBackward"; }
  bool always_record() const override { return true; }
  bool accepts_undefined_grads() const override { return true; }

  void fire(bool backward) const {
    HookInfo info{point_name(point), static_cast<int>(layer), backward, micro_batch};
    Roles r = roles(point, backward);
    if (last && point == SyncPoint::D) {
      if (!backward) coordinator->notify_dispatched(r.prev, info);  // D_LAST
      return;
    }
    coordinator->notify_dispatched(r.prev, info);
    coordinator->rendezvous(r.next, info);
  }
  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>& in) override {
    fire(false);
    return {in[0]};
  }
  std::vector<Tensor> backward(FunctionCtx&, const std::vector<Tensor>& g) override {
    fire(true);
    return {g[0]};
  }
};

}  // namespace

int current_micro_batch() {
  return micro_batch;
}

Tensor sync_hook(const Tensor& x, const std::shared_ptr<HookCoordinator>& coordinator,
                 SyncPoint point, int64_t layer, bool last_layer) {
  auto f = std::make_shared<SyncHookFunction>();
  f->coordinator = coordinator;
  f->point = point;
  f->layer = layer;
  f->last = last_layer;
  return Function::apply(f, {x})[0];
}

int install_dual_pipe(const std::shared_ptr<Module>& model, const DeviceMesh& ep_mesh,
                      const std::shared_ptr<HookCoordinator>& coordinator) {
  std::vector<std::shared_ptr<nn::MoE>> layers;
  for (auto& [name, m] : model->named_modules()) {
    if (auto moe = std::dynamic_pointer_cast<nn::MoE>(m)) layers.push_back(moe);
  }
  TANDEM_CHECK(!layers.empty(),
               "[parallel::install_dual_pipe] expected a model with MoE layers, got none in {}",
               model->type_name());
  const int n = static_cast<int>(layers.size());
  for (int l = 0; l < n; ++l) {
    const bool last = l == n - 1;
    MoEPhaseHooks hooks;
    auto at = [coordinator, last](SyncPoint p) {
      return [coordinator, last, p](int64_t layer, const Tensor& x) {
        return sync_hook(x, coordinator, p, layer, last);
      };
    };
    hooks.before_dispatch = at(SyncPoint::A);
    hooks.before_experts = at(SyncPoint::B);
    hooks.before_combine = at(SyncPoint::C);
    hooks.after_combine = at(SyncPoint::D);
    expert_parallel(layers[l], ep_mesh, hooks, l);
  }
  return n;
}

std::vector<HookRole> hook_sequence(int moe_layers, bool backward) {
  std::vector<HookRole> out;
  if (!backward) {
    for (int l = 0; l < moe_layers; ++l) {
      for (SyncPoint p : {SyncPoint::A, SyncPoint::B, SyncPoint::C, SyncPoint::D}) {
        if (l == moe_layers - 1 && p == SyncPoint::D) continue;  // D_LAST: notify only
        out.push_back(roles(p, false).next);
      }
    }
  } else {
    for (int l = moe_layers - 1; l >= 0; --l) {
      for (SyncPoint p : {SyncPoint::D, SyncPoint::C, SyncPoint::B, SyncPoint::A}) {
        if (l == moe_layers - 1 && p == SyncPoint::D) continue;  // D_LAST: skipped
        out.push_back(roles(p, true).next);
      }
    }
  }
  return out;
}

std::string check_pairing(int forward_layers, int backward_layers) {
  std::vector<HookRole> f = hook_sequence(forward_layers, false);
  std::vector<HookRole> b = hook_sequence(backward_layers, true);
  const size_t rounds = std::min(f.size(), b.size());
  for (size_t i = 0; i < rounds; ++i) {
    TANDEM_CHECK(
        f[i] != b[i],
        "[parallel::dual_pipe] expected rendezvous {} to pair COMM with COMPUTE, got {} on "
        "both sides (forward {} MoE layers, backward {})",
        i, to_string(f[i]), forward_layers, backward_layers);
  }
  std::string s = fmt::format("{} paired rounds", rounds);
  if (f.size() != b.size()) {
    s += fmt::format("; the {} side departs after round {} and the other runs {} more hooks solo",
                     f.size() < b.size() ? "forward" : "backward", rounds,
                     std::max(f.size(), b.size()) - rounds);
  }
  return s;
}

DualPipeSchedule::DualPipeSchedule(std::shared_ptr<HookCoordinator> coordinator, Device device)
    : coordinator_(std::move(coordinator)), pair_(device) {
  TANDEM_CHECK(coordinator_ != nullptr, "[parallel::DualPipeSchedule] expected a coordinator");
}

void DualPipeSchedule::abort_on_failure(std::vector<ProcessGroupPtr> groups) {
  abort_groups_ = [groups = std::move(groups)] { return groups; };
}

void DualPipeSchedule::abort_on_failure(const DeviceMesh& mesh) {
  abort_groups_ = [mesh] { return mesh.all_groups(); };
}

DualPipeResult DualPipeSchedule::run(int n, const std::function<Tensor(int)>& forward, bool overlap,
                                     int moe_layers) {
  TANDEM_CHECK(n >= 1, "[parallel::DualPipeSchedule] expected at least one micro-batch, got {}", n);
  if (moe_layers > 0) check_pairing(moe_layers, moe_layers);
  DualPipeResult result;
  result.losses.assign(static_cast<size_t>(n), 0.0);
  if (!overlap) {
    coordinator_->disable();
    for (int i = 0; i < n; ++i) {
      micro_batch = i;
      Tensor loss = forward(i);
      result.losses[i] = loss.item_double();
      backward(loss);
    }
    micro_batch = -1;
    return result;
  }
  std::vector<Tensor> losses(static_cast<size_t>(n));
  auto fwd = [&](int i) {
    return [&, i] {
      micro_batch = i;
      losses[i] = forward(i);
      coordinator_->depart(HookInfo{"end of forward", -1, false, i});
    };
  };
  auto bwd = [&](int i) {
    return [&, i] {
      micro_batch = i;
      backward(losses[i]);
      coordinator_->depart(HookInfo{"end of backward", -1, true, i});
    };
  };
  auto on_failure = [this] {
    coordinator_->disable();
    if (!abort_groups_) return;
    for (const ProcessGroupPtr& g : abort_groups_()) {
      g->abort("a side of its dual-pipe schedule failed (that rank's error has the cause)");
    }
  };
  // F1 alone, [B(i-1) ‖ F(i)], Bn alone; the coordinator is only enabled for pairs.
  coordinator_->disable();
  pair_.run(fwd(0), {}, on_failure);
  for (int i = 1; i < n; ++i) {
    coordinator_->enable();
    try {
      pair_.run(fwd(i), bwd(i - 1), on_failure);
    } catch (...) {
      coordinator_->disable();
      throw;
    }
    coordinator_->disable();
  }
  pair_.run({}, bwd(n - 1), on_failure);
  for (int i = 0; i < n; ++i)
    result.losses[i] = losses[i].item_double();
  return result;
}

DualPipe::DualPipe(const std::shared_ptr<Module>& model, const DeviceMesh& ep_mesh, Device device,
                   HookCoordinatorOptions options)
    : coordinator_(std::make_shared<HookCoordinator>(options)),
      moe_layers_(install_dual_pipe(model, ep_mesh, coordinator_)),
      schedule_(coordinator_, device) {}

DualPipeResult DualPipe::run(int micro_batches, const std::function<Tensor(int)>& forward,
                             bool overlap) {
  return schedule_.run(micro_batches, forward, overlap, moe_layers_);
}

}  // namespace tandem
