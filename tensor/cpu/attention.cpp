// CPU fused scaled dot-product attention, forward and backward (interface in
// tensor/kernels.h, front ends in tensor/ops_nn.cpp).
//
// Note [Fused CPU attention]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// The composite attention (scores, mask, max, exp, sum, divide, two batched
// GEMMs; twice that in backward) wrote and re-read several (B, H, Sq, Sk)
// tensors per pass and computed the whole score matrix even under a causal
// mask. Here each (batch, head) is processed in blocks of kBlockQ query rows,
// and each block in tiles of kTile rows:
//
// - Causal skipping at tile granularity: a tile of query rows only computes
//   scores against the keys its last row can see (rounded up to one SIMD
//   width), so a causal pass does about half the multiply-adds of the full
//   square (B=4, S=256, D=64: 55% with 8-row tiles); masked scores are never
//   computed, never exponentiated and never multiplied.
// - Exact softmax per row, not the online (running max) form: a block's rows
//   of scores are at most kBlockQ x Sk values (64 KiB at Sk = 256), which stay
//   in L2, so the row max is known before any exp and P needs no rescaling.
// - Backward recomputes P = exp(scale * S - lse) from the saved log-sum-exp
//   (the FlashAttention formulation of autograd's AttentionBackward), so no
//   probabilities are saved between the passes. dK and dV accumulate in f32
//   (f64) scratch over every query block and every query head of a group
//   (grouped-query attention), which is why backward parallelises over
//   (batch, kv head) and forward over (batch, query head, block).
// - The products are small (k = D or a block) and run on a register-tiled
//   micro-kernel (gemm_small) over GCC vector extensions, with K and V packed
//   once per head into zero-padded, SIMD-aligned panels; OpenBLAS is not
//   called, since its per-call set-up and threading decisions cost more than
//   these products at D = 64.
// - The operands are (B, S, H, D) buffers seen as (B, H, S, D): a head's row is
//   D floats, H * D apart, so a block's rows of Q (and in backward of O and
//   dO) are each a separate cache miss. The next block's rows are prefetched
//   while the current one computes, and backward's delta = rowsum(dO * O) is
//   one pass over a block's rows rather than one row between each tile's
//   products.
//
// Rows that see no key (a causal shard entirely before its keys) get lse =
// -inf, a zero output and zero gradients, as in the composite reference.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "tandem/tensor/cpu/parallel.h"
#include "tandem/tensor/cpu/simd.h"
#include "tandem/tensor/kernels.h"

