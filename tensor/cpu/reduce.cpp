// CPU reductions, softmax and cumsum over a contiguous (outer, r, inner) view.
// Sums accumulate in acc_t (double for f64, float otherwise; i64 for the
// integers) in the order of Note [Cascade summation] (tensor/cpu/cascade.h),
// whatever the layout: along contiguous rows when inner == 1, down the
// columns of each (r, inner) slab otherwise. Work is split over the kernel
// threads only at the fixed points that note allows, so every result has the
// same bits at any thread count.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "tandem/tensor/cpu/cascade.h"
#include "tandem/tensor/cpu/parallel.h"
#include "tandem/tensor/kernels.h"

namespace tandem::cpu {
namespace {

// Elements a chunk of parallel work should cover to be worth a thread.
constexpr int64_t kGrainElements = int64_t{1} << 15;
// Columns side by side in one column task (a few KiB of accumulators).
constexpr int64_t kColumnChunk = 256;
// A long sum is split into at most this many groups of blocks per output.
constexpr int64_t kMaxGroups = 64;

int64_t grain_for(int64_t elements_per_task) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(elements_per_task, 1));
}

template <class T, class A>
A load(const T* p, int64_t i) {
  return static_cast<A>(p[i]);
}

// y[o] = scale * sum of the contiguous row o of length r (inner == 1).
template <class T, class A>
void sum_rows(const T* x, int64_t outer, int64_t r, T* y, A scale, bool apply_scale) {
  const int64_t blocks = std::max<int64_t>(1, (r + kSumBlock - 1) / kSumBlock);
  const int64_t per_group = blocks_per_group(blocks, kMaxGroups);
  const int64_t groups = (blocks + per_group - 1) / per_group;
  const int64_t group_len = per_group * kSumBlock;
  auto row_part = [&](int64_t o, int64_t g) {
    const int64_t begin = g * group_len, n = std::min(group_len, r - begin);
    const T* p = x + o * r + begin;
    return cascade_sum<A>(n, [p](int64_t i) { return load<T, A>(p, i); });
  };
  auto finish = [&](A s) { return static_cast<T>(apply_scale ? s * scale : s); };
  if (groups == 1) {  // short rows: one task per row, no partials
    parallel_for(outer, grain_for(r), [&](int64_t o0, int64_t o1) {
      for (int64_t o = o0; o < o1; ++o)
        y[o] = finish(row_part(o, 0));
    });
    return;
  }
  std::vector<A> partial(static_cast<size_t>(outer * groups));
  parallel_for(outer * groups, grain_for(group_len), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      partial[t] = row_part(t / groups, t % groups);
  });
  for (int64_t o = 0; o < outer; ++o)
    y[o] = finish(pairwise_sum(partial.data() + o * groups, groups));
}

