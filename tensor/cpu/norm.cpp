// CPU kernels for layer_norm and rms_norm over the last dim, forward and
// backward (the interface is in tensor/kernels.h; front ends in
// tensor/ops_nn.cpp).
//
// Statistics are accumulated in acc_t<T> (f32 for the 16-bit types, f64 for
// f64), in the order of Note [Cascade summation] (tensor/cpu/cascade.h).
// layer_norm takes the variance in a second pass over the centred row
// rather than E[x^2] - E[x]^2, which cancels catastrophically when |mean| is
// large next to the spread. mean and rstd are stored as f32 whatever T is,
// because that is what the backward pass and the CUDA kernels exchange.
//
// Note [Fused norm backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// The backward of both norms is one kernel instead of the ~13 composite ops
// (casts, centring, two row means, products, column sums) it used to be:
// with xhat = (x - mean) * rstd (rms_norm: x * rstd) and gw = dy * weight,
//   dx      = rstd * (gw - mean_row(gw) - xhat * mean_row(gw * xhat))
//             (rms_norm drops the mean_row(gw) term),
//   dweight = sum_rows(dy * xhat),   dbias = sum_rows(dy).
// A row is read twice (sums, then dx) while it is still in L1. The column
// sums are taken per fixed block of kRowBlock rows and the block partials
// added pairwise (Note [Cascade summation]: groups of 2^j blocks per task,
// then the group sums), so dweight and dbias have the same bits at any thread
// count (Note [CPU kernel threads]).
#include <algorithm>
#include <cmath>
#include <vector>

#include "tandem/tensor/cpu/cascade.h"
#include "tandem/tensor/cpu/parallel.h"
#include "tandem/tensor/cpu/simd.h"
#include "tandem/tensor/kernels.h"

namespace tandem::cpu {
namespace {

using simd::Vec;

// A norm backward is split into at most this many groups of row blocks.
constexpr int64_t kMaxGroups = 64;

// W consecutive elements of T as a vector of A (converting 16-bit types).
template <class A, class T>
inline Vec<A> load_as(const T* p) {
  if constexpr (std::is_same_v<T, A>) {
    return simd::load(p);
  } else {
    Vec<A> v;
    for (int64_t i = 0; i < simd::kWidth<A>; ++i)
      v[i] = static_cast<A>(p[i]);
    return v;
  }
}
template <class A, class T>
inline void store_as(T* p, Vec<A> v) {
  if constexpr (std::is_same_v<T, A>) {
    simd::store(p, v);
  } else {
    for (int64_t i = 0; i < simd::kWidth<A>; ++i)
      p[i] = static_cast<T>(v[i]);
  }
}

// A parameter vector (weight or bias) in A, or empty when absent.
template <class A, class T>
std::vector<A> param_as(const TensorArg& p, int64_t d) {
  if (p.data == nullptr) return {};
  const T* src = static_cast<const T*>(p.data);
  return std::vector<A>(src, src + d);
}

// Grain of the row loops: enough rows that a chunk is worth a thread.
int64_t row_grain(int64_t d) {
  return std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(d, 1));
}

// What the rows of a norm backward read and write (Note [Fused norm backward]).
template <class T, class A>
struct BackwardRows {
  const T* x;
  const T* dy;
  T* dx;
  const float* mean;  // null: rms_norm
  const float* rstd;
  const A* w;  // the weight, or ones when there is none
  int64_t d;
  int64_t dv;  // d rounded down to the SIMD width
  A inv_d;
  bool want_w, want_b;
};

// Row r of a norm backward: adds its dweight and dbias terms to the block's
// column partials pw and pb, and writes its dx.
template <class T, class A>
void backprop_row(const BackwardRows<T, A>& a, int64_t r, A* pw, A* pb) {
  constexpr int64_t W = simd::kWidth<A>;
  const int64_t d = a.d, dv = a.dv;
  const A inv_d = a.inv_d;
  const bool want_w = a.want_w, want_b = a.want_b;
  const A* wp = a.w;
  const T* xr = a.x + r * d;
  const T* gr = a.dy + r * d;
  T* dxr = a.dx + r * d;
  const A mu = a.mean != nullptr ? static_cast<A>(a.mean[r]) : A(0);
  const A rs = static_cast<A>(a.rstd[r]);
  // Pass 1: row sums of gw and gw * xhat, and the column partials.
  const A s1 = a.mean == nullptr
                   ? A(0)
                   : cascade_sum<A>(d, [&](int64_t j) { return static_cast<A>(gr[j]) * wp[j]; });
  const A s2 = cascade_sum<A>(d, [&](int64_t j) {
    return static_cast<A>(gr[j]) * wp[j] * ((static_cast<A>(xr[j]) - mu) * rs);
  });
  for (int64_t j = 0; j < dv; j += W) {
    const Vec<A> g = load_as<A>(gr + j);
    if (want_w) simd::store(pw + j, simd::load(pw + j) + g * ((load_as<A>(xr + j) - mu) * rs));
    if (want_b) simd::store(pb + j, simd::load(pb + j) + g);
  }
  for (int64_t j = dv; j < d; ++j) {
    const A g = static_cast<A>(gr[j]);
    if (want_w) pw[j] += g * ((static_cast<A>(xr[j]) - mu) * rs);
    if (want_b) pb[j] += g;
  }
  const A m1 = s1 * inv_d;
  const A m2 = s2 * inv_d;
  // Pass 2: dx.
  for (int64_t j = 0; j < dv; j += W) {
    const Vec<A> xh = (load_as<A>(xr + j) - mu) * rs;
    const Vec<A> gw = load_as<A>(gr + j) * simd::load(wp + j);
    store_as<A>(dxr + j, (gw - m1 - xh * m2) * rs);
  }
  for (int64_t j = dv; j < d; ++j) {
    const A xh = (static_cast<A>(xr[j]) - mu) * rs;
    const A gw = static_cast<A>(gr[j]) * wp[j];
    dxr[j] = static_cast<T>((gw - m1 - xh * m2) * rs);
  }
}

}  // namespace

