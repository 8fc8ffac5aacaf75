#include "tandem/autograd/engine.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <mutex>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "tandem/autograd/grad_ready.h"

#include "tandem/runtime/error.h"
#include "tandem/runtime/trace.h"
#include "tandem/tensor/ops.h"

namespace tandem {
namespace {

struct BySequence {
  bool operator()(const Node* a, const Node* b) const {
    return a->sequence_nr() < b->sequence_nr();
  }
};

Tensor apply_hooks(const std::vector<std::pair<int, GradHook>>& hooks, Tensor g) {
  for (const auto& [handle, hook] : hooks) {
    Tensor replaced = hook(g);
    if (replaced.defined()) {
      TANDEM_CHECK(replaced.shape() == g.shape(),
                   "[autograd::hook] expected a replacement gradient of shape {}, got {}",
                   g.shape(), replaced.shape());
      g = replaced;
    }
  }
  return g;
}

// Note [Gradient-ready hooks] (autograd/grad_ready.h): the registry.
struct ReadyHook {
  int handle = 0;
  Tensor leaf;  // a handle on the leaf, passed to the hook
  GradReadyHook hook;
};

struct ReadyHooks {
  std::mutex mu;
  std::unordered_map<AutogradMeta*, std::vector<ReadyHook>> by_leaf;
  std::unordered_map<int, AutogradMeta*> leaf_of;
  int next = 1;
  std::atomic<int> count{0};
};

ReadyHooks& ready_hooks() {
  static ReadyHooks* hooks = new ReadyHooks();  // outlives every thread's last backward
  return *hooks;
}

// The hooks of `leaf` now (a copy: a hook may register or remove hooks).
std::vector<ReadyHook> ready_hooks_of(AutogradMeta* leaf) {
  ReadyHooks& r = ready_hooks();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.by_leaf.find(leaf);
  return it == r.by_leaf.end() ? std::vector<ReadyHook>{} : it->second;
}

// The replay. With `capture` set, gradients of those leaves/nodes are returned
// instead of being accumulated into .grad.
struct Replay {
  std::unordered_map<Node*, std::vector<Tensor>> buffers;
  std::unordered_map<AutogradMeta*, Tensor> leaf_grads;
  std::vector<std::shared_ptr<AutogradMeta>> leaf_order;
  std::priority_queue<Node*, std::vector<Node*>, BySequence> ready;
  std::unordered_set<Node*> queued;
  std::vector<std::shared_ptr<Node>> keep;  // nodes alive during the replay
  // Hooked leaves not yet finished, by the sequence number of their oldest
  // consumer (Note [Gradient-ready hooks]); newest threshold on top.
  std::priority_queue<std::pair<uint64_t, AutogradMeta*>> pending_ready;
  std::unordered_set<AutogradMeta*> finished;

  // backward() only: finds the hooked leaves reachable from the queued roots.
  void plan_ready_hooks() {
    if (ready_hooks().count.load(std::memory_order_acquire) == 0) return;
    std::unordered_map<AutogradMeta*, uint64_t> oldest;
    std::unordered_set<Node*> seen;
    std::vector<Node*> stack(keep.size());
    for (size_t i = 0; i < keep.size(); ++i)
      stack[i] = keep[i].get();
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      if (!seen.insert(n).second) continue;
      for (const Edge& e : n->next_edges()) {
        if (e.fn) {
          stack.push_back(e.fn.get());
        } else if (e.leaf) {
          auto [it, fresh] = oldest.try_emplace(e.leaf.get(), n->sequence_nr());
          if (!fresh) it->second = std::min(it->second, n->sequence_nr());
        }
      }
    }
    for (const auto& leaf : leaf_order)  // roots that are leaves, consumed by no node
      oldest.try_emplace(leaf.get(), std::numeric_limits<uint64_t>::max());
    ReadyHooks& r = ready_hooks();
    std::lock_guard<std::mutex> lock(r.mu);
    for (const auto& [leaf, seq] : oldest) {
      if (r.by_leaf.count(leaf)) pending_ready.push({seq, leaf});
    }
  }

