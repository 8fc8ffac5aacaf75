#include "tandem/autograd/module.h"

#include <atomic>
#include <cstdlib>
#include <string>

#include "tandem/autograd/function.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/trace.h"
#include "tandem/tensor/ops.h"

namespace tandem {
namespace {

std::atomic<int> next_hook_id{1};

// Identity over several tensors whose backward passes the gradients through a
// module's backward (pre-)hooks. The module is kept alive by the node.
struct ModuleHookFunction final : Function {
  std::shared_ptr<Module> keep;  // null when the module is not owned by a shared_ptr
  Module* module = nullptr;
  std::function<std::optional<std::vector<Tensor>>(Module&, const std::vector<Tensor>&)> call;
  const char* node_name = "ModuleHookBackward";

  const char* name() const override { return node_name; }
  bool accepts_undefined_grads() const override { return true; }
  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>& inputs) override {
    return inputs;
  }
  std::vector<Tensor> backward(FunctionCtx&, const std::vector<Tensor>& grads) override {
    std::optional<std::vector<Tensor>> replaced = call(*module, grads);
    if (!replaced) return grads;
    TANDEM_CHECK(replaced->size() == grads.size(),
                 "[nn::{}] expected a backward hook to return {} gradients, got {}",
                 module->type_name(), grads.size(), replaced->size());
    return *replaced;
  }
};

template <class Hooks>
std::vector<Tensor> through_hooks(Module& m, const char* node_name, Hooks& hooks,
                                  const std::vector<Tensor>& tensors) {
  auto fn = std::make_shared<ModuleHookFunction>();
  fn->keep = m.weak_from_this().lock();
  fn->module = &m;
  fn->node_name = node_name;
  fn->call = [&hooks](Module& mod, const std::vector<Tensor>& grads) {
    std::vector<Tensor> g = grads;
    bool changed = false;
    for (auto& [id, hook] : hooks) {
      if (auto r = hook(mod, g)) {
        g = std::move(*r);
        changed = true;
      }
    }
    return changed ? std::optional<std::vector<Tensor>>(std::move(g)) : std::nullopt;
  };
  return Function::apply(fn, tensors);
}

// Note [Dropped gradients]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A raw ops:: call in a forward (Note [Two op namespaces] in autograd/ops.h)
// returns a tensor without a backward node, and the parameters before it never
// get a gradient: no error, just a model that does not learn. Module::call
// checks the symptom at every module boundary when check_dropped_gradients()
// is on (autograd/module.h): in grad mode, a forward that saw a tensor
// requiring grad — an input, one of its own parameters, or an output of a
// child module it called — must return at least one floating tensor that
// requires grad. Each active call keeps one flag on a per-thread stack, which
// a child's call sets when the child returns such a tensor; so a parent whose
// own inputs are token ids is still checked after its embedding. A forward
// that returns no floating tensor, or that turns grad mode off itself, is not
// checked; a deliberate stop belongs under NoGradGuard or detach().
bool check_gradients_from_env() {
  const char* text = std::getenv("TANDEM_CHECK_GRADIENTS");
  if (text == nullptr) {
#ifdef NDEBUG
    return false;
#else
    return true;
#endif
  }
  TANDEM_CHECK(std::string(text) == "0" || std::string(text) == "1",
               "[autograd] expected TANDEM_CHECK_GRADIENTS=0|1, got \"{}\"", text);
  return std::string(text) == "1";
}

std::atomic<bool>& check_gradients() {
  static std::atomic<bool> value{check_gradients_from_env()};
  return value;
}

struct GradientCheckFrame {
  static std::vector<bool>& stack() {
    thread_local std::vector<bool> frames;
    return frames;
  }
  bool active;
  explicit GradientCheckFrame(bool saw_grad)
      : active(check_dropped_gradients() && grad_mode_enabled()) {
    if (active) stack().push_back(saw_grad);
  }
  ~GradientCheckFrame() {
    if (active) stack().pop_back();
  }
  bool saw_grad() const { return stack().back(); }
};

bool any_floating(const std::vector<Tensor>& tensors) {
  for (const Tensor& t : tensors) {
    if (t.defined() && is_floating(t.dtype())) return true;
  }
  return false;
}

}  // namespace

