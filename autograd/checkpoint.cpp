#include "autograd/checkpoint.h"

#include "autograd/engine.h"
#include "autograd/function.h"
#include "runtime/recompute_flag.h"

namespace tandem {
namespace {

struct CheckpointFunction final : Function {
  CheckpointFn fn;
  std::vector<Tensor> inputs;  // detached; re-run in backward

  const char* name() const override { return "CheckpointBackward"; }
  bool always_record() const override { return true; }
  bool accepts_undefined_grads() const override { return true; }

  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>& in) override {
    for (const Tensor& t : in)
      inputs.push_back(detach(t));
    return fn(in);
  }

  std::vector<Tensor> backward(FunctionCtx& ctx, const std::vector<Tensor>& grads) override {
    std::vector<Tensor> leaves;
    for (size_t i = 0; i < inputs.size(); ++i) {
      Tensor x = detach(inputs[i]);
      if (ctx.needs_input_grad[i]) set_requires_grad(x, true);
      leaves.push_back(x);
    }
    std::vector<Tensor> outs;
    {
      RecomputeGuard recompute;
      EnableGradGuard enable;
      outs = fn(leaves);
    }
    std::vector<Tensor> roots, seeds;
    for (size_t i = 0; i < outs.size() && i < grads.size(); ++i) {
      if (grads[i].defined() && requires_grad(outs[i])) {
        roots.push_back(outs[i]);
        seeds.push_back(grads[i]);
      }
    }
    if (!roots.empty()) tandem::backward(roots, seeds);
    std::vector<Tensor> result;
    for (size_t i = 0; i < leaves.size(); ++i) {
      result.push_back(ctx.needs_input_grad[i] ? tandem::grad(leaves[i]) : Tensor());
    }
    inputs.clear();
    return result;
  }
};

}  // namespace

// The flag is runtime's (Note [Recompute flag]), so the HookCoordinator sees re-runs.
bool is_recomputing() {
  return thread_is_recomputing();
}
RecomputeGuard::RecomputeGuard() : previous_(set_thread_recomputing(true)) {}
RecomputeGuard::~RecomputeGuard() {
  set_thread_recomputing(previous_);
}

std::vector<Tensor> checkpoint(CheckpointFn fn, const std::vector<Tensor>& inputs) {
  auto f = std::make_shared<CheckpointFunction>();
  f->fn = std::move(fn);
  return Function::apply(f, inputs);
}

}  // namespace tandem