  // Finishes the leaves no queued node can reach any more.
  void finish_ready_leaves() {
    const uint64_t newest_queued = ready.empty() ? 0 : ready.top()->sequence_nr();
    while (!pending_ready.empty() && (ready.empty() || pending_ready.top().first > newest_queued)) {
      AutogradMeta* leaf = pending_ready.top().second;
      pending_ready.pop();
      auto it = leaf_grads.find(leaf);
      if (it == leaf_grads.end()) continue;  // no gradient this backward
      Tensor g = apply_hooks(leaf->leaf_hooks, it->second);
      // Nothing adds to it any more; a hook that drops grad() (FSDP, once
      // the gradient is reduce-scattered) frees it.
      leaf_grads.erase(it);
      {
        std::lock_guard<std::mutex> lock(leaf->mu);
        leaf->grad = leaf->grad.defined() ? ops::add(leaf->grad, g) : g;
      }
      finished.insert(leaf);
      for (const ReadyHook& h : ready_hooks_of(leaf))
        h.hook(h.leaf);
    }
  }

  void send(const Edge& e, const Tensor& g) {
    if (!g.defined() || !e.valid()) return;
    if (e.fn) {
      auto& buf = buffers[e.fn.get()];
      if (buf.empty()) buf.resize(static_cast<size_t>(e.fn->num_outputs()));
      buf[e.output_nr] = accumulate(buf[e.output_nr], g);
      if (queued.insert(e.fn.get()).second) {
        ready.push(e.fn.get());
        keep.push_back(e.fn);
      }
    } else {
      auto [it, fresh] = leaf_grads.try_emplace(e.leaf.get(), Tensor());
      if (fresh) leaf_order.push_back(e.leaf);
      it->second = accumulate(it->second, g);
    }
  }

  void run(const BackwardOptions& options) {
    NoGradGuard no_grad;  // backward formulas are not recorded
    while (!ready.empty()) {
      Node* node = ready.top();
      ready.pop();
      TANDEM_CHECK(!node->released(),
                   "[autograd::backward] expected the saved tensors of {} (node #{}), got them "
                   "released by an earlier backward (pass retain_graph to backward twice)",
                   node->name(), node->sequence_nr());
      std::vector<Tensor> grads = std::move(buffers[node]);
      buffers.erase(node);
      for (const auto& [handle, slot_hook] : node->output_hooks()) {
        auto& g = grads[slot_hook.first];
        if (!g.defined()) continue;
        Tensor replaced = slot_hook.second(g);
        if (replaced.defined()) {
          TANDEM_CHECK(replaced.shape() == g.shape(),
                       "[autograd::hook] expected a replacement gradient of shape {}, got {}",
                       g.shape(), replaced.shape());
          g = replaced;
        }
      }
      std::vector<Tensor> input_grads;
      {
        TraceSpan span("autograd", node->name());
        input_grads = node->apply(grads);
      }
      const auto& edges = node->next_edges();
      TANDEM_INTERNAL_ASSERT(input_grads.size() <= edges.size(),
                             "{} returned {} grads for {} inputs", node->name(), input_grads.size(),
                             edges.size());
      for (size_t i = 0; i < input_grads.size(); ++i)
        send(edges[i], input_grads[i]);
      if (!options.retain_graph) {
        node->release_saved();
        node->mark_released();
      }
      if (!pending_ready.empty()) finish_ready_leaves();
    }
  }
};

void seed(Replay& replay, const std::vector<Tensor>& roots, const std::vector<Tensor>& grads) {
  TANDEM_CHECK(roots.size() == grads.size(),
               "[autograd::backward] expected one gradient per root, got {} roots and {} grads",
               roots.size(), grads.size());
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& r = roots[i];
    TANDEM_CHECK(requires_grad(r),
                 "[autograd::backward] expected root {} to require grad (did the forward run "
                 "under no_grad, or on tensors without requires_grad?), got one that does not",
                 i);
    TANDEM_CHECK(grads[i].shape() == r.shape(),
                 "[autograd::backward] expected the gradient of root {} to have shape {}, got {}",
                 i, r.shape(), grads[i].shape());
    AutogradMeta* m = autograd_meta(r);
    Edge e;
    if (m->grad_fn) {
      e.fn = m->grad_fn;
      e.output_nr = m->output_nr;
    } else {
      e.leaf = std::static_pointer_cast<AutogradMeta>(r.autograd_meta_ptr());
    }
    replay.send(e, grads[i]);
  }
}

}  // namespace

Tensor accumulate(const Tensor& acc, const Tensor& g) {
  if (!g.defined()) return acc;
  if (!acc.defined()) return g;
  if (g.shape() != acc.shape()) {
    TANDEM_FAIL("[autograd::accumulate] expected gradients of one shape, got {} and {}",
                acc.shape(), g.shape());
  }
  return ops::add(acc, g);
}