// y[o, c] = scale * sum over j of x[o, j, c] (inner > 1): row blocks of
// kRowBlock rows, vectorised across the columns, then pairwise.
template <class T, class A>
void sum_columns(const T* x, int64_t outer, int64_t r, int64_t inner, T* y, A scale,
                 bool apply_scale) {
  const int64_t blocks = std::max<int64_t>(1, (r + kRowBlock - 1) / kRowBlock);
  const int64_t per_group = blocks_per_group(blocks, kMaxGroups);
  const int64_t groups = (blocks + per_group - 1) / per_group;
  const int64_t group_rows = per_group * kRowBlock;
  const int64_t chunks = (inner + kColumnChunk - 1) / kColumnChunk;
  // partial[(o, g), c]: the sum of group g of slab o's column c.
  std::vector<A> partial(static_cast<size_t>(outer * groups * inner));
  const int64_t tasks = outer * groups * chunks;
  const int64_t task_elements = std::min(r, group_rows) * std::min(inner, kColumnChunk);
  parallel_for(tasks, grain_for(task_elements), [&](int64_t t0, int64_t t1) {
    std::vector<A> block(static_cast<size_t>(kColumnChunk));
    PairwiseColumns<A> sum(kColumnChunk);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c = t % chunks, og = t / chunks;
      const int64_t o = og / groups, g = og % groups;
      const int64_t c0 = c * kColumnChunk, width = std::min(kColumnChunk, inner - c0);
      const int64_t row0 = g * group_rows, row1 = std::min(r, row0 + group_rows);
      A* out = partial.data() + og * inner + c0;
      // A group of one block (short columns) is its block's sum itself.
      const bool one_block = row1 - row0 <= kRowBlock;
      A* acc = one_block ? out : block.data();
      sum.reset(width);
      for (int64_t b = row0; b < row1 || b == row0; b += kRowBlock) {
        std::fill(acc, acc + width, A(0));
        const int64_t b1 = std::min(row1, b + kRowBlock);
        for (int64_t j = b; j < b1; ++j) {
          const T* row = x + (o * r + j) * inner + c0;
          for (int64_t i = 0; i < width; ++i)
            acc[i] += load<T, A>(row, i);
        }
        if (!one_block) sum.add(acc);
      }
      if (!one_block) sum.total(out);
    }
  });
  std::vector<A> total(static_cast<size_t>(inner));
  for (int64_t o = 0; o < outer; ++o) {
    pairwise_sum_columns(partial.data() + o * groups * inner, groups, inner, inner, total.data());
    for (int64_t i = 0; i < inner; ++i)
      y[o * inner + i] = static_cast<T>(apply_scale ? total[i] * scale : total[i]);
  }
}

template <class A>
bool better(A candidate, A best, bool want_max) {
  if (candidate != candidate) return best == best;  // NaN wins (propagates), first NaN kept
  if (best != best) return false;
  return want_max ? candidate > best : candidate < best;
}

}  // namespace

