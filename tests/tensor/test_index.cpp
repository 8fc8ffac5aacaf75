// Tests of the indexing and sorting ops (embedding, index_select, gather,
// scatter_add, topk, argsort, one_hot) against naive loops written here, on
// contiguous and strided inputs, plus their error messages.
//
// Errors that depend on index values are raised by the kernel; the tests read
// the result (to_vector) inside the throwing expression so that they also hold
// when CPU streams are async (TANDEM_CPU_STREAMS=async) and the error surfaces
// at the synchronisation.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "tandem/tensor/ops.h"

using namespace tandem;
using Catch::Matchers::Contains;

namespace {

using Sizes = std::vector<int64_t>;

int64_t count_of(const Sizes& shape) {
  int64_t n = 1;
  for (int64_t s : shape) {
    n *= s;
  }
  return n;
}

Sizes unravel(int64_t flat, const Sizes& shape) {
  Sizes c(shape.size());
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    c[i] = flat % shape[i];
    flat /= shape[i];
  }
  return c;
}

int64_t ravel(const Sizes& c, const Sizes& shape) {
  int64_t flat = 0;
  for (size_t i = 0; i < shape.size(); ++i) {
    flat = flat * shape[i] + c[i];
  }
  return flat;
}

// The values of permute(t, perm) in row-major order, from t's values.
template <class T>
std::vector<T> permuted(const std::vector<T>& v, const Sizes& shape, const Sizes& perm) {
  Sizes out_shape(shape.size());
  for (size_t i = 0; i < perm.size(); ++i) {
    out_shape[i] = shape[perm[i]];
  }
  std::vector<T> out(v.size());
  for (int64_t f = 0; f < count_of(out_shape); ++f) {
    Sizes oc = unravel(f, out_shape), ic(shape.size());
    for (size_t i = 0; i < perm.size(); ++i) {
      ic[perm[i]] = oc[i];
    }
    out[f] = v[ravel(ic, shape)];
  }
  return out;
}

std::vector<float> random_floats(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  std::vector<float> v(n);
  for (auto& x : v) {
    x = dist(gen);
  }
  return v;
}

std::vector<int64_t> random_indices(int64_t count, int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int64_t> dist(0, n - 1);
  std::vector<int64_t> v(count);
  for (auto& x : v) {
    x = dist(gen);
  }
  return v;
}

Tensor i64_tensor(const std::vector<int64_t>& v, const Sizes& shape) {
  return ops::from_vector<int64_t>(v, Shape(shape));
}

Tensor i32_tensor(const std::vector<int64_t>& v, const Sizes& shape) {
  std::vector<int32_t> w(v.begin(), v.end());
  return ops::from_vector<int32_t>(w, Shape(shape));
}

}  // namespace

TEST_CASE("embedding looks up rows for any index shape", "[index]") {
  const int64_t V = 6, D = 3;
  const std::vector<float> w = random_floats(V * D, 1);
  const Tensor weight = ops::from_vector<float>(w, {V, D});
  const std::vector<int64_t> idx = {5, 0, 2, 2, 4, 1};
  for (bool use_i32 : {false, true}) {
    DYNAMIC_SECTION("index dtype " << (use_i32 ? "i32" : "i64")) {
      const Tensor indices = use_i32 ? i32_tensor(idx, {2, 3}) : i64_tensor(idx, {2, 3});
      const Tensor out = ops::embedding(weight, indices);
      REQUIRE(out.shape() == Shape{2, 3, D});
      const std::vector<float> got = out.to_vector<float>();
      for (size_t i = 0; i < idx.size(); ++i) {
        for (int64_t d = 0; d < D; ++d) {
          REQUIRE(got[i * D + d] == w[idx[i] * D + d]);
        }
      }
    }
  }
  SECTION("a transposed weight") {
    const Tensor wt = ops::transpose(ops::from_vector<float>(w, {D, V}), 0, 1);  // (V, D)
    const std::vector<float> dense = permuted(w, {D, V}, {1, 0});
    const std::vector<float> got = ops::embedding(wt, i64_tensor(idx, {6})).to_vector<float>();
    for (size_t i = 0; i < idx.size(); ++i) {
      for (int64_t d = 0; d < D; ++d) {
        REQUIRE(got[i * D + d] == dense[idx[i] * D + d]);
      }
    }
  }
  SECTION("errors") {
    REQUIRE_THROWS_WITH(ops::embedding(weight, i64_tensor({0, 6}, {2})).to_vector<float>(),
                        Contains("[tensor::") && Contains("got 6") && Contains("[0, 6)"));
    REQUIRE_THROWS_WITH(ops::embedding(ops::from_vector<float>(w, {V * D}), i64_tensor({0}, {1})),
                        Contains("[tensor::embedding]") && Contains("2-D"));
    REQUIRE_THROWS_WITH(ops::embedding(weight, ops::from_vector<float>({0.0f}, {1})),
                        Contains("[tensor::embedding]") && Contains("f32"));
  }
}

