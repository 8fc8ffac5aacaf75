// View ops (DESIGN §3): every result shares the base's storage, and its
// element at each index is the base element that index arithmetic says it
// should be. The base holds 0, 1, 2, ... so any mix-up of indices shows.
#include <catch2/catch.hpp>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "tandem/tensor/ops.h"
#include "tests/support/test_util.h"

using namespace tandem;
using namespace tandem::test;
using Catch::Matchers::Contains;

namespace {

using Index = std::vector<int64_t>;

// Checks view[idx] == base[source(idx)] for every index of the view, where
// the base holds iota values (so base[i] == i at linear index i).
void check_view(const Tensor& view, const Tensor& base, const std::vector<int64_t>& view_shape,
                const std::function<Index(const Index&)>& source) {
  REQUIRE(view.shape() == Shape(view_shape));
  REQUIRE(view.is_alias_of(base));
  const std::vector<int64_t> base_shape = base.shape().vec();
  const std::vector<double> base_values = values_of(base);
  const std::vector<double> got = values_of(view);
  REQUIRE(got.size() == static_cast<size_t>(numel_of(view_shape)));
  for_each_index(view_shape, [&](const Index& idx) {
    Index src = source(idx);
    INFO("view index " << ravel(idx, view_shape));
    REQUIRE(got[ravel(idx, view_shape)] == base_values[ravel(src, base_shape)]);
  });
}

// Writing through `view` must change exactly the base elements it covers.
void check_write_through(const Tensor& view, const Tensor& base) {
  const std::vector<double> before = values_of(base);
  Tensor marked = ops::clone(view);
  ops::fill_(view, -1.0);
  const std::vector<double> after = values_of(base);
  // Each base element is either untouched or was one of the view's elements.
  size_t changed = 0;
  for (size_t i = 0; i < before.size(); ++i) {
    if (after[i] != before[i]) {
      ++changed;
      REQUIRE(after[i] == -1.0);
    }
  }
  // Distinct elements covered by the view (a view may repeat elements: expand).
  std::vector<double> distinct = values_of(marked);
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  REQUIRE(changed == distinct.size());
  ops::copy_(view, marked);  // restore through the view
  REQUIRE(values_of(base) == before);
}

}  // namespace

TEST_CASE("view and reshape", "[views]") {
  Tensor base = iota_tensor({2, 3, 4});
  SECTION("view to a compatible shape aliases") {
    Tensor v = ops::view(base, {6, 4});
    check_view(v, base, {6, 4}, [](const Index& i) { return unravel(i[0] * 4 + i[1], {2, 3, 4}); });
    check_write_through(v, base);
  }
  SECTION("-1 is inferred") {
    Tensor v = ops::view(base, {4, -1});
    REQUIRE(v.shape() == Shape{4, 6});
    Tensor flat = ops::view(base, {-1});
    check_view(flat, base, {24}, [](const Index& i) { return unravel(i[0], {2, 3, 4}); });
    REQUIRE(ops::reshape(base, {-1, 2}).shape() == Shape{12, 2});
  }
  SECTION("bad shapes are errors") {
    REQUIRE_THROWS_AS(ops::view(base, {5, 5}), Error);
    REQUIRE_THROWS_AS(ops::view(base, {-1, -1}), Error);
    REQUIRE_THROWS_AS(ops::view(base, {7, -1}), Error);
    REQUIRE_THROWS_AS(ops::reshape(base, {5, 5}), Error);
  }
  SECTION("view of a transposed tensor fails where reshape copies") {
    Tensor t = ops::transpose(base, 1, 2);  // (2, 4, 3)
    REQUIRE_THROWS_WITH(ops::view(t, {24}), Contains("[tensor::view]"));
    Tensor r = ops::reshape(t, {24});
    REQUIRE_FALSE(r.is_alias_of(base));
    std::vector<double> got = values_of(r);
    for_each_index({2, 4, 3}, [&](const Index& i) {
      REQUIRE(got[ravel(i, {2, 4, 3})] ==
              static_cast<double>(ravel({i[0], i[2], i[1]}, {2, 3, 4})));
    });
    // Adding a size-1 dim needs no particular strides.
    check_view(ops::view(t, {1, 2, 4, 3}), base, {1, 2, 4, 3}, [](const Index& i) {
      return Index{i[1], i[3], i[2]};
    });
  }
  SECTION("reshape of a contiguous tensor is a view") {
    Tensor r = ops::reshape(base, {3, 8});
    check_view(r, base, {3, 8}, [](const Index& i) { return unravel(i[0] * 8 + i[1], {2, 3, 4}); });
  }
  SECTION("view of a narrowed-row block keeps the offset") {
    Tensor rows = ops::narrow(base, 1, 1, 2);  // (2, 2, 4), row-contiguous inside each batch
    Tensor v = ops::view(rows, {2, 8});
    check_view(v, base, {2, 8}, [](const Index& i) { return Index{i[0], 1 + i[1] / 4, i[1] % 4}; });
  }
}