namespace tandem::cpu {
namespace {

using simd::kWidth;
using simd::Vec;

constexpr int64_t kBlockQ = 64;  // query rows per block
constexpr int64_t kTile = 8;     // query rows per tile (the causal granularity)

int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

// ---- the micro-kernel ----

// Keeps GCC from re-reading a B vector as a memory operand of each of the MR
// FMAs that use it (one load instead of MR).
#define TANDEM_IN_REGISTER(v) __asm__("" : "+v"(v))

// C[MR x NV*W] (= or +=) A[MR x k] B[k x NV*W]: A(i, p) = a[i * a_rs + p * a_cs],
// B rows contiguous with stride ldb, C rows with stride ldc.
template <class T, int MR, int NV>
void tile_kernel(int64_t k, const T* a, int64_t a_rs, int64_t a_cs, const T* b, int64_t ldb, T* c,
                 int64_t ldc, bool accumulate) {
  constexpr int64_t W = kWidth<T>;
  Vec<T> acc[MR][NV];
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < NV; ++v)
      acc[r][v] = accumulate ? simd::load(c + r * ldc + v * W) : Vec<T>{};
  }
  for (int64_t p = 0; p < k; ++p) {
    const T* bp = b + p * ldb;
    Vec<T> bv[NV];
    for (int v = 0; v < NV; ++v) {
      bv[v] = simd::load(bp + v * W);
      TANDEM_IN_REGISTER(bv[v]);
    }
    const T* ap = a + p * a_cs;
    for (int r = 0; r < MR; ++r) {
      Vec<T> av = simd::splat(ap[r * a_rs]);
      TANDEM_IN_REGISTER(av);
      for (int v = 0; v < NV; ++v)
        acc[r][v] = simd::fma(av, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < NV; ++v)
      simd::store(c + r * ldc + v * W, acc[r][v]);
  }
}

// tile_kernel with a run-time row count mr <= MR.
template <class T, int MR, int NV>
void rows_kernel(int64_t mr, int64_t k, const T* a, int64_t a_rs, int64_t a_cs, const T* b,
                 int64_t ldb, T* c, int64_t ldc, bool accumulate) {
  if constexpr (MR > 1) {
    if (mr < MR)
      return rows_kernel<T, MR - 1, NV>(mr, k, a, a_rs, a_cs, b, ldb, c, ldc, accumulate);
  }
  tile_kernel<T, MR, NV>(k, a, a_rs, a_cs, b, ldb, c, ldc, accumulate);
}

// Register tiles (Note [SIMD width]): with 32 vector registers, 4 rows x 4
// vectors, else 8 rows x 2 or 1 vectors (at most 16 accumulators); with 16,
// 6 rows x 2 vectors (12 accumulators, 2 B vectors and a broadcast) or 8 x 1.
constexpr bool kWideRegisters = simd::kVectorRegisters >= 32;
constexpr int kRowsOf2 = kWideRegisters ? 8 : 6;

// C[m x n] (= or +=) A[m x k] B[k x n] for n a multiple of the SIMD width.
template <class T>
void gemm_small(int64_t m, int64_t n, int64_t k, const T* a, int64_t a_rs, int64_t a_cs, const T* b,
                int64_t ldb, T* c, int64_t ldc, bool accumulate) {
  constexpr int64_t W = kWidth<T>;
  int64_t j = 0;
  if constexpr (kWideRegisters) {
    for (; j + 4 * W <= n; j += 4 * W) {
      for (int64_t i = 0; i < m; i += 4) {
        rows_kernel<T, 4, 4>(std::min<int64_t>(4, m - i), k, a + i * a_rs, a_rs, a_cs, b + j, ldb,
                             c + i * ldc + j, ldc, accumulate);
      }
    }
  }
  for (; j + 2 * W <= n; j += 2 * W) {
    for (int64_t i = 0; i < m; i += kRowsOf2) {
      rows_kernel<T, kRowsOf2, 2>(std::min<int64_t>(kRowsOf2, m - i), k, a + i * a_rs, a_rs, a_cs,
                                  b + j, ldb, c + i * ldc + j, ldc, accumulate);
    }
  }
  for (; j < n; j += W) {
    for (int64_t i = 0; i < m; i += 8) {
      rows_kernel<T, 8, 1>(std::min<int64_t>(8, m - i), k, a + i * a_rs, a_rs, a_cs, b + j, ldb,
                           c + i * ldc + j, ldc, accumulate);
    }
  }
}

// ---- row helpers ----

// row[j] = exp(scale * row[j] - shift) for j < n; row[n, n_pad) = 0.
template <class T>
void exp_row(T* row, int64_t n, int64_t n_pad, T scale, T shift) {
  constexpr int64_t W = kWidth<T>;
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; j + W <= n; j += W)
      simd::store(row + j, simd::exp_vec(simd::load(row + j) * scale - shift));
    if (j < n) {
      Vec<T> x = simd::load_partial(row + j, n - j, T(0));
      simd::store_partial(row + j, simd::exp_vec(x * scale - shift), n - j);
      j = n;
    }
  } else {
    for (; j < n; ++j)
      row[j] = std::exp(scale * row[j] - shift);
  }
  for (; j < n_pad; ++j)
    row[j] = T(0);
}

// max_j (sign * row[j]) for sign = +1 or -1, over j < n.
template <class T>
T row_max(const T* row, int64_t n, T sign) {
  constexpr int64_t W = kWidth<T>;
  int64_t j = 0;
  Vec<T> acc;
  if (n >= W) {
    acc = simd::load(row) * sign;
    for (j = W; j + W <= n; j += W)
      acc = simd::max(acc, simd::load(row + j) * sign);
  } else {
    acc = simd::splat(-std::numeric_limits<T>::infinity());
  }
  if (j < n) {  // lanes past n: -inf once signed
    const T fill = -std::numeric_limits<T>::infinity() * sign;
    acc = simd::max(acc, simd::load_partial(row + j, n - j, fill) * sign);
  }
  return simd::reduce_max(acc);
}