void layer_norm(const TensorArg& x, const TensorArg& weight, const TensorArg& bias, double eps,
                int64_t rows, int64_t d, const TensorArg& out, const TensorArg& mean,
                const TensorArg& rstd) {
  dispatch_floating(x.dtype, "layer_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    const T* xp = static_cast<const T*>(x.data);
    const std::vector<A> w = param_as<A, T>(weight, d), b = param_as<A, T>(bias, d);
    T* op = static_cast<T*>(out.data);
    float* mean_p = static_cast<float*>(mean.data);
    float* rstd_p = static_cast<float*>(rstd.data);
    // An empty row has no statistics; mean 0 keeps the outputs finite.
    const A inv_d = d > 0 ? A(1) / static_cast<A>(d) : A(0);
    parallel_for(rows, row_grain(d), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* row = xp + r * d;
        T* orow = op + r * d;
        const A sum = cascade_sum<A>(d, [row](int64_t j) { return static_cast<A>(row[j]); });
        const A mu = sum * inv_d;
        const A sq = cascade_sum<A>(d, [row, mu](int64_t j) {
          const A c = static_cast<A>(row[j]) - mu;
          return c * c;
        });
        const A rs = A(1) / std::sqrt(sq * inv_d + static_cast<A>(eps));
        for (int64_t j = 0; j < d; ++j) {
          A y = (static_cast<A>(row[j]) - mu) * rs;
          if (!w.empty()) y *= w[j];
          if (!b.empty()) y += b[j];
          orow[j] = static_cast<T>(y);
        }
        mean_p[r] = static_cast<float>(mu);
        rstd_p[r] = static_cast<float>(rs);
      }
    });
  });
}

