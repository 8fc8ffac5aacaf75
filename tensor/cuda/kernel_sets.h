// The two sets of CUDA kernels (Note [Two kernel compilations] in
// tensor/cuda/cuda_common.cuh): cuda_kernels::native from nvcc, ::emulated from the
// host compiler against the emulation header. tensor/cuda/backend.cpp
// forwards the tandem::cuda kernels of tensor/kernels.h to one of them.
#pragma once

#include "tandem/tensor/kernels.h"

namespace tandem::cuda_kernels::native {
TANDEM_KERNELS(TANDEM_KERNEL_DECLARE_CUDA)
}  // namespace tandem::cuda_kernels::native

namespace tandem::cuda_kernels::emulated {
TANDEM_KERNELS(TANDEM_KERNEL_DECLARE_CUDA)
}  // namespace tandem::cuda_kernels::emulated
