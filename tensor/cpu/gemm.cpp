// CPU GEMM: f32 products on tandem's own register-tiled kernel, f64 through
// OpenBLAS (cblas); split over the CPU kernel threads.
//
// Note [CPU GEMM backend]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Every f32 product (and every 16-bit product, widened to f32) runs on the
// kernel below, on every target: AVX-512, AVX2 and plain SSE2 builds differ
// only in the register tile (Note [SIMD width] in simd.h). One kernel
// everywhere is what makes the promise below hold on every CPU; routing AVX2
// builds to OpenBLAS, as this file once did, gave a batched product other bits
// than the same product alone, because OpenBLAS blocks by the shape of the
// panel it is handed. OpenBLAS 0.3.21 also does not know AMD Zen 4/5 and runs
// its AVX2 kernel there. f64 (gradchecks) goes through cblas_dgemm.
//
// The kernel is the BLIS/GotoBLAS scheme for row-major C: for each block of kKC
// steps of k, A is packed into kMR-row micro-panels (up to kMC rows at a time,
// packed once for every block of columns); for each block of kNC columns, B is
// packed into kNR-column micro-panels (kKC x kNC floats, meant to stay in L2);
// then for each micro-panel of A (kMR x kKC floats, stays in L1), a kMR x kNR
// register tile of C is computed per B micro-panel: each k step loads kNV B
// vectors, broadcasts kMR A values and issues kMR * kNV FMAs. The tile is the
// largest that leaves registers for the B vectors and one broadcast: 12 x 2 zmm
// (24 accumulators of 32 registers) on AVX-512, 6 x 2 ymm (12 of 16) on AVX2, 6
// x 2 xmm on SSE2. A's last rows are zero-padded in their panel, and the right
// edge of C goes through a row buffer. k blocks after the first accumulate into
// C (alpha applies to each block).
//
// The promise, on every target: every element of C is the sum over its k blocks
// in block order, each block's terms accumulated in k order into one lane,
// whichever thread computes its tile and whether the product is alone or an
// item of a batch. So an f32 product has the same bits at any thread count,
// batched or not (tests/tensor/test_matmul.cpp checks both). Threads (Note [CPU
// kernel threads]) take one piece of C each (Note [GEMM split over threads]);
// a batch is split by item. f64 products through BLAS are split
// into panels of C rows (or columns, when C is wider than tall), each computed
// single-threaded by one chunk whose blocking depends on the panel: the same
// bits at a given thread count, not across thread counts.
#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "tandem/tensor/cpu/parallel.h"
#include "tandem/tensor/cpu/simd.h"
#include "tandem/tensor/kernels.h"

