// Optimizers, gradient clipping and the learning-rate schedule.
//
// An optimizer holds handles to the parameters it was given (Tensor copies
// alias the module's members, storage and gradient slot alike) and updates
// them in place with ops::copy_ under NoGradGuard, so module members, the
// optimizer and any other holder keep seeing one tensor. Build the optimizer
// after Module::to(): to() replaces the members with new tensors.
//
// State is per parameter and deterministic (no RNG, fixed update order), and
// state_dict()/load_state_dict() capture all of it, so a run resumed from
// (model state, optimizer state) continues bit-identically. Keys:
//   "lr"                    0-d f64, the current learning rate
//   "<param>.step"          0-d i64, updates applied to that parameter
//   "<param>.momentum_buffer"          (SGD with momentum)
//   "<param>.exp_avg", "<param>.exp_avg_sq"   (AdamW)
// where <param> is the name given (named_parameters()) or the index "0", "1", ….
// Buffers are f64 for f64 parameters and f32 otherwise.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tandem/tensor/tensor.h"

namespace tandem::optim {

using NamedParams = std::vector<std::pair<std::string, Tensor>>;

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Updates every parameter that has a gradient; parameters without one are
  // skipped (their state does not advance), as in PyTorch.
  virtual void step() = 0;
  // Drops every parameter's gradient.
  void zero_grad();

  double lr() const { return lr_; }
  void set_lr(double lr);
  const NamedParams& params() const { return params_; }

  std::map<std::string, Tensor> state_dict() const;  // copies
  // Strict: the keys of state_dict() exactly, with matching shapes; checks
  // everything before changing anything.
  void load_state_dict(const std::map<std::string, Tensor>& state);

 protected:
  Optimizer(NamedParams params, double lr, std::vector<std::string> buffer_names, const char* name);

  struct ParamState {
    int64_t step = 0;
    std::map<std::string, Tensor> buffers;  // by buffer name, zero-initialised
  };
  // The dtype updates are computed in for parameter `p`.
  static DType state_dtype(const Tensor& p);

  NamedParams params_;
  std::vector<ParamState> state_;  // parallel to params_
  double lr_;
  const char* name_;
};

// Stochastic gradient descent (PyTorch semantics, dampening 0):
//   d = g + weight_decay * p;  buf = momentum * buf + d;  p -= lr * buf
// (weight decay here is coupled L2, as in torch.optim.SGD).
struct SGDOptions {
  double lr = 1e-3;
  double momentum = 0.0;
  double weight_decay = 0.0;
};

class SGD final : public Optimizer {
 public:
  using Options = SGDOptions;
  SGD(NamedParams params, const SGDOptions& options);
  SGD(const std::vector<Tensor>& params, const SGDOptions& options);
  void step() override;

 private:
  double momentum_;
  double weight_decay_;
};

// Adam with decoupled weight decay (Loshchilov & Hutter; torch.optim.AdamW):
//   p *= 1 - lr * weight_decay
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
struct AdamWOptions {  // torch.optim.AdamW's defaults
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

class AdamW final : public Optimizer {
 public:
  using Options = AdamWOptions;
  AdamW(NamedParams params, const AdamWOptions& options);
  AdamW(const std::vector<Tensor>& params, const AdamWOptions& options);
  void step() override;

 private:
  double beta1_;
  double beta2_;
  double eps_;
  double weight_decay_;
};

// Scales the gradients so that their global L2 norm (over all parameters
// together, computed in f64) is at most max_norm, replacing each gradient
// with set_grad. Returns the norm before clipping. Gradients are scaled by
// max_norm / (norm + 1e-6) only when that factor is below 1.
double clip_grad_norm(const std::vector<Tensor>& params, double max_norm);

// Linear warm-up then cosine decay (llm.c's schedule), for 0-based steps:
//   step < warmup:         base_lr * (step + 1) / warmup
//   warmup <= step < total: min_lr + (base_lr - min_lr) * (1 + cos(pi * r)) / 2,
//                           r = (step - warmup) / (total - warmup)
//   step >= total:          min_lr
struct CosineScheduleOptions {
  double base_lr = 0.0;
  int64_t warmup_steps = 0;
  int64_t total_steps = 0;
  double min_lr = 0.0;
};

class CosineSchedule {
 public:
  using Options = CosineScheduleOptions;
  explicit CosineSchedule(const CosineScheduleOptions& options);
  double lr(int64_t step) const;

 private:
  double base_lr_;
  int64_t warmup_steps_;
  int64_t total_steps_;
  double min_lr_;
};

}  // namespace tandem::optim