void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads,
              const BackwardOptions& options) {
  TraceSpan span("autograd", "backward");
  Replay replay;
  seed(replay, roots, grads);
  replay.plan_ready_hooks();
  replay.run(options);
  replay.finish_ready_leaves();  // what the last node reached, and roots that are leaves
  for (const auto& leaf : replay.leaf_order) {
    if (replay.finished.count(leaf.get())) continue;
    Tensor g = apply_hooks(leaf->leaf_hooks, replay.leaf_grads[leaf.get()]);
    std::lock_guard<std::mutex> lock(leaf->mu);
    leaf->grad = leaf->grad.defined() ? ops::add(leaf->grad, g) : g;
  }
}

void backward(const Tensor& loss, const BackwardOptions& options) {
  TANDEM_CHECK(loss.defined() && loss.numel() == 1,
               "[autograd::backward] expected a loss with one element, got shape {} (pass "
               "gradients for non-scalar roots)",
               loss.defined() ? loss.shape() : Shape{});
  backward({loss}, {ops::ones_like(loss)}, options);
}

int register_grad_ready_hook(const Tensor& leaf, GradReadyHook hook) {
  TANDEM_CHECK(leaf.defined() && requires_grad(leaf) && !grad_fn(leaf),
               "[autograd::register_grad_ready_hook] expected a leaf that requires grad (a "
               "parameter), got {}",
               !leaf.defined()        ? "an undefined tensor"
               : !requires_grad(leaf) ? "a tensor that does not require grad"
                                      : "a tensor computed by an op (it has a grad_fn)");
  TANDEM_CHECK(hook != nullptr, "[autograd::register_grad_ready_hook] expected a hook, got none");
  ReadyHooks& r = ready_hooks();
  std::lock_guard<std::mutex> lock(r.mu);
  const int handle = r.next++;
  AutogradMeta* meta = autograd_meta(leaf);
  r.by_leaf[meta].push_back({handle, leaf, std::move(hook)});
  r.leaf_of[handle] = meta;
  r.count.fetch_add(1, std::memory_order_release);
  return handle;
}

void remove_grad_ready_hook(int handle) {
  ReadyHooks& r = ready_hooks();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.leaf_of.find(handle);
  if (it == r.leaf_of.end()) return;
  auto& hooks = r.by_leaf[it->second];
  hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                             [&](const ReadyHook& h) { return h.handle == handle; }),
              hooks.end());
  if (hooks.empty()) r.by_leaf.erase(it->second);
  r.leaf_of.erase(it);
  r.count.fetch_sub(1, std::memory_order_release);
}

std::vector<Tensor> gradients(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                              const std::vector<Tensor>& grad_outputs,
                              const BackwardOptions& options) {
  std::vector<Tensor> seeds = grad_outputs;
  if (seeds.empty()) {
    for (const Tensor& o : outputs)
      seeds.push_back(ops::ones_like(o));
  }
  // Capture through temporary hooks on the inputs; leave .grad untouched.
  std::vector<Tensor> result(inputs.size());
  Replay replay;
  std::vector<std::pair<std::shared_ptr<Node>, int>> node_hooks;
  for (size_t i = 0; i < inputs.size(); ++i) {
    TANDEM_CHECK(requires_grad(inputs[i]),
                 "[autograd::gradients] expected input {} to require grad, got one that does not",
                 i);
    AutogradMeta* m = autograd_meta(inputs[i]);
    if (m->grad_fn) {
      int h = m->grad_fn->add_output_hook(m->output_nr, [&result, i](const Tensor& g) {
        result[i] = accumulate(result[i], g);
        return Tensor();
      });
      node_hooks.push_back({m->grad_fn, h});
    }
  }
  seed(replay, outputs, seeds);
  try {
    replay.run(options);
  } catch (...) {
    for (auto& [node, h] : node_hooks)
      node->remove_output_hook(h);
    throw;
  }
  for (auto& [node, h] : node_hooks)
    node->remove_output_hook(h);
  for (size_t i = 0; i < inputs.size(); ++i) {
    AutogradMeta* m = autograd_meta(inputs[i]);
    if (!m->grad_fn) {
      auto it = replay.leaf_grads.find(m);
      if (it != replay.leaf_grads.end()) result[i] = apply_hooks(m->leaf_hooks, it->second);
    }
  }
  return result;
}

}  // namespace tandem
