#include "tandem/autograd/mixed_precision.h"

#include <cmath>
#include <limits>

#include "tandem/autograd/node.h"
#include "tandem/autograd/ops.h"
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

LossScaler::LossScaler(LossScalerOptions options) : options_(options), scale_(options.init_scale) {
  TANDEM_CHECK(std::isfinite(options.init_scale) && options.init_scale > 0,
               "[autograd::LossScaler] expected a finite positive init_scale, got {}",
               options.init_scale);
  TANDEM_CHECK(options.growth_factor >= 1 && std::isfinite(options.growth_factor),
               "[autograd::LossScaler] expected a growth_factor >= 1, got {}",
               options.growth_factor);
  TANDEM_CHECK(options.backoff_factor > 0 && options.backoff_factor < 1,
               "[autograd::LossScaler] expected a backoff_factor in (0, 1), got {}",
               options.backoff_factor);
  TANDEM_CHECK(options.growth_interval >= 1,
               "[autograd::LossScaler] expected a growth_interval >= 1, got {}",
               options.growth_interval);
}

Tensor LossScaler::scale(const Tensor& loss) const {
  TANDEM_CHECK(loss.defined() && is_floating(loss.dtype()),
               "[autograd::LossScaler] expected a floating loss, got {}",
               loss.defined() ? dtype_name(loss.dtype()) : "nothing");
  return mul(loss, scale_);
}

void LossScaler::unscale(const std::vector<Tensor>& params) const {
  NoGradGuard no_grad;
  for (const Tensor& p : params) {
    const Tensor g = grad(p);
    if (g.defined()) set_grad(p, ops::mul(g, 1.0 / scale_));
  }
}

bool LossScaler::update(bool found_inf) {
  if (found_inf) {
    scale_ *= options_.backoff_factor;
    good_steps_ = 0;
    ++skipped_;
    return false;
  }
  if (++good_steps_ >= options_.growth_interval) {
    // A scale that would overflow f32 stays where it is.
    const double grown = scale_ * options_.growth_factor;
    if (grown <= std::numeric_limits<float>::max()) scale_ = grown;
    good_steps_ = 0;
  }
  return true;
}

void LossScaler::load_state(const State& s) {
  TANDEM_CHECK(std::isfinite(s.scale) && s.scale > 0 && s.good_steps >= 0,
               "[autograd::LossScaler] expected a finite positive scale and good_steps >= 0, "
               "got scale {} after {} steps",
               s.scale, s.good_steps);
  scale_ = s.scale;
  good_steps_ = s.good_steps;
}

}  // namespace tandem
