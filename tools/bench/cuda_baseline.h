// cuBLAS called directly: the baseline of the GPU matmul rows of
// `tandem-bench tensor`. Meson compiles cuda_baseline.cpp when CUDA is found
// and cuda_baseline_stub.cpp otherwise (the same split as Note [CUDA stubs]).
#pragma once

#include <memory>
#include <string>

#include "tandem/tensor/tensor.h"

namespace tandem::bench {

// Empty when the cuBLAS baseline can run in this build; otherwise why not.
std::string cublas_unavailable_reason();

// c = a · b for square, contiguous CUDA tensors of one dtype (f32 through
// cublasSgemm, bf16 through cublasGemmEx with f32 accumulation), on the
// calling thread's current stream of their device, so it is ordered with
// tandem's own work on the same tensors. The tensors are kept alive by this
// object.
class CublasGemm {
 public:
  CublasGemm(Tensor a, Tensor b, Tensor c);
  ~CublasGemm();
  CublasGemm(const CublasGemm&) = delete;
  CublasGemm& operator=(const CublasGemm&) = delete;

  // Enqueues `reps` GEMMs, then the host waits for them.
  void run(int reps);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::bench
