// CUDA batched GEMM through cuBLAS (tensor/kernels.h: GemmArgs).
//
// cuBLAS is column-major; a row-major matrix with row stride ld is the
// column-major transpose with the same ld. So the row-major product
// C = op(A) op(B) is computed as the column-major C^T = op(B)^T op(A)^T: swap
// the operands (and m with n) and keep each operand's transpose flag.
// 16-bit inputs accumulate in f32 (CUBLAS_COMPUTE_32F); f32 stays in full f32
// (no TF32) so results match the CPU to f32 rounding. A batch stride of 0
// broadcasts that operand over the batch.
//
// Handles: one cublasHandle_t per (device, thread), created on first use and
// destroyed when the thread exits. A handle is not safe to share between
// threads that set different streams on it; per-thread handles need no lock.
#include <cublas_v2.h>

#include <climits>
#include <memory>
#include <unordered_map>

#include "tandem/tensor/cuda/cuda_common.cuh"
#include "tandem/tensor/cuda/gemm_shape.h"

#define TANDEM_CUBLAS_CHECK(expr)                                                                 \
  do {                                                                                            \
    cublasStatus_t tandem_status_ = (expr);                                                       \
    TANDEM_CHECK(tandem_status_ == CUBLAS_STATUS_SUCCESS, "[cuda::gemm] {} failed: {} ({})",      \
                 #expr, cublasGetStatusString(tandem_status_), static_cast<int>(tandem_status_)); \
  } while (0)

namespace tandem::TANDEM_KERNEL_SET {
namespace {

// RAII owner of one cuBLAS handle (STYLE: every native handle is an RAII type).
class CublasHandle {
 public:
  CublasHandle() { TANDEM_CUBLAS_CHECK(cublasCreate(&handle_)); }
  ~CublasHandle() {
    if (handle_ != nullptr) (void)cublasDestroy(handle_);  // destructors never throw
  }
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  cublasHandle_t get() const { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
};

// The calling thread's handle for `device` (which must be current).
cublasHandle_t handle_for(int device) {
  thread_local std::unordered_map<int, std::unique_ptr<CublasHandle>> handles;
  auto& slot = handles[device];
  if (!slot) slot = std::make_unique<CublasHandle>();
  return slot->get();
}

using gemm_shape::checked_int;
using gemm_shape::leading_dim;

struct TypeConfig {
  cudaDataType_t data;
  cublasComputeType_t compute;
};

TypeConfig type_config(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return {CUDA_R_32F, CUBLAS_COMPUTE_32F};
    case DType::F64:
      return {CUDA_R_64F, CUBLAS_COMPUTE_64F};
    case DType::BF16:
      return {CUDA_R_16BF, CUBLAS_COMPUTE_32F};
    case DType::F16:
      return {CUDA_R_16F, CUBLAS_COMPUTE_32F};
    default:
      break;
  }
  TANDEM_FAIL("[cuda::gemm] expected a floating dtype (f32, f64, bf16, f16), got {}",
              dtype_name(dtype));
}

}  // namespace

void gemm(const GemmArgs& args, void* stream) {
  if (args.batch == 0 || args.m == 0 || args.n == 0) return;
  detail::StreamDeviceGuard guard(stream);
  cublasHandle_t handle = handle_for(guard.device());
  TANDEM_CUBLAS_CHECK(cublasSetStream(handle, detail::native(stream)));

  TypeConfig types = type_config(args.dtype);
  // Stored row-major shapes: A is (m, k), or (k, m) when trans_a; B likewise.
  int64_t a_rows = args.trans_a ? args.k : args.m, a_cols = args.trans_a ? args.m : args.k;
  int64_t b_rows = args.trans_b ? args.n : args.k, b_cols = args.trans_b ? args.k : args.n;
  int64_t lda = leading_dim(args.lda, a_rows, a_cols);
  int64_t ldb = leading_dim(args.ldb, b_rows, b_cols);
  int64_t ldc = leading_dim(args.ldc, args.m, args.n);

  // Scalars in the compute type: double for f64, float otherwise.
  double alpha64 = args.alpha, beta64 = args.beta;
  const void* alpha = &args.alpha;
  const void* beta = &args.beta;
  if (args.dtype == DType::F64) {
    alpha = &alpha64;
    beta = &beta64;
  }
  TANDEM_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      handle, args.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, args.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
      checked_int(args.n, "n"), checked_int(args.m, "m"), checked_int(args.k, "k"), alpha, args.b,
      types.data, checked_int(ldb, "ldb"), args.stride_b, args.a, types.data,
      checked_int(lda, "lda"), args.stride_a, beta, args.c, types.data, checked_int(ldc, "ldc"),
      args.stride_c, checked_int(args.batch, "batch"), types.compute, CUBLAS_GEMM_DEFAULT));
}

}  // namespace tandem::TANDEM_KERNEL_SET
