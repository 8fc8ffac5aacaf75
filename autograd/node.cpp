#include "tandem/autograd/node.h"

#include <fmt/format.h>

#include "tandem/runtime/error.h"
#include "tandem/tensor/ops.h"

namespace tandem {
namespace {
std::atomic<uint64_t> next_sequence_nr{1};
std::atomic<int> next_hook_handle{1};
thread_local bool grad_enabled = true;

AutogradMeta& ensure_meta(const Tensor& t) {
  auto* meta = static_cast<AutogradMeta*>(t.autograd_meta());
  if (meta == nullptr) {
    auto fresh = std::make_shared<AutogradMeta>();
    meta = fresh.get();
    // The handle is a value type; its autograd slot is shared by every copy
    // made after this point, which is how a leaf is identified.
    const_cast<Tensor&>(t).set_autograd_meta(std::move(fresh));
  }
  return *meta;
}
}  // namespace

Node::Node() : sequence_nr_(next_sequence_nr++) {}

int Node::add_output_hook(int output_nr, GradHook hook) {
  int handle = next_hook_handle++;
  output_hooks_.push_back({handle, {output_nr, std::move(hook)}});
  return handle;
}

bool Node::remove_output_hook(int handle) {
  for (auto it = output_hooks_.begin(); it != output_hooks_.end(); ++it) {
    if (it->first == handle) {
      output_hooks_.erase(it);
      return true;
    }
  }
  return false;
}

bool grad_mode_enabled() {
  return grad_enabled;
}
void set_grad_mode(bool enabled) {
  grad_enabled = enabled;
}

AutogradMeta* autograd_meta(const Tensor& t) {
  return static_cast<AutogradMeta*>(t.autograd_meta());
}

bool requires_grad(const Tensor& t) {
  AutogradMeta* m = autograd_meta(t);
  return m != nullptr && m->requires_grad;
}

Tensor& set_requires_grad(Tensor& t, bool value) {
  TANDEM_CHECK(t.defined(), "[autograd::set_requires_grad] expected a defined tensor");
  AutogradMeta& m = ensure_meta(t);
  TANDEM_CHECK(m.grad_fn == nullptr || value,
               "[autograd::set_requires_grad] expected a leaf tensor, got the output of {} (use "
               "detach())",
               m.grad_fn ? m.grad_fn->name() : "");
  TANDEM_CHECK(!value || is_floating(t.dtype()),
               "[autograd::set_requires_grad] expected a floating dtype, got {}",
               dtype_name(t.dtype()));
  m.requires_grad = value;
  return t;
}

std::shared_ptr<const LeafAnnotation> leaf_annotation(const Tensor& t) {
  AutogradMeta* m = autograd_meta(t);
  return m ? m->annotation : nullptr;
}

void set_leaf_annotation(const Tensor& t, std::shared_ptr<const LeafAnnotation> annotation) {
  AutogradMeta* m = autograd_meta(t);
  TANDEM_CHECK(m != nullptr && m->requires_grad && m->grad_fn == nullptr,
               "[autograd::set_leaf_annotation] expected a leaf that requires grad (a "
               "parameter), got {}",
               !t.defined()      ? "an undefined tensor"
               : m && m->grad_fn ? fmt::format("the output of {}", m->grad_fn->name())
                                 : std::string("a tensor that does not require grad"));
  m->annotation = std::move(annotation);
}

Tensor requires_grad_(Tensor t, bool value) {
  set_requires_grad(t, value);
  return t;
}

bool is_leaf(const Tensor& t) {
  AutogradMeta* m = autograd_meta(t);
  return m == nullptr || m->grad_fn == nullptr;
}

Tensor grad(const Tensor& t) {
  AutogradMeta* m = autograd_meta(t);
  if (m == nullptr) return Tensor();
  std::lock_guard<std::mutex> lock(m->mu);
  return m->grad;
}

void set_grad(const Tensor& t, const Tensor& g) {
  AutogradMeta& m = ensure_meta(t);
  TANDEM_CHECK(!g.defined() || g.shape() == t.shape(),
               "[autograd::set_grad] expected a gradient of shape {}, got {}", t.shape(),
               g.shape());
  std::lock_guard<std::mutex> lock(m.mu);
  m.grad = g;
}

void zero_grad(const Tensor& t) {
  AutogradMeta* m = autograd_meta(t);
  if (m == nullptr) return;
  std::lock_guard<std::mutex> lock(m->mu);
  m->grad = Tensor();
}

std::shared_ptr<Node> grad_fn(const Tensor& t) {
  AutogradMeta* m = autograd_meta(t);
  return m ? m->grad_fn : nullptr;
}

Tensor detach(const Tensor& t) {
  if (!t.defined()) return t;
  return Tensor(t.storage(), t.shape(), t.strides(), t.storage_offset(), t.dtype());
}

int register_hook(const Tensor& t, GradHook hook) {
  TANDEM_CHECK(requires_grad(t),
               "[autograd::register_hook] expected a tensor that requires grad, got one that "
               "does not");
  AutogradMeta* m = autograd_meta(t);
  if (m->grad_fn) return m->grad_fn->add_output_hook(m->output_nr, std::move(hook));
  int handle = next_hook_handle++;
  m->leaf_hooks.push_back({handle, std::move(hook)});
  return handle;
}

void remove_hook(const Tensor& t, int handle) {
  AutogradMeta* m = autograd_meta(t);
  if (m == nullptr) return;
  if (m->grad_fn && m->grad_fn->remove_output_hook(handle)) return;
  for (auto it = m->leaf_hooks.begin(); it != m->leaf_hooks.end(); ++it) {
    if (it->first == handle) {
      m->leaf_hooks.erase(it);
      return;
    }
  }
}

void retain_grad(const Tensor& t) {
  TANDEM_CHECK(requires_grad(t),
               "[autograd::retain_grad] expected a tensor that requires grad, got one that does "
               "not");
  AutogradMeta* m = autograd_meta(t);
  if (!m->grad_fn) return;  // leaves keep their gradient anyway
  std::weak_ptr<AutogradMetaBase> weak = t.autograd_meta_ptr();
  m->grad_fn->add_output_hook(m->output_nr, [weak](const Tensor& g) {
    if (auto base = weak.lock()) {
      auto* meta = static_cast<AutogradMeta*>(base.get());
      std::lock_guard<std::mutex> lock(meta->mu);
      meta->grad = meta->grad.defined() ? ops::add(meta->grad, g) : g;
    }
    return Tensor();
  });
}

bool any_requires_grad(std::initializer_list<const Tensor*> inputs) {
  for (const Tensor* t : inputs) {
    if (t->defined() && requires_grad(*t)) return true;
  }
  return false;
}

bool any_requires_grad(const std::vector<Tensor>& inputs) {
  for (const Tensor& t : inputs) {
    if (t.defined() && requires_grad(t)) return true;
  }
  return false;
}

void NodeRecorder::wire(const std::shared_ptr<Node>& node, const std::vector<const Tensor*>& inputs,
                        const std::vector<Tensor*>& outputs) {
  node->next_.reserve(inputs.size());
  for (const Tensor* t : inputs) {
    Edge e;
    AutogradMeta* m = t->defined() ? autograd_meta(*t) : nullptr;
    if (m != nullptr && m->requires_grad) {
      if (m->grad_fn) {
        e.fn = m->grad_fn;
        e.output_nr = m->output_nr;
      } else {
        e.leaf = std::static_pointer_cast<AutogradMeta>(t->autograd_meta_ptr());
      }
    }
    node->next_.push_back(std::move(e));
  }
  node->num_outputs_ = static_cast<int>(outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) {
    Tensor* out = outputs[i];
    if (!out->defined() || !is_floating(out->dtype())) continue;  // integer outputs carry no grad
    auto meta = std::make_shared<AutogradMeta>();
    meta->requires_grad = true;
    meta->grad_fn = node;
    meta->output_nr = static_cast<int>(i);
    out->set_autograd_meta(std::move(meta));
  }
}

}  // namespace tandem
