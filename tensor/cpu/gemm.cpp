// CPU GEMM: OpenBLAS (cblas) or, on AVX-512 builds, tandem's own f32 kernel;
// split into row or column panels over the CPU kernel threads.
//
// Note [CPU GEMM backend]
// ~~~~~~~~~~~~~~~~~~~~~~~
// OpenBLAS 0.3.21 (Debian bookworm) does not know AMD Zen 4/5 and runs its
// AVX2 Haswell kernel there, which leaves half of an AVX-512 core unused:
// 120-125 GFLOP/s on one Zen 5 core for the transformer block's shapes (1024
// tokens x 256..1024, every transpose combination). Eigen's own product,
// compiled with -march=native, reaches 165-175; the AVX-512 kernel below
// 215-255 (what OpenBLAS's SkylakeX kernel reaches when forced with
// OPENBLAS_CORETYPE). So f32 products use it when the build targets AVX-512
// (tensor/meson.build compiles the library with -march=native) and cblas_sgemm
// otherwise (on AVX2-only machines OpenBLAS is the fastest we have, TOOLCHAIN.md);
// f64 (gradchecks) always goes through cblas_dgemm.
//
// The kernel is the BLIS/GotoBLAS scheme for row-major C: for each block of
// kKC steps of k and kNC columns, B is packed into kNR-column micro-panels
// (kKC x kNC floats: 512 KiB, in L2); then for each kMR-row micro-panel of A
// (read in place, 12 KiB, stays in L1), a 12 x 32 register tile of C is
// computed per B micro-panel: each k step loads two B vectors, broadcasts 12
// A values and issues 24 FMAs into 24 of the 32 zmm registers. Partial tiles
// pack A's last rows into a zero-padded panel and store C through lane masks.
// k blocks after the first accumulate into C (alpha applies to each block).
//
// Threads (Note [CPU kernel threads]): the AVX-512 kernel packs each block of
// B once, the threads sharing the packing, and then hands out row tiles of C;
// every element of C is summed in the same order whichever thread computes
// it, so its products have the same bits at any thread count. Through BLAS, a
// product is split into panels of C rows (or columns, when C is wider than
// tall), each computed single-threaded by one chunk, whose blocking depends on
// the panel: the same bits at a given thread count. A batch is split by item.
//
// 16-bit inputs are widened to f32, multiplied, and rounded on store.
#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "tensor/cpu/parallel.h"
#include "tensor/kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tandem::cpu {
namespace {

// Below this many multiply-adds a product stays on one thread.
constexpr int64_t kParallelMacs = int64_t{1} << 18;

#if defined(__AVX512F__)
constexpr bool kOwnF32 = true;

constexpr int64_t kMR = 12, kNR = 32, kKC = 256, kNC = 512;

// Keeps GCC from re-reading `v` as a memory operand of every FMA that uses it.
#define TANDEM_IN_REGISTER(v) __asm__("" : "+v"(v))

// C[mr x nr] = alpha * A B + (load_c ? beta * C : 0) for one 12 x 32 tile:
// A(r, p) at a[r * lda + p] (kRowMajorA) or a[p * lda + r]; bp is a packed B
// micro-panel [kc][32].
template <bool kRowMajorA>
void micro_kernel(int64_t kc, const float* a, int64_t lda, const float* bp, float* c, int64_t ldc,
                  int64_t mr, int64_t nr, float alpha, float beta, bool load_c) {
  __m512 acc[kMR][2];
  for (int r = 0; r < kMR; ++r)
    acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kc; ++p) {
    __m512 b0 = _mm512_loadu_ps(bp + p * kNR), b1 = _mm512_loadu_ps(bp + p * kNR + 16);
    TANDEM_IN_REGISTER(b0);
    TANDEM_IN_REGISTER(b1);
#pragma GCC unroll 12
    for (int r = 0; r < kMR; ++r) {
      __m512 av = _mm512_set1_ps(kRowMajorA ? a[r * lda + p] : a[p * lda + r]);
      TANDEM_IN_REGISTER(av);
      acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
    }
  }
  const __mmask16 m0 = nr >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << nr) - 1);
  const __mmask16 m1 = nr >= 32   ? 0xFFFF
                       : nr <= 16 ? 0
                                  : static_cast<__mmask16>((1u << (nr - 16)) - 1);
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  for (int r = 0; r < kMR && r < mr; ++r) {
    float* cr = c + r * ldc;
    __m512 v0 = _mm512_mul_ps(acc[r][0], va), v1 = _mm512_mul_ps(acc[r][1], va);
    if (load_c) {
      v0 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m0, cr), v0);
      v1 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m1, cr + 16), v1);
    }
    _mm512_mask_storeu_ps(cr, m0, v0);
    _mm512_mask_storeu_ps(cr + 16, m1, v1);
  }
}