// Note [Cascade summation] for Sum and Mean.
void reduce(ReduceOp op, const TensorArg& in, int64_t outer, int64_t r, int64_t inner,
            const TensorArg& out) {
  dispatch_dtype(in.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = std::conditional_t<std::is_same_v<T, bool>, int64_t, acc_t<T>>;
    const T* x = static_cast<const T*>(in.data);
    if (op == ReduceOp::Sum || op == ReduceOp::Mean) {
      if (outer * inner == 0) return;
      T* y = static_cast<T*>(out.data);
      const bool is_mean = op == ReduceOp::Mean && r > 0;
      const A scale = is_mean ? A(1) / A(r) : A(1);
      if (inner == 1) {
        sum_rows<T, A>(x, outer, r, y, scale, is_mean);
      } else {
        sum_columns<T, A>(x, outer, r, inner, y, scale, is_mean);
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

namespace {

// Softmax of one line of r elements `stride` apart (kContiguous: stride 1,
// known to the compiler). The exponentials go to a contiguous buffer (the
// output line itself when it can hold them) whose sum is a cascade_sum, so
// the denominator is as accurate as ops::sum's.
template <bool kContiguous, class T, class A>
void softmax_line(const T* p, T* q, int64_t r, int64_t stride, bool log, std::vector<A>& buf) {
  const int64_t s = kContiguous ? 1 : stride;
  A m = -std::numeric_limits<A>::infinity();
  for (int64_t j = 0; j < r; ++j)
    m = std::max(m, A(p[j * s]));
  if (m == -std::numeric_limits<A>::infinity()) m = 0;  // all -inf: avoid inf - inf
  A* e = nullptr;                                       // exp(x - m), contiguous
  if constexpr (kContiguous && std::is_same_v<T, A>) {
    if (!log) e = q;
  }
  if (e == nullptr) {
    if (static_cast<int64_t>(buf.size()) < r) buf.resize(static_cast<size_t>(r));
    e = buf.data();
  }
  for (int64_t j = 0; j < r; ++j)
    e[j] = std::exp(A(p[j * s]) - m);
  const A sum = cascade_sum<A>(r, [e](int64_t j) { return e[j]; });
  if (log) {
    const A shift = m + std::log(sum);
    for (int64_t j = 0; j < r; ++j)
      q[j * s] = static_cast<T>(A(p[j * s]) - shift);
  } else {
    const A inv = sum > A(0) ? A(1) / sum : A(0);  // a fully masked line gives zeros
    for (int64_t j = 0; j < r; ++j)
      q[j * s] = static_cast<T>(e[j] * inv);
  }
}

}  // namespace

// One line per (o, i), split over the kernel threads by whole lines.
void softmax(const TensorArg& in, int64_t outer, int64_t r, int64_t inner, bool log,
             const TensorArg& out) {
  dispatch_floating(in.dtype, "softmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    const T* x = static_cast<const T*>(in.data);
    T* y = static_cast<T*>(out.data);
    parallel_for(outer * inner, grain_for(r), [&](int64_t l0, int64_t l1) {
      std::vector<A> buf;
      if (inner == 1) {
        for (int64_t line = l0; line < l1; ++line)
          softmax_line<true, T, A>(x + line * r, y + line * r, r, 1, log, buf);
        return;
      }
      for (int64_t line = l0; line < l1; ++line) {
        const int64_t at = (line / inner) * r * inner + line % inner;
        softmax_line<false, T, A>(x + at, y + at, r, inner, log, buf);
      }
    });
  });
}

// Blocked scan: each block of kScanBlock elements (rows, for inner > 1) is
// scanned in order from zero, and the carry into it is the pairwise sum of
// the blocks before it (PairwiseSum::total()), so the error of a prefix grows
// like log of its length past the first block. Lines (or column chunks) run
// on the kernel threads; a line is never split.
constexpr int64_t kScanBlock = 64;

void cumsum(const TensorArg& in, int64_t outer, int64_t r, int64_t inner, const TensorArg& out) {
  dispatch_dtype(in.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = std::conditional_t<std::is_same_v<T, bool>, int64_t, acc_t<T>>;
    const T* x = static_cast<const T*>(in.data);
    T* y = static_cast<T*>(out.data);
    if (inner == 1) {
      parallel_for(outer, grain_for(r), [&](int64_t o0, int64_t o1) {
        for (int64_t o = o0; o < o1; ++o) {
          const T* p = x + o * r;
          T* q = y + o * r;
          PairwiseSum<A> blocks;
          for (int64_t b = 0; b < r; b += kScanBlock) {
            const A carry = blocks.total();
            const int64_t b1 = std::min(r, b + kScanBlock);
            A local = 0;
            for (int64_t j = b; j < b1; ++j) {
              local += A(p[j]);
              q[j] = static_cast<T>(carry + local);
            }
            blocks.add(local);
          }
        }
      });
      return;
    }
    const int64_t chunks = (inner + kColumnChunk - 1) / kColumnChunk;
    parallel_for(outer * chunks, grain_for(r * std::min(inner, kColumnChunk)),
                 [&](int64_t t0, int64_t t1) {
                   std::vector<A> carry(static_cast<size_t>(kColumnChunk));
                   std::vector<A> local(static_cast<size_t>(kColumnChunk));
                   for (int64_t t = t0; t < t1; ++t) {
                     const int64_t o = t / chunks, c0 = (t % chunks) * kColumnChunk;
                     const int64_t width = std::min(kColumnChunk, inner - c0);
                     PairwiseColumns<A> blocks(width);
                     for (int64_t b = 0; b < r; b += kScanBlock) {
                       blocks.total(carry.data());
                       std::fill(local.begin(), local.begin() + width, A(0));
                       const int64_t b1 = std::min(r, b + kScanBlock);
                       for (int64_t j = b; j < b1; ++j) {
                         const int64_t at = (o * r + j) * inner + c0;
                         for (int64_t i = 0; i < width; ++i) {
                           local[i] += A(x[at + i]);
                           y[at + i] = static_cast<T>(carry[i] + local[i]);
                         }
                       }
                       blocks.add(local.data());
                     }
                   }
                 });
  });
}

}  // namespace tandem::cpu
