#include "tandem/autograd/engine.h"

#include <queue>
#include <unordered_map>
#include <unordered_set>

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

// The replay. With `capture` set, gradients of those leaves/nodes are returned
// instead of being accumulated into .grad.
struct Replay {
  std::unordered_map<Node*, std::vector<Tensor>> buffers;
  std::unordered_map<AutogradMeta*, Tensor> leaf_grads;
  std::vector<std::shared_ptr<AutogradMeta>> leaf_order;
  std::priority_queue<Node*, std::vector<Node*>, BySequence> ready;
  std::unordered_set<Node*> queued;
  std::vector<std::shared_ptr<Node>> keep;  // nodes alive during the replay

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
  replay.run(options);
  for (const auto& leaf : replay.leaf_order) {
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
