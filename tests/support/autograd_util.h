// Helpers shared by the autograd suites: leaves built from the standard
// library's random numbers, a gradcheck assertion that prints gradcheck's own
// message, bit-exact comparison of gradient lists, and a naive reference
// forward for the small MLPs the engine/checkpoint/pair tests train.
//
// Expected values stay independent of the code under test: references are
// naive loops over std::vector<double> (test_util.h) or finite differences.
#pragma once

#include <catch2/catch.hpp>

#include <functional>
#include <string>
#include <vector>

#include "tandem/autograd/gradcheck.h"
#include "tandem/autograd/ops.h"
#include "tests/support/test_util.h"

namespace tandem::test {

// A leaf that requires grad, filled with uniform values in [lo, hi).
inline Tensor leaf(const Shape& shape, uint32_t seed, DType dtype = DType::F64, double lo = -1.0,
                   double hi = 1.0) {
  Tensor t = random_tensor(shape, dtype, seed, lo, hi);
  set_requires_grad(t, true);
  return t;
}

// An i64 tensor holding `values` (indices, targets).
inline Tensor long_tensor(const std::vector<int64_t>& values, const Shape& shape) {
  return ops::from_vector<int64_t>(values, shape);
}

using GradFn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

// Runs gradcheck and CHECKs it passed, printing the worst element on failure.
inline void check_gradients(const std::string& what, const GradFn& fn,
                            const std::vector<Tensor>& inputs, const GradcheckOptions& options = {},
                            const std::vector<size_t>& no_grad_inputs = {}) {
  GradcheckResult r = gradcheck(fn, inputs, options, no_grad_inputs);
  INFO(what << ": " << r.message << " (max |error| " << r.max_abs_error << ")");
  CHECK(r.ok);
}

// The gradients of `tensors`, cloned (undefined where none).
inline std::vector<Tensor> grads_of(const std::vector<Tensor>& tensors) {
  std::vector<Tensor> out;
  for (const Tensor& t : tensors) {
    Tensor g = grad(t);
    out.push_back(g.defined() ? ops::clone(g) : Tensor());
  }
  return out;
}

// The gradients of sum(f(leaves) * up) with respect to fresh leaves holding
// `values`.
inline std::vector<Tensor> gradients(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                                     const std::vector<Tensor>& values, const Tensor& up) {
  std::vector<Tensor> leaves;
  for (const Tensor& v : values) {
    Tensor l = ops::clone(v);
    set_requires_grad(l, true);
    leaves.push_back(l);
  }
  backward(sum(mul(f(leaves), up)));
  return grads_of(leaves);
}

// True when both lists have defined, bit-identical tensors at every position.
inline bool all_equal(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!a[i].defined() || !b[i].defined() || !ops::equal(a[i], b[i])) return false;
  }
  return true;
}

}  // namespace tandem::test
