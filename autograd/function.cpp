#include "tandem/autograd/function.h"

#include "tandem/runtime/error.h"
#include "tandem/tensor/ops.h"

namespace tandem {

void FunctionCtx::save_for_backward(const std::vector<Tensor>& tensors) {
  saved_.clear();
  for (const Tensor& t : tensors)
    saved_.push_back(detach(t));
}

namespace {

struct FunctionNode final : Node {
  std::shared_ptr<Function> fn;
  FunctionCtx ctx;
  std::vector<Shape> output_shapes;
  std::vector<DType> output_dtypes;
  std::vector<Device> output_devices;

  const char* name() const override { return fn->name(); }

  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    if (!fn->accepts_undefined_grads()) {
      for (size_t i = 0; i < grads.size(); ++i) {
        if (!grads[i].defined()) {
          grads[i] = ops::zeros(output_shapes[i], output_dtypes[i], output_devices[i]);
        }
      }
    }
    std::vector<Tensor> out = fn->backward(ctx, grads);
    TANDEM_CHECK(out.size() == next_edges().size(),
                 "[autograd::Function] expected {}::backward to return {} gradients (one per "
                 "input), got {}",
                 fn->name(), next_edges().size(), out.size());
    return out;
  }

  void release_saved() override { ctx.release(); }
};

}  // namespace

std::vector<Tensor> Function::apply(const std::shared_ptr<Function>& fn,
                                    const std::vector<Tensor>& inputs) {
  TANDEM_CHECK(fn != nullptr, "[autograd::apply] expected a Function, got null");
  const bool record = grad_mode_enabled() && (any_requires_grad(inputs) || fn->always_record());
  auto node = record ? std::make_shared<FunctionNode>() : nullptr;
  FunctionCtx local;
  FunctionCtx& ctx = node ? node->ctx : local;
  ctx.needs_input_grad.clear();
  for (const Tensor& t : inputs)
    ctx.needs_input_grad.push_back(t.defined() && requires_grad(t));
  std::vector<Tensor> outputs;
  {
    NoGradGuard no_grad;
    outputs = fn->forward(ctx, inputs);
  }
  if (!node) return outputs;
  node->fn = fn;
  std::vector<const Tensor*> in;
  for (const Tensor& t : inputs)
    in.push_back(&t);
  std::vector<Tensor*> out;
  for (Tensor& t : outputs) {
    t = detach(t);  // a forward may return an input itself: give the output its own identity
    out.push_back(&t);
    node->output_shapes.push_back(t.shape());
    node->output_dtypes.push_back(t.dtype());
    node->output_devices.push_back(t.device());
  }
  NodeRecorder::wire(node, in, out);
  return outputs;
}

}  // namespace tandem
