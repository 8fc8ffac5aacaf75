// CUDA fused scaled dot-product attention, forward and backward (interface in
// tensor/kernels.h; the CPU kernel and its Note [Fused CPU attention] are in
// tensor/cpu/attention.cpp). f32 and f64 (the front end computes 16-bit
// inputs in f32).
//
// A straightforward kernel, written for correctness first: one block per query
// row (forward, dq) or key row (dk, dv), the dot products recomputed where
// needed rather than staged through shared-memory tiles, keys (or queries)
// taken in chunks of blockDim whose probabilities are staged in shared memory
// and then multiplied into the row's output by the threads of the block, one
// head-dim element each. Every output element is written by one thread in a
// fixed order, so the results are deterministic; dk/dv need no atomics since
// a key row's block loops over every query row (and query head of its group)
// that sees it. Causal masking skips the masked keys; rows that see no key get
// a zero output, lse = -inf and zero gradients, as on the CPU.
#include "tensor/cuda/cuda_common.cuh"

namespace tandem::TANDEM_KERNEL_SET {
namespace {

constexpr int kAttnThreads = 128;

// Element strides of a (B, H, S, D) operand.
struct Strides4 {
  int64_t b, h, s, d;
};
Strides4 strides_of(const TensorArg& t) {
  return {t.strides[0], t.strides[1], t.strides[2], t.strides[3]};
}

struct Geometry {
  int64_t B, Hq, Hkv, G, Sq, Sk, D;
  double scale;
  bool causal;
  int64_t q_offset, k_offset;
  // Keys visible to query row i: [0, visible(i)).
  __device__ int64_t visible(int64_t i) const {
    if (!causal) return Sk;
    const int64_t n = q_offset + i - k_offset + 1;
    return n < 0 ? 0 : (n > Sk ? Sk : n);
  }
  // Query rows that see key j: [first_query(j), Sq).
  __device__ int64_t first_query(int64_t j) const {
    if (!causal) return 0;
    const int64_t i = j + k_offset - q_offset;
    return i < 0 ? 0 : (i > Sq ? Sq : i);
  }
};

Geometry geometry_of(const AttentionArgs& a) {
  return {a.batch,  a.heads_q,  a.heads_kv, a.heads_q / a.heads_kv,
          a.seq_q,  a.seq_k,    a.dim,      a.scale,
          a.causal, a.q_offset, a.k_offset};
}

template <class V>
__device__ V dot(const V* x, int64_t xs, const V* y, int64_t ys, int64_t n) {
  V s = 0;
  for (int64_t d = 0; d < n; ++d)
    s += x[d * xs] * y[d * ys];
  return s;
}

template <class V>
__device__ V block_sum(V v, V* shared) {
  return detail::block_reduce(v, shared, [](V a, V b) { return a + b; });
}
template <class V>
__device__ V block_max(V v, V* shared) {
  return detail::block_reduce(v, shared, [](V a, V b) { return a > b ? a : b; });
}

// One block per (b, h, i): lse, then out = sum_j p_j v_j.
template <class V>
__global__ void attention_forward_kernel(Geometry g, const V* q, Strides4 sq, const V* k,
                                         Strides4 sk, const V* v, Strides4 sv, V* out, Strides4 so,
                                         float* lse) {
  TANDEM_SHARED(V, shared, kAttnThreads);
  TANDEM_SHARED(V, p_chunk, kAttnThreads);
  const V scale = static_cast<V>(g.scale);
  for (int64_t row = blockIdx.x; row < g.B * g.Hq * g.Sq; row += gridDim.x) {
    const int64_t i = row % g.Sq, h = (row / g.Sq) % g.Hq, b = row / (g.Sq * g.Hq);
    const int64_t hk = h / g.G, n = g.visible(i);
    const V* qi = q + b * sq.b + h * sq.h + i * sq.s;
    const V* kh = k + b * sk.b + hk * sk.h;
    const V* vh = v + b * sv.b + hk * sv.h;
    V* oi = out + b * so.b + h * so.h + i * so.s;
    V m = -INFINITY;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const V s = scale * dot(qi, sq.d, kh + j * sk.s, sk.d, g.D);
      m = s > m ? s : m;
    }
    m = block_max(m, shared);
    detail::CascadeSum<V> partial;  // Note [Cascade summation]
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
      partial.add(detail::d_exp(scale * dot(qi, sq.d, kh + j * sk.s, sk.d, g.D) - m));
    const V z = block_sum(partial.total(), shared);
    if (threadIdx.x == 0) {
      lse[row] = n == 0 ? -INFINITY : static_cast<float>(m + detail::d_log(z));
    }
    for (int64_t d = threadIdx.x; d < g.D; d += blockDim.x)
      oi[d * so.d] = V(0);
    for (int64_t j0 = 0; j0 < n; j0 += blockDim.x) {
      const int64_t j = j0 + threadIdx.x;
      p_chunk[threadIdx.x] =
          j < n ? detail::d_exp(scale * dot(qi, sq.d, kh + j * sk.s, sk.d, g.D) - m) / z : V(0);
      __syncthreads();
      const int64_t count = n - j0 < blockDim.x ? n - j0 : blockDim.x;
      for (int64_t d = threadIdx.x; d < g.D; d += blockDim.x) {
        V acc = oi[d * so.d];
        for (int64_t jj = 0; jj < count; ++jj)
          acc += p_chunk[jj] * vh[(j0 + jj) * sv.s + d * sv.d];
        oi[d * so.d] = acc;
      }
      __syncthreads();
    }
  }
}

// P_ij and dS_ij of one (query row, key) pair; delta = rowsum(dO_i * O_i).
template <class V>
struct PairGrad {
  V p, ds;
};
template <class V>
__device__ PairGrad<V> pair_grad(const Geometry& g, const V* qi, int64_t qs, const V* kj,
                                 int64_t ks, const V* vj, int64_t vs, const V* doi, int64_t dos,
                                 float lse, V delta) {
  const V scale = static_cast<V>(g.scale);
  const V p = detail::d_exp(scale * dot(qi, qs, kj, ks, g.D) - static_cast<V>(lse));
  const V dp = dot(doi, dos, vj, vs, g.D);
  return {p, p * (dp - delta) * scale};
}

// One block per (b, h, i): dq_i = sum_j dS_ij k_j.
template <class V>
__global__ void attention_dq_kernel(Geometry g, const V* q, Strides4 sq, const V* k, Strides4 sk,
                                    const V* v, Strides4 sv, const V* o, Strides4 so,
                                    const float* lse, const V* dout, Strides4 sdo, V* dq,
                                    Strides4 sdq) {
  TANDEM_SHARED(V, shared, kAttnThreads);
  TANDEM_SHARED(V, ds_chunk, kAttnThreads);
  for (int64_t row = blockIdx.x; row < g.B * g.Hq * g.Sq; row += gridDim.x) {
    const int64_t i = row % g.Sq, h = (row / g.Sq) % g.Hq, b = row / (g.Sq * g.Hq);
    const int64_t hk = h / g.G;
    const float l = lse[row];
    const int64_t n = isinf(l) ? 0 : g.visible(i);  // lse = -inf: P = 0
    const V* qi = q + b * sq.b + h * sq.h + i * sq.s;
    const V* oi = o + b * so.b + h * so.h + i * so.s;
    const V* doi = dout + b * sdo.b + h * sdo.h + i * sdo.s;
    const V* kh = k + b * sk.b + hk * sk.h;
    const V* vh = v + b * sv.b + hk * sv.h;
    V* dqi = dq + b * sdq.b + h * sdq.h + i * sdq.s;
    V part = 0;
    for (int64_t d = threadIdx.x; d < g.D; d += blockDim.x)
      part += doi[d * sdo.d] * oi[d * so.d];
    const V delta = block_sum(part, shared);
    for (int64_t d = threadIdx.x; d < g.D; d += blockDim.x)
      dqi[d * sdq.d] = V(0);
    for (int64_t j0 = 0; j0 < n; j0 += blockDim.x) {
      const int64_t j = j0 + threadIdx.x;
      ds_chunk[threadIdx.x] = j < n ? pair_grad(g, qi, sq.d, kh + j * sk.s, sk.d, vh + j * sv.s,
                                                sv.d, doi, sdo.d, l, delta)
                                          .ds
                                    : V(0);
      __syncthreads();
      const int64_t count = n - j0 < blockDim.x ? n - j0 : blockDim.x;
      for (int64_t d = threadIdx.x; d < g.D; d += blockDim.x) {
        V acc = dqi[d * sdq.d];
        for (int64_t jj = 0; jj < count; ++jj)
          acc += ds_chunk[jj] * kh[(j0 + jj) * sk.s + d * sk.d];
        dqi[d * sdq.d] = acc;
      }
      __syncthreads();
    }
  }
}

// One block per (b, hkv, j): dv_j = sum_(h, i) P_ij dO_i, dk_j = sum dS_ij q_i
// over the query heads h of the group and the query rows that see key j.
template <class V>
__global__ void attention_dkv_kernel(Geometry g, const V* q, Strides4 sq, const V* k, Strides4 sk,
                                     const V* v, Strides4 sv, const V* o, Strides4 so,
                                     const float* lse, const V* dout, Strides4 sdo, V* dk,
                                     Strides4 sdk, V* dv, Strides4 sdv) {
  TANDEM_SHARED(V, p_chunk, kAttnThreads);
  TANDEM_SHARED(V, ds_chunk, kAttnThreads);
  for (int64_t row = blockIdx.x; row < g.B * g.Hkv * g.Sk; row += gridDim.x) {
    const int64_t j = row % g.Sk, hk = (row / g.Sk) % g.Hkv, b = row / (g.Sk * g.Hkv);
    const V* kj = k + b * sk.b + hk * sk.h + j * sk.s;
    const V* vj = v + b * sv.b + hk * sv.h + j * sv.s;
    V* dkj = dk + b * sdk.b + hk * sdk.h + j * sdk.s;
    V* dvj = dv + b * sdv.b + hk * sdv.h + j * sdv.s;
    for (int64_t d = threadIdx.x; d < g.D; d += blockDim.x) {
      dkj[d * sdk.d] = V(0);
      dvj[d * sdv.d] = V(0);
    }
    const int64_t i_first = g.first_query(j);
    for (int64_t h = hk * g.G; h < (hk + 1) * g.G; ++h) {
      const V* qh = q + b * sq.b + h * sq.h;
      const V* oh = o + b * so.b + h * so.h;
      const V* doh = dout + b * sdo.b + h * sdo.h;
      const float* lse_h = lse + (b * g.Hq + h) * g.Sq;
      for (int64_t i0 = i_first; i0 < g.Sq; i0 += blockDim.x) {
        const int64_t i = i0 + threadIdx.x;
        V p = 0, ds = 0;
        if (i < g.Sq && !isinf(lse_h[i])) {
          const V delta = dot(doh + i * sdo.s, sdo.d, oh + i * so.s, so.d, g.D);
          const PairGrad<V> pg = pair_grad(g, qh + i * sq.s, sq.d, kj, sk.d, vj, sv.d,
                                           doh + i * sdo.s, sdo.d, lse_h[i], delta);
          p = pg.p;
          ds = pg.ds;
        }
        p_chunk[threadIdx.x] = p;
        ds_chunk[threadIdx.x] = ds;
        __syncthreads();
        const int64_t count = g.Sq - i0 < blockDim.x ? g.Sq - i0 : blockDim.x;
        for (int64_t d = threadIdx.x; d < g.D; d += blockDim.x) {
          V acc_v = dvj[d * sdv.d], acc_k = dkj[d * sdk.d];
          for (int64_t ii = 0; ii < count; ++ii) {
            acc_v += p_chunk[ii] * doh[(i0 + ii) * sdo.s + d * sdo.d];
            acc_k += ds_chunk[ii] * qh[(i0 + ii) * sq.s + d * sq.d];
          }
          dvj[d * sdv.d] = acc_v;
          dkj[d * sdk.d] = acc_k;
        }
        __syncthreads();
      }
    }
  }
}

unsigned grid_for(int64_t rows) {
  return static_cast<unsigned>(std::clamp<int64_t>(rows, 1, int64_t{1} << 16));
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
    detail::launch(attention_forward_kernel<V>, grid_for(g.B * g.Hq * g.Sq), kAttnThreads, 0,
                   stream, g, static_cast<const V*>(q.data), strides_of(q),
                   static_cast<const V*>(k.data), strides_of(k), static_cast<const V*>(v.data),
                   strides_of(v), static_cast<V*>(out.data), strides_of(out),
                   static_cast<float*>(lse.data));
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
    const V* op = static_cast<const V*>(out.data);
    const V* dop = static_cast<const V*>(dout.data);
    const float* lp = static_cast<const float*>(lse.data);
    detail::launch(attention_dq_kernel<V>, grid_for(g.B * g.Hq * g.Sq), kAttnThreads, 0, stream, g,
                   qp, strides_of(q), kp, strides_of(k), vp, strides_of(v), op, strides_of(out), lp,
                   dop, strides_of(dout), static_cast<V*>(dq.data), strides_of(dq));
    detail::launch(attention_dkv_kernel<V>, grid_for(g.B * g.Hkv * g.Sk), kAttnThreads, 0, stream,
                   g, qp, strides_of(q), kp, strides_of(k), vp, strides_of(v), op, strides_of(out),
                   lp, dop, strides_of(dout), static_cast<V*>(dk.data), strides_of(dk),
                   static_cast<V*>(dv.data), strides_of(dv));
  });
}

}  // namespace tandem::TANDEM_KERNEL_SET