// row[j] *= c for j < n.
template <class T>
void scale_row(T* row, int64_t n, T c) {
  constexpr int64_t W = kWidth<T>;
  int64_t j = 0;
  for (; j + W <= n; j += W)
    simd::store(row + j, simd::load(row + j) * c);
  if (j < n) simd::store_partial(row + j, simd::load_partial(row + j, n - j, T(0)) * c, n - j);
}

// ds[j] = p[j] * (ds[j] - delta) * scale for j < n: softmax's backward, from
// dP in ds.
template <class T>
void softmax_grad_row(const T* p, T* ds, int64_t n, T delta, T scale) {
  constexpr int64_t W = kWidth<T>;
  auto at = [&](Vec<T> pv, Vec<T> dv) { return pv * (dv - delta) * scale; };
  int64_t j = 0;
  for (; j + W <= n; j += W)
    simd::store(ds + j, at(simd::load(p + j), simd::load(ds + j)));
  if (j < n) {
    const Vec<T> pv = simd::load_partial(p + j, n - j, T(0));
    simd::store_partial(ds + j, at(pv, simd::load_partial(ds + j, n - j, T(0))), n - j);
  }
}

template <class T>
T row_sum(const T* row, int64_t n) {
  constexpr int64_t W = kWidth<T>;
  Vec<T> acc{};
  int64_t j = 0;
  for (; j + W <= n; j += W)
    acc += simd::load(row + j);
  T s = simd::reduce_add(acc);
  for (; j < n; ++j)
    s += row[j];
  return s;
}

// ---- layout ----

// Element strides of a 4-D (B, H, S, D) operand (unit stride along D).
struct Layout4 {
  int64_t b, h, s;
};
Layout4 layout_of(const TensorArg& t) {
  return {t.strides[0], t.strides[1], t.strides[2]};
}

// The shape facts every pass needs.
struct Geometry {
  int64_t B, Hq, Hkv, G, Sq, Sk, D, Dp, Skp;
  bool causal;
  int64_t q_offset, k_offset;
  const int32_t* windows;  // packed sequences (AttentionArgs), or null
  int64_t window_rows;
  // Keys visible to query row i of batch b: [begin(b, i), end(b, i)); both
  // non-decreasing in i.
  int64_t begin(int64_t b, int64_t i) const { return windows ? windows[window(b, i)] : 0; }
  int64_t end(int64_t b, int64_t i) const {
    if (windows) return windows[window(b, i) + 1];
    if (!causal) return Sk;
    return std::clamp<int64_t>(q_offset + i - k_offset + 1, 0, Sk);
  }
  int64_t window(int64_t b, int64_t i) const { return ((window_rows == 1 ? 0 : b) * Sq + i) * 2; }
  // Where the scores of a tile whose first row is i start: begin rounded down
  // to a multiple of the SIMD width and of kTile, so that every key tile of
  // accumulate_dkv that a row sees lies in columns its tile computed.
  int64_t tile_begin(int64_t b, int64_t i) const {
    constexpr int64_t kAlign = std::max<int64_t>(kTile, kWidth<float>);  // >= kWidth<double>
    return begin(b, i) / kAlign * kAlign;
  }
};

template <class T>
Geometry geometry_of(const AttentionArgs& a) {
  Geometry g{};
  g.B = a.batch;
  g.Hq = a.heads_q;
  g.Hkv = a.heads_kv;
  g.G = a.heads_q / a.heads_kv;
  g.Sq = a.seq_q;
  g.Sk = a.seq_k;
  g.D = a.dim;
  g.Dp = round_up(a.dim, kWidth<T>);
  g.Skp = round_up(a.seq_k, kWidth<T>);
  g.causal = a.causal;
  g.q_offset = a.q_offset;
  g.k_offset = a.k_offset;
  g.windows = a.windows;
  g.window_rows = a.window_rows;
  return g;
}

