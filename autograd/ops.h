// Differentiable operations: the tensor layer's ops (tensor/ops.h) with the
// same names in namespace tandem, each recording a named backward node
// (Note [The tape]). This is the API models are written against:
//
//   Tensor h = relu(matmul(x, w1) + b1);
//   Tensor loss = cross_entropy(matmul(h, w2), targets);
//   backward(loss);
//
// Gradient conventions follow PyTorch: broadcasting is summed back, integer
// outputs (argmax, topk indices) carry no gradient, amax/amin split the
// gradient evenly between tied maxima.
//
// Note [Two op namespaces]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// tandem::ops:: (tensor/ops.h) computes and records nothing; tandem:: (this
// file) computes through ops:: and records the backward node. A model's
// forward uses tandem::; ops:: is for what no gradient flows through:
// optimizer updates, data, metrics, initialisation, and the bodies of
// Function::forward/backward and of backward nodes. An ops:: call on a tensor
// that requires grad, in grad mode, returns a tensor that does not: the
// gradient stops there without a word. Module::call catches the common case,
// a module whose forward saw a tensor requiring grad and returns none (Note
// [Dropped gradients] in autograd/module.cpp; on in builds with assertions,
// TANDEM_CHECK_GRADIENTS=1 elsewhere; autograd/module.h).
#pragma once

#include <utility>
#include <vector>

#include "tandem/autograd/engine.h"
#include "tandem/autograd/node.h"
#include "tandem/tensor/ops.h"

namespace tandem {

// Factories (re-exported; results do not require grad).
using ops::allclose;
using ops::arange;
using ops::empty_like;
using ops::equal;
using ops::from_vector;
using ops::full;
using ops::full_like;
using ops::ones;
using ops::ones_like;
using ops::rand;
using ops::randn;
using ops::scalar_tensor;
using ops::zeros;
using ops::zeros_like;

// ---- elementwise ----
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double s);
Tensor sub(const Tensor& a, double s);
Tensor rsub(const Tensor& a, double s);
Tensor mul(const Tensor& a, double s);
Tensor div(const Tensor& a, double s);
Tensor rdiv(const Tensor& a, double s);
Tensor pow(const Tensor& a, double exponent);
// The unary ops of tensor/unary_ops.h, each defined with its backward in
// autograd/functions/elementwise.cpp (Note [Adding a unary op]).
#define TANDEM_UNARY_DECLARE(E, name, linear) Tensor name(const Tensor& a);
TANDEM_UNARY_OPS(TANDEM_UNARY_DECLARE)
#undef TANDEM_UNARY_DECLARE
// approximate: Tanh (the default here, unlike PyTorch) or None (exact, erf);
// tensor/ops.h says why.
Tensor gelu(const Tensor& a, GeluApproximate approximate = GeluApproximate::Tanh);
// Dropout while `training` (x itself otherwise): ops::dropout with counters
// reserved from gen through draw_random, so a checkpointed block re-runs with
// the mask its forward used (Note [Random draws under checkpoint] in
// autograd/checkpoint.h). The backward applies the same mask and scale to the
// gradient; the node keeps only the counters, no tensor.
Tensor dropout(const Tensor& x, double p, bool training, Generator& gen);
// silu(a) * b as one fused op (the SwiGLU gate); a and b of one shape and dtype.
Tensor swiglu(const Tensor& a, const Tensor& b);
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
Tensor where(const Tensor& cond, const Tensor& a, double b);
using ops::eq;
using ops::ge;
using ops::gt;
using ops::le;
using ops::lt;
using ops::ne;

Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator+(const Tensor& a, double s);
Tensor operator-(const Tensor& a, double s);
Tensor operator*(const Tensor& a, double s);
Tensor operator/(const Tensor& a, double s);
Tensor operator*(double s, const Tensor& a);
Tensor operator+(double s, const Tensor& a);
Tensor operator-(double s, const Tensor& a);
Tensor operator-(const Tensor& a);