TEST_CASE("flatten", "[views]") {
  Tensor base = iota_tensor({2, 3, 4, 5});
  check_view(ops::flatten(base), base, {120}, [](const Index& i) {
    return unravel(i[0], {2, 3, 4, 5});
  });
  check_view(ops::flatten(base, 1), base, {2, 60}, [](const Index& i) {
    Index r = unravel(i[1], {3, 4, 5});
    return Index{i[0], r[0], r[1], r[2]};
  });
  check_view(ops::flatten(base, 1, 2), base, {2, 12, 5}, [](const Index& i) {
    return Index{i[0], i[1] / 4, i[1] % 4, i[2]};
  });
  check_view(ops::flatten(base, -2, -1), base, {2, 3, 20}, [](const Index& i) {
    return Index{i[0], i[1], i[2] / 5, i[2] % 5};
  });
  REQUIRE(ops::flatten(base, 2, 2).shape() == Shape{2, 3, 4, 5});
  REQUIRE_THROWS_AS(ops::flatten(base, 2, 1), Error);
  REQUIRE_THROWS_AS(ops::flatten(base, 0, 4), Error);
}

TEST_CASE("permute and transpose", "[views]") {
  Tensor base = iota_tensor({2, 3, 4});
  Tensor p = ops::permute(base, {2, 0, 1});
  REQUIRE_FALSE(p.is_contiguous());
  REQUIRE(p.strides() == Dims{1, 12, 4});
  check_view(p, base, {4, 2, 3}, [](const Index& i) { return Index{i[1], i[2], i[0]}; });
  check_write_through(p, base);

  check_view(ops::permute(base, {-1, -2, -3}), base, {4, 3, 2}, [](const Index& i) {
    return Index{i[2], i[1], i[0]};
  });
  check_view(ops::transpose(base, 0, 2), base, {4, 3, 2}, [](const Index& i) {
    return Index{i[2], i[1], i[0]};
  });
  check_view(ops::transpose(base, -1, 1), base, {2, 4, 3}, [](const Index& i) {
    return Index{i[0], i[2], i[1]};
  });
  check_view(ops::transpose(base, 1, 1), base, {2, 3, 4}, [](const Index& i) { return i; });
  // Transposing twice is the identity, and of a view composes.
  Tensor twice = ops::transpose(ops::transpose(base, 0, 1), 0, 1);
  REQUIRE(twice.is_contiguous());
  check_view(ops::transpose(p, 0, 1), base, {2, 4, 3}, [](const Index& i) {
    return Index{i[0], i[2], i[1]};
  });

  // An empty tensor is contiguous whatever its strides, like in PyTorch, so
  // contiguous() of one does not copy.
  Tensor empty_t = ops::transpose(ops::zeros({0, 3, 2}), 0, 2);
  REQUIRE(empty_t.shape() == Shape{2, 3, 0});
  REQUIRE(empty_t.is_contiguous());
  REQUIRE(ops::contiguous(empty_t).storage() == empty_t.storage());

  REQUIRE_THROWS_AS(ops::permute(base, {0, 0, 1}), Error);
  REQUIRE_THROWS_AS(ops::permute(base, {0, 1}), Error);
  REQUIRE_THROWS_AS(ops::permute(base, {0, 1, 3}), Error);
  REQUIRE_THROWS_AS(ops::transpose(base, 0, 3), Error);
}