TEST_CASE("index_select picks slices along each dim", "[index]") {
  const Sizes shape = {3, 4, 5};
  const std::vector<float> v = random_floats(count_of(shape), 2);
  for (int dim = 0; dim < 3; ++dim) {
    for (bool strided : {false, true}) {
      DYNAMIC_SECTION("dim " << dim << (strided ? " of a permuted tensor" : "")) {
        // The permuted case builds the same logical (3, 4, 5) tensor from a
        // (5, 3, 4) buffer, so it is not contiguous.
        Tensor t;
        std::vector<float> dense = v;
        if (strided) {
          const Sizes base_shape = {5, 3, 4};
          const std::vector<float> base = random_floats(count_of(base_shape), 3);
          t = ops::permute(ops::from_vector<float>(base, Shape(base_shape)), {1, 2, 0});
          REQUIRE_FALSE(t.is_contiguous());
          dense = permuted(base, base_shape, {1, 2, 0});
        } else {
          t = ops::from_vector<float>(v, Shape(shape));
        }
        // Duplicates and out-of-order indices; i32 on odd dims.
        const std::vector<int64_t> idx = {shape[dim] - 1, 0, shape[dim] - 1, 1};
        const Tensor index = dim % 2 ? i32_tensor(idx, {4}) : i64_tensor(idx, {4});
        const Tensor out = ops::index_select(t, dim - 3, index);  // negative dims wrap
        Sizes out_shape = shape;
        out_shape[dim] = 4;
        REQUIRE(out.shape() == Shape(out_shape));
        const std::vector<float> got = out.to_vector<float>();
        for (int64_t f = 0; f < count_of(out_shape); ++f) {
          Sizes c = unravel(f, out_shape);
          c[dim] = idx[c[dim]];
          REQUIRE(got[f] == dense[ravel(c, shape)]);
        }
      }
    }
  }
  SECTION("errors") {
    const Tensor t = ops::from_vector<float>(v, Shape(shape));
    REQUIRE_THROWS_WITH(
        ops::index_select(t, 1, i64_tensor({0, 4}, {2})).to_vector<float>(),
        Contains("[tensor::index_select]") && Contains("got 4") && Contains("[0, 4)"));
    REQUIRE_THROWS_WITH(ops::index_select(t, 0, i64_tensor({-1}, {1})).to_vector<float>(),
                        Contains("[tensor::index_select]") && Contains("got -1"));
    REQUIRE_THROWS_WITH(ops::index_select(t, 0, i64_tensor({0, 1}, {1, 2})),
                        Contains("[tensor::index_select]") && Contains("1-D"));
    REQUIRE_THROWS_WITH(ops::index_select(t, 0, ops::from_vector<float>({0.0f}, {1})),
                        Contains("[tensor::index_select]") && Contains("f32"));
    REQUIRE_THROWS_WITH(ops::index_select(t, 3, i64_tensor({0}, {1})),
                        Contains("[tensor::index_select]") && Contains("got 3"));
  }
}

