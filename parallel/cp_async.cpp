// AsyncContextParallel (DESIGN §7): Ulysses and all-gather KV with the
// collectives moved out of the attention pre-hook. Each q/k/v projection's
// forward hook starts its collective as an Exchange (Note [Exchange windows])
// as soon as the projection has produced its output; the attention pre-hook
// records the exchange's Launch and Wait and puts what arrived in place of
// q/k/v. In backward every reverse collective is issued as soon as its
// gradient exists (all three before any is waited on) and waited by the
// exchange's Open, just before the projection's GEMM. The kernel and the
// layout are ContextParallel's (context_parallel.cpp, installed without its
// pre-hook collectives). Per-call state: Note [CP per-call state].
#include <algorithm>
#include <map>
#include <mutex>
#include <optional>

#include "tandem/autograd/function.h"
#include "tandem/autograd/ops.h"
#include "tandem/parallel/collectives.h"
#include "tandem/parallel/context_parallel.h"
#include "tandem/parallel/cp_internal.h"
#include "tandem/parallel/dtensor.h"
#include "tandem/runtime/error.h"

namespace tandem {

namespace {

using cp_detail::qkv_slots;
using cp_detail::replicate_heads;
using cp_detail::restore_sequence_order;

// A tensor view's identity: its storage and where it starts.
using ViewKey = std::pair<const void*, int64_t>;
ViewKey key_of(const Tensor& t) {
  return {t.storage().get(), t.storage_offset()};
}

// Between a projection's forward hook and the attention pre-hook of the same
// forward (Note [CP per-call state]).
struct Handoff {
  struct Started {
    Tensor output;  // the projection output the exchange was started on
    std::shared_ptr<Exchange> exchange;
    std::vector<int64_t> lengths;  // every rank's local sequence length
  };
  struct Lengths {
    Tensor input;  // keeps the key's storage alive while the entry exists
    std::vector<int64_t> lengths;
    int uses_left = 0;
  };
  std::mutex mu;
  std::map<const void*, Started> started;  // by the output's storage
  std::map<ViewKey, Lengths> lengths;      // by the projections' common input
};

// What the hooks of one async layer share; each hook keeps a copy.
struct AsyncLayer {
  std::shared_ptr<Handoff> handoff;
  ProcessGroupPtr group;  // the CP group
  int cp = 1;
  int64_t hs = 0;  // head size
  bool ulysses = false;
  bool load_balance = false;
  int projections = 3;  // hooked projections (all-gather KV leaves q alone)
};

void check_options(const AsyncContextParallel& async, const std::shared_ptr<Module>& q_proj,
                   const std::shared_ptr<Module>& k_proj, const std::shared_ptr<Module>& v_proj,
                   const DeviceMesh& mesh) {
  const ContextParallel& config = async.config;
  TANDEM_CHECK(q_proj && k_proj && v_proj,
               "[parallel::AsyncContextParallel] expected q, k and v projection modules");
  TANDEM_CHECK(async.head_size > 0,
               "[parallel::AsyncContextParallel] expected head_size > 0 (the projections output "
               "heads * head_size features), got {}",
               async.head_size);
  TANDEM_CHECK(config.mode == CPMode::Auto,
               "[parallel::AsyncContextParallel] expected mode Auto (Ulysses or all-gather KV), "
               "got mode Ring (ring attention has no async variant: apply ContextParallel with "
               "mode Ring instead)");
  TANDEM_CHECK(
      config.ulysses_degree == 1 || config.ulysses_degree == static_cast<int64_t>(mesh.size()),
      "[parallel::AsyncContextParallel] expected Ulysses (ulysses_degree == cp) or "
      "all-gather KV (ulysses_degree == 1), got ulysses_degree {} on cp={} (hybrid has no async "
      "variant)",
      config.ulysses_degree, mesh.size());
  TANDEM_CHECK(
      config.seq_dim == 1 && config.head_dim == 2,
      "[parallel::AsyncContextParallel] expected BSHD (seq_dim 1, head_dim 2), got {} and {}",
      config.seq_dim, config.head_dim);
}

// Every rank's local sequence length in this forward: gathered by the first
// hooked projection that sees input `x`, kept for the others.
std::vector<int64_t> forward_lengths(const AsyncLayer& layer, const Tensor& x, const Tensor& y) {
  Handoff& h = *layer.handoff;
  const ViewKey key = key_of(x);
  {
    std::lock_guard<std::mutex> lock(h.mu);
    auto it = h.lengths.find(key);
    if (it != h.lengths.end()) {
      std::vector<int64_t> lengths = it->second.lengths;
      if (--it->second.uses_left == 0) h.lengths.erase(it);
      return lengths;
    }
  }
  std::vector<int64_t> lengths =
      sequence_lengths(y, 1, layer.group, "an async context-parallel layer");
  if (layer.projections > 1) {
    std::lock_guard<std::mutex> lock(h.mu);
    h.lengths[key] = {x, lengths, layer.projections - 1};
  }
  return lengths;
}

// Ulysses: projection `i`'s output (B, S, heads * hs) from sequence- to
// head-sharded; KV heads are replicated inside the launcher where cp does not
// divide them, and their gradients summed back in the reverse one's finish.
Exchange ulysses_exchange(const Shape& y, int i, const AsyncLayer& layer,
                          const std::vector<int64_t>& lengths) {
  const int cp = layer.cp;
  const int64_t B = y[0], S = y[1], hs = layer.hs, heads = y[2] / hs;
  const bool replicate = i > 0 && heads % cp != 0;
  const int64_t sent_heads = replicate ? cp : heads;
  if (replicate) {
    NoGradGuard no_grad;  // checks that the counts divide one another
    replicate_heads(ops::zeros(Shape{1, 1, heads, 1}), 2, cp);
  }
  TANDEM_CHECK(sent_heads % cp == 0,
               "[parallel::AsyncContextParallel] expected heads divisible by cp={}, got {}", cp,
               sent_heads);
  const Shape split{B, S, heads, hs};
  ProcessGroupPtr group = layer.group;
  Exchange ex;
  ex.what = "the async Ulysses all-to-all";
  ex.forward = [=](const Tensor& t) {
    Tensor x = t;
    if (replicate) {
      NoGradGuard no_grad;
      x = ops::reshape(replicate_heads(ops::reshape(t, split), 2, cp),
                       Shape{B, S, sent_heads * hs});
    }
    return launch_all_to_all(x, group, 2, 1, {}, lengths, "async cp");
  };
  ex.backward = [=](const Tensor& g) {
    PendingTensor p = launch_all_to_all(g, group, 1, 2, lengths, {}, "async cp grad");
    if (replicate) {
      p.finish = [=, finish = p.finish](const Tensor& raw) {
        NoGradGuard no_grad;
        Tensor d = ops::reshape(finish(raw), Shape{B, S, heads, cp / heads, hs});
        return ops::reshape(sum_to(d, Shape{B, S, heads, 1, hs}), Shape{B, S, heads * hs});
      };
    }
    return p;
  };
  return ex;
}

// All-gather KV: every rank's tokens along the sequence; the gradient
// reduce-scattered back.
Exchange gather_exchange(const AsyncLayer& layer, const std::vector<int64_t>& lengths) {
  ProcessGroupPtr group = layer.group;
  Exchange ex;
  ex.what = "the async K/V all-gather";
  ex.forward = [=](const Tensor& t) { return launch_all_gather(t, group, 1, lengths, "async cp"); };
  ex.backward = [=](const Tensor& g) {
    return launch_reduce_scatter(g, group, 1, lengths, RedOp::Sum, "async cp grad");
  };
  return ex;
}

// Projection `i`'s forward hook: opens and starts its exchange, and leaves it
// for the attention pre-hook under the storage of the output it returns.
void register_launch_hook(const std::shared_ptr<Module>& proj, int i, const AsyncLayer& layer) {
  // The hook is owned by `proj`: capturing `proj` would be a cycle that leaks
  // the module (LeakSanitizer).
  proj->register_forward_hook(
      [=](Module&, const Args& in,
          const std::vector<Tensor>& outs) -> std::optional<std::vector<Tensor>> {
        const int64_t hs = layer.hs;
        const Tensor& y = outs.at(0);  // (B, S, heads * hs), already past the backward pre-hook
        TANDEM_CHECK(y.dim() == 3 && y.shape()[2] % hs == 0,
                     "[parallel::AsyncContextParallel] expected a projection output (B, S, heads * "
                     "{}), got {}",
                     hs, y.shape());
        const Tensor& x = in.positional.empty() ? y : in.positional[0];
        std::vector<int64_t> lengths = forward_lengths(layer, x, y);
        auto ex = std::make_shared<Exchange>(layer.ulysses
                                                 ? ulysses_exchange(y.shape(), i, layer, lengths)
                                                 : gather_exchange(layer, lengths));
        std::vector<Tensor> out = outs;
        out[0] = exchange_open(ex, y);
        exchange_start(ex, out[0]);
        std::lock_guard<std::mutex> lock(layer.handoff->mu);
        layer.handoff->started[out[0].storage().get()] = {out[0], ex, lengths};
        return out;
      });
}

// The attention pre-hook: finds the exchanges the projections started,
// records their Launch and Wait (after every projection, so that backward
// issues all reverse collectives before the first Open waits), records the
// layout for the kernel and puts what arrived in place of q/k/v.
void register_join_pre_hook(const std::shared_ptr<nn::CoreAttention>& core,
                            const ContextParallel& cfg, const AsyncLayer& layer) {
  core->register_forward_pre_hook([=](Module&, const Args& in) -> std::optional<Args> {
    Args args = in;
    std::vector<Tensor*> qkv = qkv_slots(args, cfg);
    static const char* names[] = {"q", "k", "v"};
    std::vector<std::optional<Handoff::Started>> started(3);
    {
      std::lock_guard<std::mutex> lock(layer.handoff->mu);
      for (int i = layer.ulysses ? 0 : 1; i < 3; ++i) {
        auto it = layer.handoff->started.find(qkv[i]->storage().get());
        TANDEM_CHECK(it != layer.handoff->started.end(),
                     "[parallel::AsyncContextParallel] expected {} to be a view of its "
                     "projection's output (reshaped, nothing computed in between), got a tensor "
                     "{} no projection hook started a collective for",
                     names[i], qkv[i]->shape());
        started[i] = std::move(it->second);
        layer.handoff->started.erase(it);
      }
    }
    const std::vector<int64_t>& lengths = started[2]->lengths;
    cp_detail::CPCallState s = cp_detail::set_layout(args, lengths);
    for (int i = 0; i < 3; ++i) {
      if (!started[i]) continue;
      const Handoff::Started& e = *started[i];
      Tensor joined = exchange_wait(e.exchange, exchange_launch(e.exchange, e.output));
      if (!layer.ulysses && layer.load_balance)
        joined = restore_sequence_order(joined, 1, s.lengths, s.total, layer.cp);
      const int64_t B = e.output.shape()[0];
      *qkv[i] = reshape(joined, Shape{B, s.total, joined.shape()[2] / layer.hs, layer.hs});
    }
    return args;
  });
}

}  // namespace

void AsyncContextParallel::apply(const std::shared_ptr<nn::CoreAttention>& core,
                                 const std::shared_ptr<Module>& q_proj,
                                 const std::shared_ptr<Module>& k_proj,
                                 const std::shared_ptr<Module>& v_proj,
                                 const DeviceMesh& mesh) const {
  check_options(*this, q_proj, k_proj, v_proj, mesh);
  std::shared_ptr<CPRuntime> rt = config.install(core, mesh, false);
  AsyncLayer layer;
  layer.handoff = std::make_shared<Handoff>();
  layer.group = rt->cp_group;
  layer.cp = rt->cp;
  layer.hs = head_size;
  layer.ulysses = rt->ds > 1;
  layer.load_balance = config.load_balance;
  layer.projections = layer.ulysses ? 3 : 2;

  std::vector<std::shared_ptr<Module>> projections = {q_proj, k_proj, v_proj};
  for (int i = 0; i < 3; ++i) {
    if (!layer.ulysses && i == 0) continue;  // all-gather KV leaves Q where it is
    register_launch_hook(projections[i], i, layer);
  }
  register_join_pre_hook(core, config, layer);
}

}  // namespace tandem
