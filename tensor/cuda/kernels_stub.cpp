// Compiled instead of a kernel set that is not built (Note [CUDA stubs] in
// runtime/cuda/cuda_api.h, Note [Two kernel compilations]): every kernel
// throws. cuda_kernels::native without nvcc; cuda_kernels::emulated (through
// tensor/cuda/emulated/kernels_stub.cpp) with -Dgpu_emulator=disabled. No
// tensor can live on a device whose backend is absent (Device::cuda fails
// first), so these are reached only through a front end that skipped its
// device check.
#include "tandem/runtime/error.h"
#include "tandem/tensor/cuda/kernel_sets.h"

#ifndef TANDEM_KERNEL_SET
#define TANDEM_KERNEL_SET cuda_kernels::native
#endif

namespace tandem::TANDEM_KERNEL_SET {
namespace {
[[noreturn]] void no_cuda(const char* kernel) {
  TANDEM_FAIL("[cuda::{}] expected a CUDA build, got a build without CUDA", kernel);
}
}  // namespace

void unary(UnaryOp, const TensorArg&, const TensorArg&, void*) {
  no_cuda("unary");
}
void binary(BinaryOp, const TensorArg&, const TensorArg&, const TensorArg&, void*) {
  no_cuda("binary");
}
void binary_scalar(BinaryOp, const TensorArg&, double, bool, const TensorArg&, void*) {
  no_cuda("binary_scalar");
}
void where(const TensorArg&, const TensorArg&, const TensorArg&, const TensorArg&, void*) {
  no_cuda("where");
}
void copy(const TensorArg&, const TensorArg&, void*) {
  no_cuda("copy");
}
void fill(const TensorArg&, double, void*) {
  no_cuda("fill");
}
void arange(const TensorArg&, double, double, void*) {
  no_cuda("arange");
}
void random(const TensorArg&, RandomKind, uint64_t, uint64_t, double, double, void*) {
  no_cuda("random");
}
void dropout(const TensorArg&, double, uint64_t, uint64_t, const TensorArg&, void*) {
  no_cuda("dropout");
}
void reduce(ReduceOp, const TensorArg&, int64_t, int64_t, int64_t, const TensorArg&, void*) {
  no_cuda("reduce");
}
void softmax(const TensorArg&, int64_t, int64_t, int64_t, bool, const TensorArg&, void*) {
  no_cuda("softmax");
}
void cumsum(const TensorArg&, int64_t, int64_t, int64_t, const TensorArg&, void*) {
  no_cuda("cumsum");
}
void layer_norm(const TensorArg&, const TensorArg&, const TensorArg&, double, int64_t, int64_t,
                const TensorArg&, const TensorArg&, const TensorArg&, void*) {
  no_cuda("layer_norm");
}
void rms_norm(const TensorArg&, const TensorArg&, double, int64_t, int64_t, const TensorArg&,
              const TensorArg&, void*) {
  no_cuda("rms_norm");
}
void norm_backward(const TensorArg&, const TensorArg&, const TensorArg&, const TensorArg&,
                   const TensorArg&, int64_t, int64_t, const TensorArg&, const TensorArg&,
                   const TensorArg&, void*) {
  no_cuda("norm_backward");
}
void swiglu(const TensorArg&, const TensorArg&, const TensorArg&, void*) {
  no_cuda("swiglu");
}
void swiglu_backward(const TensorArg&, const TensorArg&, const TensorArg&, const TensorArg&,
                     const TensorArg&, void*) {
  no_cuda("swiglu_backward");
}
void attention(const AttentionArgs&, const TensorArg&, const TensorArg&, const TensorArg&,
               const TensorArg&, const TensorArg&, void*) {
  no_cuda("attention");
}
void attention_backward(const AttentionArgs&, const TensorArg&, const TensorArg&, const TensorArg&,
                        const TensorArg&, const TensorArg&, const TensorArg&, const TensorArg&,
                        const TensorArg&, const TensorArg&, void*) {
  no_cuda("attention_backward");
}
void gemm(const GemmArgs&, void*) {
  no_cuda("gemm");
}
void index_select(const TensorArg&, int64_t, int64_t, int64_t, const TensorArg&, const TensorArg&,
                  void*) {
  no_cuda("index_select");
}
void gather(const TensorArg&, int64_t, int64_t, int64_t, const TensorArg&, int64_t,
            const TensorArg&, void*) {
  no_cuda("gather");
}
void scatter_add(const TensorArg&, int64_t, int64_t, int64_t, const TensorArg&, int64_t,
                 const TensorArg&, void*) {
  no_cuda("scatter_add");
}
void topk(const TensorArg&, int64_t, int64_t, int64_t, bool, const TensorArg&, const TensorArg&,
          void*) {
  no_cuda("topk");
}
void argsort(const TensorArg&, int64_t, int64_t, bool, const TensorArg&, void*) {
  no_cuda("argsort");
}
void one_hot(const TensorArg&, int64_t, int64_t, const TensorArg&, void*) {
  no_cuda("one_hot");
}

}  // namespace tandem::TANDEM_KERNEL_SET