void rms_norm(const TensorArg& x, const TensorArg& weight, double eps, int64_t rows, int64_t d,
              const TensorArg& out, const TensorArg& rstd) {
  dispatch_floating(x.dtype, "rms_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    const T* xp = static_cast<const T*>(x.data);
    const std::vector<A> w = param_as<A, T>(weight, d);
    T* op = static_cast<T*>(out.data);
    float* rstd_p = static_cast<float*>(rstd.data);
    const A inv_d = d > 0 ? A(1) / static_cast<A>(d) : A(0);
    parallel_for(rows, row_grain(d), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* row = xp + r * d;
        T* orow = op + r * d;
        const A sq = cascade_sum<A>(d, [row](int64_t j) {
          const A v = static_cast<A>(row[j]);
          return v * v;
        });
        const A rs = A(1) / std::sqrt(sq * inv_d + static_cast<A>(eps));
        for (int64_t j = 0; j < d; ++j) {
          A y = static_cast<A>(row[j]) * rs;
          if (!w.empty()) y *= w[j];
          orow[j] = static_cast<T>(y);
        }
        rstd_p[r] = static_cast<float>(rs);
      }
    });
  });
}

// Note [Fused norm backward].
void norm_backward(const TensorArg& dy, const TensorArg& x, const TensorArg& weight,
                   const TensorArg& mean, const TensorArg& rstd, int64_t rows, int64_t d,
                   const TensorArg& dx, const TensorArg& dweight, const TensorArg& dbias) {
  dispatch_floating(x.dtype, "norm_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    constexpr int64_t W = simd::kWidth<A>;
    const std::vector<A> w = param_as<A, T>(weight, d);
    const bool want_w = dweight.data != nullptr, want_b = dbias.data != nullptr;
    const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
    // Tasks of per_group row blocks (Note [Cascade summation]).
    const int64_t per_group = blocks_per_group(blocks, kMaxGroups);
    const int64_t groups = (blocks + per_group - 1) / per_group;
    // Per group: the dweight partial, then the dbias partial.
    const int64_t stride = (want_w ? d : 0) + (want_b ? d : 0);
    std::vector<A> partial(static_cast<size_t>(groups * stride), A(0));
    std::vector<A> ones;
    if (w.empty()) ones.assign(static_cast<size_t>(d), A(1));
    BackwardRows<T, A> args{};
    args.x = static_cast<const T*>(x.data);
    args.dy = static_cast<const T*>(dy.data);
    args.dx = static_cast<T*>(dx.data);
    args.mean = static_cast<const float*>(mean.data);
    args.rstd = static_cast<const float*>(rstd.data);
    args.w = w.empty() ? ones.data() : w.data();
    args.d = d;
    args.dv = d / W * W;
    args.inv_d = d > 0 ? A(1) / static_cast<A>(d) : A(0);
    args.want_w = want_w;
    args.want_b = want_b;
    const int64_t grain = std::max<int64_t>(1, row_grain(d) / (kRowBlock * per_group));
    parallel_for(groups, grain, [&](int64_t g0, int64_t g1) {
      std::vector<A> block(static_cast<size_t>(stride));
      for (int64_t grp = g0; grp < g1; ++grp) {
        PairwiseColumns<A> columns(stride);
        const int64_t blk_end = std::min(blocks, (grp + 1) * per_group);
        for (int64_t blk = grp * per_group; blk < blk_end; ++blk) {
          std::fill(block.begin(), block.end(), A(0));
          A* pw = block.data();
          A* pb = pw + (want_w ? d : 0);
          const int64_t r_end = std::min(rows, (blk + 1) * kRowBlock);
          for (int64_t r = blk * kRowBlock; r < r_end; ++r)
            backprop_row(args, r, pw, pb);
          columns.add(block.data());
        }
        columns.total(partial.data() + grp * stride);
      }
    });
    // The group sums, pairwise.
    std::vector<A> total(static_cast<size_t>(stride));
    pairwise_sum_columns(partial.data(), groups, stride, stride, total.data());
    if (want_w) std::copy(total.begin(), total.begin() + d, static_cast<A*>(dweight.data));
    if (want_b) {
      std::copy(total.begin() + (want_w ? d : 0), total.end(), static_cast<A*>(dbias.data));
    }
  });
}

}  // namespace tandem::cpu
