// The tandem::cuda kernels of tensor/kernels.h: each forwards to the kernel set
// of the live CUDA backend (Note [Two kernel compilations] in
// tensor/cuda/cuda_common.cuh, Note [CUDA backends] in runtime/cuda/cuda_api.h):
// the emulated compilation when the device is emulated, nvcc's otherwise.
#include "tandem/runtime/cuda/cuda_api.h"
#include "tandem/tensor/cuda/kernel_sets.h"

namespace tandem::cuda {

#define TANDEM_KERNEL_FORWARD(call) \
  (cuda_api::emulated() ? cuda_kernels::emulated::call : cuda_kernels::native::call)

void unary(UnaryOp op, const TensorArg& in, const TensorArg& out, void* stream) {
  TANDEM_KERNEL_FORWARD(unary(op, in, out, stream));
}

void binary(BinaryOp op, const TensorArg& a, const TensorArg& b, const TensorArg& out,
            void* stream) {
  TANDEM_KERNEL_FORWARD(binary(op, a, b, out, stream));
}

void binary_scalar(BinaryOp op, const TensorArg& a, double s, bool scalar_first,
                   const TensorArg& out, void* stream) {
  TANDEM_KERNEL_FORWARD(binary_scalar(op, a, s, scalar_first, out, stream));
}

void where(const TensorArg& cond, const TensorArg& a, const TensorArg& b, const TensorArg& out,
           void* stream) {
  TANDEM_KERNEL_FORWARD(where(cond, a, b, out, stream));
}

void copy(const TensorArg& in, const TensorArg& out, void* stream) {
  TANDEM_KERNEL_FORWARD(copy(in, out, stream));
}

void fill(const TensorArg& out, double value, void* stream) {
  TANDEM_KERNEL_FORWARD(fill(out, value, stream));
}

void arange(const TensorArg& out, double start, double step, void* stream) {
  TANDEM_KERNEL_FORWARD(arange(out, start, step, stream));
}

void random(const TensorArg& out, RandomKind kind, uint64_t seed, uint64_t offset, double a,
            double b, void* stream) {
  TANDEM_KERNEL_FORWARD(random(out, kind, seed, offset, a, b, stream));
}

void reduce(ReduceOp op, const TensorArg& in, int64_t outer, int64_t r, int64_t inner,
            const TensorArg& out, void* stream) {
  TANDEM_KERNEL_FORWARD(reduce(op, in, outer, r, inner, out, stream));
}

void softmax(const TensorArg& in, int64_t outer, int64_t r, int64_t inner, bool log,
             const TensorArg& out, void* stream) {
  TANDEM_KERNEL_FORWARD(softmax(in, outer, r, inner, log, out, stream));
}

void cumsum(const TensorArg& in, int64_t outer, int64_t r, int64_t inner, const TensorArg& out,
            void* stream) {
  TANDEM_KERNEL_FORWARD(cumsum(in, outer, r, inner, out, stream));
}

void layer_norm(const TensorArg& x, const TensorArg& weight, const TensorArg& bias, double eps,
                int64_t rows, int64_t d, const TensorArg& out, const TensorArg& mean,
                const TensorArg& rstd, void* stream) {
  TANDEM_KERNEL_FORWARD(layer_norm(x, weight, bias, eps, rows, d, out, mean, rstd, stream));
}

void rms_norm(const TensorArg& x, const TensorArg& weight, double eps, int64_t rows, int64_t d,
              const TensorArg& out, const TensorArg& rstd, void* stream) {
  TANDEM_KERNEL_FORWARD(rms_norm(x, weight, eps, rows, d, out, rstd, stream));
}

void norm_backward(const TensorArg& dy, const TensorArg& x, const TensorArg& weight,
                   const TensorArg& mean, const TensorArg& rstd, int64_t rows, int64_t d,
                   const TensorArg& dx, const TensorArg& dweight, const TensorArg& dbias,
                   void* stream) {
  TANDEM_KERNEL_FORWARD(
      norm_backward(dy, x, weight, mean, rstd, rows, d, dx, dweight, dbias, stream));
}

void dropout(const TensorArg& in, double p, uint64_t seed, uint64_t offset, const TensorArg& out,
             void* stream) {
  TANDEM_KERNEL_FORWARD(dropout(in, p, seed, offset, out, stream));
}

void swiglu(const TensorArg& a, const TensorArg& b, const TensorArg& out, void* stream) {
  TANDEM_KERNEL_FORWARD(swiglu(a, b, out, stream));
}

void swiglu_backward(const TensorArg& a, const TensorArg& b, const TensorArg& g,
                     const TensorArg& da, const TensorArg& db, void* stream) {
  TANDEM_KERNEL_FORWARD(swiglu_backward(a, b, g, da, db, stream));
}

void attention(const AttentionArgs& args, const TensorArg& q, const TensorArg& k,
               const TensorArg& v, const TensorArg& out, const TensorArg& lse, void* stream) {
  TANDEM_KERNEL_FORWARD(attention(args, q, k, v, out, lse, stream));
}

void attention_backward(const AttentionArgs& args, const TensorArg& q, const TensorArg& k,
                        const TensorArg& v, const TensorArg& out, const TensorArg& lse,
                        const TensorArg& dout, const TensorArg& dq, const TensorArg& dk,
                        const TensorArg& dv, void* stream) {
  TANDEM_KERNEL_FORWARD(attention_backward(args, q, k, v, out, lse, dout, dq, dk, dv, stream));
}

void gemm(const GemmArgs& args, void* stream) {
  TANDEM_KERNEL_FORWARD(gemm(args, stream));
}

void index_select(const TensorArg& in, int64_t outer, int64_t n, int64_t inner,
                  const TensorArg& index, const TensorArg& out, void* stream) {
  TANDEM_KERNEL_FORWARD(index_select(in, outer, n, inner, index, out, stream));
}

void gather(const TensorArg& in, int64_t outer, int64_t n, int64_t inner, const TensorArg& index,
            int64_t k, const TensorArg& out, void* stream) {
  TANDEM_KERNEL_FORWARD(gather(in, outer, n, inner, index, k, out, stream));
}

void scatter_add(const TensorArg& out, int64_t outer, int64_t n, int64_t inner,
                 const TensorArg& index, int64_t k, const TensorArg& src, void* stream) {
  TANDEM_KERNEL_FORWARD(scatter_add(out, outer, n, inner, index, k, src, stream));
}

void topk(const TensorArg& in, int64_t rows, int64_t n, int64_t k, bool largest,
          const TensorArg& values, const TensorArg& indices, void* stream) {
  TANDEM_KERNEL_FORWARD(topk(in, rows, n, k, largest, values, indices, stream));
}

void argsort(const TensorArg& in, int64_t rows, int64_t n, bool descending,
             const TensorArg& indices, void* stream) {
  TANDEM_KERNEL_FORWARD(argsort(in, rows, n, descending, indices, stream));
}

void one_hot(const TensorArg& indices, int64_t n, int64_t classes, const TensorArg& out,
             void* stream) {
  TANDEM_KERNEL_FORWARD(one_hot(indices, n, classes, out, stream));
}

#undef TANDEM_KERNEL_FORWARD

}  // namespace tandem::cuda
