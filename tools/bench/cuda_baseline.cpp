// The cuBLAS baseline (tools/bench/cuda_baseline.h), compiled when CUDA is
// found. Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ, so cuBLAS gets the
// operands swapped and no transposes.
#include "tools/bench/cuda_baseline.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "tandem/runtime/cuda/cuda_check.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/stream.h"

#define TANDEM_CUBLAS_CHECK(expr)                                                                 \
  do {                                                                                            \
    cublasStatus_t tandem_status_ = (expr);                                                       \
    TANDEM_CHECK(tandem_status_ == CUBLAS_STATUS_SUCCESS, "[bench::cublas] {} failed: {} ({})",   \
                 #expr, cublasGetStatusString(tandem_status_), static_cast<int>(tandem_status_)); \
  } while (0)

namespace tandem::bench {

std::string cublas_unavailable_reason() {
  return {};
}

struct CublasGemm::Impl {
  Tensor a, b, c;
  Stream stream;
  cublasHandle_t handle = nullptr;

  ~Impl() {
    if (handle != nullptr) cublasDestroy(handle);  // destructors never throw
  }
};

CublasGemm::CublasGemm(Tensor a, Tensor b, Tensor c) : impl_(std::make_unique<Impl>()) {
  Device device = a.device();
  int64_t n = a.size(0);
  bool square = a.dim() == 2 && a.shape() == b.shape() && a.shape() == c.shape() && a.size(1) == n;
  TANDEM_CHECK(square && device.is_cuda() && b.device() == device && c.device() == device,
               "[bench::cublas] expected three square CUDA tensors of one shape, got {} {} {} on "
               "{} {} {}",
               a.shape(), b.shape(), c.shape(), a.device(), b.device(), c.device());
  TANDEM_CHECK(a.is_contiguous() && b.is_contiguous() && c.is_contiguous(),
               "[bench::cublas] expected contiguous tensors, got a non-contiguous operand");
  TANDEM_CHECK(a.dtype() == b.dtype() && a.dtype() == c.dtype() &&
                   (a.dtype() == DType::F32 || a.dtype() == DType::BF16),
               "[bench::cublas] expected f32 or bf16 operands of one dtype, got {} {} {}",
               dtype_name(a.dtype()), dtype_name(b.dtype()), dtype_name(c.dtype()));
  TANDEM_CUDA_CHECK(cudaSetDevice(device.index()));
  impl_->stream = current_stream(device);
  TANDEM_CUBLAS_CHECK(cublasCreate(&impl_->handle));
  TANDEM_CUBLAS_CHECK(
      cublasSetStream(impl_->handle, static_cast<cudaStream_t>(impl_->stream.native_handle())));
  impl_->a = std::move(a);
  impl_->b = std::move(b);
  impl_->c = std::move(c);
}

CublasGemm::~CublasGemm() = default;

void CublasGemm::run(int reps) {
  const Impl& p = *impl_;
  int n = static_cast<int>(p.a.size(0));
  const float alpha = 1.0f, beta = 0.0f;
  for (int i = 0; i < reps; ++i) {
    if (p.a.dtype() == DType::F32) {
      TANDEM_CUBLAS_CHECK(cublasSgemm(p.handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha,
                                      static_cast<const float*>(p.b.raw_data()), n,
                                      static_cast<const float*>(p.a.raw_data()), n, &beta,
                                      static_cast<float*>(p.c.raw_data()), n));
    } else {
      TANDEM_CUBLAS_CHECK(cublasGemmEx(p.handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha,
                                       p.b.raw_data(), CUDA_R_16BF, n, p.a.raw_data(), CUDA_R_16BF,
                                       n, &beta, p.c.raw_data(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                                       CUBLAS_GEMM_DEFAULT));
    }
  }
  p.stream.synchronize();
}

}  // namespace tandem::bench
