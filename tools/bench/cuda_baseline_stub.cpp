// Compiled instead of cuda_baseline.cpp when CUDA is not found: the GPU rows
// report the baseline as unavailable.
#include "tools/bench/cuda_baseline.h"

#include "tandem/runtime/error.h"

namespace tandem::bench {

std::string cublas_unavailable_reason() {
  return "unavailable: tandem-bench was built without CUDA (no cuBLAS baseline)";
}

struct CublasGemm::Impl {};

CublasGemm::CublasGemm(Tensor, Tensor, Tensor) {
  TANDEM_FAIL("[bench::cublas] expected a CUDA build, got a build without CUDA");
}

CublasGemm::~CublasGemm() = default;

void CublasGemm::run(int) {
  TANDEM_FAIL("[bench::cublas] expected a CUDA build, got a build without CUDA");
}

}  // namespace tandem::bench