// dst (D x Skp) = src^T zero-padded, src rows j < Sk with stride `rs`; in
// blocks of 16 rows, so that writes run along dst's rows and the 16 source
// rows stay in L1.
template <class T, class S>
void pack_transposed(const S* src, int64_t rs, const Geometry& g, T* dst) {
  constexpr int64_t kRows = 16;
  for (int64_t j0 = 0; j0 < g.Skp; j0 += kRows) {
    const int64_t j1 = std::min(j0 + kRows, g.Sk);
    for (int64_t d = 0; d < g.D; ++d) {
      T* out = dst + d * g.Skp;
      int64_t j = j0;
      for (; j < j1; ++j)
        out[j] = static_cast<T>(src[j * rs + d]);
      for (; j < std::min(j0 + kRows, g.Skp); ++j)
        out[j] = T(0);
    }
  }
}

// dst (rows x Dp) = src zero-padded, src rows with stride `rs`.
template <class T, class S>
void pack_rows(const S* src, int64_t rs, int64_t rows, const Geometry& g, T* dst) {
  for (int64_t j = 0; j < rows; ++j) {
    for (int64_t d = 0; d < g.D; ++d)
      dst[j * g.Dp + d] = static_cast<T>(src[j * rs + d]);
    std::fill(dst + j * g.Dp + g.D, dst + (j + 1) * g.Dp, T(0));
  }
}

// Asks for the n elements at p to be brought into the cache.
template <class T>
void prefetch_row(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64)
    __builtin_prefetch(c + off, 0, 3);
}

// Per-thread scratch, grown on demand and kept (a few MiB at most for the
// sequence lengths attention runs at on a CPU).
template <class T>
T* scratch(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  return v.data();
}

// ---- forward ----

template <class T>
void attention_forward(const AttentionArgs& args, const TensorArg& q, const TensorArg& k,
                       const TensorArg& v, const TensorArg& out, const TensorArg& lse) {
  const Geometry g = geometry_of<T>(args);
  const T scale = static_cast<T>(args.scale);
  const Layout4 lq = layout_of(q), lk = layout_of(k), lv = layout_of(v), lo = layout_of(out);
  const T* qp = static_cast<const T*>(q.data);
  const T* kp = static_cast<const T*>(k.data);
  const T* vp = static_cast<const T*>(v.data);
  T* op = static_cast<T*>(out.data);
  float* lse_p = static_cast<float*>(lse.data);
  const int64_t blocks = (g.Sq + kBlockQ - 1) / kBlockQ;
  // Tasks: (batch, query head, block); the packing of K and V is repeated per
  // block, O(Sk D) against the block's O(kBlockQ Sk D) products.
  parallel_for(g.B * g.Hq * blocks, 1, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<T> kt_buf, v_buf, s_buf, o_buf;
    T* kt = scratch(kt_buf, g.D * g.Skp);
    T* vb = scratch(v_buf, g.Sk * g.Dp);
    T* s = scratch(s_buf, kBlockQ * g.Skp);
    T* ob = scratch(o_buf, kTile * g.Dp);
    int64_t packed_head = -1;
    // Task t's first query row.
    auto query_block = [&](int64_t t) {
      const int64_t blk = t % blocks, bh = t / blocks;
      return qp + (bh / g.Hq) * lq.b + (bh % g.Hq) * lq.h + blk * kBlockQ * lq.s;
    };
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t blk = t % blocks, bh = t / blocks, b = bh / g.Hq, h = bh % g.Hq;
      const int64_t hkv = h / g.G;
      const int64_t i0 = blk * kBlockQ, rows = std::min(kBlockQ, g.Sq - i0);
      if (b * g.Hkv + hkv != packed_head) {
        pack_transposed(kp + b * lk.b + hkv * lk.h, lk.s, g, kt);
        pack_rows(vp + b * lv.b + hkv * lv.h, lv.s, g.Sk, g, vb);
        packed_head = b * g.Hkv + hkv;
      }
      if (t + 1 < t1) {  // the next task's query rows, read from memory (prefetch_block)
        const T* next = query_block(t + 1);
        for (int64_t r = 0; r < std::min(kBlockQ, g.Sq - ((t + 1) % blocks) * kBlockQ); ++r)
          prefetch_row(next + r * lq.s, g.D);
      }
      const T* qb = query_block(t);
      T* obase = op + b * lo.b + h * lo.h + i0 * lo.s;
      float* lse_row = lse_p + (b * g.Hq + h) * g.Sq + i0;
      for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
        const int64_t tr = std::min(kTile, rows - r0);
        // The tile's scores: columns [c0, tile_pad), every key a row sees.
        const int64_t c0 = g.tile_begin(b, i0 + r0);
        const int64_t tile_end = g.end(b, i0 + r0 + tr - 1);
        const int64_t tile_pad = round_up(tile_end, kWidth<T>);
        T* st = s + r0 * g.Skp;
        if (tile_end > c0) {
          gemm_small(tr, tile_pad - c0, g.D, qb + r0 * lq.s, lq.s, 1, kt + c0, g.Skp, st + c0,
                     g.Skp, false);
        }
        for (int64_t r = 0; r < tr; ++r) {
          T* row = st + r * g.Skp;
          const int64_t lo = g.begin(b, i0 + r0 + r), n = g.end(b, i0 + r0 + r);
          if (n <= lo) {
            std::fill(row + c0, row + std::max(c0, tile_pad), T(0));
            lse_row[r0 + r] = -std::numeric_limits<float>::infinity();
            continue;
          }
          std::fill(row + c0, row + lo, T(0));
          // max_j (scale * S_ij), for a scale of either sign.
          const T sign = scale < T(0) ? T(-1) : T(1);
          const T m = row_max(row + lo, n - lo, sign) * sign * scale;
          exp_row(row + lo, n - lo, tile_pad - lo, scale, m);
          const T sum = row_sum(row + lo, n - lo);
          const T inv = T(1) / sum;
          scale_row(row + lo, n - lo, inv);
          lse_row[r0 + r] = static_cast<float>(m + std::log(sum));
        }
        if (tile_end > c0) {
          gemm_small(tr, g.Dp, tile_end - c0, st + c0, g.Skp, 1, vb + c0 * g.Dp, g.Dp, ob, g.Dp,
                     false);
        } else {
          std::fill(ob, ob + tr * g.Dp, T(0));
        }
        for (int64_t r = 0; r < tr; ++r)
          std::copy(ob + r * g.Dp, ob + r * g.Dp + g.D, obase + (r0 + r) * lo.s);
      }
    }
  });
}

