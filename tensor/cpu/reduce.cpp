// CPU reductions, softmax and cumsum over a contiguous (outer, r, inner) view.
// Sums accumulate in acc_t (double for f64, float otherwise) with eight
// independent lanes when inner == 1, which both vectorises and bounds the
// rounding error growth on long rows.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "tensor/kernels.h"

namespace tandem::cpu {
namespace {

template <class T, class A>
A row_sum(const T* x, int64_t n) {
  A lanes[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l)
      lanes[l] += A(x[i + l]);
  }
  for (; i < n; ++i)
    lanes[0] += A(x[i]);
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
         ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

template <class A>
bool better(A candidate, A best, bool want_max) {
  if (candidate != candidate) return best == best;  // NaN wins (propagates), first NaN kept
  if (best != best) return false;
  return want_max ? candidate > best : candidate < best;
}

}  // namespace

void reduce(ReduceOp op, const TensorArg& in, int64_t outer, int64_t r, int64_t inner,
            const TensorArg& out) {
  dispatch_dtype(in.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = std::conditional_t<std::is_same_v<T, bool>, int64_t, acc_t<T>>;
    const T* x = static_cast<const T*>(in.data);
    if (op == ReduceOp::Sum || op == ReduceOp::Mean) {
      T* y = static_cast<T*>(out.data);
      const A scale = op == ReduceOp::Mean && r > 0 ? A(1) / A(r) : A(1);
      std::vector<A> acc(static_cast<size_t>(inner));
      for (int64_t o = 0; o < outer; ++o) {
        const T* base = x + o * r * inner;
        if (inner == 1) {
          A s = row_sum<T, A>(base, r);
          y[o] = static_cast<T>(op == ReduceOp::Mean ? s * scale : s);
          continue;
        }
        std::fill(acc.begin(), acc.end(), A(0));
        for (int64_t j = 0; j < r; ++j) {
          const T* row = base + j * inner;
          for (int64_t i = 0; i < inner; ++i)
            acc[i] += A(row[i]);
        }
        for (int64_t i = 0; i < inner; ++i) {
          y[o * inner + i] = static_cast<T>(op == ReduceOp::Mean ? acc[i] * scale : acc[i]);
        }
      }
      return;
    }
    const bool want_max = op == ReduceOp::Max || op == ReduceOp::Argmax;
    const bool want_index = op == ReduceOp::Argmax || op == ReduceOp::Argmin;
    for (int64_t o = 0; o < outer; ++o) {
      for (int64_t i = 0; i < inner; ++i) {
        const T* p = x + o * r * inner + i;
        A best = A(p[0]);
        int64_t best_j = 0;
        for (int64_t j = 1; j < r; ++j) {
          A v = A(p[j * inner]);
          if (better(v, best, want_max)) {
            best = v;
            best_j = j;
          }
        }
        if (want_index) {
          static_cast<int64_t*>(out.data)[o * inner + i] = best_j;
        } else {
          static_cast<T*>(out.data)[o * inner + i] = static_cast<T>(best);
        }
      }
    }
  });
}

void softmax(const TensorArg& in, int64_t outer, int64_t r, int64_t inner, bool log,
             const TensorArg& out) {
  dispatch_floating(in.dtype, "softmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    const T* x = static_cast<const T*>(in.data);
    T* y = static_cast<T*>(out.data);
    std::vector<A> buf(static_cast<size_t>(r));
    for (int64_t o = 0; o < outer; ++o) {
      for (int64_t i = 0; i < inner; ++i) {
        const T* p = x + o * r * inner + i;
        T* q = y + o * r * inner + i;
        A m = -std::numeric_limits<A>::infinity();
        for (int64_t j = 0; j < r; ++j)
          m = std::max(m, A(p[j * inner]));
        if (m == -std::numeric_limits<A>::infinity()) m = 0;  // all -inf: avoid inf - inf
        A s = 0;
        if (log) {
          for (int64_t j = 0; j < r; ++j)
            s += std::exp(A(p[j * inner]) - m);
          const A shift = m + std::log(s);
          for (int64_t j = 0; j < r; ++j)
            q[j * inner] = static_cast<T>(A(p[j * inner]) - shift);
        } else if constexpr (std::is_same_v<T, A>) {
          // The exponentials go straight into the output, then one scaling pass.
          if (inner == 1) {
            for (int64_t j = 0; j < r; ++j) {
              q[j] = std::exp(p[j] - m);
              s += q[j];
            }
            const A inv = s > A(0) ? A(1) / s : A(0);  // a fully masked row gives zeros
            for (int64_t j = 0; j < r; ++j)
              q[j] *= inv;
          } else {
            for (int64_t j = 0; j < r; ++j) {
              q[j * inner] = std::exp(p[j * inner] - m);
              s += q[j * inner];
            }
            const A inv = s > A(0) ? A(1) / s : A(0);  // a fully masked row gives zeros
            for (int64_t j = 0; j < r; ++j)
              q[j * inner] *= inv;
          }
        } else {
          for (int64_t j = 0; j < r; ++j) {
            buf[j] = std::exp(A(p[j * inner]) - m);
            s += buf[j];
          }
          const A inv = s > A(0) ? A(1) / s : A(0);  // a fully masked row gives zeros
          for (int64_t j = 0; j < r; ++j)
            q[j * inner] = static_cast<T>(buf[j] * inv);
        }
      }
    }
  });
}

void cumsum(const TensorArg& in, int64_t outer, int64_t r, int64_t inner, const TensorArg& out) {
  dispatch_dtype(in.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = std::conditional_t<std::is_same_v<T, bool>, int64_t, acc_t<T>>;
    const T* x = static_cast<const T*>(in.data);
    T* y = static_cast<T*>(out.data);
    for (int64_t o = 0; o < outer; ++o) {
      for (int64_t i = 0; i < inner; ++i) {
        A s = 0;
        for (int64_t j = 0; j < r; ++j) {
          int64_t at = (o * r + j) * inner + i;
          s += A(x[at]);
          y[at] = static_cast<T>(s);
        }
      }
    }
  });
}

}  // namespace tandem::cpu