bool check_dropped_gradients() {
  return check_gradients().load(std::memory_order_relaxed);
}
void set_check_dropped_gradients(bool on) {
  check_gradients() = on;
}

void HookHandle::remove() {
  if (auto m = module_.lock()) m->remove_hook(id_);
  id_ = 0;
}

bool HookHandle::active() const {
  return id_ != 0 && !module_.expired();
}

std::vector<Tensor> Module::call(Args args) {
  // The forward of every module call is a span of the Chrome trace (the
  // backward shows as its autograd nodes); nothing is recorded while off.
  TraceSpan span("forward", type_name().c_str());
  for (auto& [id, hook] : pre_hooks_) {
    if (auto replaced = hook(*this, args)) args = std::move(*replaced);
  }
  if (!backward_hooks_.empty() && grad_mode_enabled() && any_requires_grad(args.positional)) {
    std::vector<size_t> index;
    std::vector<Tensor> wrapped;
    for (size_t i = 0; i < args.positional.size(); ++i) {
      if (args.positional[i].defined() && requires_grad(args.positional[i])) {
        index.push_back(i);
        wrapped.push_back(args.positional[i]);
      }
    }
    wrapped = through_hooks(*this, "ModuleBackwardHook", backward_hooks_, wrapped);
    for (size_t j = 0; j < index.size(); ++j)
      args.positional[index[j]] = wrapped[j];
  }
  std::vector<Tensor> outputs;
  {
    bool saw_grad = false;
    if (check_dropped_gradients() && grad_mode_enabled()) {
      saw_grad = any_requires_grad(args.positional);
      for (const auto& [name, t] : args.named)
        saw_grad = saw_grad || (t.defined() && requires_grad(t));
      for (const auto& [name, p] : params_)
        saw_grad = saw_grad || (p->defined() && requires_grad(*p));
    }
    GradientCheckFrame frame(saw_grad);
    outputs = forward(args);
    if (frame.active && grad_mode_enabled()) {
      const bool out_grad = any_requires_grad(outputs);
      TANDEM_CHECK(out_grad || !frame.saw_grad() || !any_floating(outputs),
                   "[nn::{}] expected forward to return a tensor that requires grad: it saw one "
                   "(an input, a parameter or a child module's output) in grad mode, but none of "
                   "its {} outputs requires grad. A raw ops:: call (tensor/ops.h) records no "
                   "backward node; use the differentiable op of the same name in namespace "
                   "tandem (autograd/ops.h), or NoGradGuard where the gradient is meant to stop "
                   "(Note [Dropped gradients])",
                   type_name_, outputs.size());
      auto& stack = GradientCheckFrame::stack();
      if (out_grad && stack.size() >= 2) stack[stack.size() - 2] = true;
    }
  }
  // Note [Backward pre-hooks see every use]: the outputs pass the backward
  // pre-hook node *before* the forward hooks run, so a forward hook that
  // consumes an output (e.g. launches a collective on it) contributes to the
  // gradient the pre-hooks see, and the module's own backward runs after them.
  if (!backward_pre_hooks_.empty() && grad_mode_enabled() && any_requires_grad(outputs)) {
    outputs = through_hooks(*this, "ModuleBackwardPreHook", backward_pre_hooks_, outputs);
  }
  for (auto& [id, hook] : hooks_) {
    if (auto replaced = hook(*this, args, outputs)) outputs = std::move(*replaced);
  }
  return outputs;
}

Tensor Module::operator()(const Tensor& x) {
  std::vector<Tensor> out = call(Args{x});
  TANDEM_CHECK(out.size() == 1,
               "[nn::{}] expected one output from (*module)(x), got {} (Note [Module outputs]: "
               "call() gives them all{})",
               type_name_, out.size(),
               out.size() == 2 ? "; nn::call_with_aux names an output and an aux loss" : "");
  return out[0];
}

