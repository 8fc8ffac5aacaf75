#include "tandem/autograd/optim.h"

#include <cmath>
#include <numbers>
#include <set>

#include "tandem/autograd/node.h"
#include "tandem/runtime/error.h"
#include "tandem/tensor/ops.h"

namespace tandem::optim {
namespace {

NamedParams index_names(const std::vector<Tensor>& params) {
  NamedParams named;
  for (size_t i = 0; i < params.size(); ++i)
    named.emplace_back(std::to_string(i), params[i]);
  return named;
}

}  // namespace

Optimizer::Optimizer(NamedParams params, double lr, std::vector<std::string> buffer_names,
                     const char* name)
    : params_(std::move(params)), lr_(lr), name_(name) {
  TANDEM_CHECK(lr >= 0, "[optim::{}] expected lr >= 0, got {}", name, lr);
  std::set<std::string> seen;
  for (const auto& [pname, p] : params_) {
    TANDEM_CHECK(p.defined() && is_floating(p.dtype()),
                 "[optim::{}] expected defined floating parameters, got '{}'", name, pname);
    TANDEM_CHECK(seen.insert(pname).second,
                 "[optim::{}] expected unique parameter names, got '{}' twice", name, pname);
    ParamState s;
    for (const std::string& b : buffer_names) {
      s.buffers[b] = ops::zeros(p.shape(), state_dtype(p), p.device());
    }
    state_.push_back(std::move(s));
  }
}

DType Optimizer::state_dtype(const Tensor& p) {
  return p.dtype() == DType::F64 ? DType::F64 : DType::F32;
}

void Optimizer::zero_grad() {
  for (const auto& [name, p] : params_)
    tandem::zero_grad(p);
}

void Optimizer::set_lr(double lr) {
  TANDEM_CHECK(lr >= 0, "[optim::{}] expected lr >= 0, got {}", name_, lr);
  lr_ = lr;
}

std::map<std::string, Tensor> Optimizer::state_dict() const {
  std::map<std::string, Tensor> out;
  out["lr"] = ops::scalar_tensor(lr_, DType::F64);
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string& pname = params_[i].first;
    out[pname + ".step"] = ops::scalar_tensor(static_cast<double>(state_[i].step), DType::I64);
    for (const auto& [b, t] : state_[i].buffers)
      out[pname + "." + b] = ops::clone(t);
  }
  return out;
}

void Optimizer::load_state_dict(const std::map<std::string, Tensor>& state) {
  const std::map<std::string, Tensor> mine = state_dict();
  for (const auto& [key, t] : state) {
    auto it = mine.find(key);
    TANDEM_CHECK(it != mine.end(), "[optim::{}::load_state_dict] expected known keys, got '{}'",
                 name_, key);
    TANDEM_CHECK(t.defined() && t.shape() == it->second.shape(),
                 "[optim::{}::load_state_dict] expected '{}' of shape {}, got {}", name_, key,
                 it->second.shape(), t.defined() ? t.shape() : Shape{});
  }
  for (const auto& [key, t] : mine) {
    TANDEM_CHECK(state.count(key) == 1, "[optim::{}::load_state_dict] expected key '{}', got none",
                 name_, key);
  }
  lr_ = state.at("lr").item_double();
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string& pname = params_[i].first;
    state_[i].step = static_cast<int64_t>(state.at(pname + ".step").item_double());
    for (auto& [b, t] : state_[i].buffers) {
      // A private copy: the caller's dict must not change with later steps.
      t = ops::clone(ops::to(ops::to(state.at(pname + "." + b), t.device()), t.dtype()));
    }
  }
}

SGD::SGD(NamedParams params, const SGDOptions& options)
    : Optimizer(std::move(params), options.lr,
                options.momentum != 0.0 ? std::vector<std::string>{"momentum_buffer"}
                                        : std::vector<std::string>{},
                "SGD"),
      momentum_(options.momentum),
      weight_decay_(options.weight_decay) {
  TANDEM_CHECK(momentum_ >= 0 && weight_decay_ >= 0,
               "[optim::SGD] expected momentum >= 0 and weight_decay >= 0, got {} and {}",
               momentum_, weight_decay_);
}

SGD::SGD(const std::vector<Tensor>& params, const SGDOptions& options)
    : SGD(index_names(params), options) {}

void SGD::step() {
  NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i].second;
    const Tensor g = tandem::grad(p);
    if (!g.defined()) continue;
    const DType dt = state_dtype(p);
    Tensor pf = ops::to(p, dt);
    Tensor d = ops::to(g, dt);
    if (weight_decay_ != 0.0) d = ops::add(d, ops::mul(pf, weight_decay_));
    if (momentum_ != 0.0) {
      Tensor& buf = state_[i].buffers.at("momentum_buffer");
      buf = ops::add(ops::mul(buf, momentum_), d);
      d = buf;
    }
    ops::copy_(p, ops::sub(pf, ops::mul(d, lr_)));
    ++state_[i].step;
  }
}

