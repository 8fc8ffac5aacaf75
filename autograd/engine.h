// backward(): replays the recorded nodes reachable from the roots in reverse
// sequence order (Note [The tape]) and accumulates leaf gradients.
#pragma once

#include <vector>

#include "tandem/autograd/node.h"

namespace tandem {

struct BackwardOptions {
  bool retain_graph = false;  // keep saved tensors for another backward
};

// Seeds d(loss)/d(loss) = 1; `loss` must have one element.
void backward(const Tensor& loss, const BackwardOptions& options = {});
// Seeds each root with its gradient (same shape as the root).
void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads,
              const BackwardOptions& options = {});

// Gradients of `outputs` with respect to `inputs` without touching .grad
// (undefined where an input is unreachable): torch.autograd.grad. Not named
// grad: grad(t) (autograd/node.h) reads one tensor's accumulated gradient.
std::vector<Tensor> gradients(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                              const std::vector<Tensor>& grad_outputs = {},
                              const BackwardOptions& options = {});

// Adds `g` into `acc` (either may be undefined); sums g over broadcast dims
// when its shape is wider than `shape`.
Tensor accumulate(const Tensor& acc, const Tensor& g);

}  // namespace tandem
