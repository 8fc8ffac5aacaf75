// ModuleList: an ordered list of child modules named "0", "1", … so that
// parameter names read "blocks.3.attn.q_proj.weight" and "experts.5.w1.weight"
// as in PyTorch. It holds modules; it is not callable itself. Also the
// argument helper the one-input layers share.
#pragma once

#include <memory>
#include <vector>

#include "tandem/autograd/module.h"
#include "tandem/tensor/random.h"

namespace tandem::nn {

class ModuleList final : public Module {
 public:
  ModuleList() : Module("ModuleList") {}

  // Registers `module` as child str(size()) and returns it.
  template <class M>
  std::shared_ptr<M> append(std::shared_ptr<M> module) {
    items_.push_back(module);
    return register_module(std::to_string(items_.size() - 1), std::move(module));
  }
  size_t size() const { return items_.size(); }
  const std::shared_ptr<Module>& operator[](size_t i) const;
  // The i-th module as type M (checked).
  template <class M>
  std::shared_ptr<M> at(size_t i) const {
    auto typed = std::dynamic_pointer_cast<M>((*this)[i]);
    TANDEM_CHECK(typed != nullptr,
                 "[nn::ModuleList] expected module {} of the requested type, got {}", i,
                 (*this)[i]->type_name());
    return typed;
  }

 protected:
  std::vector<Tensor> forward(Args& args) override;

 private:
  std::vector<std::shared_ptr<Module>> items_;
};

// A layer made from its options struct, which the braces name field by field:
//   auto up = nn::make<nn::Linear>({.in_features = 64, .out_features = 256}, gen);
//   auto norm = nn::make<nn::RMSNorm>({.dim = 64});
// (std::make_shared cannot take a braced list; this can, because the options
// type is M::Options rather than deduced.)
template <class M>
std::shared_ptr<M> make(const typename M::Options& options, Generator& gen) {
  return std::make_shared<M>(options, gen);
}
template <class M>
std::shared_ptr<M> make(const typename M::Options& options) {
  return std::make_shared<M>(options);
}

// The first positional argument of a one-input module (checked).
const Tensor& single_input(Args& args, const char* module);

}  // namespace tandem::nn