AdamW::AdamW(NamedParams params, const AdamWOptions& options)
    : Optimizer(std::move(params), options.lr, {"exp_avg", "exp_avg_sq"}, "AdamW"),
      beta1_(options.beta1),
      beta2_(options.beta2),
      eps_(options.eps),
      weight_decay_(options.weight_decay) {
  TANDEM_CHECK(beta1_ >= 0 && beta1_ < 1 && beta2_ >= 0 && beta2_ < 1,
               "[optim::AdamW] expected betas in [0, 1), got {} and {}", beta1_, beta2_);
  TANDEM_CHECK(eps_ >= 0 && weight_decay_ >= 0,
               "[optim::AdamW] expected eps >= 0 and weight_decay >= 0, got {} and {}", eps_,
               weight_decay_);
}

AdamW::AdamW(const std::vector<Tensor>& params, const AdamWOptions& options)
    : AdamW(index_names(params), options) {}

void AdamW::step() {
  NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i].second;
    const Tensor g0 = tandem::grad(p);
    if (!g0.defined()) continue;
    ParamState& s = state_[i];
    const int64_t t = ++s.step;
    const DType dt = state_dtype(p);
    Tensor g = ops::to(g0, dt);
    Tensor pf = ops::to(p, dt);
    // Decoupled: the decay never enters the moment estimates.
    if (weight_decay_ != 0.0) pf = ops::mul(pf, 1.0 - lr_ * weight_decay_);
    Tensor& m = s.buffers.at("exp_avg");
    Tensor& v = s.buffers.at("exp_avg_sq");
    m = ops::add(ops::mul(m, beta1_), ops::mul(g, 1.0 - beta1_));
    v = ops::add(ops::mul(v, beta2_), ops::mul(ops::mul(g, g), 1.0 - beta2_));
    const double bc1 = 1.0 - std::pow(beta1_, static_cast<double>(t));
    const double bc2 = 1.0 - std::pow(beta2_, static_cast<double>(t));
    Tensor denom = ops::add(ops::div(ops::sqrt(v), std::sqrt(bc2)), eps_);
    ops::copy_(p, ops::sub(pf, ops::mul(ops::div(m, denom), lr_ / bc1)));
  }
}

double clip_grad_norm(const std::vector<Tensor>& params, double max_norm) {
  TANDEM_CHECK(max_norm > 0, "[optim::clip_grad_norm] expected max_norm > 0, got {}", max_norm);
  NoGradGuard no_grad;
  double sum_sq = 0;
  for (const Tensor& p : params) {
    const Tensor g = tandem::grad(p);
    if (!g.defined()) continue;
    Tensor g64 = ops::to(g, DType::F64);
    sum_sq += ops::sum(ops::mul(g64, g64)).item<double>();
  }
  const double norm = std::sqrt(sum_sq);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    for (const Tensor& p : params) {
      const Tensor g = tandem::grad(p);
      if (g.defined()) set_grad(p, ops::mul(g, coef));
    }
  }
  return norm;
}

CosineSchedule::CosineSchedule(const CosineScheduleOptions& options)
    : base_lr_(options.base_lr),
      warmup_steps_(options.warmup_steps),
      total_steps_(options.total_steps),
      min_lr_(options.min_lr) {
  const double base_lr = base_lr_, min_lr = min_lr_;
  const int64_t warmup_steps = warmup_steps_, total_steps = total_steps_;
  TANDEM_CHECK(warmup_steps >= 0 && total_steps >= warmup_steps,
               "[optim::CosineSchedule] expected 0 <= warmup_steps <= total_steps, got {} and {}",
               warmup_steps, total_steps);
  TANDEM_CHECK(min_lr <= base_lr, "[optim::CosineSchedule] expected min_lr <= base_lr, got {} > {}",
               min_lr, base_lr);
}

double CosineSchedule::lr(int64_t step) const {
  TANDEM_CHECK(step >= 0, "[optim::CosineSchedule] expected step >= 0, got {}", step);
  if (step < warmup_steps_) {
    return base_lr_ * static_cast<double>(step + 1) / static_cast<double>(warmup_steps_);
  }
  if (step >= total_steps_) return min_lr_;
  const double r =
      static_cast<double>(step - warmup_steps_) / static_cast<double>(total_steps_ - warmup_steps_);
  return min_lr_ + (base_lr_ - min_lr_) * 0.5 * (1.0 + std::cos(std::numbers::pi * r));
}

}  // namespace tandem::optim