// ---- backward ----

// Per-thread scratch of a backward task: K^T, V^T and K packed for one kv
// head, its dK and dV accumulators, and for one block of query rows P, dS,
// the packed Q and dO, the rows' delta = rowsum(dO * O), and a tile's dQ.
template <class T>
struct BackwardScratch {
  T* kt;
  T* vt;
  T* kr;
  T* dka;
  T* dva;
  T* p;
  T* ds;
  T* qblk;
  T* doblk;
  T* delta;
  T* dqt;
};

template <class T>
BackwardScratch<T> reserve_backward_scratch(const Geometry& g) {
  thread_local std::vector<T> kt_buf, vt_buf, k_buf, dk_buf, dv_buf, p_buf, ds_buf, qb_buf, dob_buf,
      delta_buf, dqt_buf;
  BackwardScratch<T> s;
  s.kt = scratch(kt_buf, g.D * g.Skp);
  s.vt = scratch(vt_buf, g.D * g.Skp);
  s.kr = scratch(k_buf, g.Skp * g.Dp);
  s.dka = scratch(dk_buf, g.Skp * g.Dp);
  s.dva = scratch(dv_buf, g.Skp * g.Dp);
  s.p = scratch(p_buf, kBlockQ * g.Skp);
  s.ds = scratch(ds_buf, kBlockQ * g.Skp);
  s.qblk = scratch(qb_buf, kBlockQ * g.Dp);
  s.doblk = scratch(dob_buf, kBlockQ * g.Dp);
  s.delta = scratch(delta_buf, kBlockQ);
  s.dqt = scratch(dqt_buf, kTile * g.Dp);
  return s;
}