void Module::register_parameter(const std::string& name, Tensor* tensor) {
  TANDEM_CHECK(tensor != nullptr && tensor->defined(),
               "[nn::{}] expected a defined tensor for parameter '{}'", type_name_, name);
  for (auto& [n, t] : params_) {
    TANDEM_CHECK(n != name, "[nn::{}] expected a new parameter name, got '{}' twice", type_name_,
                 name);
  }
  set_requires_grad(*tensor, true);
  params_.emplace_back(name, tensor);
}

void Module::register_buffer(const std::string& name, Tensor* tensor) {
  TANDEM_CHECK(tensor != nullptr && tensor->defined(),
               "[nn::{}] expected a defined tensor for buffer '{}'", type_name_, name);
  buffers_.emplace_back(name, tensor);
}

void Module::collect(const std::string& prefix, bool params,
                     std::vector<std::pair<std::string, Tensor*>>& out) const {
  for (const auto& [name, t] : params ? params_ : buffers_)
    out.emplace_back(prefix + name, t);
  for (const auto& [name, child] : children_)
    child->collect(prefix + name + ".", params, out);
}

std::vector<std::pair<std::string, Tensor>> Module::named_parameters() const {
  std::vector<std::pair<std::string, Tensor*>> found;
  collect("", true, found);
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [n, t] : found)
    out.emplace_back(n, *t);
  return out;
}

std::vector<std::pair<std::string, Tensor>> Module::named_buffers() const {
  std::vector<std::pair<std::string, Tensor*>> found;
  collect("", false, found);
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [n, t] : found)
    out.emplace_back(n, *t);
  return out;
}

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> out;
  for (auto& [n, t] : named_parameters())
    out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, std::shared_ptr<Module>>> Module::named_children() const {
  return children_;
}

std::vector<std::pair<std::string, std::shared_ptr<Module>>> Module::named_modules() {
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> out;
  out.emplace_back("", shared_from_this());
  for (auto& [name, child] : children_) {
    for (auto& [sub, m] : child->named_modules()) {
      out.emplace_back(sub.empty() ? name : name + "." + sub, m);
    }
  }
  return out;
}

int64_t Module::num_parameters() const {
  int64_t n = 0;
  for (const Tensor& p : parameters())
    n += p.numel();
  return n;
}

std::map<std::string, Tensor> Module::state_dict() const {
  std::map<std::string, Tensor> out;
  for (auto& [n, t] : named_parameters())
    out[n] = detach(t);
  for (auto& [n, t] : named_buffers())
    out[n] = detach(t);
  return out;
}

void Module::load_state_dict(const std::map<std::string, Tensor>& state, bool strict) {
  std::vector<std::pair<std::string, Tensor*>> mine;
  collect("", true, mine);
  collect("", false, mine);
  std::map<std::string, Tensor*> by_name(mine.begin(), mine.end());
  // Check everything before copying anything, so a bad dict changes nothing.
  for (const auto& [name, src] : state) {
    auto it = by_name.find(name);
    TANDEM_CHECK(it != by_name.end() || !strict,
                 "[nn::load_state_dict] expected keys of {}, got unexpected key '{}'", type_name_,
                 name);
    if (it == by_name.end()) continue;
    TANDEM_CHECK(src.shape() == it->second->shape(),
                 "[nn::load_state_dict] expected '{}' of shape {}, got {}", name,
                 it->second->shape(), src.shape());
  }
  if (strict) {
    for (const auto& [name, t] : mine) {
      TANDEM_CHECK(state.count(name) == 1, "[nn::load_state_dict] expected key '{}', got none",
                   name);
    }
  }
  NoGradGuard no_grad;
  for (const auto& [name, src] : state) {
    auto it = by_name.find(name);
    if (it != by_name.end()) ops::copy_(*it->second, src);
  }
}

void Module::to(Device device) {
  std::vector<std::pair<std::string, Tensor*>> all;
  collect("", true, all);
  collect("", false, all);
  for (auto& [name, t] : all) {
    bool rg = requires_grad(*t);
    Tensor moved = ops::to(detach(*t), device);
    if (moved.storage() == t->storage()) continue;
    std::shared_ptr<const LeafAnnotation> annotation = leaf_annotation(*t);
    *t = moved;
    if (rg) set_requires_grad(*t, true);
    if (annotation) set_leaf_annotation(*t, std::move(annotation));
  }
}

