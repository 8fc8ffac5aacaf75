// Module: named parameters, buffers and children, with the hooks the
// parallel layers attach to (DESIGN §4).
//
// Calling a module runs: forward pre-hooks (may replace the arguments) →
// forward → forward hooks (may replace the outputs). Arguments are positional
// tensors plus named tensors, so a hook can find and replace Q/K/V wherever a
// model passes them. Full backward pre-hooks see the gradient of the module's
// outputs before the module's own backward runs (and may replace it);
// backward hooks see the gradient of the inputs. Every registration returns a
// HookHandle whose remove() detaches it.
//
// Parameters are registered by address (`register_parameter("weight",
// &weight_)`), so to(device/dtype) and load_state_dict() update the module's
// own members. Modules are held by shared_ptr and are not copyable.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tandem/autograd/node.h"

namespace tandem {

struct Args {
  std::vector<Tensor> positional;
  std::map<std::string, Tensor> named;

  Args() = default;
  Args(std::initializer_list<Tensor> tensors) : positional(tensors) {}
  explicit Args(std::vector<Tensor> tensors) : positional(std::move(tensors)) {}
  // Positional index or name; null when absent.
  Tensor* find(const std::string& name) {
    auto it = named.find(name);
    return it == named.end() ? nullptr : &it->second;
  }
  Tensor* at(size_t index) { return index < positional.size() ? &positional[index] : nullptr; }
};

class Module;

using ForwardPreHook = std::function<std::optional<Args>(Module&, const Args&)>;
using ForwardHook = std::function<std::optional<std::vector<Tensor>>(Module&, const Args&,
                                                                     const std::vector<Tensor>&)>;
// Gradients of the outputs (undefined where none arrived); may replace them.
using BackwardPreHook =
    std::function<std::optional<std::vector<Tensor>>(Module&, const std::vector<Tensor>&)>;
// Gradients of the positional inputs that require grad; may replace them.
using BackwardHook =
    std::function<std::optional<std::vector<Tensor>>(Module&, const std::vector<Tensor>&)>;

class HookHandle {
 public:
  HookHandle() = default;
  HookHandle(std::weak_ptr<Module> module, int id) : module_(std::move(module)), id_(id) {}
  void remove();
  bool active() const;

 private:
  std::weak_ptr<Module> module_;
  int id_ = 0;
};

// Whether Module::call checks that a forward which saw a tensor requiring grad
// returns one (Note [Dropped gradients] in autograd/module.cpp):
// TANDEM_CHECK_GRADIENTS=1|0; by default on in builds with assertions
// (NDEBUG undefined: debug and the sanitizer builds), off in release builds.
bool check_dropped_gradients();
void set_check_dropped_gradients(bool on);

class Module : public std::enable_shared_from_this<Module> {
 public:
  explicit Module(std::string type_name) : type_name_(std::move(type_name)) {}
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // Runs hooks and forward.
  //
  // Note [Module outputs]
  // ~~~~~~~~~~~~~~~~~~~~~
  // call() returns a module's outputs as a vector: the form hooks see and
  // may replace, whatever the module. Model code reads them by name instead:
  // a module with one output is called as (*m)(x) and gives a Tensor (an
  // error when forward returned several, so that an auxiliary output is
  // never dropped unseen); a module with several has a struct naming them,
  // made from call()'s vector by a function that checks the count
  // (nn::AuxOutput and nn::call_with_aux for the layers that add a
  // load-balancing loss).
  std::vector<Tensor> call(Args args);
  // One tensor in, the module's single output out.
  Tensor operator()(const Tensor& x);

  const std::string& type_name() const { return type_name_; }

  std::vector<Tensor> parameters() const;
  std::vector<std::pair<std::string, Tensor>> named_parameters() const;
  std::vector<std::pair<std::string, Tensor>> named_buffers() const;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_children() const;
  // Every module below this one (depth first, this one first), with dotted names.
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_modules();
  int64_t num_parameters() const;

  // Parameters and buffers by dotted name.
  std::map<std::string, Tensor> state_dict() const;
  // Copies values in place. strict: every key must exist on both sides.
  void load_state_dict(const std::map<std::string, Tensor>& state, bool strict = true);

  void to(Device device);
  void to(DType dtype);  // floating parameters and buffers only
  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }
  void zero_grad();
  // Replaces this module's own parameter `name` (not a dotted path) with
  // `value`, keeping requires_grad: how parallel styles install local shards.
  void set_parameter(const std::string& name, const Tensor& value);
  // Makes `value` itself (no detach: the same autograd leaf, gradient slot
  // and annotations) this module's own parameter `name`: how sharded data
  // parallelism swaps a parameter's shard and its gathered whole in and out
  // around the forward (parallel/fsdp.h). `value` must be a leaf that
  // requires grad.
  void assign_parameter(const std::string& name, const Tensor& value);
  // The module at a dotted path below this one ("" = this); error if absent.
  std::shared_ptr<Module> get_submodule(const std::string& path);

  HookHandle register_forward_pre_hook(ForwardPreHook hook);
  HookHandle register_forward_hook(ForwardHook hook);
  HookHandle register_full_backward_pre_hook(BackwardPreHook hook);
  HookHandle register_full_backward_hook(BackwardHook hook);
  bool remove_hook(int id);

 protected:
  virtual std::vector<Tensor> forward(Args& args) = 0;

  // Registers a member tensor as a parameter (sets requires_grad).
  void register_parameter(const std::string& name, Tensor* tensor);
  void register_buffer(const std::string& name, Tensor* tensor);
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> module) {
    children_.emplace_back(name, module);
    return module;
  }
  // Swaps the child registered as `name` for `module` (error if absent): how
  // a layer installs a container it rebuilt (expert parallelism keeps only
  // the local experts, under their global names).
  void replace_module(const std::string& name, std::shared_ptr<Module> module);

 private:
  void collect(const std::string& prefix, bool params,
               std::vector<std::pair<std::string, Tensor*>>& out) const;

  std::string type_name_;
  bool training_ = true;
  std::vector<std::pair<std::string, Tensor*>> params_;
  std::vector<std::pair<std::string, Tensor*>> buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  std::vector<std::pair<int, ForwardPreHook>> pre_hooks_;
  std::vector<std::pair<int, ForwardHook>> hooks_;
  std::vector<std::pair<int, BackwardPreHook>> backward_pre_hooks_;
  std::vector<std::pair<int, BackwardHook>> backward_hooks_;
};

}  // namespace tandem
