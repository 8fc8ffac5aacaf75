// The unary elementwise ops, one line each: the table that tensor/kernels.h
// (the UnaryOp enum and its count), tensor/ops.h and tensor/ops_elementwise.cpp
// (tandem::ops), autograd/ops.h (tandem::, differentiable) and
// parallel/dtensor_ops.h (DTensors) expand.
//
// Note [Adding a unary op]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A new op `foo` is one line here, X(Foo, foo, linear), and then:
//   - its case in tensor/cpu/elementwise.cpp and in tensor/cuda/elementwise.cu
//     (both switches name every op without a default, and -Werror=switch
//     makes a missing case a compile error; the emulated CUDA device
//     compiles the same .cu as host C++);
//   - its differentiable form, `Tensor foo(const Tensor&)` with its backward,
//     in autograd/functions/elementwise.cpp (declared from this table, and
//     called by the DTensor foo: a missing definition fails the link of the
//     parallel test suite);
//   - a forward test and a gradient test.
// tandem::ops::foo, tandem::foo's declaration and the DTensor foo come from
// this table. `linear` says f(a + b) = f(a) + f(b), so that a Partial (sum)
// DTensor stays Partial through it; any other op redistributes a Partial
// input to Replicate first.
//
// X(Enum, name, linear)
#pragma once

#define TANDEM_UNARY_OPS(X)  \
  X(Neg, neg, true)          \
  X(Exp, exp, false)         \
  X(Log, log, false)         \
  X(Sqrt, sqrt, false)       \
  X(Rsqrt, rsqrt, false)     \
  X(Abs, abs, false)         \
  X(Tanh, tanh, false)       \
  X(Sigmoid, sigmoid, false) \
  X(Relu, relu, false)       \
  X(Silu, silu, false)       \
  X(Erf, erf, false)         \
  X(Softplus, softplus, false)

// Kernels whose public op takes more arguments, written by hand: the two
// forms of gelu(a, approximate). Gelu is the tanh approximation, GeluErf the
// exact 0.5 x (1 + erf(x / sqrt 2)). X(Enum, kernel name)
#define TANDEM_UNARY_KERNELS_ONLY(X) \
  X(Gelu, gelu)                      \
  X(GeluErf, gelu_erf)
