// Operations on DTensors (sharding propagation, DESIGN §6). Each computes on
// the local tensors and derives the output placements per mesh dim:
//
//   elementwise   Replicate∘Replicate → Replicate; Shard(d) with Shard(d), or
//                 with an operand broadcast along d → Shard(d); Partial ± Partial
//                 → Partial; Partial × Replicate (and ÷ Replicate) → Partial
//   unary         Shard/Replicate kept; Partial kept by neg and scalar mul/div
//   matmul        (…, M, K) @ (…, K, N): Shard of a batch dim or of M → that
//                 Shard; Shard(N) of b → Shard(-1); Shard(K) of both →
//                 Partial(sum); Partial with Replicate → Partial
//   sum / mean    over a sharded dim → Partial(sum); other Shards kept
//   softmax, norms over an unsharded last dim → placements kept
//   embedding     Replicate table → the indices' placement; Shard(1) table →
//                 Shard(-1); Shard(0) (vocab-parallel) → Partial(sum)
//   reshape/view  when a sharded dim survives as one output dim
//   transpose/permute  Shard dims follow the permutation
//
// A combination without a rule is first redistributed to Replicate on the
// offending mesh dims (logged at debug level: TANDEM_LOG_LEVEL=debug), never
// computed on wrongly laid-out data. Gradients follow Note [Redistribute
// gradients]: where an input is Replicate on a mesh dim but the output is not,
// the input's local gradient is partial and is all-reduced over that dim in
// backward (Megatron's "f").
#pragma once

#include <vector>

#include "tandem/parallel/dtensor.h"
#include "tandem/tensor/unary_ops.h"

namespace tandem {

DTensor add(const DTensor& a, const DTensor& b);
DTensor sub(const DTensor& a, const DTensor& b);
DTensor mul(const DTensor& a, const DTensor& b);
DTensor div(const DTensor& a, const DTensor& b);
DTensor mul(const DTensor& a, double s);
// Every unary op of tensor/unary_ops.h, from one template: a linear op keeps
// Partial placements, any other redistributes a Partial input first.
#define TANDEM_UNARY_DECLARE(E, name, linear) DTensor name(const DTensor& a);
TANDEM_UNARY_OPS(TANDEM_UNARY_DECLARE)
#undef TANDEM_UNARY_DECLARE
DTensor gelu(const DTensor& a);

DTensor matmul(const DTensor& a, const DTensor& b);
// x @ w^T (+ b), w of shape (out, in).
DTensor linear(const DTensor& x, const DTensor& w, const DTensor& b = DTensor());

DTensor sum(const DTensor& t, const Dims& dims = {}, bool keepdim = false);
DTensor mean(const DTensor& t, const Dims& dims = {}, bool keepdim = false);
DTensor softmax(const DTensor& t, int64_t dim = -1);
DTensor layer_norm(const DTensor& x, const DTensor& weight, const DTensor& bias, double eps = 1e-5);
DTensor rms_norm(const DTensor& x, const DTensor& weight, double eps = 1e-6);
DTensor embedding(const DTensor& weight, const DTensor& indices);

DTensor reshape(const DTensor& t, const Shape& shape);
DTensor view(const DTensor& t, const Shape& shape);
DTensor transpose(const DTensor& t, int64_t dim0, int64_t dim1);
DTensor permute(const DTensor& t, const Dims& dims);

// Identity in forward; all-reduces the gradient over `group` in backward
// (Megatron's "f"): for a replicated input consumed by sharded compute.
Tensor all_reduce_grad(const Tensor& x, const ProcessGroupPtr& group);

}  // namespace tandem
