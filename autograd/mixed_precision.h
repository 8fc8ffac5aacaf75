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
#pragma once

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

}  // namespace tandem
