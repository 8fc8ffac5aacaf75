#include "tandem/autograd/mixed_precision.h"

#include "tandem/autograd/node.h"
#include "tandem/runtime/error.h"
#include "tandem/tensor/ops.h"

namespace tandem {

MasterWeights::MasterWeights(std::vector<std::pair<std::string, Tensor>> model_params)
    : model_(std::move(model_params)) {
  NoGradGuard no_grad;
  for (const auto& [name, p] : model_) {
    TANDEM_CHECK(p.defined() && is_floating(p.dtype()),
                 "[autograd::MasterWeights] expected floating parameters, got '{}' of {}", name,
                 p.defined() ? dtype_name(p.dtype()) : "nothing");
    Tensor m = ops::to(p, DType::F32);
    if (m.is_alias_of(p)) m = ops::clone(m);  // an f32 parameter: a copy of its own
    set_requires_grad(m);
    if (auto a = leaf_annotation(p)) set_leaf_annotation(m, std::move(a));
    master_.emplace_back(name, m);
  }
}

std::vector<Tensor> MasterWeights::tensors() const {
  std::vector<Tensor> out;
  for (const auto& [name, m] : master_)
    out.push_back(m);
  return out;
}

void MasterWeights::grads_to_master() {
  NoGradGuard no_grad;
  for (size_t i = 0; i < model_.size(); ++i) {
    const Tensor g = grad(model_[i].second);
    if (g.defined()) {
      set_grad(master_[i].second, ops::to(g, DType::F32));
    } else {
      zero_grad(master_[i].second);
    }
    zero_grad(model_[i].second);
  }
}

void MasterWeights::master_to_model() {
  NoGradGuard no_grad;
  for (size_t i = 0; i < model_.size(); ++i)
    ops::copy_(model_[i].second, ops::to(master_[i].second, model_[i].second.dtype()));
}

}  // namespace tandem
