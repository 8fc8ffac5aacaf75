// AsyncContextParallel (DESIGN §7): Ulysses and all-gather KV with the
// collectives moved out of the attention pre-hook. The q/k/v projections'
// forward hooks launch them, the attention pre-hook joins what arrived to the
// autograd graph, and in backward each reverse collective is launched as soon
// as its gradient exists and waited in the projection's backward pre-hook,
// just before its GEMM. The kernel and the layout are ContextParallel's
// (context_parallel.cpp, installed without its pre-hook collectives).
#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "tandem/autograd/function.h"
#include "tandem/autograd/ops.h"
#include "tandem/parallel/context_parallel.h"
#include "tandem/parallel/cp_internal.h"
#include "tandem/parallel/dtensor.h"
#include "tandem/parallel/functional.h"
#include "tandem/runtime/error.h"

namespace tandem {

namespace {

// One collective launched by a projection's forward hook and finished by the
// attention pre-hook. `moved` is the autograd-tracked tensor it was launched
// on; the node that joins it to the received buffer is recorded at finish
// time, after every projection GEMM, so that in backward all reverse
// collectives are launched before the first projection waits for its own.
struct AsyncLaunch {
  Tensor moved;
  WorkPtr work;
  bool all_to_all = true;
  int64_t features = 0;                        // per-rank features after the all-to-all
  std::vector<int64_t> in_splits, out_splits;  // all_to_all_single splits
  std::shared_ptr<Module> projection;
};

struct AsyncSlots {
  std::mutex mu;
  std::map<std::thread::id, std::vector<std::optional<AsyncLaunch>>> forward;  // q, k, v
  std::map<std::thread::id, std::vector<int64_t>> lengths;
  std::map<std::pair<std::thread::id, Module*>, WorkPtr> backward;
};

// The received buffer of an AsyncLaunch, joined to the autograd graph. Its
// backward launches the reverse collective and returns its (pending) output;
// the projection's backward pre-hook waits for it before the GEMM reads it.
struct AsyncCollective final : Function {
  AsyncLaunch launch;
  ProcessGroupPtr group;
  std::shared_ptr<AsyncSlots> slots;
  const char* name() const override { return "AsyncCollectiveBackward"; }
  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>&) override {
    launch.work->wait();
    return {launch.work->result()};
  }
  std::vector<Tensor> backward(FunctionCtx&, const std::vector<Tensor>& g) override {
    WorkPtr w;
    if (launch.all_to_all) {
      w = group->all_to_all_single(ops::contiguous(g[0]),
                                   {launch.out_splits, launch.in_splits, "async cp grad"});
    } else {
      w = group->reduce_scatter(g[0], {RedOp::Sum, 1, "async cp grad"});
    }
    {
      std::lock_guard<std::mutex> lock(slots->mu);
      slots->backward[{std::this_thread::get_id(), launch.projection.get()}] = w;
    }
    return {w->result()};  // filled asynchronously; waited before the GEMM
  }
};

// Identity whose backward waits for the projection's pending reverse
// collective: placed before ops whose backward would read the pending
// gradient early (the sums of replicated KV heads).
struct WaitPoint final : Function {
  std::shared_ptr<AsyncSlots> slots;
  Module* projection = nullptr;
  const char* name() const override { return "AsyncCollectiveWait"; }
  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>& in) override {
    return {in[0]};
  }
  std::vector<Tensor> backward(FunctionCtx&, const std::vector<Tensor>& g) override {
    WorkPtr w;
    {
      std::lock_guard<std::mutex> lock(slots->mu);
      auto it = slots->backward.find({std::this_thread::get_id(), projection});
      if (it != slots->backward.end()) {
        w = it->second;
        slots->backward.erase(it);
      }
    }
    if (w) w->wait();
    return {g[0]};
  }
};

using cp_detail::qkv_slots;
using cp_detail::replicate_heads;
using cp_detail::restore_sequence_order;