void Module::to(DType dtype) {
  std::vector<std::pair<std::string, Tensor*>> all;
  collect("", true, all);
  collect("", false, all);
  for (auto& [name, t] : all) {
    if (!is_floating(t->dtype()) || t->dtype() == dtype) continue;
    bool rg = requires_grad(*t);
    std::shared_ptr<const LeafAnnotation> annotation = leaf_annotation(*t);
    *t = ops::to(detach(*t), dtype);
    if (rg) set_requires_grad(*t, true);
    if (annotation) set_leaf_annotation(*t, std::move(annotation));
  }
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [name, child] : children_)
    child->train(on);
}

void Module::set_parameter(const std::string& name, const Tensor& value) {
  for (auto& [n, t] : params_) {
    if (n != name) continue;
    *t = detach(value);
    set_requires_grad(*t, true);
    return;
  }
  TANDEM_FAIL("[nn::{}] expected one of its own parameters, got \"{}\"", type_name_, name);
}

void Module::assign_parameter(const std::string& name, const Tensor& value) {
  TANDEM_CHECK(value.defined() && requires_grad(value) && grad_fn(value) == nullptr,
               "[nn::{}] expected a leaf that requires grad for parameter \"{}\", got {}",
               type_name_, name,
               !value.defined()            ? "an undefined tensor"
               : grad_fn(value) != nullptr ? "the result of an op"
                                           : "a tensor without requires_grad");
  for (auto& [n, t] : params_) {
    if (n != name) continue;
    *t = value;
    return;
  }
  TANDEM_FAIL("[nn::{}] expected one of its own parameters, got \"{}\"", type_name_, name);
}

void Module::replace_module(const std::string& name, std::shared_ptr<Module> module) {
  TANDEM_CHECK(module != nullptr, "[nn::{}] expected a module to replace child '{}', got null",
               type_name_, name);
  for (auto& [n, child] : children_) {
    if (n != name) continue;
    child = std::move(module);
    return;
  }
  TANDEM_FAIL("[nn::{}] expected one of its own children, got \"{}\"", type_name_, name);
}

std::shared_ptr<Module> Module::get_submodule(const std::string& path) {
  for (auto& [name, m] : named_modules()) {
    if (name == path) return m;
  }
  TANDEM_FAIL("[nn::{}] expected a submodule path, got \"{}\" (no such module)", type_name_, path);
}

void Module::zero_grad() {
  for (const Tensor& p : parameters())
    tandem::zero_grad(p);
}

HookHandle Module::register_forward_pre_hook(ForwardPreHook hook) {
  int id = next_hook_id++;
  pre_hooks_.emplace_back(id, std::move(hook));
  return HookHandle(weak_from_this(), id);
}

HookHandle Module::register_forward_hook(ForwardHook hook) {
  int id = next_hook_id++;
  hooks_.emplace_back(id, std::move(hook));
  return HookHandle(weak_from_this(), id);
}

HookHandle Module::register_full_backward_pre_hook(BackwardPreHook hook) {
  int id = next_hook_id++;
  backward_pre_hooks_.emplace_back(id, std::move(hook));
  return HookHandle(weak_from_this(), id);
}

HookHandle Module::register_full_backward_hook(BackwardHook hook) {
  int id = next_hook_id++;
  backward_hooks_.emplace_back(id, std::move(hook));
  return HookHandle(weak_from_this(), id);
}

bool Module::remove_hook(int id) {
  auto erase = [id](auto& list) {
    for (auto it = list.begin(); it != list.end(); ++it) {
      if (it->first == id) {
        list.erase(it);
        return true;
      }
    }
    return false;
  };
  return erase(pre_hooks_) || erase(hooks_) || erase(backward_pre_hooks_) || erase(backward_hooks_);
}

}  // namespace tandem
