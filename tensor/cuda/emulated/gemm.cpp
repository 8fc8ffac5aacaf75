// The emulated device's GEMM (tensor/kernels.h: GemmArgs) on OpenBLAS, in place
// of gemm.cu's cuBLAS call (Note [Two kernel compilations]). Row-major cblas
// takes the row-major contract directly. As with cuBLAS's CUBLAS_COMPUTE_32F,
// 16-bit operands are multiplied in f32 (widened per batch into f32 buffers)
// and the result rounded once to 16 bits. Runs in stream order on the
// emulated stream.
#include <cblas.h>

#include <algorithm>
#include <climits>
#include <vector>

#include "tandem/runtime/cuda/emulator/kernel_api.h"
#include "tandem/runtime/error.h"
#include "tandem/tensor/cuda/gemm_shape.h"
#include "tandem/tensor/cuda/kernel_sets.h"
#include "tandem/tensor/half.h"

namespace tandem::cuda_kernels::emulated {
namespace {

using gemm_shape::checked_int;
using gemm_shape::leading_dim;

// A (rows, cols) matrix with row stride ld, widened into a dense f32 copy.
template <class H>
std::vector<float> widen(const H* x, int64_t rows, int64_t cols, int64_t ld) {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      out[r * cols + c] = static_cast<float>(x[r * ld + c]);
  return out;
}

template <class H>
void gemm_16bit(const GemmArgs& g) {
  const int64_t a_rows = g.trans_a ? g.k : g.m, a_cols = g.trans_a ? g.m : g.k;
  const int64_t b_rows = g.trans_b ? g.n : g.k, b_cols = g.trans_b ? g.k : g.n;
  const auto ta = g.trans_a ? CblasTrans : CblasNoTrans;
  const auto tb = g.trans_b ? CblasTrans : CblasNoTrans;
  for (int64_t batch = 0; batch < g.batch; ++batch) {
    const H* a = static_cast<const H*>(g.a) + batch * g.stride_a;
    const H* b = static_cast<const H*>(g.b) + batch * g.stride_b;
    H* c = static_cast<H*>(g.c) + batch * g.stride_c;
    std::vector<float> a32 = widen(a, a_rows, a_cols, g.lda);
    std::vector<float> b32 = widen(b, b_rows, b_cols, g.ldb);
    std::vector<float> c32 = g.beta != 0.0f ? widen(c, g.m, g.n, g.ldc)
                                            : std::vector<float>(static_cast<size_t>(g.m * g.n));
    cblas_sgemm(CblasRowMajor, ta, tb, checked_int(g.m, "m"), checked_int(g.n, "n"),
                checked_int(g.k, "k"), g.alpha, a32.data(),
                checked_int(std::max<int64_t>(a_cols, 1), "lda"), b32.data(),
                checked_int(std::max<int64_t>(b_cols, 1), "ldb"), g.beta, c32.data(),
                checked_int(std::max<int64_t>(g.n, 1), "ldc"));
    for (int64_t r = 0; r < g.m; ++r)
      for (int64_t col = 0; col < g.n; ++col)
        c[r * g.ldc + col] = H(c32[r * g.n + col]);
  }
}

void run_gemm(const GemmArgs& g) {
  const int64_t a_rows = g.trans_a ? g.k : g.m, a_cols = g.trans_a ? g.m : g.k;
  const int64_t b_rows = g.trans_b ? g.n : g.k, b_cols = g.trans_b ? g.k : g.n;
  const int lda = checked_int(leading_dim(g.lda, a_rows, a_cols), "lda");
  const int ldb = checked_int(leading_dim(g.ldb, b_rows, b_cols), "ldb");
  const int ldc = checked_int(leading_dim(g.ldc, g.m, g.n), "ldc");
  const int m = checked_int(g.m, "m"), n = checked_int(g.n, "n"), k = checked_int(g.k, "k");
  const auto ta = g.trans_a ? CblasTrans : CblasNoTrans;
  const auto tb = g.trans_b ? CblasTrans : CblasNoTrans;
  switch (g.dtype) {
    case DType::F32:
      for (int64_t i = 0; i < g.batch; ++i) {
        cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, g.alpha,
                    static_cast<const float*>(g.a) + i * g.stride_a, lda,
                    static_cast<const float*>(g.b) + i * g.stride_b, ldb, g.beta,
                    static_cast<float*>(g.c) + i * g.stride_c, ldc);
      }
      return;
    case DType::F64:
      for (int64_t i = 0; i < g.batch; ++i) {
        cblas_dgemm(CblasRowMajor, ta, tb, m, n, k, g.alpha,
                    static_cast<const double*>(g.a) + i * g.stride_a, lda,
                    static_cast<const double*>(g.b) + i * g.stride_b, ldb, g.beta,
                    static_cast<double*>(g.c) + i * g.stride_c, ldc);
      }
      return;
    case DType::BF16:
      return gemm_16bit<BFloat16>(g);
    case DType::F16:
      return gemm_16bit<Half>(g);
    default:
      break;
  }
  TANDEM_FAIL("[cuda::gemm] expected a floating dtype (f32, f64, bf16, f16), got {}",
              dtype_name(g.dtype));
}

}  // namespace

void gemm(const GemmArgs& args, void* stream) {
  if (args.batch == 0 || args.m == 0 || args.n == 0) return;
  TANDEM_CHECK(args.dtype == DType::F32 || args.dtype == DType::F64 || args.dtype == DType::BF16 ||
                   args.dtype == DType::F16,
               "[cuda::gemm] expected a floating dtype (f32, f64, bf16, f16), got {}",
               dtype_name(args.dtype));
  emu::enqueue_host(stream, [args] { run_gemm(args); });
}

}  // namespace tandem::cuda_kernels::emulated
