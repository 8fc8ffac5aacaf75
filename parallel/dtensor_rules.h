// What the DTensor op rules share (dtensor_ops.cpp, dtensor_matmul.cpp): the
// fallback redistribution of a combination without a rule and the gradient
// wrapping of Note [Redistribute gradients]. Private to parallel/; not
// installed.
#pragma once

#include <cstdint>

#include "tandem/parallel/dtensor.h"

namespace tandem::dtensor_detail {

void check_same_mesh(const DTensor& a, const DTensor& b, const char* op);

// Redistributes mesh dim m of x to `p` (logging the fallback).
DTensor move(const DTensor& x, int m, const Placement& p, const char* op);

// Wraps inputs that are Replicate on a mesh dim where the output is not (their
// local gradients are partial there; Note [Redistribute gradients]).
Tensor with_f(const DTensor& in, const Placements& out);

// Output dim of input dim d of an operand of rank r broadcast to rank n.
inline int64_t out_dim(int64_t d, int r, int n) {
  return d + (n - r);
}

}  // namespace tandem::dtensor_detail
