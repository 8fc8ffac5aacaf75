// The tandem::cuda kernels of tensor/kernels.h: each forwards to the kernel set
// of the live CUDA backend (Note [Two kernel compilations] in
// tensor/cuda/cuda_common.cuh, Note [CUDA backends] in runtime/cuda/cuda_api.h):
// the emulated compilation when the device is emulated, nvcc's otherwise.
#include "tandem/runtime/cuda/cuda_api.h"
#include "tandem/tensor/cuda/kernel_sets.h"

namespace tandem::cuda {

#define TANDEM_KERNEL_FORWARD(name, params, args)                      \
  void name(TANDEM_KERNEL_EXPAND params, void* stream) {               \
    if (cuda_api::emulated()) {                                        \
      cuda_kernels::emulated::name(TANDEM_KERNEL_EXPAND args, stream); \
    } else {                                                           \
      cuda_kernels::native::name(TANDEM_KERNEL_EXPAND args, stream);   \
    }                                                                  \
  }
TANDEM_KERNELS(TANDEM_KERNEL_FORWARD)
#undef TANDEM_KERNEL_FORWARD

}  // namespace tandem::cuda