TEST_CASE("gather reads along each dim, duplicates included", "[index]") {
  const Sizes shape = {3, 4, 5};
  const std::vector<float> v = random_floats(count_of(shape), 4);
  for (int dim = 0; dim < 3; ++dim) {
    for (bool strided : {false, true}) {
      DYNAMIC_SECTION("dim " << dim << (strided ? " of a transposed tensor" : "")) {
        Tensor t;
        std::vector<float> dense = v;
        if (strided) {
          // (3, 4, 5) as the transpose of a (5, 4, 3) buffer.
          const Sizes base_shape = {5, 4, 3};
          const std::vector<float> base = random_floats(count_of(base_shape), 5);
          t = ops::transpose(ops::from_vector<float>(base, Shape(base_shape)), 0, 2);
          REQUIRE_FALSE(t.is_contiguous());
          dense = permuted(base, base_shape, {2, 1, 0});
        } else {
          t = ops::from_vector<float>(v, Shape(shape));
        }
        // Index: 6 along dim (more than n, so duplicates are certain) and
        // smaller than t on the other dims (torch.gather allows it).
        Sizes ishape = {2, 3, 4};
        ishape[dim] = 6;
        const std::vector<int64_t> idx = random_indices(count_of(ishape), shape[dim], 10 + dim);
        const Tensor index = i64_tensor(idx, ishape);
        const Tensor out = ops::gather(t, dim, index);
        REQUIRE(out.shape() == Shape(ishape));
        const std::vector<float> got = out.to_vector<float>();
        for (int64_t f = 0; f < count_of(ishape); ++f) {
          Sizes c = unravel(f, ishape);
          c[dim] = idx[f];
          REQUIRE(got[f] == dense[ravel(c, shape)]);
        }
      }
    }
  }
  SECTION("i32 index and a transposed index") {
    const Tensor t = ops::from_vector<float>(v, Shape(shape));
    const Sizes ishape = {3, 4, 2};  // stored transposed as (2, 4, 3)
    const std::vector<int64_t> base = random_indices(count_of(ishape), 5, 20);
    const Tensor index = ops::transpose(i32_tensor(base, {2, 4, 3}), 0, 2);
    const std::vector<int64_t> idx = permuted(base, {2, 4, 3}, {2, 1, 0});
    const std::vector<float> got = ops::gather(t, -1, index).to_vector<float>();
    for (int64_t f = 0; f < count_of(ishape); ++f) {
      Sizes c = unravel(f, ishape);
      c[2] = idx[f];
      REQUIRE(got[f] == v[ravel(c, shape)]);
    }
  }
  SECTION("errors") {
    const Tensor t = ops::from_vector<float>(v, Shape(shape));
    REQUIRE_THROWS_WITH(ops::gather(t, 1, i64_tensor({0, 1, 2, 7}, {1, 4, 1})).to_vector<float>(),
                        Contains("[tensor::gather]") && Contains("got 7") && Contains("[0, 4)"));
    REQUIRE_THROWS_WITH(ops::gather(t, 1, i64_tensor({0, 1}, {1, 2})),
                        Contains("[tensor::gather]") && Contains("rank"));
    REQUIRE_THROWS_WITH(ops::gather(t, 1, ops::from_vector<float>({0.0f}, {1, 1, 1})),
                        Contains("[tensor::gather]") && Contains("f32"));
    REQUIRE_THROWS_WITH(ops::gather(t, 1, i64_tensor(std::vector<int64_t>(4, 0), {4, 1, 1})),
                        Contains("[tensor::gather]") && Contains("index.shape[0] <= t.shape[0]"));
  }
}

