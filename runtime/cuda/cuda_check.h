// TANDEM_CUDA_CHECK: names the failing CUDA call and its error string.
// Included by files compiled with the CUDA toolkit (Note [CUDA stubs]) and by
// the emulated kernel compilation, whose emulation header supplies the CUDA
// names (Note [Two kernel compilations] in tensor/cuda/cuda_common.cuh).
#pragma once

#ifdef TANDEM_EMULATED_KERNELS
#include "tandem/runtime/cuda/emulator/kernel_api.h"
#else
#include <cuda_runtime_api.h>
#endif

#include "tandem/runtime/error.h"

#define TANDEM_CUDA_CHECK(expr)                                                   \
  do {                                                                            \
    cudaError_t tandem_err_ = (expr);                                             \
    TANDEM_CHECK(tandem_err_ == cudaSuccess, "[cuda] {} failed: {} ({})", #expr,  \
                 cudaGetErrorString(tandem_err_), static_cast<int>(tandem_err_)); \
  } while (0)