// Micro-panels [p0, p1) of B[pc:pc+kc, jc:jc+nc] (B(p, j) at b[p * ldb + j], or
// b[j * ldb + p] when trans), each [kc][kNR], zero-padded past nc.
void pack_b(const float* b, int64_t ldb, bool trans, int64_t pc, int64_t kc, int64_t jc, int64_t nc,
            int64_t p0, int64_t p1, float* dst) {
  for (int64_t panel = p0; panel < p1; ++panel) {
    const int64_t j0 = panel * kNR, nr = std::min(kNR, nc - j0);
    float* d = dst + panel * kc * kNR;
    if (!trans) {
      for (int64_t p = 0; p < kc; ++p) {
        const float* src = b + (pc + p) * ldb + jc + j0;
        std::memcpy(d + p * kNR, src, static_cast<size_t>(nr) * sizeof(float));
        std::fill(d + p * kNR + nr, d + (p + 1) * kNR, 0.0f);
      }
    } else {
      for (int64_t j = 0; j < kNR; ++j) {
        const float* src = b + (jc + j0 + j) * ldb + pc;
        for (int64_t p = 0; p < kc; ++p)
          d[p * kNR + j] = j < nr ? src[p] : 0.0f;
      }
    }
  }
}

// Row tiles [t0, t1) of C for one packed block of B (k steps [pc, pc+kc),
// columns [jc, jc+nc)).
void compute_tiles(const float* a, const float* bp, float* c, int64_t m, int64_t pc, int64_t kc,
                   int64_t jc, int64_t nc, const GemmArgs& g, int64_t lda, int64_t ldc, int64_t t0,
                   int64_t t1) {
  thread_local std::vector<float> a_buf(static_cast<size_t>(kKC * kMR));
  float* ap_pad = a_buf.data();
  const bool first = pc == 0;
  const bool load_c = !first || g.beta != 0.0f;
  const float beta = first ? g.beta : 1.0f;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t i0 = t * kMR, mr = std::min(kMR, m - i0);
    const float* ap = nullptr;
    int64_t alda = lda;
    bool row_major = false;
    if (mr == kMR) {
      row_major = !g.trans_a;
      ap = g.trans_a ? a + pc * lda + i0 : a + i0 * lda + pc;
    } else {  // the last rows: a zero-padded [kc][kMR] panel
      for (int64_t p = 0; p < kc; ++p) {
        for (int64_t r = 0; r < kMR; ++r) {
          ap_pad[p * kMR + r] =
              r >= mr ? 0.0f
                      : (g.trans_a ? a[(pc + p) * lda + i0 + r] : a[(i0 + r) * lda + pc + p]);
        }
      }
      ap = ap_pad;
      alda = kMR;
    }
    for (int64_t j0 = 0; j0 < nc; j0 += kNR) {
      const float* bpp = bp + (j0 / kNR) * kc * kNR;
      float* cc = c + i0 * ldc + jc + j0;
      const int64_t nr = std::min(kNR, nc - j0);
      if (row_major) {
        micro_kernel<true>(kc, ap, alda, bpp, cc, ldc, mr, nr, g.alpha, beta, load_c);
      } else {
        micro_kernel<false>(kc, ap, alda, bpp, cc, ldc, mr, nr, g.alpha, beta, load_c);
      }
    }
  }
}

// The AVX-512 product of Note [CPU GEMM backend] (k > 0): per block of B, the
// threads pack its micro-panels, then take row tiles of C.
void own_sgemm(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t k,
               const GemmArgs& g, int64_t lda, int64_t ldb, int64_t ldc) {
  thread_local std::vector<float> b_buf(static_cast<size_t>(kKC * kNC));
  float* bp = b_buf.data();  // the caller's; the workers read it within the call
  const int64_t tiles = (m + kMR - 1) / kMR;
  const int64_t tile_grain =
      std::max<int64_t>(1, kParallelMacs / (kMR * std::min(n, kNC) * std::min(k, kKC)));
  for (int64_t pc = 0; pc < k; pc += kKC) {
    const int64_t kc = std::min(kKC, k - pc);
    for (int64_t jc = 0; jc < n; jc += kNC) {
      const int64_t nc = std::min(kNC, n - jc);
      parallel_for((nc + kNR - 1) / kNR, 4, [&](int64_t p0, int64_t p1) {
        pack_b(b, ldb, g.trans_b, pc, kc, jc, nc, p0, p1, bp);
      });
      parallel_for(tiles, tile_grain, [&](int64_t t0, int64_t t1) {
        compute_tiles(a, bp, c, m, pc, kc, jc, nc, g, lda, ldc, t0, t1);
      });
    }
  }
}
#else
constexpr bool kOwnF32 = false;
constexpr int64_t kMR = 12, kNR = 32;
void own_sgemm(const float*, const float*, float*, int64_t, int64_t, int64_t, const GemmArgs&,
               int64_t, int64_t, int64_t) {}
#endif