// ---- reductions ----
Tensor sum(const Tensor& t, const Dims& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& t, const Dims& dims = {}, bool keepdim = false);
Tensor amax(const Tensor& t, const Dims& dims = {}, bool keepdim = false);
Tensor amin(const Tensor& t, const Dims& dims = {}, bool keepdim = false);
std::pair<Tensor, Tensor> max(const Tensor& t, int64_t dim, bool keepdim = false);
using ops::argmax;
using ops::argmin;
using ops::argsort;
using ops::one_hot;
Tensor cumsum(const Tensor& t, int64_t dim);
Tensor softmax(const Tensor& t, int64_t dim = -1);
Tensor log_softmax(const Tensor& t, int64_t dim = -1);
// Sums `g` over broadcast dims down to `shape` (the adjoint of broadcasting).
Tensor sum_to(const Tensor& g, const Shape& shape);

// ---- views and copies ----
Tensor view(const Tensor& t, const Shape& shape);
Tensor reshape(const Tensor& t, const Shape& shape);
Tensor flatten(const Tensor& t, int64_t start_dim = 0, int64_t end_dim = -1);
Tensor permute(const Tensor& t, const Dims& dims);
Tensor transpose(const Tensor& t, int64_t dim0, int64_t dim1);
Tensor narrow(const Tensor& t, int64_t dim, int64_t start, int64_t length);
Tensor slice(const Tensor& t, int64_t dim, int64_t start, int64_t end, int64_t step = 1);
Tensor select(const Tensor& t, int64_t dim, int64_t index);
Tensor expand(const Tensor& t, const Shape& shape);
Tensor squeeze(const Tensor& t);
Tensor squeeze(const Tensor& t, int64_t dim);
Tensor unsqueeze(const Tensor& t, int64_t dim);
std::vector<Tensor> split(const Tensor& t, int64_t split_size, int64_t dim = 0);
std::vector<Tensor> split_sizes(const Tensor& t, const std::vector<int64_t>& sizes,
                                int64_t dim = 0);
std::vector<Tensor> chunk(const Tensor& t, int64_t chunks, int64_t dim = 0);
Tensor contiguous(const Tensor& t);
Tensor clone(const Tensor& t);
Tensor to(const Tensor& t, DType dtype);
Tensor to(const Tensor& t, Device device);
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim = 0);
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim = 0);

// ---- linear algebra, normalisation, indexing ----
Tensor matmul(const Tensor& a, const Tensor& b);
// x @ w^T (+ b): w is (out, in) as in torch.nn.Linear.
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b = Tensor());
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-6);
Tensor embedding(const Tensor& weight, const Tensor& indices);
Tensor index_select(const Tensor& t, int64_t dim, const Tensor& index);
Tensor gather(const Tensor& t, int64_t dim, const Tensor& index);
Tensor scatter_add(const Tensor& t, int64_t dim, const Tensor& index, const Tensor& src);
std::pair<Tensor, Tensor> topk(const Tensor& t, int64_t k, int64_t dim = -1, bool largest = true);

// ---- losses and attention ----
// PyTorch's semantics (reduction, label_smoothing, ignore_index), except
// that a mean over targets that are all ignored is 0 rather than NaN: see
// ops::cross_entropy in tensor/ops.h.
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index = -100);
Tensor cross_entropy(const Tensor& logits, const Tensor& targets,
                     const CrossEntropyOptions& options);
// Differentiable in q, k, v (the lse output is not). Rows that see no key
// give 0 and zero gradients, not PyTorch's NaN (tensor/ops.h says why).
AttentionResult scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const AttentionOptions& options = {});

// The gradients (dq, dk, dv) of attention from its inputs, output, log-sum-exp
// and output gradient (BHSD layouts; not differentiable). `lse` may come from
// a larger computation (ring attention passes the final one for each block):
// P = exp(S - lse) is recomputed from it, rows with lse = -inf get P = 0.
std::vector<Tensor> attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& out, const Tensor& lse, const Tensor& dout,
                                       const AttentionOptions& options);

}  // namespace tandem