// One query head of a backward task: its (S, D) operands and their row
// strides, and its lse row.
template <class T>
struct QueryHead {
  int64_t b;  // its batch row
  const T* q;
  const T* o;
  const T* dout;
  T* dq;
  const float* lse;
  int64_t q_s, o_s, do_s, dq_s;
};

// Query row i: prow holds its scores S and dsrow its dP on entry from column
// c0; on return prow = P = exp(scale * S - lse) and dsrow = dS = P * (dP -
// delta) * scale, both zero outside the row's visible keys in [c0, kv_pad).
template <class T>
void backprop_softmax_row(const Geometry& g, T scale, const QueryHead<T>& h, int64_t i, int64_t c0,
                          int64_t kv_pad, T delta, T* prow, T* dsrow) {
  const int64_t lo = g.begin(h.b, i), n = g.end(h.b, i);
  const float l = h.lse[i];
  if (n <= lo || !std::isfinite(l)) {  // no visible key: P = 0
    std::fill(prow + c0, prow + kv_pad, T(0));
    std::fill(dsrow + c0, dsrow + kv_pad, T(0));
    return;
  }
  std::fill(prow + c0, prow + lo, T(0));
  std::fill(dsrow + c0, dsrow + lo, T(0));
  exp_row(prow + lo, n - lo, kv_pad - lo, scale, static_cast<T>(l));
  softmax_grad_row(prow + lo, dsrow + lo, n - lo, delta, scale);
  std::fill(dsrow + n, dsrow + kv_pad, T(0));
}

// The tile of tr query rows at row r0 of the block at i0: its rows of P and
// dS (kept in s.p and s.ds for dK and dV), and its dQ, written out.
template <class T>
void backprop_tile(const Geometry& g, T scale, const QueryHead<T>& h, const BackwardScratch<T>& s,
                   int64_t i0, int64_t r0, int64_t tr, int64_t kv_pad) {
  const int64_t c0 = g.tile_begin(h.b, i0 + r0);
  const int64_t tile_end = g.end(h.b, i0 + r0 + tr - 1);
  const int64_t tile_pad = round_up(tile_end, kWidth<T>);
  T* pt = s.p + r0 * g.Skp;
  T* dst = s.ds + r0 * g.Skp;
  if (tile_end > c0) {
    // S = Q K^T, dP = dO V^T for the tile's visible keys.
    gemm_small(tr, tile_pad - c0, g.D, s.qblk + r0 * g.Dp, g.Dp, 1, s.kt + c0, g.Skp, pt + c0,
               g.Skp, false);
    gemm_small(tr, tile_pad - c0, g.D, s.doblk + r0 * g.Dp, g.Dp, 1, s.vt + c0, g.Skp, dst + c0,
               g.Skp, false);
  }
  for (int64_t r = 0; r < tr; ++r)
    backprop_softmax_row(g, scale, h, i0 + r0 + r, c0, kv_pad, s.delta[r0 + r], pt + r * g.Skp,
                         dst + r * g.Skp);
  // dQ = dS K for the tile.
  if (tile_end > c0) {
    gemm_small(tr, g.Dp, tile_end - c0, dst + c0, g.Skp, 1, s.kr + c0 * g.Dp, g.Dp, s.dqt, g.Dp,
               false);
  } else {
    std::fill(s.dqt, s.dqt + tr * g.Dp, T(0));
  }
  for (int64_t r = 0; r < tr; ++r) {
    std::copy(s.dqt + r * g.Dp, s.dqt + r * g.Dp + g.D, h.dq + (i0 + r0 + r) * h.dq_s);
  }
}

