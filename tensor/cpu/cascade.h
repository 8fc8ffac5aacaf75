// The summation order of every floating sum in the CPU kernels (reductions,
// softmax denominators, cumsum carries, normalisation statistics and weight
// gradients): Note [Cascade summation].
//
// Note [Cascade summation]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Adding n floats one after the other into one accumulator makes a rounding
// error that grows like n * eps (the running total gets large next to each
// term). Every sum here has a fixed order whose error grows like log n:
// - A contiguous run is cut into blocks of kSumBlock elements. Inside a block,
//   kSumLanes independent accumulators take every kSumLanes-th element (the
//   loop vectorises at any vector width, and the order is the source's, not
//   the target's), and the lanes are added pairwise (folded in halves).
// - A sum down a column of a (rows, cols) array (a reduction over a non-last
//   dim, a weight gradient) adds kRowBlock rows in order, side by side for all
//   columns (vectorised along the row), then treats each row block as one
//   term.
// - The block terms are added pairwise: pairwise_sum(v, n) is
//   pairwise_sum(v, k) + pairwise_sum(v + k, n - k) with k the largest power
//   of two below n. PairwiseSum builds the same tree one term at a time with a
//   binary counter (level j holds the sum of 2^j consecutive terms), so a sum
//   of unknown length needs only log2(n) partials.
// - That tree has every aligned run of 2^j terms as a subtree, so a long sum
//   may be split into groups of 2^j blocks (any j), each group summed on its
//   own thread and the group sums added with pairwise_sum: the bits are the
//   same for every j and every thread count (Note [CPU kernel threads]).
// The rounding error of a sum of n terms is then at most about
// (kSumBlock / kSumLanes + log2(kSumLanes) + log2(n / kSumBlock)) * eps * sum|x|
// for contiguous runs and (kRowBlock + log2(rows / kRowBlock)) * eps * sum|x|
// for columns; the first terms are constants, so the error no longer grows
// with n beyond its logarithm. Integer sums use the same code and are exact.
// tensor/cuda/cuda_common.cuh's CascadeSum is the GPU's counterpart.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <vector>

namespace tandem::cpu {

constexpr int64_t kSumLanes = 32;
constexpr int64_t kSumBlock = 2048;  // a multiple of kSumLanes
constexpr int64_t kRowBlock = 32;

// Where pairwise_sum splits n >= 2 terms: the largest power of two below n.
inline int64_t pairwise_split(int64_t n) {
  return static_cast<int64_t>(std::bit_floor(static_cast<uint64_t>(n - 1)));
}

template <class A>
A pairwise_sum(const A* v, int64_t n) {
  if (n <= 0) return A(0);
  if (n == 1) return v[0];
  const int64_t k = pairwise_split(n);
  return pairwise_sum(v, k) + pairwise_sum(v + k, n - k);
}

// pairwise_sum over v[i * stride] for i < n, for `width` adjacent columns at
// once: out[c] = pairwise_sum of v[i * stride + c].
template <class A>
void pairwise_sum_columns(const A* v, int64_t n, int64_t stride, int64_t width, A* out) {
  if (n <= 0) {
    std::fill(out, out + width, A(0));
    return;
  }
  if (n == 1) {
    std::copy(v, v + width, out);
    return;
  }
  const int64_t k = pairwise_split(n);
  std::vector<A> right(static_cast<size_t>(width));
  pairwise_sum_columns(v, k, stride, width, out);
  pairwise_sum_columns(v + k * stride, n - k, stride, width, right.data());
  for (int64_t c = 0; c < width; ++c)
    out[c] += right[c];
}

// Adds 2 * W lanes pairwise, folded in halves (lane l takes lane l + W):
// with W known at compile time each step is a few vector adds.
template <int64_t W, class A>
inline void fold_lanes(A* lanes) {
  for (int64_t l = 0; l < W; ++l)
    lanes[l] += lanes[l + W];
  if constexpr (W > 1) fold_lanes<W / 2>(lanes);
}

// The sum of f(i) for i in [0, n), n <= kSumBlock, in kSumLanes lanes.
template <class A, class F>
inline A block_sum(int64_t n, F&& f) {
  A lanes[kSumLanes] = {};
  int64_t i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes) {
    for (int64_t l = 0; l < kSumLanes; ++l)
      lanes[l] += f(i + l);
  }
  for (int64_t l = 0; i + l < n; ++l)
    lanes[l] += f(i + l);
  fold_lanes<kSumLanes / 2>(lanes);
  return lanes[0];
}

