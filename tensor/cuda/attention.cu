// CUDA fused scaled dot-product attention, forward and backward (interface in
// tensor/kernels.h; the CPU kernel and its Note [Fused CPU attention] are in
// tensor/cpu/attention.cpp). f32 and f64 (the front end computes 16-bit
// inputs in f32); every sum accumulates in acc_t, i.e. the input's dtype.
//
// Note [Tiled CUDA attention]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// FlashAttention-2's tiling. A block stages tiles of rows of its operands in
// shared memory (rows padded to D + 1 elements so that threads reading
// consecutive rows hit different banks) and never materialises a score
// matrix larger than one tile:
// - Forward: one block per (batch, query head, tile of Br query rows). It
//   walks the key tiles of Bc rows that its last row can see (causally
//   masked tiles are skipped; the first key tile is always needed), keeping
//   per row a running max m and sum l of exp(score - m); each step rescales
//   the row's output accumulator by exp(m_old - m_new) before adding P V.
//   The end writes out = acc / l and lse = m + log(l).
// - Backward: a small kernel first writes delta_i = rowsum(dO_i * O_i). Then
//   one block per (batch, kv head, tile of Bc key rows) loops over the query
//   heads of its grouped-query group and over the query tiles that can see
//   its keys, recomputing P = exp(scale * Q K^T - lse) from the given lse
//   (which may come from a larger computation, as in ring attention), and
//   accumulates dV += P^T dO and dK += dS^T Q, dS = P (dO V^T - delta) * scale.
//   A third kernel, one block per (batch, query head, tile of Br query rows),
//   loops over the visible key tiles: dQ += dS K.
// - Tile sizes come from D and the dtype, per kernel: the largest pair of
//   candidate sizes whose tiles fit in 48 KiB of dynamic shared memory (no
//   static shared memory is used; tiles_for below). Br x Bc of the forward,
//   dK/dV and dQ kernels: f32 at D = 64: 32x32, 16x32, 32x32; at D = 128:
//   32x16, 8x16, 16x16; at D = 256: 16x8, 4x8, 8x8; f64 at D = 256: 8x4,
//   2x4, 4x4. Single-row tiles fit every D up to 1022 in f64 and 2046 in
//   f32 (the dK/dV kernel's bound; the forward's is twice that); beyond that
//   the launcher throws.
// - Deterministic, no atomics: every output element (and every accumulator
//   element in shared memory) is owned by one thread of one block, which adds
//   its terms in a fixed order (key tiles, or query heads then query tiles,
//   in increasing order), so two runs give the same bits. dK and dV need no
//   atomics because their block visits every query row that sees its keys.
// - Rows that see no key get a zero output, lse = -inf and zero gradients,
//   as on the CPU; a row whose given lse is -inf contributes no gradient.
#include "tandem/tensor/cuda/cuda_common.cuh"