// dV += P^T dO and dK += dS^T Q over the block's rows (`rows` from i0); a tile
// of keys only needs the rows that can see one of its keys: from the first
// whose window ends after its first key to the last whose window begins
// before its end.
template <class T>
void accumulate_dkv(const Geometry& g, const BackwardScratch<T>& s, int64_t b, int64_t i0,
                    int64_t rows, int64_t kv_pad) {
  int64_t r_start = 0, r_stop = 0;
  for (int64_t j0 = g.tile_begin(b, i0); j0 < kv_pad; j0 += kTile) {
    const int64_t tj = std::min(kTile, kv_pad - j0);
    while (r_start < rows && g.end(b, i0 + r_start) <= j0)
      ++r_start;
    r_stop = std::max(r_stop, r_start);
    while (r_stop < rows && g.begin(b, i0 + r_stop) < j0 + tj)
      ++r_stop;
    const int64_t kk = r_stop - r_start;
    if (kk == 0) continue;
    gemm_small(tj, g.Dp, kk, s.p + r_start * g.Skp + j0, 1, g.Skp, s.doblk + r_start * g.Dp, g.Dp,
               s.dva + j0 * g.Dp, g.Dp, true);
    gemm_small(tj, g.Dp, kk, s.ds + r_start * g.Skp + j0, 1, g.Skp, s.qblk + r_start * g.Dp, g.Dp,
               s.dka + j0 * g.Dp, g.Dp, true);
  }
}

// Asks for the rows of Q, O and dO of the block at i0 while the current block
// computes: they are read from memory (rows D floats long, H * D apart), and
// each block's first reads of them otherwise waited for every cache miss.
template <class T>
void prefetch_block(const Geometry& g, const QueryHead<T>& h, int64_t i0) {
  const int64_t rows = std::min(kBlockQ, g.Sq - i0);
  for (int64_t r = i0; r < i0 + rows; ++r) {
    prefetch_row(h.q + r * h.q_s, g.D);
    prefetch_row(h.o + r * h.o_s, g.D);
    prefetch_row(h.dout + r * h.do_s, g.D);
  }
}

// The block of query rows at i0 of one query head: its dQ, and its terms of
// the kv head's dK and dV.
template <class T>
void backprop_block(const Geometry& g, T scale, const QueryHead<T>& h, const BackwardScratch<T>& s,
                    int64_t i0) {
  const int64_t rows = std::min(kBlockQ, g.Sq - i0);
  const int64_t kv_end = g.end(h.b, i0 + rows - 1);
  bool sees = false;
  for (int64_t r = 0; r < rows && !sees; ++r)
    sees = g.end(h.b, i0 + r) > g.begin(h.b, i0 + r);
  if (!sees) {  // no row of the block sees a key
    for (int64_t r = 0; r < rows; ++r)
      std::fill(h.dq + (i0 + r) * h.dq_s, h.dq + (i0 + r) * h.dq_s + g.D, T(0));
    return;
  }
  const int64_t kv_pad = round_up(kv_end, kWidth<T>);
  pack_rows(h.q + i0 * h.q_s, h.q_s, rows, g, s.qblk);
  pack_rows(h.dout + i0 * h.do_s, h.do_s, rows, g, s.doblk);
  // delta = rowsum(dO * O) (= rowsum(P * dP)) of every row, in one pass whose
  // loads of O are independent of each other (a row at a time between the
  // tiles' products, each load of O waited for its cache miss alone).
  for (int64_t r = 0; r < rows; ++r) {
    const T* orow = h.o + (i0 + r) * h.o_s;
    const T* dorow = s.doblk + r * g.Dp;
    T delta = 0;
    for (int64_t d = 0; d < g.D; ++d)
      delta += dorow[d] * orow[d];
    s.delta[r] = delta;
  }
  for (int64_t r0 = 0; r0 < rows; r0 += kTile)
    backprop_tile(g, scale, h, s, i0, r0, std::min(kTile, rows - r0), kv_pad);
  accumulate_dkv(g, s, h.b, i0, rows, kv_pad);
}