TEST_CASE("scatter_add accumulates along each dim, duplicates included", "[index]") {
  const Sizes shape = {3, 4, 5};
  const std::vector<float> v = random_floats(count_of(shape), 6);
  for (int dim = 0; dim < 3; ++dim) {
    for (bool strided : {false, true}) {
      DYNAMIC_SECTION("dim " << dim << (strided ? " with transposed t and src" : "")) {
        Tensor t;
        std::vector<float> dense = v;
        if (strided) {
          const Sizes base_shape = {5, 4, 3};
          const std::vector<float> base = random_floats(count_of(base_shape), 7);
          t = ops::transpose(ops::from_vector<float>(base, Shape(base_shape)), 0, 2);
          dense = permuted(base, base_shape, {2, 1, 0});
        } else {
          t = ops::from_vector<float>(v, Shape(shape));
        }
        // Index smaller than t off dim, src larger than index everywhere.
        Sizes ishape = {2, 3, 4};
        ishape[dim] = 7;
        Sizes sshape = {3, 4, 5};
        sshape[dim] = 8;
        const std::vector<int64_t> idx = random_indices(count_of(ishape), shape[dim], 30 + dim);
        Tensor src;
        std::vector<float> src_dense;
        if (strided) {
          const Sizes base_shape = {sshape[2], sshape[1], sshape[0]};
          const std::vector<float> base = random_floats(count_of(base_shape), 40 + dim);
          src = ops::transpose(ops::from_vector<float>(base, Shape(base_shape)), 0, 2);
          src_dense = permuted(base, base_shape, {2, 1, 0});
        } else {
          src_dense = random_floats(count_of(sshape), 40 + dim);
          src = ops::from_vector<float>(src_dense, Shape(sshape));
        }
        const Tensor out = ops::scatter_add(t, dim, i64_tensor(idx, ishape), src);
        REQUIRE(out.shape() == Shape(shape));
        std::vector<double> want(dense.begin(), dense.end());
        for (int64_t f = 0; f < count_of(ishape); ++f) {
          const Sizes c = unravel(f, ishape);
          Sizes dst = c;
          dst[dim] = idx[f];
          want[ravel(dst, shape)] += src_dense[ravel(c, sshape)];
        }
        const std::vector<float> got = out.to_vector<float>();
        for (size_t i = 0; i < want.size(); ++i) {
          INFO("element " << i);
          REQUIRE(got[i] == Approx(want[i]).margin(1e-5));
        }
        // The input is not modified.
        REQUIRE(t.to_vector<float>() == dense);
      }
    }
  }
  SECTION("every index the same position") {
    const Tensor t = ops::zeros({2, 3});
    const Tensor src = ops::from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
    const std::vector<float> got =
        ops::scatter_add(t, 1, i32_tensor({1, 1, 1, 2, 2, 2}, {2, 3}), src).to_vector<float>();
    REQUIRE(got == std::vector<float>{0, 1 + 2 + 3, 0, 0, 0, 4 + 5 + 6});
  }
  SECTION("errors") {
    const Tensor t = ops::zeros({3, 4});
    const Tensor src = ops::ones({3, 4});
    REQUIRE_THROWS_WITH(
        ops::scatter_add(t, 0, i64_tensor({0, 1, 3, 0}, {1, 4}), src).to_vector<float>(),
        Contains("[tensor::scatter_add]") && Contains("got 3") && Contains("[0, 3)"));
    REQUIRE_THROWS_WITH(ops::scatter_add(t, 0, i64_tensor({0, 1, 2, 0}, {4}), src),
                        Contains("[tensor::scatter_add]") && Contains("rank"));
    REQUIRE_THROWS_WITH(
        ops::scatter_add(t, 0, i64_tensor({0}, {1, 1}), ops::ones({3, 4}, DType::F64)),
        Contains("[tensor::scatter_add]") && Contains("f64"));
    REQUIRE_THROWS_WITH(
        ops::scatter_add(t, 0, i64_tensor(std::vector<int64_t>(5, 0), {1, 5}), ops::ones({3, 5})),
        Contains("[tensor::scatter_add]") && Contains("index.shape[1] <= t.shape[1]"));
    REQUIRE_THROWS_WITH(ops::scatter_add(t, 0, i64_tensor({0, 0}, {2, 1}), ops::ones({1, 4})),
                        Contains("[tensor::scatter_add]") &&
                            Contains("index.shape[0] <= src.shape[0], got 2 vs 1"));
    REQUIRE_THROWS_WITH(ops::scatter_add(t, 0, ops::zeros({1, 1}), src),
                        Contains("[tensor::scatter_add]") && Contains("f32"));
  }
}