namespace tandem::TANDEM_KERNEL_SET {
namespace {

constexpr int kAttnThreads = 128;
constexpr int64_t kMaxSharedBytes = 48 * 1024;

// Element strides of a (B, H, S, D) operand; unit stride along D (the kernel
// contract of tensor/kernels.h).
struct Strides3 {
  int64_t b, h, s;
};
Strides3 strides_of(const TensorArg& t) {
  return {t.strides[0], t.strides[1], t.strides[2]};
}

struct Geometry {
  int64_t B, Hq, Hkv, G, Sq, Sk, D;
  double scale;
  bool causal;
  int64_t q_offset, k_offset;
  const int32_t* windows;  // packed sequences (AttentionArgs), or null
  int64_t window_rows;
  // Keys visible to query row i of batch b: [begin(b, i), end(b, i)); both
  // non-decreasing in i.
  __device__ int64_t begin(int64_t b, int64_t i) const {
    return windows ? windows[window(b, i)] : 0;
  }
  __device__ int64_t end(int64_t b, int64_t i) const {
    if (windows) return windows[window(b, i) + 1];
    if (!causal) return Sk;
    const int64_t n = q_offset + i - k_offset + 1;
    return n < 0 ? 0 : (n > Sk ? Sk : n);
  }
  __device__ int64_t window(int64_t b, int64_t i) const {
    return ((window_rows == 1 ? 0 : b) * Sq + i) * 2;
  }
  __device__ bool sees(int64_t b, int64_t i, int64_t j) const {
    return j >= begin(b, i) && j < end(b, i);
  }
  // Query rows that may see a key of [j0, j1): [first_query, last_query);
  // rows outside see none of them (binary searches over the monotone bounds).
  __device__ int64_t first_query(int64_t b, int64_t j0) const {
    if (!windows) {
      if (!causal) return 0;
      const int64_t i = j0 + k_offset - q_offset;
      return i < 0 ? 0 : (i > Sq ? Sq : i);
    }
    int64_t lo = 0, hi = Sq;  // the first row whose window ends after j0
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (end(b, mid) > j0) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    return lo;
  }
  __device__ int64_t last_query(int64_t b, int64_t j1) const {
    if (!windows) return Sq;
    int64_t lo = 0, hi = Sq;  // the first row whose window begins at j1 or later
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (begin(b, mid) >= j1) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    return lo;
  }
};

Geometry geometry_of(const AttentionArgs& a) {
  return {a.batch,      a.heads_q,  a.heads_kv, a.heads_q / a.heads_kv,
          a.seq_q,      a.seq_k,    a.dim,      a.scale,
          a.causal,     a.q_offset, a.k_offset, a.windows,
          a.window_rows};
}

// Br query rows and Bc key rows per tile. The shared-memory footprint of each
// kernel, in elements, is written once here and carved in the same order by
// the kernel; ld = D + 1 is the padded row of a (rows, D) tile, Bc + 1 that of
// a (Br, Bc) score tile.
struct Tiles {
  int64_t br, bc;
  // q, o accumulator (Br, ld); k then v (Bc, ld); p (Br, Bc + 1); m, l, alpha (Br).
  __host__ __device__ int64_t forward_elems(int64_t d) const {
    return 2 * br * (d + 1) + bc * (d + 1) + br * (bc + 1) + 3 * br;
  }
  // k, v, dk, dv accumulators (Bc, ld); q, do (Br, ld); p, ds (Br, Bc + 1); lse, delta (Br).
  __host__ __device__ int64_t dkv_elems(int64_t d) const {
    return 4 * bc * (d + 1) + 2 * br * (d + 1) + 2 * br * (bc + 1) + 2 * br;
  }
  // q, do, dq accumulator (Br, ld); k, v (Bc, ld); ds (Br, Bc + 1); lse, delta (Br).
  __host__ __device__ int64_t dq_elems(int64_t d) const {
    return 3 * br * (d + 1) + 2 * bc * (d + 1) + br * (bc + 1) + 2 * br;
  }
};

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) {
  return a < b ? a : b;
}

// Dot product of two shared-memory rows.
template <class V>
__device__ __forceinline__ V dot(const V* x, const V* y, int64_t n) {
  V s = 0;
  for (int64_t d = 0; d < n; ++d)
    s += x[d] * y[d];
  return s;
}

// dst[r * ld + d] = src[r * row_stride + d] for the first `rows` rows; the
// padding rows of a ragged tile are left alone, never read (the emulator
// fills shared memory with NaN bytes, so a read would show in the tests).
template <class V>
__device__ void load_rows(V* dst, int64_t ld, const V* src, int64_t row_stride, int64_t rows,
                          int64_t D) {
  for (int64_t e = threadIdx.x; e < rows * D; e += blockDim.x) {
    const int64_t r = e / D, d = e % D;
    dst[r * ld + d] = src[r * row_stride + d];
  }
}

template <class V>
__device__ void zero_rows(V* dst, int64_t ld, int64_t rows, int64_t D) {
  for (int64_t e = threadIdx.x; e < rows * D; e += blockDim.x)
    dst[(e / D) * ld + e % D] = V(0);
}

// One block per (b, h, tile of Br query rows): the online softmax over the
// visible key tiles (Note [Tiled CUDA attention]).
template <class V>
__global__ void attention_forward_kernel(Geometry g, Tiles t, const V* q, Strides3 sq, const V* k,
                                         Strides3 sk, const V* v, Strides3 sv, V* out, Strides3 so,
                                         float* lse) {
  TANDEM_DYNAMIC_SHARED(V, smem);
  const int64_t Br = t.br, Bc = t.bc, D = g.D, ld = D + 1, lds = Bc + 1;
  V* s_q = smem;            // (Br, ld)
  V* s_o = s_q + Br * ld;   // (Br, ld): unnormalised output, scaled to the running max
  V* s_kv = s_o + Br * ld;  // (Bc, ld): the key tile, then the value tile
  V* s_p = s_kv + Bc * ld;  // (Br, lds): scores, then exp(score - m)
  V* s_m = s_p + Br * lds;  // (Br): running max of the scores
  V* s_l = s_m + Br;        // (Br): running sum of exp(score - m)
  V* s_alpha = s_l + Br;    // (Br): this step's rescale factor exp(m_old - m_new)
  const V scale = static_cast<V>(g.scale);
  const int64_t tiles = (g.Sq + Br - 1) / Br;
  for (int64_t tile = blockIdx.x; tile < g.B * g.Hq * tiles; tile += gridDim.x) {
    const int64_t i0 = (tile % tiles) * Br, h = (tile / tiles) % g.Hq, b = tile / (tiles * g.Hq);
    const int64_t rows = min64(Br, g.Sq - i0), hk = h / g.G;
    const V* kh = k + b * sk.b + hk * sk.h;
    const V* vh = v + b * sv.b + hk * sv.h;
    load_rows(s_q, ld, q + b * sq.b + h * sq.h + i0 * sq.s, sq.s, rows, D);
    zero_rows(s_o, ld, rows, D);
    for (int64_t r = threadIdx.x; r < Br; r += blockDim.x) {
      s_m[r] = -INFINITY;
      s_l[r] = V(0);
    }
    // The keys any row of the tile sees: from the first row's begin to the last row's end.
    const int64_t n = g.end(b, i0 + rows - 1);
    for (int64_t j0 = g.begin(b, i0); j0 < n; j0 += Bc) {
      const int64_t cols = min64(Bc, n - j0);
      __syncthreads();  // the previous step's reads of s_kv and s_p are done
      load_rows(s_kv, ld, kh + j0 * sk.s, sk.s, cols, D);
      __syncthreads();
      for (int64_t e = threadIdx.x; e < Br * Bc; e += blockDim.x) {
        const int64_t r = e / Bc, c = e % Bc;
        V s = -INFINITY;
        if (r < rows && c < cols && g.sees(b, i0 + r, j0 + c)) {
          s = scale * dot(s_q + r * ld, s_kv + c * ld, D);
        }
        s_p[r * lds + c] = s;
      }
      __syncthreads();
      // One thread per row: the new max, the rescale factor and the tile's
      // probabilities relative to the new max.
      for (int64_t r = threadIdx.x; r < Br; r += blockDim.x) {
        V* pr = s_p + r * lds;
        const V m_old = s_m[r];
        V m_new = m_old;
        for (int64_t c = 0; c < cols; ++c)
          m_new = pr[c] > m_new ? pr[c] : m_new;
        V alpha = V(1), sum = V(0);
        if (isinf(m_new)) {  // no visible key yet: exp(-inf - -inf) would be NaN
          for (int64_t c = 0; c < cols; ++c)
            pr[c] = V(0);
        } else {
          alpha = detail::d_exp(m_old - m_new);  // 0 when m_old = -inf
          for (int64_t c = 0; c < cols; ++c) {
            pr[c] = detail::d_exp(pr[c] - m_new);  // masked scores: exp(-inf) = 0
            sum += pr[c];
          }
        }
        s_l[r] = alpha * s_l[r] + sum;
        s_m[r] = m_new;
        s_alpha[r] = alpha;
      }
      // The key tile's last reads were before the barrier above.
      load_rows(s_kv, ld, vh + j0 * sv.s, sv.s, cols, D);
      __syncthreads();
      for (int64_t e = threadIdx.x; e < rows * D; e += blockDim.x) {
        const int64_t r = e / D, d = e % D;
        const V* pr = s_p + r * lds;
        V acc = s_o[r * ld + d] * s_alpha[r];
        for (int64_t c = 0; c < cols; ++c)
          acc += pr[c] * s_kv[c * ld + d];
        s_o[r * ld + d] = acc;
      }
    }
    __syncthreads();
    V* oh = out + b * so.b + h * so.h + i0 * so.s;
    for (int64_t e = threadIdx.x; e < rows * D; e += blockDim.x) {
      const int64_t r = e / D, d = e % D;
      const V l = s_l[r];
      oh[r * so.s + d] = l > V(0) ? s_o[r * ld + d] / l : V(0);
    }
    float* lse_h = lse + (b * g.Hq + h) * g.Sq + i0;
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
      const V l = s_l[r];
      lse_h[r] = l > V(0) ? static_cast<float>(s_m[r] + detail::d_log(l)) : -INFINITY;
    }
    __syncthreads();  // the next tile overwrites s_q, s_o and the row statistics
  }
}