namespace tandem::cpu {
namespace {

// Below this many multiply-adds a product stays on one thread.
constexpr int64_t kParallelMacs = int64_t{1} << 18;

using simd::VecF;
constexpr int64_t kW = simd::kWidth<float>;
// The register tile (Note [CPU GEMM backend]): kMR rows x kNV vectors.
constexpr int64_t kNV = 2;
constexpr int64_t kMR = simd::kVectorRegisters >= 32 ? 12 : 6;
constexpr int64_t kNR = kNV * kW;
static_assert(kMR * kNV + kNV + 1 <= simd::kVectorRegisters, "the tile must fit the registers");
constexpr int64_t kKC = 256;
constexpr int64_t kNC = simd::kVectorRegisters >= 32 ? 512 : 256;
// Rows of A packed at a time (kMC x kKC floats: 2 MiB at most). B is packed
// again for every block of rows, so a product is cut into blocks of equal
// size (in tiles): with 12-row tiles, 2052 rows are blocks of 1032 and 1020,
// not 2040 and a tile of 12 that repacks all of B for itself.
constexpr int64_t kMC = 2048 / kMR * kMR;

// Note [GEMM B prefetch]
// ~~~~~~~~~~~~~~~~~~~~~~
// Each micro-kernel call reads its B micro-panel (kKC x kNR floats) once per
// A tile, and the packed block of B (kKC x kNC) lives in L2, not L1. The
// hardware's L2-to-L1 prefetcher follows that stream late: on an Intel core
// with two 512-bit FMA ports the kernel waited on B often enough to leave FMA
// slots idle (the tensor matmul and llama-block rows of tandem-bench). So the
// kernel asks for B kBAhead steps ahead, one prefetch per cache line; the
// last panel's prefetches land in kBAhead rows of slack at the end of the
// buffer. The bits do not change.
constexpr int64_t kBAhead = 4;

// Keeps GCC from re-reading `v` as a memory operand of every FMA that uses it.
#define TANDEM_IN_REGISTER(v) __asm__("" : "+v"(v))

// Row r of a tile: out[0, nr) = alpha * acc (+ beta * out when load_c).
inline void store_row(const VecF* acc, float* out, int64_t nr, float alpha, float beta,
                      bool load_c) {
  const VecF va = simd::splat(alpha), vb = simd::splat(beta);
  if (nr == kNR) {
    for (int64_t v = 0; v < kNV; ++v) {
      VecF x = acc[v] * va;
      if (load_c) x = simd::fma(vb, simd::load(out + v * kW), x);
      simd::store(out + v * kW, x);
    }
    return;
  }
  alignas(64) float row[kNR] = {};  // the right edge: through a buffer
  if (load_c) std::memcpy(row, out, static_cast<size_t>(nr) * sizeof(float));
  for (int64_t v = 0; v < kNV; ++v) {
    VecF x = acc[v] * va;
    if (load_c) x = simd::fma(vb, simd::load(row + v * kW), x);
    simd::store(row + v * kW, x);
  }
  std::memcpy(out, row, static_cast<size_t>(nr) * sizeof(float));
}

// C[mr x nr] = alpha * A B + (load_c ? beta * C : 0) for one kMR x kNR tile:
// ap is a packed A micro-panel [kc][kMR] (or, kInPlace, kMR rows of A lda
// floats apart: Note [GEMM A in place]), bp a packed B micro-panel [kc][kNR].
// Never inlined: inside the packing loops of own_sgemm, GCC 12 no longer keeps
// the accumulator tile in registers on AVX2 builds and spills it every k step.
template <bool kInPlace>
__attribute__((noinline)) void micro_kernel(int64_t kc, const float* ap, int64_t lda,
                                            const float* bp, float* c, int64_t ldc, int64_t mr,
                                            int64_t nr, float alpha, float beta, bool load_c) {
  if (load_c) {  // C's rows are far apart: start their loads before the k loop
    for (int64_t r = 0; r < mr; ++r) {
      for (int64_t v = 0; v < kNR; v += 64 / static_cast<int64_t>(sizeof(float)))
        __builtin_prefetch(c + r * ldc + v, 1, 2);
    }
  }
  VecF acc[kMR][kNV];
  for (int64_t r = 0; r < kMR; ++r) {
    for (int64_t v = 0; v < kNV; ++v)
      acc[r][v] = VecF{};
  }
  for (int64_t p = 0; p < kc; ++p) {
    // The B micro-panel streams from L2 (a kKC x kNC block does not fit L1):
    // ask for its rows a few steps ahead, past its end into the next panel,
    // which the next call reads (Note [GEMM B prefetch]).
    for (int64_t v = 0; v < kNR; v += 64 / static_cast<int64_t>(sizeof(float)))
      __builtin_prefetch(bp + (p + kBAhead) * kNR + v, 0, 3);
    VecF b[kNV];
    for (int64_t v = 0; v < kNV; ++v) {
      b[v] = simd::load(bp + p * kNR + v * kW);
      TANDEM_IN_REGISTER(b[v]);
    }
#pragma GCC unroll 12
    for (int64_t r = 0; r < kMR; ++r) {
      VecF av = simd::splat(kInPlace ? ap[r * lda + p] : ap[p * kMR + r]);
      TANDEM_IN_REGISTER(av);
      for (int64_t v = 0; v < kNV; ++v)
        acc[r][v] = simd::fma(av, b[v], acc[r][v]);
    }
  }
  for (int64_t r = 0; r < mr; ++r)
    store_row(acc[r], c + r * ldc, nr, alpha, beta, load_c);
}

#if defined(__AVX__)
// x[0..8) = the columns of the 8 x 8 block whose rows are x[0..8).
inline void transpose8x8(__m256 (&x)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(x[i], x[i + 1]);      // rows i, i+1 interleaved: 0 1 | 4 5
    t[i + 1] = _mm256_unpackhi_ps(x[i], x[i + 1]);  // 2 3 | 6 7
  }
  for (int h = 0; h < 8; h += 4) {  // rows h..h+3: columns c and c+4 in the two lanes
    u[h] = _mm256_shuffle_ps(t[h], t[h + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {
    x[c] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x20);
    x[c + 4] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x31);
  }
}
#endif

// dst[p * ld_dst + r] = src[r * ld_src + p] for p < kc and r < rows, and 0 for
// rows <= r < panel_rows: rows of a matrix become the columns of a packed
// panel. Blocks of 8 rows x 8 steps (AVX) and of 4 x 4 go through registers:
// one 8 x 8 transpose is 8 loads, 24 shuffles and 8 stores for 64 floats,
// where element by element it is 64 loads and 64 stores. panel_rows is a
// multiple of 2 (kMR or kNR), and a last pair of rows goes through one unpack.
void transpose_into_panel(const float* src, int64_t ld_src, int64_t rows, int64_t panel_rows,
                          int64_t kc, float* dst, int64_t ld_dst) {
  int64_t p_vec = 0;
#if defined(__SSE2__)
  p_vec = kc / 4 * 4;
  auto row = [&](int64_t r, int64_t p) {
    return r < rows ? _mm_loadu_ps(src + r * ld_src + p) : _mm_setzero_ps();
  };
  // Rows r0..r0+3 at steps p..p+3.
  auto block4 = [&](int64_t r0, int64_t p) {
    __m128 x0 = row(r0, p), x1 = row(r0 + 1, p), x2 = row(r0 + 2, p), x3 = row(r0 + 3, p);
    _MM_TRANSPOSE4_PS(x0, x1, x2, x3);
    float* d = dst + p * ld_dst + r0;
    _mm_storeu_ps(d, x0);
    _mm_storeu_ps(d + ld_dst, x1);
    _mm_storeu_ps(d + 2 * ld_dst, x2);
    _mm_storeu_ps(d + 3 * ld_dst, x3);
  };
  int64_t r0 = 0;
#if defined(__AVX__)
  const int64_t p_vec8 = kc / 8 * 8;
  for (; r0 + 8 <= panel_rows; r0 += 8) {
    for (int64_t p = 0; p < p_vec8; p += 8) {
      __m256 x[8];
      for (int i = 0; i < 8; ++i)
        x[i] = r0 + i < rows ? _mm256_loadu_ps(src + (r0 + i) * ld_src + p) : _mm256_setzero_ps();
      transpose8x8(x);
      float* d = dst + p * ld_dst + r0;
      for (int i = 0; i < 8; ++i)
        _mm256_storeu_ps(d + i * ld_dst, x[i]);
    }
    for (int64_t p = p_vec8; p < p_vec; p += 4) {  // at most one block of 4 steps
      block4(r0, p);
      block4(r0 + 4, p);
    }
  }
#endif
  for (; r0 + 4 <= panel_rows; r0 += 4) {
    for (int64_t p = 0; p < p_vec; p += 4)
      block4(r0, p);
  }
  if (r0 < panel_rows) {  // two rows left
    for (int64_t p = 0; p < p_vec; p += 4) {
      const __m128 x0 = row(r0, p), x1 = row(r0 + 1, p);
      const __m128 lo = _mm_unpacklo_ps(x0, x1), hi = _mm_unpackhi_ps(x0, x1);
      float* d = dst + p * ld_dst + r0;
      _mm_storel_pi(reinterpret_cast<__m64*>(d), lo);
      _mm_storeh_pi(reinterpret_cast<__m64*>(d + ld_dst), lo);
      _mm_storel_pi(reinterpret_cast<__m64*>(d + 2 * ld_dst), hi);
      _mm_storeh_pi(reinterpret_cast<__m64*>(d + 3 * ld_dst), hi);
    }
  }
#endif
  for (int64_t p = p_vec; p < kc; ++p) {
    for (int64_t r = 0; r < panel_rows; ++r)
      dst[p * ld_dst + r] = r < rows ? src[r * ld_src + p] : 0.0f;
  }
}

// B[pc:pc+kc, jc:jc+nc] (B(p, j) at b[p * ldb + j], or b[j * ldb + p] when
// trans) as micro-panels of [kc][kNR], zero-padded past nc.
void pack_b(const float* b, int64_t ldb, bool trans, int64_t pc, int64_t kc, int64_t jc, int64_t nc,
            float* dst) {
  for (int64_t panel = 0; panel * kNR < nc; ++panel) {
    const int64_t j0 = panel * kNR, nr = std::min(kNR, nc - j0);
    float* d = dst + panel * kc * kNR;
    if (trans) {
      transpose_into_panel(b + (jc + j0) * ldb + pc, ldb, nr, kNR, kc, d, kNR);
    } else if (nr == kNR) {
      // Each k step is another row of B, usually another page, where the
      // hardware prefetchers do not follow: ask for the rows a few steps ahead.
      constexpr int64_t kAhead = 8;
      for (int64_t p = 0; p < kc; ++p) {
        const float* src = b + (pc + p) * ldb + jc + j0;
        if (p + kAhead < kc) {
          for (int64_t v = 0; v < kNR; v += 64 / static_cast<int64_t>(sizeof(float)))
            __builtin_prefetch(src + kAhead * ldb + v, 0, 3);
        }
        for (int64_t v = 0; v < kNV; ++v)
          simd::store(d + p * kNR + v * kW, simd::load(src + v * kW));
      }
    } else {
      for (int64_t p = 0; p < kc; ++p) {
        const float* src = b + (pc + p) * ldb + jc + j0;
        std::memcpy(d + p * kNR, src, static_cast<size_t>(nr) * sizeof(float));
        std::fill(d + p * kNR + nr, d + (p + 1) * kNR, 0.0f);
      }
    }
  }
}

// A's rows [i0, i0+mr) and k steps [pc, pc+kc) as a [kc][kMR] panel, zero
// past mr (Note [CPU GEMM backend]: packed so that the kernel reads it
// contiguously; in place, the rows of a matrix whose row stride is a multiple
// of 4 KiB fall into the same L1 sets and evict each other).
void pack_a(const float* a, int64_t lda, bool trans, int64_t i0, int64_t mr, int64_t pc, int64_t kc,
            float* dst) {
  if (!trans) return transpose_into_panel(a + i0 * lda + pc, lda, mr, kMR, kc, dst, kMR);
  // A(i, p) at a[p * lda + i]: each k step's rows are contiguous
  for (int64_t p = 0; p < kc; ++p) {
    const float* src = a + (pc + p) * lda + i0;
    if (mr == kMR) {  // a copy of known size: a few vector moves, not a call
      std::memcpy(dst + p * kMR, src, kMR * sizeof(float));
    } else {
      std::memcpy(dst + p * kMR, src, static_cast<size_t>(mr) * sizeof(float));
      std::fill(dst + p * kMR + mr, dst + (p + 1) * kMR, 0.0f);
    }
  }
}

// Note [GEMM A in place]
// ~~~~~~~~~~~~~~~~~~~~~~
// The micro-kernel reads one value of each of its kMR rows of A per k step and
// broadcasts it: that load costs the same whether the value comes from a
// packed panel or from the row-major matrix itself. Packing a row-major A is a
// transpose (Note [CPU GEMM backend]), a few percent of a product whose n is
// a few hundred (the k/v projections of a Llama layer, the input gradients).
// So full tiles of a row-major A are read in place, kMR row streams instead of
// one; a partial last tile is still packed (its zero rows), and so is a
// transposed A, whose in-place reads would walk one row of the stored matrix
// per k step. In place is only safe for the cache when the kMR rows do not
// pile into a few L1 sets: a row stride of 4 KiB puts every row in one set,
// where they evict each other and the B panel; rows_spread() asks for at most
// 3 rows per set (64 sets of 64 bytes, the L1 of current x86 cores). The
// arithmetic is the same FMAs in the same order: the bits do not change.
bool rows_spread(int64_t lda) {
  int per_set[64] = {};
  for (int64_t r = 0; r < kMR; ++r) {
    if (++per_set[(r * lda * int64_t{sizeof(float)} / 64) % 64] > 3) return false;
  }
  return true;
}

// Row tiles [t0, t1) of C for one packed block of B (k steps [pc, pc+kc),
// columns [jc, jc+nc)); ap holds the packed A panels of the tiles from t_base
// on, kc x kMR floats each, except the full tiles read in place from
// a_in_place (row-major, lda) when it is not null.
void compute_tiles(const float* ap, int64_t t_base, const float* a_in_place, int64_t lda,
                   const float* bp, float* c, int64_t m, int64_t pc, int64_t kc, int64_t jc,
                   int64_t nc, const GemmArgs& g, int64_t ldc, int64_t t0, int64_t t1) {
  const bool first = pc == 0;
  const bool load_c = !first || g.beta != 0.0f;
  const float beta = first ? g.beta : 1.0f;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t i0 = t * kMR, mr = std::min(kMR, m - i0);
    const bool in_place = a_in_place != nullptr && mr == kMR;
    const float* at = in_place ? a_in_place + i0 * lda + pc : ap + (t - t_base) * kc * kMR;
    for (int64_t j0 = 0; j0 < nc; j0 += kNR) {
      const float* bpp = bp + (j0 / kNR) * kc * kNR;
      float* cc = c + i0 * ldc + jc + j0;
      const int64_t nr = std::min(kNR, nc - j0);
      if (in_place) {
        micro_kernel<true>(kc, at, lda, bpp, cc, ldc, mr, nr, g.alpha, beta, load_c);
      } else {
        micro_kernel<false>(kc, at, 0, bpp, cc, ldc, mr, nr, g.alpha, beta, load_c);
      }
    }
  }
}

// The f32 product of Note [CPU GEMM backend] (k > 0) on the calling thread
// alone. Per block of k steps, the A panels of up to kMC rows are packed once
// and serve every block of columns; per block of columns, B's micro-panels are
// packed, then every row tile of C is computed against them.
void own_sgemm(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t k,
               const GemmArgs& g, int64_t lda, int64_t ldb, int64_t ldc) {
  // Per thread: each piece of a split product packs into its own buffers.
  thread_local std::vector<float> b_buf(static_cast<size_t>(kKC * kNC + kBAhead * kNR));
  thread_local std::vector<float> a_buf;
  float* bp = b_buf.data();
  const int64_t tiles = (m + kMR - 1) / kMR;
  const int64_t blocks = (tiles + kMC / kMR - 1) / (kMC / kMR);
  const int64_t mc_tiles = (tiles + blocks - 1) / blocks;
  if (a_buf.size() < static_cast<size_t>(mc_tiles * kMR * kKC)) {
    a_buf.resize(static_cast<size_t>(mc_tiles * kMR * kKC));
  }
  float* ap = a_buf.data();
  // Note [GEMM A in place]: full tiles of a row-major A skip the packing.
  const float* a_in_place = !g.trans_a && rows_spread(lda) ? a : nullptr;
  for (int64_t pc = 0; pc < k; pc += kKC) {
    const int64_t kc = std::min(kKC, k - pc);
    for (int64_t tc = 0; tc < tiles; tc += mc_tiles) {
      const int64_t tc_end = std::min(tiles, tc + mc_tiles);
      for (int64_t t = tc; t < tc_end; ++t) {
        if (a_in_place != nullptr && (t + 1) * kMR <= m) continue;
        pack_a(a, lda, g.trans_a, t * kMR, std::min(kMR, m - t * kMR), pc, kc,
               ap + (t - tc) * kc * kMR);
      }
      for (int64_t jc = 0; jc < n; jc += kNC) {
        const int64_t nc = std::min(kNC, n - jc);
        pack_b(b, ldb, g.trans_b, pc, kc, jc, nc, bp);
        compute_tiles(ap, tc, a_in_place, lda, bp, c, m, pc, kc, jc, nc, g, ldc, tc, tc_end);
      }
    }
  }
}

// Note [GEMM split over threads]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A product on several threads is cut into one piece of C per thread, along m
// in whole kMR-row tiles, or along n in whole kNR-column panels when that
// deals out the register tiles at least 5% more evenly (a piece cut along n
// packs all of A, whose rows go through transposes), and each piece is an own_sgemm of
// its own: it packs its rows of A and its columns of B into its thread's
// buffers and never waits for another thread. Sharing the packing instead
// (each block of A and B packed once by all threads) costs two barriers per
// block of B, and on two cores the thread that arrives first idles at each;
// packing the other operand once per piece costs about 2/m (or 2/n) of the
// piece's multiply-adds. The cut changes which thread computes an element,
// never its arithmetic: the promise of Note [CPU GEMM backend] holds.
void split_sgemm(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t k,
                 const GemmArgs& g, int64_t lda, int64_t ldb, int64_t ldc) {
  const int64_t threads = num_threads();
  if (threads == 1 || m * n * k < kParallelMacs)
    return own_sgemm(a, b, c, m, n, k, g, lda, ldb, ldc);
  const int64_t tiles = (m + kMR - 1) / kMR, panels = (n + kNR - 1) / kNR;
  // The largest piece's share of micro-tiles when `units` are dealt out in
  // `threads` contiguous runs, against the other dim's count.
  auto largest = [&](int64_t units, int64_t other) {
    return (units + threads - 1) / threads * other;
  };
  const bool by_rows = 100 * largest(panels, tiles) > 95 * largest(tiles, panels);
  const int64_t units = by_rows ? tiles : panels;
  const int64_t pieces = std::min(threads, units);
  parallel_for(pieces, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      // Pieces of units/pieces units, the first units % pieces one larger.
      const int64_t base = units / pieces, extra = units % pieces;
      const int64_t u0 = p * base + std::min(p, extra), u1 = u0 + base + (p < extra ? 1 : 0);
      if (by_rows) {
        const int64_t i0 = u0 * kMR, i1 = std::min(m, u1 * kMR);
        const float* a_part = g.trans_a ? a + i0 : a + i0 * lda;
        own_sgemm(a_part, b, c + i0 * ldc, i1 - i0, n, k, g, lda, ldb, ldc);
      } else {
        const int64_t j0 = u0 * kNR, j1 = std::min(n, u1 * kNR);
        const float* b_part = g.trans_b ? b + j0 * ldb : b + j0;
        own_sgemm(a, b_part, c + j0, m, j1 - j0, k, g, lda, ldb, ldc);
      }
    }
  });
}

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
    if (k > 0) return split_sgemm(a, b, c, m, n, k, g, lda, ldb, ldc);
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