// Terms added one at a time into the pairwise tree (binary counter).
template <class A>
class PairwiseSum {
 public:
  void add(A term) {
    stack_[top_++] = term;
    for (uint64_t c = ++count_; (c & 1) == 0; c >>= 1) {
      --top_;
      stack_[top_ - 1] = stack_[top_ - 1] + stack_[top_];
    }
  }
  // The sum of the terms so far (pairwise_sum of them, in the same tree).
  A total() const {
    if (top_ == 0) return A(0);
    A s = stack_[top_ - 1];
    for (int k = top_ - 2; k >= 0; --k)
      s = stack_[k] + s;
    return s;
  }

 private:
  A stack_[65] = {};
  int top_ = 0;
  uint64_t count_ = 0;
};

// The sum of f(i) for i in [0, n), any n: blocks of kSumBlock, pairwise.
template <class A, class F>
A cascade_sum(int64_t n, F&& f) {
  if (n <= kSumBlock) return block_sum<A>(n, f);
  PairwiseSum<A> sum;
  for (int64_t b = 0; b < n; b += kSumBlock) {
    sum.add(block_sum<A>(std::min(kSumBlock, n - b), [&](int64_t i) { return f(b + i); }));
  }
  return sum.total();
}

// PairwiseSum for `width` columns side by side: add() takes one term per
// column (a row block's column sums).
template <class A>
class PairwiseColumns {
 public:
  explicit PairwiseColumns(int64_t width) : width_(width) {}
  // Empties the sum for `width` columns (keeps the memory).
  void reset(int64_t width) {
    width_ = width;
    top_ = 0;
    count_ = 0;
  }
  void add(const A* terms) {
    if (static_cast<int64_t>(stack_.size()) < (top_ + 1) * width_) {
      stack_.resize(static_cast<size_t>((top_ + 1) * width_));
    }
    std::copy(terms, terms + width_, stack_.data() + top_ * width_);
    ++top_;
    for (uint64_t c = ++count_; (c & 1) == 0; c >>= 1) {
      --top_;
      A* left = stack_.data() + (top_ - 1) * width_;
      const A* right = stack_.data() + top_ * width_;
      for (int64_t j = 0; j < width_; ++j)
        left[j] = left[j] + right[j];
    }
  }
  // out[c] = the sum of column c's terms so far.
  void total(A* out) const {
    if (top_ == 0) {
      std::fill(out, out + width_, A(0));
      return;
    }
    std::copy(stack_.data() + (top_ - 1) * width_, stack_.data() + top_ * width_, out);
    for (int64_t k = top_ - 2; k >= 0; --k) {
      const A* left = stack_.data() + k * width_;
      for (int64_t j = 0; j < width_; ++j)
        out[j] = left[j] + out[j];
    }
  }

 private:
  int64_t width_;
  std::vector<A> stack_;
  int64_t top_ = 0;
  uint64_t count_ = 0;
};

// Groups of 2^j blocks for splitting a sum of `blocks` blocks over threads:
// the smallest power of two that leaves at most `max_groups` groups.
inline int64_t blocks_per_group(int64_t blocks, int64_t max_groups) {
  const int64_t want = (blocks + max_groups - 1) / std::max<int64_t>(max_groups, 1);
  return static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(std::max<int64_t>(want, 1))));
}

}  // namespace tandem::cpu
