// TANDEM_CUDA_CHECK: names the failing CUDA call and its error string.
// Included only by files compiled with the CUDA toolkit (Note [CUDA stubs]).
#pragma once

#include <cuda_runtime_api.h>

#include "runtime/error.h"

#define TANDEM_CUDA_CHECK(expr)                                                   \
  do {                                                                            \
    cudaError_t tandem_err_ = (expr);                                             \
    TANDEM_CHECK(tandem_err_ == cudaSuccess, "[cuda] {} failed: {} ({})", #expr,  \
                 cudaGetErrorString(tandem_err_), static_cast<int>(tandem_err_)); \
  } while (0)