TEST_CASE("narrow", "[views]") {
  Tensor base = iota_tensor({3, 5, 2});
  Tensor n = ops::narrow(base, 1, 1, 3);
  check_view(n, base, {3, 3, 2}, [](const Index& i) { return Index{i[0], i[1] + 1, i[2]}; });
  REQUIRE(n.storage_offset() == 2);
  check_write_through(n, base);
  check_view(ops::narrow(base, -1, 1, 1), base, {3, 5, 1}, [](const Index& i) {
    return Index{i[0], i[1], 1};
  });
  check_view(ops::narrow(base, 0, 2, 1), base, {1, 5, 2}, [](const Index& i) {
    return Index{2, i[1], i[2]};
  });
  REQUIRE(ops::narrow(base, 1, 5, 0).numel() == 0);
  REQUIRE_THROWS_AS(ops::narrow(base, 1, 3, 3), Error);
  REQUIRE_THROWS_AS(ops::narrow(base, 1, -1, 2), Error);
  REQUIRE_THROWS_AS(ops::narrow(base, 3, 0, 1), Error);
}

TEST_CASE("slice follows Python semantics", "[views]") {
  Tensor base = iota_tensor({2, 10});
  auto check_slice = [&](int64_t start, int64_t end, int64_t step,
                         const std::vector<int64_t>& cols) {
    INFO("slice [" << start << ":" << end << ":" << step << "]");
    Tensor s = ops::slice(base, 1, start, end, step);
    check_view(s, base, {2, static_cast<int64_t>(cols.size())}, [&](const Index& i) {
      return Index{i[0], cols[i[1]]};
    });
  };
  check_slice(0, 10, 1, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  check_slice(1, 8, 3, {1, 4, 7});
  check_slice(1, 9, 3, {1, 4, 7});
  check_slice(0, 10, 4, {0, 4, 8});
  check_slice(-3, 10, 1, {7, 8, 9});
  check_slice(2, -2, 2, {2, 4, 6});
  check_slice(-100, 3, 1, {0, 1, 2});
  check_slice(8, 100, 1, {8, 9});
  check_slice(5, 3, 1, {});
  check_slice(20, 30, 1, {});
  check_slice(-1, -100, 1, {});
  check_slice(9, 10, 5, {9});

  Tensor s = ops::slice(base, 1, 1, 10, 2);
  REQUIRE(s.stride(1) == 2);
  check_write_through(s, base);
  // Slicing a slice composes.
  Tensor ss = ops::slice(s, 1, 1, 5, 2);  // columns 3, 7
  check_view(ss, base, {2, 2}, [](const Index& i) { return Index{i[0], 3 + 4 * i[1]}; });
  check_view(ops::slice(base, -2, 1, 2), base, {1, 10}, [](const Index& i) {
    return Index{1, i[1]};
  });

  REQUIRE_THROWS_AS(ops::slice(base, 1, 0, 5, 0), Error);
  REQUIRE_THROWS_AS(ops::slice(base, 1, 0, 5, -1), Error);
  REQUIRE_THROWS_AS(ops::slice(base, 2, 0, 1), Error);
}

TEST_CASE("select drops a dim", "[views]") {
  Tensor base = iota_tensor({3, 4, 2});
  check_view(ops::select(base, 0, 1), base, {4, 2}, [](const Index& i) {
    return Index{1, i[0], i[1]};
  });
  check_view(ops::select(base, 1, -1), base, {3, 2}, [](const Index& i) {
    return Index{i[0], 3, i[1]};
  });
  check_view(ops::select(base, -1, 0), base, {3, 4}, [](const Index& i) {
    return Index{i[0], i[1], 0};
  });
  Tensor s = ops::select(base, 1, 2);
  check_write_through(s, base);
  // Down to a 0-d tensor.
  Tensor scalar = ops::select(ops::select(ops::select(base, 0, 2), 0, 3), 0, 1);
  REQUIRE(scalar.dim() == 0);
  REQUIRE(scalar.item<float>() == static_cast<float>(ravel({2, 3, 1}, {3, 4, 2})));
  REQUIRE_THROWS_AS(ops::select(base, 1, 4), Error);
  REQUIRE_THROWS_AS(ops::select(base, 1, -5), Error);
  REQUIRE_THROWS_AS(ops::select(base, 3, 0), Error);
}

TEST_CASE("expand broadcasts with stride 0", "[views]") {
  Tensor base = iota_tensor({3, 1});
  Tensor e = ops::expand(base, {2, 3, 4});
  REQUIRE(e.strides()[0] == 0);
  REQUIRE(e.strides()[2] == 0);
  REQUIRE(e.stride(1) == 1);
  check_view(e, base, {2, 3, 4}, [](const Index& i) { return Index{i[1], 0}; });
  check_view(ops::expand(base, {-1, 5}), base, {3, 5}, [](const Index& i) {
    return Index{i[0], 0};
  });
  check_view(ops::expand(base, {3, 1}), base, {3, 1}, [](const Index& i) { return i; });
  // Writing through an expanded view writes each base element.
  Tensor small = iota_tensor({1, 2});
  Tensor ex = ops::expand(small, {4, 2});
  ops::fill_(ex, 5.0);
  REQUIRE(values_of(small) == std::vector<double>{5, 5});

  REQUIRE_THROWS_AS(ops::expand(iota_tensor({3, 2}), {3, 4}), Error);
  REQUIRE_THROWS_AS(ops::expand(base, {4}), Error);  // fewer dims than the tensor
  REQUIRE_THROWS_AS(ops::expand(base, {2, 4, 1}), Error);
}

TEST_CASE("squeeze and unsqueeze", "[views]") {
  Tensor base = iota_tensor({1, 3, 1, 2});
  check_view(ops::squeeze(base), base, {3, 2}, [](const Index& i) {
    return Index{0, i[0], 0, i[1]};
  });
  check_view(ops::squeeze(base, 2), base, {1, 3, 2}, [](const Index& i) {
    return Index{0, i[1], 0, i[2]};
  });
  check_view(ops::squeeze(base, -4), base, {3, 1, 2}, [](const Index& i) {
    return Index{0, i[0], 0, i[2]};
  });
  // Squeezing a dim that is not 1 leaves the tensor as it is (PyTorch).
  check_view(ops::squeeze(base, 1), base, {1, 3, 1, 2}, [](const Index& i) { return i; });
  REQUIRE_THROWS_AS(ops::squeeze(base, 4), Error);

  Tensor t = iota_tensor({2, 3});
  check_view(ops::unsqueeze(t, 0), t, {1, 2, 3}, [](const Index& i) { return Index{i[1], i[2]}; });
  check_view(ops::unsqueeze(t, 1), t, {2, 1, 3}, [](const Index& i) { return Index{i[0], i[2]}; });
  check_view(ops::unsqueeze(t, 2), t, {2, 3, 1}, [](const Index& i) { return Index{i[0], i[1]}; });
  check_view(ops::unsqueeze(t, -1), t, {2, 3, 1}, [](const Index& i) { return Index{i[0], i[1]}; });
  check_view(ops::unsqueeze(t, -3), t, {1, 2, 3}, [](const Index& i) { return Index{i[1], i[2]}; });
  REQUIRE_THROWS_AS(ops::unsqueeze(t, 3), Error);
  REQUIRE_THROWS_AS(ops::unsqueeze(t, -4), Error);
  // Unsqueeze of a non-contiguous tensor keeps its strides.
  Tensor tt = ops::transpose(t, 0, 1);
  check_view(ops::unsqueeze(tt, 1), t, {3, 1, 2}, [](const Index& i) { return Index{i[2], i[0]}; });
  // A squeezed scalar.
  Tensor one = iota_tensor({1, 1});
  REQUIRE(ops::squeeze(one).dim() == 0);
}

namespace {

// The pieces of a split along `dim` of an iota base: piece p starts at
// starts[p] and has sizes[p] elements along dim.
void check_pieces(const std::vector<Tensor>& pieces, const Tensor& base, int dim,
                  const std::vector<int64_t>& sizes) {
  REQUIRE(pieces.size() == sizes.size());
  int64_t start = 0;
  for (size_t p = 0; p < pieces.size(); ++p) {
    INFO("piece " << p);
    std::vector<int64_t> shape = base.shape().vec();
    shape[dim] = sizes[p];
    check_view(pieces[p], base, shape, [&](const Index& i) {
      Index src = i;
      src[dim] += start;
      return src;
    });
    start += sizes[p];
  }
}

}  // namespace

TEST_CASE("split, split_sizes and chunk", "[views]") {
  Tensor base = iota_tensor({5, 4});
  check_pieces(ops::split(base, 2, 0), base, 0, {2, 2, 1});
  check_pieces(ops::split(base, 2, 1), base, 1, {2, 2});
  check_pieces(ops::split(base, 3, -1), base, 1, {3, 1});
  check_pieces(ops::split(base, 5, 0), base, 0, {5});
  check_pieces(ops::split(base, 10, 0), base, 0, {5});
  check_pieces(ops::split_sizes(base, {1, 3, 1}, 0), base, 0, {1, 3, 1});
  check_pieces(ops::split_sizes(base, {0, 4}, 1), base, 1, {0, 4});
  REQUIRE_THROWS_AS(ops::split_sizes(base, {1, 2}, 0), Error);
  REQUIRE_THROWS_AS(ops::split_sizes(base, {3, 3}, 0), Error);
  REQUIRE_THROWS_AS(ops::split(base, 0, 0), Error);

  // torch.chunk: pieces of ceil(n / chunks), so fewer pieces when n is small.
  check_pieces(ops::chunk(base, 3, 0), base, 0, {2, 2, 1});
  check_pieces(ops::chunk(base, 2, 0), base, 0, {3, 2});
  check_pieces(ops::chunk(base, 5, 0), base, 0, {1, 1, 1, 1, 1});
  check_pieces(ops::chunk(base, 4, 1), base, 1, {1, 1, 1, 1});
  check_pieces(ops::chunk(base, 3, -1), base, 1, {2, 2});
  Tensor six = iota_tensor({6});
  check_pieces(ops::chunk(six, 4, 0), six, 0, {2, 2, 2});
  check_pieces(ops::chunk(six, 5, 0), six, 0, {2, 2, 2});
  check_pieces(ops::chunk(six, 6, 0), six, 0, {1, 1, 1, 1, 1, 1});
  Tensor two = iota_tensor({2});
  check_pieces(ops::chunk(two, 5, 0), two, 0, {1, 1});
  REQUIRE_THROWS_AS(ops::chunk(six, 0, 0), Error);

  // Writing through a piece reaches the base.
  std::vector<Tensor> cols = ops::chunk(base, 2, 1);
  check_write_through(cols[1], base);
  ops::fill_(cols[1], 0.0);
  std::vector<double> got = values_of(base);
  for (int64_t i = 0; i < 5; ++i) {
    for (int64_t j = 0; j < 4; ++j)
      REQUIRE(got[i * 4 + j] == (j >= 2 ? 0.0 : i * 4.0 + j));
  }
}

TEST_CASE("views of views keep aliasing and index arithmetic", "[views]") {
  Tensor base = iota_tensor({4, 6, 5}, DType::F64);
  // permute -> slice with step -> select -> unsqueeze -> expand
  Tensor v = ops::permute(base, {1, 2, 0});  // (6, 5, 4): v[a,b,c] = base[c,a,b]
  v = ops::slice(v, 0, 1, 6, 2);             // a = 1 + 2a'      -> (3, 5, 4)
  v = ops::select(v, 1, 3);                  // b = 3            -> (3, 4)
  v = ops::unsqueeze(v, 1);                  //                  -> (3, 1, 4)
  v = ops::expand(v, {3, 2, 4});             //                  -> (3, 2, 4)
  check_view(v, base, {3, 2, 4}, [](const Index& i) { return Index{i[2], 1 + 2 * i[0], 3}; });
  Tensor r = ops::reshape(v, {6, 4});  // needs a copy
  std::vector<double> got = values_of(r);
  for_each_index({6, 4}, [&](const Index& i) {
    REQUIRE(got[ravel(i, {6, 4})] ==
            static_cast<double>(ravel({i[1], 1 + 2 * (i[0] / 2), 3}, {4, 6, 5})));
  });
  check_write_through(ops::select(ops::permute(base, {2, 0, 1}), 0, 4), base);
}
