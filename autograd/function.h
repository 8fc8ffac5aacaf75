// Custom differentiable functions (DESIGN §4): subclass Function, implement
// forward (runs without recording) and backward (one gradient per input;
// undefined = no gradient), and call apply(). Non-tensor state (split sizes,
// flags, handles) lives in the Function's own members; tensors backward needs
// go through ctx.save_for_backward, which stores them detached (a member
// holding an output would tie the node to itself). The sync hooks of the dual-pipe
// schedule and the differentiable collectives are Functions.
//
//   struct Scale final : Function {
//     double s;
//     const char* name() const override { return "ScaleBackward"; }
//     std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>& x) override {
//       return {ops::mul(x[0], s)};
//     }
//     std::vector<Tensor> backward(FunctionCtx&, const std::vector<Tensor>& g) override {
//       return {ops::mul(g[0], s)};
//     }
//   };
//   Tensor y = Function::apply(std::make_shared<Scale>(...), {x})[0];
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tandem/autograd/node.h"

namespace tandem {

struct FunctionCtx {
  // Tensors backward needs (stored detached).
  void save_for_backward(const std::vector<Tensor>& tensors);
  const std::vector<Tensor>& saved_tensors() const { return saved_; }
  // needs_input_grad[i]: whether input i gets a gradient.
  std::vector<bool> needs_input_grad;

  void release() { saved_.clear(); }

 private:
  std::vector<Tensor> saved_;
};

class Function {
 public:
  virtual ~Function() = default;
  // The backward node's name in errors and traces.
  virtual const char* name() const = 0;
  virtual std::vector<Tensor> forward(FunctionCtx& ctx, const std::vector<Tensor>& inputs) = 0;
  virtual std::vector<Tensor> backward(FunctionCtx& ctx,
                                       const std::vector<Tensor>& grad_outputs) = 0;
  // Whether backward can run on undefined output gradients (filled with
  // zeros otherwise). Identity-like hooks set this to fire even without grads.
  virtual bool accepts_undefined_grads() const { return false; }
  // Record the node under grad mode even when no input requires grad (its
  // outputs then require grad): checkpointed blocks whose parameters are
  // inside, hooks that must fire in backward.
  virtual bool always_record() const { return false; }

  // Runs fn->forward without recording and, when grad mode is on and an input
  // requires grad (or always_record()), records one node whose backward calls
  // fn->backward.
  static std::vector<Tensor> apply(const std::shared_ptr<Function>& fn,
                                   const std::vector<Tensor>& inputs);
};

}  // namespace tandem