template <class A>
void blas_gemm(const A* a, const A* b, A* c, int64_t m, int64_t n, int64_t k, const GemmArgs& g,
               int64_t lda, int64_t ldb, int64_t ldc) {
  const CBLAS_TRANSPOSE ta = g.trans_a ? CblasTrans : CblasNoTrans;
  const CBLAS_TRANSPOSE tb = g.trans_b ? CblasTrans : CblasNoTrans;
  // BLAS requires ld >= max(1, columns as stored) even when a dim is 1.
  lda = std::max<int64_t>({lda, g.trans_a ? m : k, 1});
  ldb = std::max<int64_t>({ldb, g.trans_b ? k : n, 1});
  ldc = std::max<int64_t>({ldc, n, 1});
  if constexpr (std::is_same_v<A, float>) {
    cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, g.alpha, a, lda, b, ldb, g.beta, c, ldc);
  } else {
    cblas_dgemm(CblasRowMajor, ta, tb, m, n, k, g.alpha, a, lda, b, ldb, g.beta, c, ldc);
  }
}

template <class A>
void gemm_block(const A* a, const A* b, A* c, int64_t m, int64_t n, int64_t k, const GemmArgs& g,
                int64_t lda, int64_t ldb, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // BLAS may skip the beta scaling for k == 0; do it here
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j)
        c[i * ldc + j] = g.beta == 0.0f ? A(0) : static_cast<A>(g.beta) * c[i * ldc + j];
    }
    return;
  }
  blas_gemm(a, b, c, m, n, k, g, lda, ldb, ldc);
}

// One product of the batch, split into panels of C over the kernel threads.
template <class A>
void gemm_one(const A* a, const A* b, A* c, const GemmArgs& g, int64_t lda, int64_t ldb,
              int64_t ldc) {
  const int64_t m = g.m, n = g.n, k = g.k;
  if constexpr (std::is_same_v<A, float>) {
    if (kOwnF32 && k > 0) return own_sgemm(a, b, c, m, n, k, g, lda, ldb, ldc);  // threads inside
  }
  const bool split_rows = m >= n;
  const int64_t extent = split_rows ? m : n;
  // Panels of whole register tiles (4 of them), so that only the last chunk
  // has a partial tile.
  const int64_t panel = 4 * (split_rows ? kMR : kNR);
  const int64_t panels = (extent + panel - 1) / panel;
  const int64_t macs_per_panel = std::max<int64_t>(1, panel * (split_rows ? n : m) * k);
  const int64_t grain = std::max<int64_t>(1, kParallelMacs / macs_per_panel);
  parallel_for(panels, grain, [&](int64_t p0, int64_t p1) {
    const int64_t lo = p0 * panel, hi = std::min(extent, p1 * panel);
    if (split_rows) {
      const A* a_part = g.trans_a ? a + lo : a + lo * lda;
      gemm_block(a_part, b, c + lo * ldc, hi - lo, n, k, g, lda, ldb, ldc);
    } else {
      const A* b_part = g.trans_b ? b + lo * ldb : b + lo;
      gemm_block(a, b_part, c + lo, m, hi - lo, k, g, lda, ldb, ldc);
    }
  });
}

template <class A>
void gemm_batch(const A* a, const A* b, A* c, const GemmArgs& g, int64_t lda, int64_t ldb,
                int64_t ldc) {
  if (g.batch == 1) return gemm_one(a, b, c, g, lda, ldb, ldc);
  // A batch splits by item; each item then runs on its chunk's thread alone.
  const int64_t grain = std::max<int64_t>(1, kParallelMacs / std::max<int64_t>(1, g.m * g.n * g.k));
  parallel_for(g.batch, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      gemm_one(a + i * g.stride_a, b + i * g.stride_b, c + i * g.stride_c, g, lda, ldb, ldc);
    }
  });
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
      return gemm_batch(static_cast<const float*>(g.a), static_cast<const float*>(g.b),
                        static_cast<float*>(g.c), g, g.lda, g.ldb, g.ldc);
    case DType::F64:
      return gemm_batch(static_cast<const double*>(g.a), static_cast<const double*>(g.b),
                        static_cast<double*>(g.c), g, g.lda, g.ldb, g.ldc);
    case DType::BF16:
    case DType::F16:
      dispatch_floating(g.dtype, "gemm", [&](auto tag) {
        using T = typename decltype(tag)::type;
        if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>) {
          const int64_t ar = g.trans_a ? g.k : g.m, ac = g.trans_a ? g.m : g.k;
          const int64_t br = g.trans_b ? g.n : g.k, bc = g.trans_b ? g.k : g.n;
          std::vector<float> fa(ar * ac), fb(br * bc), fc(g.m * g.n);
          GemmArgs one = g;
          one.batch = 1;
          for (int64_t i = 0; i < g.batch; ++i) {
            const T* a = static_cast<const T*>(g.a) + i * g.stride_a;
            const T* b = static_cast<const T*>(g.b) + i * g.stride_b;
            T* c = static_cast<T*>(g.c) + i * g.stride_c;
            widen(a, fa.data(), ar, ac, g.lda);
            widen(b, fb.data(), br, bc, g.ldb);
            if (g.beta != 0.0f) widen(c, fc.data(), g.m, g.n, g.ldc);
            gemm_one<float>(fa.data(), fb.data(), fc.data(), one, ac, bc, g.n);
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