// What the hooks of one async layer share; each hook keeps a copy.
struct AsyncLayer {
  std::shared_ptr<AsyncSlots> slots;
  ProcessGroupPtr group;  // the CP group
  int cp = 1;
  int64_t hs = 0;  // head size
  bool ulysses = false;
  bool load_balance = false;
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

// Every rank's local sequence length in this thread's forward: gathered by
// the first projection hook, kept for the others and the attention pre-hook.
std::vector<int64_t> forward_lengths(AsyncSlots& slots, const Tensor& y,
                                     const ProcessGroupPtr& group) {
  std::vector<int64_t> lengths;
  {
    std::lock_guard<std::mutex> lock(slots.mu);
    auto it = slots.lengths.find(std::this_thread::get_id());
    if (it != slots.lengths.end()) lengths = it->second;
  }
  if (lengths.empty()) {
    lengths = gather_lengths(y, group, 1);
    std::lock_guard<std::mutex> lock(slots.mu);
    slots.lengths[std::this_thread::get_id()] = lengths;
  }
  return lengths;
}

// Ulysses: launches the all-to-all of projection output `y` (of projection
// `i`, run by `self`) from sequence- to head-sharded.
void launch_all_to_all(AsyncLaunch& l, const Tensor& y, Module& self, int i,
                       const AsyncLayer& layer, const std::vector<int64_t>& lengths) {
  const int cp = layer.cp;
  const int64_t hs = layer.hs;
  Tensor x = y;
  const int64_t heads = y.shape()[2] / hs;
  if (i > 0 && heads % cp != 0) {
    Shape h = {y.shape()[0], y.shape()[1], heads, hs};
    Tensor replicated = replicate_heads(reshape(y, h), 2, cp);
    // Every extent spelled out: this rank's sequence shard may be empty.
    x = reshape(replicated, Shape{y.shape()[0], y.shape()[1], replicated.shape()[2] * hs});
    // The backward of the replication reads the gradient: wait first.
    auto wait = std::make_shared<WaitPoint>();
    wait->slots = layer.slots;
    wait->projection = &self;
    x = Function::apply(wait, {x})[0];
  }
  TANDEM_CHECK(x.shape()[2] / hs % cp == 0,
               "[parallel::AsyncContextParallel] expected heads divisible by cp={}, got {}", cp,
               x.shape()[2] / hs);
  // As all_to_all_dims(x, scatter=features, gather=sequence).
  const int64_t F = x.shape()[2], B = x.shape()[0];
  l.moved = reshape(contiguous(transpose(x, 0, 2)), Shape{-1});  // (F, S, B) flat
  const int64_t per_row = x.shape()[1] * B;
  l.features = F / cp;
  for (int r = 0; r < cp; ++r) {
    l.in_splits.push_back(F / cp * per_row);
    l.out_splits.push_back(F / cp * lengths[r] * B);
  }
  NoGradGuard no_grad;
  l.work = layer.group->all_to_all_single(l.moved, {l.in_splits, l.out_splits, "async cp"});
}

// All-gather KV: launches the all-gather of projection output `y`, padded to
// the longest rank's length.
void launch_all_gather(AsyncLaunch& l, const Tensor& y, const AsyncLayer& layer,
                       const std::vector<int64_t>& lengths) {
  const int64_t block = *std::max_element(lengths.begin(), lengths.end());
  Tensor x = y;
  if (x.shape()[1] < block) {
    Shape pad = x.shape();
    pad[1] = block - x.shape()[1];
    x = cat({x, zeros(pad, x.dtype(), x.device())}, 1);
  }
  l.moved = x;
  l.all_to_all = false;
  NoGradGuard no_grad;
  l.work = layer.group->all_gather(l.moved, {1, "async cp"});
}

// Projection `i`'s forward hook: launches its collective and leaves it in the
// slots for the attention pre-hook.
void register_launch_hook(const std::shared_ptr<Module>& proj, int i, const AsyncLayer& layer) {
  // The hook is owned by `proj` and reaches it through its argument: capturing
  // `proj` would be a cycle that leaks the module (LeakSanitizer).
  proj->register_forward_hook(
      [=](Module& self, const Args&,
          const std::vector<Tensor>& outs) -> std::optional<std::vector<Tensor>> {
        const int64_t hs = layer.hs;
        const Tensor& y = outs.at(0);  // (B, S, heads * hs), already past the backward pre-hook
        TANDEM_CHECK(y.dim() == 3 && y.shape()[2] % hs == 0,
                     "[parallel::AsyncContextParallel] expected a projection output (B, S, heads * "
                     "{}), got {}",
                     hs, y.shape());
        std::vector<int64_t> lengths = forward_lengths(*layer.slots, y, layer.group);
        AsyncLaunch l;
        l.projection = self.shared_from_this();
        if (layer.ulysses) {
          launch_all_to_all(l, y, self, i, layer, lengths);
        } else {
          launch_all_gather(l, y, layer, lengths);
        }
        std::lock_guard<std::mutex> lock(layer.slots->mu);
        auto& pending = layer.slots->forward[std::this_thread::get_id()];
        pending.resize(3);
        pending[i] = std::move(l);
        return std::nullopt;
      });
}

// Wait for this projection's reverse collective right before its GEMM.
void register_wait_hook(const std::shared_ptr<Module>& proj,
                        const std::shared_ptr<AsyncSlots>& slots) {
  proj->register_full_backward_pre_hook(
      [slots](Module& m, const std::vector<Tensor>&) -> std::optional<std::vector<Tensor>> {
        WorkPtr w;
        {
          std::lock_guard<std::mutex> lock(slots->mu);
          auto it = slots->backward.find({std::this_thread::get_id(), &m});
          if (it == slots->backward.end()) return std::nullopt;
          w = it->second;
          slots->backward.erase(it);
        }
        w->wait();
        return std::nullopt;
      });
}

// Ulysses: pieces (F/cp, len_r, B) from each rank, joined along the sequence.
Tensor join_all_to_all(const Tensor& raw, const AsyncLaunch& l, const CPCallState& s, int64_t B,
                       const AsyncLayer& layer) {
  const int64_t f = l.features;
  std::vector<Tensor> parts;
  int64_t offset = 0;
  for (int r = 0; r < layer.cp; ++r) {
    parts.push_back(reshape(narrow(raw, 0, offset, l.out_splits[r]), Shape{f, s.lengths[r], B}));
    offset += l.out_splits[r];
  }
  Tensor joined = contiguous(transpose(cat(parts, 1), 0, 2));  // (B, S, F/cp)
  return reshape(joined, Shape{B, s.total, joined.shape()[2] / layer.hs, layer.hs});
}

// All-gather KV: every rank's real tokens, in global order.
Tensor join_all_gather(const Tensor& raw, const CPCallState& s, int64_t B,
                       const AsyncLayer& layer) {
  const int64_t block = *std::max_element(s.lengths.begin(), s.lengths.end());
  std::vector<Tensor> parts;
  for (int r = 0; r < layer.cp; ++r)
    parts.push_back(narrow(raw, 1, r * block, s.lengths[r]));
  Tensor joined = cat(parts, 1);
  if (layer.load_balance) joined = restore_sequence_order(joined, 1, s.lengths, s.total, layer.cp);
  return reshape(joined, Shape{B, s.total, joined.shape()[2] / layer.hs, layer.hs});
}

// Finishes launch `l` (in place of `orig`, the projection output the
// attention was given): the received buffer joined to the autograd graph.
Tensor finish_launch(const AsyncLaunch& l, const Tensor& orig, const CPCallState& s,
                     const AsyncLayer& layer) {
  auto fn = std::make_shared<AsyncCollective>();
  fn->launch = l;
  fn->group = layer.group;
  fn->slots = layer.slots;
  Tensor raw = Function::apply(fn, {l.moved})[0];
  const int64_t B = orig.shape()[0];
  return l.all_to_all ? join_all_to_all(raw, l, s, B, layer) : join_all_gather(raw, s, B, layer);
}

// The attention pre-hook: takes this thread's launches, records the layout
// for the kernel and puts what arrived in place of q/k/v.
void register_join_pre_hook(const std::shared_ptr<nn::CoreAttention>& core,
                            const ContextParallel& cfg, const std::shared_ptr<CPRuntime>& rt,
                            const AsyncLayer& layer) {
  core->register_forward_pre_hook([=](Module&, const Args& in) -> std::optional<Args> {
    Args args = in;
    std::vector<Tensor*> qkv = qkv_slots(args, cfg);
    std::vector<std::optional<AsyncLaunch>> pending;
    std::vector<int64_t> lengths;
    {
      std::lock_guard<std::mutex> lock(layer.slots->mu);
      auto tid = std::this_thread::get_id();
      TANDEM_CHECK(layer.slots->lengths.count(tid) == 1,
                   "[parallel::AsyncContextParallel] expected the q/k/v projections to run before "
                   "the attention on this thread, got no launched collectives");
      pending = std::move(layer.slots->forward[tid]);
      lengths = layer.slots->lengths[tid];
      layer.slots->forward.erase(tid);
      layer.slots->lengths.erase(tid);
    }
    CPCallState s;
    s.lengths = lengths;
    for (int64_t l : lengths)
      s.total += l;
    rt->set(s);
    pending.resize(3);
    for (int i = 0; i < 3; ++i) {
      if (!pending[i]) continue;
      *qkv[i] = finish_launch(*pending[i], *qkv[i], s, layer);
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
  layer.slots = std::make_shared<AsyncSlots>();
  layer.group = rt->cp_group;
  layer.cp = rt->cp;
  layer.hs = head_size;
  layer.ulysses = rt->ds > 1;
  layer.load_balance = config.load_balance;

  std::vector<std::shared_ptr<Module>> projections = {q_proj, k_proj, v_proj};
  for (int i = 0; i < 3; ++i) {
    if (!layer.ulysses && i == 0) continue;  // all-gather KV leaves Q where it is
    register_launch_hook(projections[i], i, layer);
    register_wait_hook(projections[i], layer.slots);
  }
  register_join_pre_hook(core, config, rt, layer);
}

}  // namespace tandem
