// CPU GEMM through Eigen, whose products are routed to OpenBLAS
// (EIGEN_USE_BLAS, set in tensor/meson.build). Eigen's own sgemm reaches only
// 55–65% of OpenBLAS on these machines (TOOLCHAIN.md). Row-major maps with an
// outer stride express transposed and strided operands without copies.
// 16-bit inputs are widened to f32, multiplied, and rounded on store.
#include <Eigen/Core>
#include <vector>

#include "tensor/kernels.h"

namespace tandem::cpu {
namespace {

template <class A>
using RowMat = Eigen::Matrix<A, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class A>
using ConstMap = Eigen::Map<const RowMat<A>, 0, Eigen::OuterStride<>>;
template <class A>
using MutMap = Eigen::Map<RowMat<A>, 0, Eigen::OuterStride<>>;

// One product C = alpha op(A) op(B) + beta C on arithmetic type A.
template <class A>
void gemm_one(const A* a, const A* b, A* c, const GemmArgs& g, int64_t lda, int64_t ldb,
              int64_t ldc) {
  ConstMap<A> ma(a, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, Eigen::OuterStride<>(lda));
  ConstMap<A> mb(b, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, Eigen::OuterStride<>(ldb));
  MutMap<A> mc(c, g.m, g.n, Eigen::OuterStride<>(ldc));
  const A alpha = static_cast<A>(g.alpha);
  if (g.beta == 0.0f) {
    mc.setZero();  // beta == 0 ignores C's old contents, even NaN (BLAS convention)
  } else if (g.beta != 1.0f) {
    mc *= static_cast<A>(g.beta);
  }
  if (g.k == 0) return;
  if (g.trans_a && g.trans_b) {
    mc.noalias() += alpha * ma.transpose() * mb.transpose();
  } else if (g.trans_a) {
    mc.noalias() += alpha * ma.transpose() * mb;
  } else if (g.trans_b) {
    mc.noalias() += alpha * ma * mb.transpose();
  } else {
    mc.noalias() += alpha * ma * mb;
  }
}

template <class T>
void widen(const T* src, float* dst, int64_t rows, int64_t cols, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c)
      dst[r * cols + c] = float(src[r * ld + c]);
  }
}

}  // namespace

void gemm(const GemmArgs& g) {
  if (g.m == 0 || g.n == 0) return;
  switch (g.dtype) {
    case DType::F32:
      for (int64_t i = 0; i < g.batch; ++i) {
        gemm_one<float>(static_cast<const float*>(g.a) + i * g.stride_a,
                        static_cast<const float*>(g.b) + i * g.stride_b,
                        static_cast<float*>(g.c) + i * g.stride_c, g, g.lda, g.ldb, g.ldc);
      }
      return;
    case DType::F64:
      for (int64_t i = 0; i < g.batch; ++i) {
        gemm_one<double>(static_cast<const double*>(g.a) + i * g.stride_a,
                         static_cast<const double*>(g.b) + i * g.stride_b,
                         static_cast<double*>(g.c) + i * g.stride_c, g, g.lda, g.ldb, g.ldc);
      }
      return;
    case DType::BF16:
    case DType::F16:
      dispatch_floating(g.dtype, "gemm", [&](auto tag) {
        using T = typename decltype(tag)::type;
        if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>) {
          const int64_t ar = g.trans_a ? g.k : g.m, ac = g.trans_a ? g.m : g.k;
          const int64_t br = g.trans_b ? g.n : g.k, bc = g.trans_b ? g.k : g.n;
          std::vector<float> fa(ar * ac), fb(br * bc), fc(g.m * g.n);
          for (int64_t i = 0; i < g.batch; ++i) {
            const T* a = static_cast<const T*>(g.a) + i * g.stride_a;
            const T* b = static_cast<const T*>(g.b) + i * g.stride_b;
            T* c = static_cast<T*>(g.c) + i * g.stride_c;
            widen(a, fa.data(), ar, ac, g.lda);
            widen(b, fb.data(), br, bc, g.ldb);
            if (g.beta != 0.0f) widen(c, fc.data(), g.m, g.n, g.ldc);
            gemm_one<float>(fa.data(), fb.data(), fc.data(), g, ac, bc, g.n);
            for (int64_t r = 0; r < g.m; ++r) {
              for (int64_t col = 0; col < g.n; ++col)
                c[r * g.ldc + col] = T(fc[r * g.n + col]);
            }
          }
        }
      });
      return;
    default:
      TANDEM_FAIL("[cpu::gemm] expected a floating dtype, got {}", dtype_name(g.dtype));
  }
}

}  // namespace tandem::cpu
