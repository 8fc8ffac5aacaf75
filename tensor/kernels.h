// The kernel interface shared by tensor/cpu/ and tensor/cuda/.
//
// Front ends (tensor/ops_*.cpp) validate, allocate and then call the same
// function in namespace cpu (inside a closure enqueued on the CPU stream) or
// namespace cuda (which launches on the given cudaStream_t, passed as void*
// last, STYLE). Kernels trust their launcher: shapes agree, outputs are
// contiguous unless stated, dtypes are as documented per kernel.
#pragma once

#include <cstdint>

#include "tandem/tensor/dtype.h"
#include "tandem/tensor/shape.h"
#include "tandem/tensor/unary_ops.h"

namespace tandem {

class Tensor;

// A strided view of a tensor's elements, passed by value to kernels.
struct TensorArg {
  void* data = nullptr;
  DType dtype = DType::F32;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements
  int64_t numel = 1;
  bool contiguous = true;
};
TensorArg arg_of(const Tensor& t);
// `t` with its shape broadcast to `shape` (stride 0 on broadcast dims).
TensorArg broadcast_arg(const Tensor& t, const Shape& shape);

// One value per line of tensor/unary_ops.h, in its order.
#define TANDEM_UNARY_ENUM(E, ...) E,
enum class UnaryOp : uint8_t {
  TANDEM_UNARY_OPS(TANDEM_UNARY_ENUM) TANDEM_UNARY_KERNELS_ONLY(TANDEM_UNARY_ENUM)
};
#undef TANDEM_UNARY_ENUM
// The number of values of an enum with a table indexed by it (each table
// static_asserts its size against it). Not an enumerator, so that switches
// stay exhaustive without a default.
#define TANDEM_UNARY_ONE(...) +1
constexpr int kUnaryOpCount =
    0 TANDEM_UNARY_OPS(TANDEM_UNARY_ONE) TANDEM_UNARY_KERNELS_ONLY(TANDEM_UNARY_ONE);
#undef TANDEM_UNARY_ONE
enum class BinaryOp : uint8_t { Add, Sub, Mul, Div, Pow, Maximum, Minimum, Eq, Ne, Lt, Le, Gt, Ge };
constexpr int kBinaryOpCount = static_cast<int>(BinaryOp::Ge) + 1;  // as kUnaryOpCount
constexpr bool is_comparison(BinaryOp op) {
  return op >= BinaryOp::Eq;
}
enum class ReduceOp : uint8_t { Sum, Mean, Max, Min, Argmax, Argmin };
enum class RandomKind : uint8_t { Uniform, Normal };

// Row-major GEMM over a batch: C[b] = alpha * op(A[b]) @ op(B[b]) + beta * C[b],
// op(X) = X^T when trans_x. A, B, C share the dtype (f32, f64, bf16, f16).
struct GemmArgs {
  const void* a;
  const void* b;
  void* c;
  DType dtype;
  int64_t batch, m, n, k;
  int64_t lda, ldb, ldc;                 // leading dims (row strides) as stored
  int64_t stride_a, stride_b, stride_c;  // batch strides; 0 broadcasts
  bool trans_a, trans_b;
  float alpha = 1.0f, beta = 0.0f;
};

// One scaled dot-product attention call over BHSD layouts (the options of
// ops::scaled_dot_product_attention, resolved): query head h uses kv head
// h / (heads_q / heads_kv); with `causal`, query i sees keys j with
// k_offset + j <= q_offset + i.
struct AttentionArgs {
  int64_t batch = 0, heads_q = 0, heads_kv = 0, seq_q = 0, seq_k = 0, dim = 0;
  double scale = 1.0;
  bool causal = false;
  int64_t q_offset = 0, k_offset = 0;
  // Packed sequences (Note [Packed sequences] in tensor/ops.h): when set, query
  // row i of batch b sees keys [w[0], w[1]) with w = windows + 2 * (row * seq_q
  // + i), row = b or 0 (window_rows == 1), in memory of the kernel's device;
  // causal and the offsets are folded in. Each bound is non-decreasing in i.
  const int32_t* windows = nullptr;
  int64_t window_rows = 0;
};

// The kernels of every backend, one entry each: X(name, (parameters),
// (argument names)). Each backend namespace declares the same list (CUDA
// versions take the stream, a cudaStream_t, as their last argument), and
// tensor/cuda/backend.cpp and tensor/cuda/kernels_stub.cpp define theirs from
// it, so a new kernel is one entry here plus its implementations.
#define TANDEM_KERNELS(X)                                                                          \
  /* out = op(in); out contiguous with in's shape; same dtype */                                   \
  X(unary, (UnaryOp op, const TensorArg& in, const TensorArg& out), (op, in, out))                 \
  /* a, b broadcast to out's shape, dtype of a == b; out: that dtype or bool (comparisons) */      \
  X(binary, (BinaryOp op, const TensorArg& a, const TensorArg& b, const TensorArg& out),           \
    (op, a, b, out))                                                                               \
  /* out = op(a, s), or op(s, a) when scalar_first */                                              \
  X(binary_scalar,                                                                                 \
    (BinaryOp op, const TensorArg& a, double s, bool scalar_first, const TensorArg& out),          \
    (op, a, s, scalar_first, out))                                                                 \
  /* cond bool, a and b of out's dtype, all broadcast to out's shape */                            \
  X(where, (const TensorArg& cond, const TensorArg& a, const TensorArg& b, const TensorArg& out),  \
    (cond, a, b, out))                                                                             \
  /* out[...] = cast(in[...]); same shape, both may be strided, dtypes may differ */               \
  X(copy, (const TensorArg& in, const TensorArg& out), (in, out))                                  \
  X(fill, (const TensorArg& out, double value), (out, value))                                      \
  /* out may be strided */                                                                         \
  X(arange, (const TensorArg& out, double start, double step), (out, start, step))                 \
  X(random,                                                                                        \
    (const TensorArg& out, RandomKind kind, uint64_t seed, uint64_t offset, double a, double b),   \
    (out, kind, seed, offset, a, b))                                                               \
  /* in contiguous viewed as (outer, r, inner); out (outer, inner), i64 for arg ops */             \
  X(reduce,                                                                                        \
    (ReduceOp op, const TensorArg& in, int64_t outer, int64_t r, int64_t inner,                    \
     const TensorArg& out),                                                                        \
    (op, in, outer, r, inner, out))                                                                \
  /* softmax / log_softmax / cumsum along r of a contiguous (outer, r, inner) */                   \
  X(softmax,                                                                                       \
    (const TensorArg& in, int64_t outer, int64_t r, int64_t inner, bool log,                       \
     const TensorArg& out),                                                                        \
    (in, outer, r, inner, log, out))                                                               \
  X(cumsum, (const TensorArg& in, int64_t outer, int64_t r, int64_t inner, const TensorArg& out),  \
    (in, outer, r, inner, out))                                                                    \
  /* x (rows, d) contiguous; weight/bias (d) or data == nullptr; mean/rstd f32 (rows) */           \
  X(layer_norm,                                                                                    \
    (const TensorArg& x, const TensorArg& weight, const TensorArg& bias, double eps, int64_t rows, \
     int64_t d, const TensorArg& out, const TensorArg& mean, const TensorArg& rstd),               \
    (x, weight, bias, eps, rows, d, out, mean, rstd))                                              \
  X(rms_norm,                                                                                      \
    (const TensorArg& x, const TensorArg& weight, double eps, int64_t rows, int64_t d,             \
     const TensorArg& out, const TensorArg& rstd),                                                 \
    (x, weight, eps, rows, d, out, rstd))                                                          \
  /* gradients of layer_norm (mean.data != nullptr) or rms_norm (mean.data == nullptr) from the    \
   * saved f32 statistics: dy, x, dx (rows, d) contiguous in x's dtype; weight (d) or data ==      \
   * nullptr; dweight, dbias (d) in acc dtype (f64 for f64, else f32) or nullptr */                \
  X(norm_backward,                                                                                 \
    (const TensorArg& dy, const TensorArg& x, const TensorArg& weight, const TensorArg& mean,      \
     const TensorArg& rstd, int64_t rows, int64_t d, const TensorArg& dx,                          \
     const TensorArg& dweight, const TensorArg& dbias),                                            \
    (dy, x, weight, mean, rstd, rows, d, dx, dweight, dbias))                                      \
  /* out[i] = u_i < p ? 0 : in[i] / (1 - p), u_i = philox_uniform(offset, seed, i)                 \
   * (tensor/random.h; the comparison in f32 on every device); in, out contiguous of one floating  \
   * dtype; 0 < p < 1 */                                                                           \
  X(dropout,                                                                                       \
    (const TensorArg& in, double p, uint64_t seed, uint64_t offset, const TensorArg& out),         \
    (in, p, seed, offset, out))                                                                    \
  /* out = silu(a) * b; a, b, out contiguous of one shape and floating dtype */                    \
  X(swiglu, (const TensorArg& a, const TensorArg& b, const TensorArg& out), (a, b, out))           \
  /* da = g * b * silu'(a), db = g * silu(a); all contiguous of one shape and dtype */             \
  X(swiglu_backward,                                                                               \
    (const TensorArg& a, const TensorArg& b, const TensorArg& g, const TensorArg& da,              \
     const TensorArg& db),                                                                         \
    (a, b, g, da, db))                                                                             \
  /* the rotary embedding (Note [Fused rotary embedding] in tensor/cpu/elementwise.cpp): x, out    \
   * contiguous rows of D (the last dim; D even), row r at position (r / inner) % seq_len of the   \
   * (seq_len, D) contiguous cos and sin tables; one floating dtype; inverse turns back */         \
  X(rotary,                                                                                        \
    (const TensorArg& x, const TensorArg& cos, const TensorArg& sin, int64_t seq_len,              \
     int64_t inner, bool inverse, const TensorArg& out),                                           \
    (x, cos, sin, seq_len, inner, inverse, out))                                                   \
  /* q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D), out (B, Hq, Sq, D): f32 or f64, any strides with   \
   * unit stride along D; lse f32 (B, Hq, Sq) contiguous; Sq, Sk, D > 0 */                         \
  X(attention,                                                                                     \
    (const AttentionArgs& args, const TensorArg& q, const TensorArg& k, const TensorArg& v,        \
     const TensorArg& out, const TensorArg& lse),                                                  \
    (args, q, k, v, out, lse))                                                                     \
  /* as attention, plus dout like out; dq, dk, dv of q's, k's, v's shape, any strides with unit    \
   * stride along D; lse may come from a larger computation (ring attention) */                    \
  X(attention_backward,                                                                            \
    (const AttentionArgs& args, const TensorArg& q, const TensorArg& k, const TensorArg& v,        \
     const TensorArg& out, const TensorArg& lse, const TensorArg& dout, const TensorArg& dq,       \
     const TensorArg& dk, const TensorArg& dv),                                                    \
    (args, q, k, v, out, lse, dout, dq, dk, dv))                                                   \
  X(gemm, (const GemmArgs& args), (args))                                                          \
  /* in (outer, n, inner) contiguous, index i64 (k) in [0, n); out (outer, k, inner) */            \
  X(index_select,                                                                                  \
    (const TensorArg& in, int64_t outer, int64_t n, int64_t inner, const TensorArg& index,         \
     const TensorArg& out),                                                                        \
    (in, outer, n, inner, index, out))                                                             \
  /* in (outer, n, inner), index i64 (outer, k, inner), out (outer, k, inner): contiguous */       \
  X(gather,                                                                                        \
    (const TensorArg& in, int64_t outer, int64_t n, int64_t inner, const TensorArg& index,         \
     int64_t k, const TensorArg& out),                                                             \
    (in, outer, n, inner, index, k, out))                                                          \
  /* out (outer, n, inner) += src (outer, k, inner) at index (outer, k, inner) */                  \
  X(scatter_add,                                                                                   \
    (const TensorArg& out, int64_t outer, int64_t n, int64_t inner, const TensorArg& index,        \
     int64_t k, const TensorArg& src),                                                             \
    (out, outer, n, inner, index, k, src))                                                         \
  /* rows x n contiguous; values (rows, k) in in's dtype, indices i64; sorted; ties: low index */  \
  X(topk,                                                                                          \
    (const TensorArg& in, int64_t rows, int64_t n, int64_t k, bool largest,                        \
     const TensorArg& values, const TensorArg& indices),                                           \
    (in, rows, n, k, largest, values, indices))                                                    \
  X(argsort,                                                                                       \
    (const TensorArg& in, int64_t rows, int64_t n, bool descending, const TensorArg& indices),     \
    (in, rows, n, descending, indices))                                                            \
  /* indices i64 (n) in [0, classes); out i64 (n, classes) */                                      \
  X(one_hot, (const TensorArg& indices, int64_t n, int64_t classes, const TensorArg& out),         \
    (indices, n, classes, out))

#define TANDEM_KERNEL_EXPAND(...) __VA_ARGS__
#define TANDEM_KERNEL_DECLARE_CPU(name, params, args) void name(TANDEM_KERNEL_EXPAND params);
#define TANDEM_KERNEL_DECLARE_CUDA(name, params, args) \
  void name(TANDEM_KERNEL_EXPAND params, void* stream);

namespace cpu {
TANDEM_KERNELS(TANDEM_KERNEL_DECLARE_CPU)
}  // namespace cpu

namespace cuda {
TANDEM_KERNELS(TANDEM_KERNEL_DECLARE_CUDA)
}  // namespace cuda

}  // namespace tandem