// delta[(b, h, i)] = rowsum(dO_i * O_i), one thread per row.
template <class V>
__global__ void attention_delta_kernel(Geometry g, const V* o, Strides3 so, const V* dout,
                                       Strides3 sdo, V* delta) {
  for (int64_t row = detail::grid_start(); row < g.B * g.Hq * g.Sq; row += detail::grid_step()) {
    const int64_t i = row % g.Sq, h = (row / g.Sq) % g.Hq, b = row / (g.Sq * g.Hq);
    const V* oi = o + b * so.b + h * so.h + i * so.s;
    const V* doi = dout + b * sdo.b + h * sdo.h + i * sdo.s;
    V s = 0;
    for (int64_t d = 0; d < g.D; ++d)
      s += doi[d] * oi[d];
    delta[row] = s;
  }
}

// P and dS of query row (r, i) and key (c, j) from staged rows; zero where the
// key is masked or the row's lse is -inf (it sees nothing: P = 0).
template <class V>
struct PairGrad {
  V p, ds;
};
template <class V>
__device__ PairGrad<V> pair_grad(const V* qr, const V* kc, const V* dor, const V* vc, int64_t D,
                                 V scale, float lse, V delta) {
  const V p = detail::d_exp(scale * dot(qr, kc, D) - static_cast<V>(lse));
  const V dp = dot(dor, vc, D);
  return {p, p * (dp - delta) * scale};
}

