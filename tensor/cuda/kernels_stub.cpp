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

#define TANDEM_KERNEL_STUB(name, params, args)           \
  void name(TANDEM_KERNEL_EXPAND params, void* stream) { \
    no_cuda(#name);                                      \
  }
TANDEM_KERNELS(TANDEM_KERNEL_STUB)
#undef TANDEM_KERNEL_STUB

}  // namespace tandem::TANDEM_KERNEL_SET
