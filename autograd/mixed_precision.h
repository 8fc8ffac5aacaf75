// Mixed precision with f32 master weights (Megatron's and apex's "O2"): the
// model computes in bf16 (or f16), the optimizer updates f32 copies of its
// parameters, and each step rounds them back into the model.
//
//   model->to(DType::BF16);
//   MasterWeights master(model->named_parameters());
//   optim::AdamW opt(master.params(), {...});   // f32 state, f32 updates
//   backward(loss);  ddp.finish();               // bf16 gradients (reduced)
//   master.grads_to_master();                    // f32(grad), model's dropped
//   clip_grad_norm(master.tensors(), mesh, 1.0);
//   opt.step();
//   master.master_to_model();                    // bf16(master), in place
//
// Note [Master weights]
// ~~~~~~~~~~~~~~~~~~~~~
// A master is an f32 leaf holding the model parameter's values (exact:
// bf16 and f16 widen to f32 without rounding), with the parameter's
// placement record (Note [Parameter placements]), so clipping, reductions
// and checkpoints over the masters see the layout the styles recorded. A
// model parameter without a gradient leaves its master without one, so an
// optimizer skips it as it would have skipped the parameter. The only
// roundings are the model's own: its gradient (computed in its dtype) and
// the update, rounded once into the model's dtype; norms, softmax and
// attention accumulate in f32 inside the kernels, and the caller computes
// the loss in f32.
//
// f16 also needs a loss scale: its smallest normal is 6e-5, and the
// gradients of a small loss fall below it (bf16 shares f32's exponent range
// and needs none). LossScaler is PyTorch's GradScaler:
//
//   LossScaler scaler;
//   backward(scaler.scale(loss));                // gradients x S, in f16
//   master.grads_to_master();
//   scaler.unscale(master.tensors());            // / S, in f32
//   const double norm = clip_grad_norm(master.tensors(), mesh, 1.0);
//   if (scaler.update(!std::isfinite(norm))) { opt.step(); master.master_to_model(); }
//
// Note [Dynamic loss scaling]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The scale S starts high (2^16) and is a power of two as long as the
// factors are, so scaling and unscaling are exact: the f32 gradients are the
// f16 computation's, not a rounding of them. A step whose gradients hold an
// inf or a NaN on any rank (the global gradient norm is then not finite:
// clip_grad_norm sums in f64 over every rank, so every rank sees the same
// verdict without another collective) is skipped and S halves; after
// growth_interval steps in a row without one, S doubles. A skipped step
// changes nothing but S: the optimizer neither moves the weights nor counts
// the step.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tandem/tensor/tensor.h"

namespace tandem {

class MasterWeights {
 public:
  explicit MasterWeights(std::vector<std::pair<std::string, Tensor>> model_params);

  const std::vector<std::pair<std::string, Tensor>>& params() const { return master_; }
  std::vector<Tensor> tensors() const;
  // grad(master) = f32(grad(param)); the model's gradients are dropped.
  void grads_to_master();
  // param = round(master), in place (the modules keep their tensors).
  void master_to_model();

 private:
  std::vector<std::pair<std::string, Tensor>> model_, master_;
};

struct LossScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

// Note [Dynamic loss scaling].
class LossScaler {
 public:
  explicit LossScaler(LossScalerOptions options = {});

  // loss x scale() (a graph op: its backward scales the gradients).
  Tensor scale(const Tensor& loss) const;
  double scale() const { return scale_; }
  // grad(p) /= scale() for every tensor that has a gradient.
  void unscale(const std::vector<Tensor>& params) const;
  // Ends a step: with found_inf the step is skipped (returns false) and the
  // scale backs off; otherwise returns true, and the scale grows after
  // growth_interval such steps in a row.
  bool update(bool found_inf);
  int64_t skipped() const { return skipped_; }

  // For checkpoints: the scale and the steps since the last change.
  struct State {
    double scale = 0;
    int64_t good_steps = 0;
  };
  State state() const { return {scale_, good_steps_}; }
  void load_state(const State& s);

 private:
  LossScalerOptions options_;
  double scale_;
  int64_t good_steps_ = 0, skipped_ = 0;
};

}  // namespace tandem