// One block per (b, hkv, tile of Bc key rows): dV = sum P^T dO and
// dK = sum dS^T Q over the query heads of the group and the query rows that
// see the tile's keys (Note [Tiled CUDA attention]).
template <class V>
__global__ void attention_dkv_kernel(Geometry g, Tiles t, const V* q, Strides3 sq, const V* k,
                                     Strides3 sk, const V* v, Strides3 sv, const float* lse,
                                     const V* delta, const V* dout, Strides3 sdo, V* dk,
                                     Strides3 sdk, V* dv, Strides3 sdv) {
  TANDEM_DYNAMIC_SHARED(V, smem);
  const int64_t Br = t.br, Bc = t.bc, D = g.D, ld = D + 1, lds = Bc + 1;
  V* s_k = smem;               // (Bc, ld)
  V* s_v = s_k + Bc * ld;      // (Bc, ld)
  V* s_dk = s_v + Bc * ld;     // (Bc, ld)
  V* s_dv = s_dk + Bc * ld;    // (Bc, ld)
  V* s_q = s_dv + Bc * ld;     // (Br, ld)
  V* s_do = s_q + Br * ld;     // (Br, ld)
  V* s_p = s_do + Br * ld;     // (Br, lds)
  V* s_ds = s_p + Br * lds;    // (Br, lds)
  V* s_lse = s_ds + Br * lds;  // (Br)
  V* s_delta = s_lse + Br;     // (Br)
  const V scale = static_cast<V>(g.scale);
  const int64_t tiles = (g.Sk + Bc - 1) / Bc;
  for (int64_t tile = blockIdx.x; tile < g.B * g.Hkv * tiles; tile += gridDim.x) {
    const int64_t j0 = (tile % tiles) * Bc, hk = (tile / tiles) % g.Hkv, b = tile / (tiles * g.Hkv);
    const int64_t cols = min64(Bc, g.Sk - j0);
    load_rows(s_k, ld, k + b * sk.b + hk * sk.h + j0 * sk.s, sk.s, cols, D);
    load_rows(s_v, ld, v + b * sv.b + hk * sv.h + j0 * sv.s, sv.s, cols, D);
    zero_rows(s_dk, ld, cols, D);
    zero_rows(s_dv, ld, cols, D);
    // No row outside [i_begin, i_end) sees any key of the tile.
    const int64_t i_begin = g.first_query(b, j0), i_end = g.last_query(b, j0 + cols);
    for (int64_t h = hk * g.G; h < (hk + 1) * g.G; ++h) {
      const V* qh = q + b * sq.b + h * sq.h;
      const V* doh = dout + b * sdo.b + h * sdo.h;
      const int64_t row_h = (b * g.Hq + h) * g.Sq;
      for (int64_t i0 = i_begin; i0 < i_end; i0 += Br) {
        const int64_t rows = min64(Br, i_end - i0);
        __syncthreads();  // the previous step's reads of s_q, s_do, s_p, s_ds are done
        load_rows(s_q, ld, qh + i0 * sq.s, sq.s, rows, D);
        load_rows(s_do, ld, doh + i0 * sdo.s, sdo.s, rows, D);
        for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
          s_lse[r] = lse[row_h + i0 + r];
          s_delta[r] = delta[row_h + i0 + r];
        }
        __syncthreads();
        for (int64_t e = threadIdx.x; e < Br * Bc; e += blockDim.x) {
          const int64_t r = e / Bc, c = e % Bc;
          PairGrad<V> pg{V(0), V(0)};
          if (r < rows && c < cols && g.sees(b, i0 + r, j0 + c) && !isinf(s_lse[r])) {
            pg = pair_grad(s_q + r * ld, s_k + c * ld, s_do + r * ld, s_v + c * ld, D, scale,
                           static_cast<float>(s_lse[r]), s_delta[r]);
          }
          s_p[r * lds + c] = pg.p;
          s_ds[r * lds + c] = pg.ds;
        }
        __syncthreads();
        for (int64_t e = threadIdx.x; e < cols * D; e += blockDim.x) {
          const int64_t c = e / D, d = e % D;
          V acc_v = s_dv[c * ld + d], acc_k = s_dk[c * ld + d];
          for (int64_t r = 0; r < rows; ++r) {
            acc_v += s_p[r * lds + c] * s_do[r * ld + d];
            acc_k += s_ds[r * lds + c] * s_q[r * ld + d];
          }
          s_dv[c * ld + d] = acc_v;
          s_dk[c * ld + d] = acc_k;
        }
      }
    }
    // Each accumulator element is written out by the thread that owns it.
    V* dkh = dk + b * sdk.b + hk * sdk.h + j0 * sdk.s;
    V* dvh = dv + b * sdv.b + hk * sdv.h + j0 * sdv.s;
    for (int64_t e = threadIdx.x; e < cols * D; e += blockDim.x) {
      const int64_t c = e / D, d = e % D;
      dkh[c * sdk.s + d] = s_dk[c * ld + d];
      dvh[c * sdv.s + d] = s_dv[c * ld + d];
    }
    __syncthreads();  // the next tile overwrites s_k, s_v and the accumulators
  }
}