namespace {

// The k best positions of a row by repeated selection: the largest (or
// smallest) value not taken yet, NaN above everything, lowest index on ties.
std::vector<int64_t> naive_topk(const std::vector<float>& row, int64_t k, bool largest) {
  const auto better = [&](float a, float b) {  // a strictly before b
    if (std::isnan(a) || std::isnan(b)) {
      return largest ? (std::isnan(a) && !std::isnan(b)) : (std::isnan(b) && !std::isnan(a));
    }
    return largest ? a > b : a < b;
  };
  std::vector<bool> taken(row.size(), false);
  std::vector<int64_t> out;
  for (int64_t t = 0; t < k; ++t) {
    int64_t best = -1;
    for (size_t j = 0; j < row.size(); ++j) {
      if (taken[j]) continue;
      if (best < 0 || better(row[j], row[best])) best = static_cast<int64_t>(j);
    }
    taken[best] = true;
    out.push_back(best);
  }
  return out;
}

// Stable insertion sort of positions: equal values keep their order.
std::vector<int64_t> naive_argsort(const std::vector<float>& row, bool descending) {
  std::vector<int64_t> out;
  for (size_t j = 0; j < row.size(); ++j) {
    size_t pos = out.size();
    while (pos > 0 && (descending ? row[out[pos - 1]] < row[j] : row[out[pos - 1]] > row[j])) {
      --pos;
    }
    out.insert(out.begin() + static_cast<std::ptrdiff_t>(pos), static_cast<int64_t>(j));
  }
  return out;
}

bool same_float(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || a == b;
}

}  // namespace

