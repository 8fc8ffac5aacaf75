// gradcheck: compares autograd gradients with central finite differences in
// f64. The check projects the outputs on a fixed random direction r
// (L = sum(r * f(x))), so one backward gives dL/dx for every input element and
// each element costs two forward evaluations.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "tandem/tensor/tensor.h"

namespace tandem {

struct GradcheckOptions {
  double eps = 1e-6;
  double atol = 1e-5;
  double rtol = 1e-4;
  uint64_t seed = 1234;
};

struct GradcheckResult {
  bool ok = true;
  double max_abs_error = 0;
  std::string message;  // names the input and element with the worst error
};

// `inputs` are converted to f64 leaves that require grad; `fn` returns one or
// more outputs (all floating). Inputs listed in `no_grad_inputs` (by index)
// are passed through unchanged (e.g. integer indices).
GradcheckResult gradcheck(const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& fn,
                          const std::vector<Tensor>& inputs, const GradcheckOptions& options = {},
                          const std::vector<size_t>& no_grad_inputs = {});

}  // namespace tandem