// One block per (b, h, tile of Br query rows): dQ = sum dS K over the visible
// key tiles (Note [Tiled CUDA attention]).
template <class V>
__global__ void attention_dq_kernel(Geometry g, Tiles t, const V* q, Strides3 sq, const V* k,
                                    Strides3 sk, const V* v, Strides3 sv, const float* lse,
                                    const V* delta, const V* dout, Strides3 sdo, V* dq,
                                    Strides3 sdq) {
  TANDEM_DYNAMIC_SHARED(V, smem);
  const int64_t Br = t.br, Bc = t.bc, D = g.D, ld = D + 1, lds = Bc + 1;
  V* s_q = smem;               // (Br, ld)
  V* s_do = s_q + Br * ld;     // (Br, ld)
  V* s_dq = s_do + Br * ld;    // (Br, ld)
  V* s_k = s_dq + Br * ld;     // (Bc, ld)
  V* s_v = s_k + Bc * ld;      // (Bc, ld)
  V* s_ds = s_v + Bc * ld;     // (Br, lds)
  V* s_lse = s_ds + Br * lds;  // (Br)
  V* s_delta = s_lse + Br;     // (Br)
  const V scale = static_cast<V>(g.scale);
  const int64_t tiles = (g.Sq + Br - 1) / Br;
  for (int64_t tile = blockIdx.x; tile < g.B * g.Hq * tiles; tile += gridDim.x) {
    const int64_t i0 = (tile % tiles) * Br, h = (tile / tiles) % g.Hq, b = tile / (tiles * g.Hq);
    const int64_t rows = min64(Br, g.Sq - i0), hk = h / g.G;
    const int64_t row_h = (b * g.Hq + h) * g.Sq;
    const V* kh = k + b * sk.b + hk * sk.h;
    const V* vh = v + b * sv.b + hk * sv.h;
    load_rows(s_q, ld, q + b * sq.b + h * sq.h + i0 * sq.s, sq.s, rows, D);
    load_rows(s_do, ld, dout + b * sdo.b + h * sdo.h + i0 * sdo.s, sdo.s, rows, D);
    zero_rows(s_dq, ld, rows, D);
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
      s_lse[r] = lse[row_h + i0 + r];
      s_delta[r] = delta[row_h + i0 + r];
    }
    const int64_t n = g.end(b, i0 + rows - 1);
    for (int64_t j0 = g.begin(b, i0); j0 < n; j0 += Bc) {
      const int64_t cols = min64(Bc, n - j0);
      __syncthreads();  // the previous step's reads of s_k and s_ds are done
      load_rows(s_k, ld, kh + j0 * sk.s, sk.s, cols, D);
      load_rows(s_v, ld, vh + j0 * sv.s, sv.s, cols, D);
      __syncthreads();
      for (int64_t e = threadIdx.x; e < Br * Bc; e += blockDim.x) {
        const int64_t r = e / Bc, c = e % Bc;
        V ds = V(0);
        if (r < rows && c < cols && g.sees(b, i0 + r, j0 + c) && !isinf(s_lse[r])) {
          ds = pair_grad(s_q + r * ld, s_k + c * ld, s_do + r * ld, s_v + c * ld, D, scale,
                         static_cast<float>(s_lse[r]), s_delta[r])
                   .ds;
        }
        s_ds[r * lds + c] = ds;
      }
      __syncthreads();
      for (int64_t e = threadIdx.x; e < rows * D; e += blockDim.x) {
        const int64_t r = e / D, d = e % D;
        const V* dsr = s_ds + r * lds;
        V acc = s_dq[r * ld + d];
        for (int64_t c = 0; c < cols; ++c)
          acc += dsr[c] * s_k[c * ld + d];
        s_dq[r * ld + d] = acc;
      }
    }
    // Each accumulator element is written out by the thread that owns it.
    V* dqh = dq + b * sdq.b + h * sdq.h + i0 * sdq.s;
    for (int64_t e = threadIdx.x; e < rows * D; e += blockDim.x) {
      const int64_t r = e / D, d = e % D;
      dqh[r * sdq.s + d] = s_dq[r * ld + d];
    }
    __syncthreads();  // the next tile overwrites every shared array
  }
}