TEST_CASE("topk returns sorted values and indices, ties by lower index", "[index]") {
  // Few distinct values, so ties are everywhere.
  const std::vector<float> v = {3, 1, 3, 2, 2, 5, 1, 5, 0, 3, 2, 2,
                                4, 4, 1, 0, 4, 3, 3, 1, 2, 0, 0, 5};
  for (bool largest : {true, false}) {
    for (int dim : {1, 0}) {
      DYNAMIC_SECTION((largest ? "largest" : "smallest") << " along dim " << dim) {
        const Tensor t = ops::from_vector<float>(v, {4, 6});
        const int64_t rows = dim == 1 ? 4 : 6, n = dim == 1 ? 6 : 4;
        const int64_t k = 3;
        auto [values, indices] = ops::topk(t, k, dim, largest);
        const Shape want_shape = dim == 1 ? Shape{4, k} : Shape{k, 6};
        REQUIRE(values.shape() == want_shape);
        REQUIRE(indices.shape() == want_shape);
        REQUIRE(indices.dtype() == DType::I64);
        const std::vector<float> gv = ops::contiguous(values).to_vector<float>();
        const std::vector<int64_t> gi = ops::contiguous(indices).to_vector<int64_t>();
        for (int64_t r = 0; r < rows; ++r) {
          std::vector<float> row(n);
          for (int64_t j = 0; j < n; ++j) {
            row[j] = dim == 1 ? v[r * 6 + j] : v[j * 6 + r];
          }
          const std::vector<int64_t> want = naive_topk(row, k, largest);
          for (int64_t s = 0; s < k; ++s) {
            const int64_t at = dim == 1 ? r * k + s : s * 6 + r;
            INFO("row " << r << " slot " << s);
            REQUIRE(gi[at] == want[s]);
            REQUIRE(gv[at] == row[want[s]]);
          }
        }
      }
    }
  }
  SECTION("NaN counts as the largest value; a transposed input") {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const std::vector<float> base = {1,   nan, -2, 7,
                                     nan, 7,   0,  3};  // (2, 4), topk on dim 0 of (4, 2)
    const Tensor t = ops::transpose(ops::from_vector<float>(base, {2, 4}), 0, 1);
    for (bool largest : {true, false}) {
      auto [values, indices] = ops::topk(t, 4, 0, largest);
      const std::vector<float> gv = ops::contiguous(values).to_vector<float>();
      const std::vector<int64_t> gi = ops::contiguous(indices).to_vector<int64_t>();
      for (int64_t col = 0; col < 2; ++col) {
        const std::vector<float> row(base.begin() + col * 4, base.begin() + col * 4 + 4);
        const std::vector<int64_t> want = naive_topk(row, 4, largest);
        for (int64_t s = 0; s < 4; ++s) {
          REQUIRE(gi[s * 2 + col] == want[s]);
          REQUIRE(same_float(gv[s * 2 + col], row[want[s]]));
        }
      }
    }
  }
  SECTION("integer values and k = 0") {
    const Tensor t = i64_tensor({4, -1, 9, 9, 2}, {5});
    auto [values, indices] = ops::topk(t, 2);
    REQUIRE(values.to_vector<int64_t>() == std::vector<int64_t>{9, 9});
    REQUIRE(indices.to_vector<int64_t>() == std::vector<int64_t>{2, 3});
    auto [v0, i0] = ops::topk(t, 0);
    REQUIRE(v0.shape() == Shape{0});
  }
  SECTION("errors") {
    const Tensor t = ops::from_vector<float>(v, {4, 6});
    REQUIRE_THROWS_WITH(ops::topk(t, 7), Contains("[tensor::topk]") && Contains("got 7"));
    REQUIRE_THROWS_WITH(ops::topk(t, 1, 2), Contains("[tensor::topk]"));
  }
}