template <class T>
void attention_backward(const AttentionArgs& args, const TensorArg& q, const TensorArg& k,
                        const TensorArg& v, const TensorArg& out, const TensorArg& lse,
                        const TensorArg& dout, const TensorArg& dq, const TensorArg& dk,
                        const TensorArg& dv) {
  const Geometry g = geometry_of<T>(args);
  const T scale = static_cast<T>(args.scale);
  const Layout4 lq = layout_of(q), lk = layout_of(k), lv = layout_of(v), lo = layout_of(out);
  const Layout4 ldo = layout_of(dout), ldq = layout_of(dq), ldk = layout_of(dk),
                ldv = layout_of(dv);
  const T* qp = static_cast<const T*>(q.data);
  const T* kp = static_cast<const T*>(k.data);
  const T* vp = static_cast<const T*>(v.data);
  const T* op = static_cast<const T*>(out.data);
  const T* dop = static_cast<const T*>(dout.data);
  const float* lse_p = static_cast<const float*>(lse.data);
  T* dqp = static_cast<T*>(dq.data);
  T* dkp = static_cast<T*>(dk.data);
  T* dvp = static_cast<T*>(dv.data);
  parallel_for(g.B * g.Hkv, 1, [&](int64_t t0, int64_t t1) {
    const BackwardScratch<T> s = reserve_backward_scratch<T>(g);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / g.Hkv, hkv = t % g.Hkv;
      const T* kh = kp + b * lk.b + hkv * lk.h;
      const T* vh = vp + b * lv.b + hkv * lv.h;
      pack_transposed(kh, lk.s, g, s.kt);
      pack_transposed(vh, lv.s, g, s.vt);
      pack_rows(kh, lk.s, g.Sk, g, s.kr);
      std::fill(s.kr + g.Sk * g.Dp, s.kr + g.Skp * g.Dp, T(0));
      std::fill(s.dka, s.dka + g.Skp * g.Dp, T(0));
      std::fill(s.dva, s.dva + g.Skp * g.Dp, T(0));
      auto head_of = [&](int64_t h) {
        return QueryHead<T>{.b = b,
                            .q = qp + b * lq.b + h * lq.h,
                            .o = op + b * lo.b + h * lo.h,
                            .dout = dop + b * ldo.b + h * ldo.h,
                            .dq = dqp + b * ldq.b + h * ldq.h,
                            .lse = lse_p + (b * g.Hq + h) * g.Sq,
                            .q_s = lq.s,
                            .o_s = lo.s,
                            .do_s = ldo.s,
                            .dq_s = ldq.s};
      };
      for (int64_t h = hkv * g.G; h < (hkv + 1) * g.G; ++h) {
        const QueryHead<T> head = head_of(h);
        for (int64_t i0 = 0; i0 < g.Sq; i0 += kBlockQ) {
          if (i0 + kBlockQ < g.Sq) {
            prefetch_block(g, head, i0 + kBlockQ);
          } else if (h + 1 < (hkv + 1) * g.G) {
            prefetch_block(g, head_of(h + 1), 0);
          }
          backprop_block(g, scale, head, s, i0);
        }
      }
      T* dkh = dkp + b * ldk.b + hkv * ldk.h;
      T* dvh = dvp + b * ldv.b + hkv * ldv.h;
      for (int64_t j = 0; j < g.Sk; ++j) {
        std::copy(s.dka + j * g.Dp, s.dka + j * g.Dp + g.D, dkh + j * ldk.s);
        std::copy(s.dva + j * g.Dp, s.dva + j * g.Dp + g.D, dvh + j * ldv.s);
      }
    }
  });
}

}  // namespace

void attention(const AttentionArgs& args, const TensorArg& q, const TensorArg& k,
               const TensorArg& v, const TensorArg& out, const TensorArg& lse) {
  switch (q.dtype) {
    case DType::F32:
      return attention_forward<float>(args, q, k, v, out, lse);
    case DType::F64:
      return attention_forward<double>(args, q, k, v, out, lse);
    default:
      TANDEM_FAIL("[cpu::attention] expected f32 or f64, got {}", dtype_name(q.dtype));
  }
}

void attention_backward(const AttentionArgs& args, const TensorArg& q, const TensorArg& k,
                        const TensorArg& v, const TensorArg& out, const TensorArg& lse,
                        const TensorArg& dout, const TensorArg& dq, const TensorArg& dk,
                        const TensorArg& dv) {
  switch (q.dtype) {
    case DType::F32:
      return attention_backward<float>(args, q, k, v, out, lse, dout, dq, dk, dv);
    case DType::F64:
      return attention_backward<double>(args, q, k, v, out, lse, dout, dq, dk, dv);
    default:
      TANDEM_FAIL("[cpu::attention_backward] expected f32 or f64, got {}", dtype_name(q.dtype));
  }
}

}  // namespace tandem::cpu