// Candidate (rows a block owns, rows per step of its loop), largest first.
constexpr int64_t kTileCandidates[][2] = {{64, 64}, {64, 32}, {32, 32}, {32, 16}, {16, 16},
                                          {16, 8},  {8, 8},   {8, 4},   {4, 4},   {4, 2},
                                          {2, 2},   {2, 1},   {1, 1}};

// The largest candidate whose footprint (elems(tiles) elements of `size`
// bytes) fits in kMaxSharedBytes; keys_own: the block owns key rows (Bc).
template <class Elems>
Tiles tiles_for(Elems elems, bool keys_own, int64_t D, size_t size, const char* op) {
  for (const auto& c : kTileCandidates) {
    const Tiles t = keys_own ? Tiles{c[1], c[0]} : Tiles{c[0], c[1]};
    if (elems(t) * static_cast<int64_t>(size) <= kMaxSharedBytes) return t;
  }
  TANDEM_FAIL(
      "[cuda::{}] expected a head dim whose single-row tiles fit in {} bytes of shared "
      "memory, got D={} with {}-byte elements",
      op, kMaxSharedBytes, D, size);
}

unsigned grid_for(int64_t tiles) {
  return static_cast<unsigned>(std::clamp<int64_t>(tiles, 1, int64_t{1} << 16));
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

template <class F>
void dispatch_attention(DType dtype, const char* op, F&& fn) {
  switch (dtype) {
    case DType::F32:
      return fn(float{});
    case DType::F64:
      return fn(double{});
    default:
      TANDEM_FAIL("[cuda::{}] expected f32 or f64, got {}", op, dtype_name(dtype));
  }
}

}  // namespace