TEST_CASE("argsort is stable in both directions", "[index]") {
  const std::vector<float> v = {2, 0, 2, 1, 0, 1, 2, 0, 1, 1, 0, 2, 2, 2, 0, 1, 0, 1};  // (3, 6)
  for (bool descending : {false, true}) {
    DYNAMIC_SECTION((descending ? "descending" : "ascending") << " along the last dim") {
      const std::vector<int64_t> got =
          ops::argsort(ops::from_vector<float>(v, {3, 6}), -1, descending).to_vector<int64_t>();
      for (int64_t r = 0; r < 3; ++r) {
        const std::vector<float> row(v.begin() + r * 6, v.begin() + r * 6 + 6);
        const std::vector<int64_t> want = naive_argsort(row, descending);
        for (int64_t j = 0; j < 6; ++j) {
          REQUIRE(got[r * 6 + j] == want[j]);
        }
      }
    }
    DYNAMIC_SECTION((descending ? "descending" : "ascending") << " along dim 0 of a transpose") {
      // t (6, 3) = transpose of the (3, 6) buffer; sorting dim 0 sorts each buffer row.
      const Tensor t = ops::transpose(ops::from_vector<float>(v, {3, 6}), 0, 1);
      const Tensor idx = ops::argsort(t, 0, descending);
      REQUIRE(idx.shape() == Shape{6, 3});
      const std::vector<int64_t> got = ops::contiguous(idx).to_vector<int64_t>();
      for (int64_t c = 0; c < 3; ++c) {
        const std::vector<float> col(v.begin() + c * 6, v.begin() + c * 6 + 6);
        const std::vector<int64_t> want = naive_argsort(col, descending);
        for (int64_t j = 0; j < 6; ++j) {
          REQUIRE(got[j * 3 + c] == want[j]);
        }
      }
    }
  }
  SECTION("long rows of three distinct values") {
    // Long enough that an unstable sort (introsort past 16 elements) would
    // reorder equal values.
    std::vector<float> r(2 * 200);
    std::mt19937 gen(60);
    for (auto& x : r) {
      x = static_cast<float>(gen() % 3);
    }
    for (bool descending : {false, true}) {
      const std::vector<int64_t> got =
          ops::argsort(ops::from_vector<float>(r, {2, 200}), 1, descending).to_vector<int64_t>();
      for (int64_t row = 0; row < 2; ++row) {
        const std::vector<float> line(r.begin() + row * 200, r.begin() + row * 200 + 200);
        const std::vector<int64_t> want = naive_argsort(line, descending);
        for (int64_t j = 0; j < 200; ++j) {
          REQUIRE(got[row * 200 + j] == want[j]);
        }
      }
    }
  }
  SECTION("random values along a middle dim") {
    const std::vector<float> r = random_floats(2 * 7 * 3, 50);
    const std::vector<int64_t> got =
        ops::contiguous(ops::argsort(ops::from_vector<float>(r, {2, 7, 3}), 1))
            .to_vector<int64_t>();
    for (int64_t a = 0; a < 2; ++a) {
      for (int64_t c = 0; c < 3; ++c) {
        std::vector<float> line(7);
        for (int64_t j = 0; j < 7; ++j) {
          line[j] = r[(a * 7 + j) * 3 + c];
        }
        const std::vector<int64_t> want = naive_argsort(line, false);
        for (int64_t j = 0; j < 7; ++j) {
          REQUIRE(got[(a * 7 + j) * 3 + c] == want[j]);
        }
      }
    }
  }
}

TEST_CASE("one_hot", "[index]") {
  const std::vector<int64_t> idx = {2, 0, 3, 3, 1, 0};
  for (bool use_i32 : {false, true}) {
    DYNAMIC_SECTION("index dtype " << (use_i32 ? "i32" : "i64")) {
      const Tensor indices = use_i32 ? i32_tensor(idx, {2, 3}) : i64_tensor(idx, {2, 3});
      const Tensor out = ops::one_hot(indices, 5);
      REQUIRE(out.shape() == Shape{2, 3, 5});
      REQUIRE(out.dtype() == DType::I64);
      const std::vector<int64_t> got = out.to_vector<int64_t>();
      for (size_t i = 0; i < idx.size(); ++i) {
        for (int64_t c = 0; c < 5; ++c) {
          REQUIRE(got[i * 5 + c] == (c == idx[i] ? 1 : 0));
        }
      }
    }
  }
  SECTION("a transposed index") {
    const Tensor indices = ops::transpose(i64_tensor(idx, {2, 3}), 0, 1);  // (3, 2)
    const std::vector<int64_t> dense = permuted(idx, {2, 3}, {1, 0});
    const std::vector<int64_t> got = ops::one_hot(indices, 4).to_vector<int64_t>();
    for (size_t i = 0; i < dense.size(); ++i) {
      for (int64_t c = 0; c < 4; ++c) {
        REQUIRE(got[i * 4 + c] == (c == dense[i] ? 1 : 0));
      }
    }
  }
  SECTION("errors") {
    REQUIRE_THROWS_WITH(ops::one_hot(i64_tensor(idx, {6}), 3).to_vector<int64_t>(),
                        Contains("[tensor::one_hot]") && Contains("got 3") && Contains("[0, 3)"));
    REQUIRE_THROWS_WITH(ops::one_hot(i64_tensor(idx, {6}), 0),
                        Contains("[tensor::one_hot]") && Contains("num_classes"));
    REQUIRE_THROWS_WITH(ops::one_hot(ops::zeros({2}), 3),
                        Contains("[tensor::one_hot]") && Contains("f32"));
  }
}