void attention(const AttentionArgs& args, const TensorArg& q, const TensorArg& k,
               const TensorArg& v, const TensorArg& out, const TensorArg& lse, void* stream) {
  const Geometry g = geometry_of(args);
  if (g.B * g.Hq * g.Sq == 0) return;
  detail::StreamDeviceGuard guard(stream);
  dispatch_attention(q.dtype, "attention", [&](auto zero) {
    using V = decltype(zero);
    const Tiles t = tiles_for([&](const Tiles& c) { return c.forward_elems(g.D); }, false, g.D,
                              sizeof(V), "attention");
    detail::launch(attention_forward_kernel<V>, grid_for(g.B * g.Hq * ceil_div(g.Sq, t.br)),
                   kAttnThreads, t.forward_elems(g.D) * sizeof(V), stream, g, t,
                   static_cast<const V*>(q.data), strides_of(q), static_cast<const V*>(k.data),
                   strides_of(k), static_cast<const V*>(v.data), strides_of(v),
                   static_cast<V*>(out.data), strides_of(out), static_cast<float*>(lse.data));
  });
}

void attention_backward(const AttentionArgs& args, const TensorArg& q, const TensorArg& k,
                        const TensorArg& v, const TensorArg& out, const TensorArg& lse,
                        const TensorArg& dout, const TensorArg& dq, const TensorArg& dk,
                        const TensorArg& dv, void* stream) {
  const Geometry g = geometry_of(args);
  if (g.B * g.Hq * g.Sq == 0 || g.Sk == 0) return;
  detail::StreamDeviceGuard guard(stream);
  dispatch_attention(q.dtype, "attention_backward", [&](auto zero) {
    using V = decltype(zero);
    const V* qp = static_cast<const V*>(q.data);
    const V* kp = static_cast<const V*>(k.data);
    const V* vp = static_cast<const V*>(v.data);
    const V* dop = static_cast<const V*>(dout.data);
    const float* lp = static_cast<const float*>(lse.data);
    const int64_t rows = g.B * g.Hq * g.Sq;
    // Stream-ordered scratch, freed in stream order after the kernels that read it.
    void* buffer = nullptr;
    TANDEM_CUDA_CHECK(cudaMallocAsync(&buffer, rows * sizeof(V), detail::native(stream)));
    V* delta = static_cast<V*>(buffer);
    detail::launch(attention_delta_kernel<V>, detail::blocks_for(rows), detail::kThreads, 0, stream,
                   g, static_cast<const V*>(out.data), strides_of(out), dop, strides_of(dout),
                   delta);
    const Tiles tkv = tiles_for([&](const Tiles& c) { return c.dkv_elems(g.D); }, true, g.D,
                                sizeof(V), "attention_backward");
    detail::launch(attention_dkv_kernel<V>, grid_for(g.B * g.Hkv * ceil_div(g.Sk, tkv.bc)),
                   kAttnThreads, tkv.dkv_elems(g.D) * sizeof(V), stream, g, tkv, qp, strides_of(q),
                   kp, strides_of(k), vp, strides_of(v), lp, delta, dop, strides_of(dout),
                   static_cast<V*>(dk.data), strides_of(dk), static_cast<V*>(dv.data),
                   strides_of(dv));
    const Tiles tq = tiles_for([&](const Tiles& c) { return c.dq_elems(g.D); }, false, g.D,
                               sizeof(V), "attention_backward");
    detail::launch(attention_dq_kernel<V>, grid_for(g.B * g.Hq * ceil_div(g.Sq, tq.br)),
                   kAttnThreads, tq.dq_elems(g.D) * sizeof(V), stream, g, tq, qp, strides_of(q), kp,
                   strides_of(k), vp, strides_of(v), lp, delta, dop, strides_of(dout),
                   static_cast<V*>(dq.data), strides_of(dq));
    TANDEM_CUDA_CHECK(cudaFreeAsync(buffer, detail::native(stream)));
  });
}

}  // namespace tandem::TANDEM_KERNEL_SET
