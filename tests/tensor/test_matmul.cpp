// matmul against a naive double-precision loop with numpy semantics: 2-D,
// batched, broadcast batch dims, 1-D operands, strided operands, per dtype.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "tandem/tensor/ops.h"
#include "tests/support/test_util.h"

using namespace tandem;
using namespace tandem::test;
using Catch::Matchers::Contains;

namespace {

using Index = std::vector<int64_t>;

// numpy.matmul in double: 1-D operands are promoted to matrices and the added
// dim dropped from the result; batch dims broadcast.
std::vector<double> ref_matmul(const std::vector<double>& a, Index a_shape,
                               const std::vector<double>& b, Index b_shape, Index& out_shape) {
  const bool a_vec = a_shape.size() == 1, b_vec = b_shape.size() == 1;
  if (a_vec) a_shape.insert(a_shape.begin(), 1);
  if (b_vec) b_shape.push_back(1);
  const int64_t M = a_shape[a_shape.size() - 2], K = a_shape.back();
  const int64_t N = b_shape.back();
  REQUIRE(b_shape[b_shape.size() - 2] == K);
  Index a_batch(a_shape.begin(), a_shape.end() - 2), b_batch(b_shape.begin(), b_shape.end() - 2);
  Index batch = broadcast_shape(a_batch, b_batch);
  std::vector<double> out;
  for_each_index(batch, [&](const Index& bi) {
    int64_t a_off = broadcast_linear(bi, a_batch) * M * K;
    int64_t b_off = broadcast_linear(bi, b_batch) * K * N;
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k)
          s += a[a_off + m * K + k] * b[b_off + k * N + n];
        out.push_back(s);
      }
    }
  });
  out_shape = batch;
  if (!a_vec) out_shape.push_back(M);
  if (!b_vec) out_shape.push_back(N);
  return out;
}

struct Tolerance {
  double rtol, atol;
};

// Inputs lie in [-1, 1], so |result| <= K; the rounding error grows with K.
Tolerance matmul_tolerance(DType dt, int64_t k) {
  switch (dt) {
    case DType::F64:
      return {1e-12, 1e-13 * k};
    case DType::F32:
      return {1e-5, 2e-6 * k};
    case DType::BF16:
      return {1.6e-2, 1e-2};  // f32 accumulation, one bf16 rounding
    case DType::F16:
      return {4e-3, 2e-3};
    default:
      return {0, 0};
  }
}

void check_matmul(const Index& a_shape, const Index& b_shape, DType dt, uint32_t seed) {
  INFO(Shape(a_shape).str() << " x " << Shape(b_shape).str() << " in " << dtype_name(dt));
  std::vector<double> a = random_stored(numel_of(a_shape), seed, dt);
  std::vector<double> b = random_stored(numel_of(b_shape), seed + 1, dt);
  Index out_shape;
  std::vector<double> expected = ref_matmul(a, a_shape, b, b_shape, out_shape);
  Tensor out = ops::matmul(tensor_of(a, Shape(a_shape), dt), tensor_of(b, Shape(b_shape), dt));
  REQUIRE(out.shape() == Shape(out_shape));
  REQUIRE(out.dtype() == dt);
  Tolerance tol = matmul_tolerance(dt, a_shape.back());
  TANDEM_REQUIRE_CLOSE(values_of(out), expected, tol.rtol, tol.atol);
}

const DType kDTypes[] = {DType::F32, DType::F64, DType::BF16, DType::F16};

}  // namespace

TEST_CASE("2-D matmul", "[matmul]") {
  for (DType dt : kDTypes) {
    check_matmul({5, 7}, {7, 3}, dt, 1);
    check_matmul({1, 9}, {9, 1}, dt, 2);
    check_matmul({16, 1}, {1, 8}, dt, 3);  // an outer product
    check_matmul({33, 65}, {65, 17}, dt, 4);
  }
  check_matmul({64, 128}, {128, 96}, DType::F32, 5);
}

TEST_CASE("batched matmul", "[matmul]") {
  for (DType dt : kDTypes) {
    check_matmul({4, 5, 6}, {4, 6, 3}, dt, 10);
    check_matmul({2, 3, 4, 5}, {2, 3, 5, 6}, dt, 11);
  }
}

TEST_CASE("matmul broadcasts batch dims", "[matmul]") {
  for (DType dt : {DType::F32, DType::F64}) {
    check_matmul({2, 1, 4, 5}, {3, 5, 6}, dt, 20);  // -> (2, 3, 4, 6)
    check_matmul({3, 4, 5}, {5, 2}, dt, 21);        // a matrix shared by the batch
    check_matmul({4, 5}, {2, 3, 5, 2}, dt, 22);
    check_matmul({1, 4, 5}, {3, 5, 2}, dt, 23);
  }
}

TEST_CASE("matmul with 1-D operands", "[matmul]") {
  for (DType dt : {DType::F32, DType::F64, DType::BF16}) {
    check_matmul({7}, {7, 4}, dt, 30);     // vector-matrix -> (4)
    check_matmul({4, 7}, {7}, dt, 31);     // matrix-vector -> (4)
    check_matmul({7}, {7}, dt, 32);        // dot -> ()
    check_matmul({3, 4, 7}, {7}, dt, 33);  // -> (3, 4)
    check_matmul({7}, {2, 7, 5}, dt, 34);  // -> (2, 5)
  }
  Tensor dot =
      ops::matmul(tensor_of({1, 2, 3}, {3}, DType::F64), tensor_of({4, 5, 6}, {3}, DType::F64));
  REQUIRE(dot.dim() == 0);
  REQUIRE(dot.item<double>() == 32.0);
}

TEST_CASE("matmul of strided operands", "[matmul]") {
  for (DType dt : {DType::F32, DType::F64, DType::BF16}) {
    INFO(dtype_name(dt));
    const int64_t M = 6, K = 10, N = 5;
    // a = transpose of a (K, M) base, b = transpose of an (N, K) base.
    std::vector<double> at = random_stored(K * M, 40, dt), bt = random_stored(N * K, 41, dt);
    Tensor a = ops::transpose(tensor_of(at, {K, M}, dt), 0, 1);
    Tensor b = ops::transpose(tensor_of(bt, {N, K}, dt), 0, 1);
    REQUIRE_FALSE(a.is_contiguous());
    std::vector<double> av, bv;
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t k = 0; k < K; ++k)
        av.push_back(at[k * M + m]);
    }
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t n = 0; n < N; ++n)
        bv.push_back(bt[n * K + k]);
    }
    Index out_shape;
    std::vector<double> expected = ref_matmul(av, {M, K}, bv, {K, N}, out_shape);
    Tolerance tol = matmul_tolerance(dt, K);
    TANDEM_REQUIRE_CLOSE(values_of(ops::matmul(a, b)), expected, tol.rtol, tol.atol);
    // Only one operand transposed.
    std::vector<double> e2 = ref_matmul(av, {M, K}, bv, {K, N}, out_shape);
    TANDEM_REQUIRE_CLOSE(values_of(ops::matmul(a, tensor_of(bv, {K, N}, dt))), e2, tol.rtol,
                         tol.atol);
    TANDEM_REQUIRE_CLOSE(values_of(ops::matmul(tensor_of(av, {M, K}, dt), b)), e2, tol.rtol,
                         tol.atol);

    // Inner stride 2: every other column of an (M, 2K) base.
    std::vector<double> wide = random_stored(M * 2 * K, 42, dt);
    Tensor as = ops::slice(tensor_of(wide, {M, 2 * K}, dt), 1, 0, 2 * K, 2);
    std::vector<double> asv;
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t k = 0; k < K; ++k)
        asv.push_back(wide[m * 2 * K + 2 * k]);
    }
    std::vector<double> e3 = ref_matmul(asv, {M, K}, bv, {K, N}, out_shape);
    TANDEM_REQUIRE_CLOSE(values_of(ops::matmul(as, b)), e3, tol.rtol, tol.atol);
  }
  // Batched, with the batch dims permuted and a broadcast (expanded) operand.
  std::vector<double> base = random_stored(3 * 2 * 4 * 5, 43, DType::F64);           // (3, 2, 4, 5)
  Tensor a = ops::permute(tensor_of(base, {3, 2, 4, 5}, DType::F64), {1, 0, 2, 3});  // (2, 3, 4, 5)
  std::vector<double> av;
  for_each_index({2, 3, 4, 5}, [&](const Index& i) {
    av.push_back(base[ravel({i[1], i[0], i[2], i[3]}, {3, 2, 4, 5})]);
  });
  std::vector<double> bsmall = random_stored(5 * 2, 44, DType::F64);
  Tensor b = ops::expand(tensor_of(bsmall, {1, 1, 5, 2}, DType::F64), {2, 3, 5, 2});
  Index out_shape;
  std::vector<double> expected = ref_matmul(av, {2, 3, 4, 5}, bsmall, {5, 2}, out_shape);
  Tensor out = ops::matmul(a, b);
  REQUIRE(out.shape() == Shape{2, 3, 4, 2});
  TANDEM_REQUIRE_CLOSE(values_of(out), expected, 1e-12, 1e-12);
}

TEST_CASE("f64 matmul of small integers is exact", "[matmul]") {
  std::vector<double> a = random_stored(8 * 12, 50, DType::I64, -9, 9);
  std::vector<double> b = random_stored(12 * 6, 51, DType::I64, -9, 9);
  Index out_shape;
  std::vector<double> expected = ref_matmul(a, {8, 12}, b, {12, 6}, out_shape);
  Tensor out = ops::matmul(tensor_of(a, {8, 12}, DType::F64), tensor_of(b, {12, 6}, DType::F64));
  REQUIRE(values_of(out) == expected);
  // f32 too: every partial sum is an integer well below 2^24.
  Tensor out32 = ops::matmul(tensor_of(a, {8, 12}), tensor_of(b, {12, 6}));
  REQUIRE(values_of(out32) == expected);
}

TEST_CASE("matmul errors name both shapes", "[matmul]") {
  try {
    ops::matmul(ops::zeros({2, 3}), ops::zeros({4, 5}));
    FAIL("matmul of mismatched shapes succeeded");
  } catch (const Error& e) {
    std::string msg = e.what();
    REQUIRE_THAT(msg, Contains("[tensor::matmul]"));
    REQUIRE_THAT(msg, Contains("[2,3]"));
    REQUIRE_THAT(msg, Contains("[4,5]"));
  }
  REQUIRE_THROWS_WITH(ops::matmul(ops::zeros({3}), ops::zeros({4})), Contains("[tensor::matmul]"));
  REQUIRE_THROWS_AS(ops::matmul(ops::zeros({2, 3, 4}), ops::zeros({3, 4, 5})),
                    Error);  // batch 2 vs 3
  REQUIRE_THROWS_AS(ops::matmul(ops::scalar_tensor(1.0), ops::zeros({1})), Error);
  REQUIRE_THROWS_AS(ops::matmul(ops::zeros({2, 2}, DType::I32), ops::zeros({2, 2}, DType::I32)),
                    Error);
}

TEST_CASE("matmul gives the same result on two BLAS threads", "[matmul]") {
  const int saved = ops::num_threads();
  REQUIRE(saved >= 1);
  std::vector<double> a = random_stored(96 * 256, 60, DType::F32);
  std::vector<double> b = random_stored(256 * 160, 61, DType::F32);
  Tensor ta = tensor_of(a, {96, 256}), tb = tensor_of(b, {256, 160});
  ops::set_num_threads(1);
  std::vector<double> one = values_of(ops::matmul(ta, tb));
  ops::set_num_threads(2);
  REQUIRE(ops::num_threads() == 2);
  std::vector<double> two = values_of(ops::matmul(ta, tb));
  ops::set_num_threads(saved);
  REQUIRE(ops::num_threads() == saved);
  TANDEM_REQUIRE_CLOSE(two, one, 1e-6, 1e-5);
  Index out_shape;
  TANDEM_REQUIRE_CLOSE(two, ref_matmul(a, {96, 256}, b, {256, 160}, out_shape), 1e-5, 2e-6 * 256);
}

// The f32 kernel (Note [CPU GEMM backend]) blocks k by 256 and n by 512
// (AVX-512) or 256, and tiles C by 12 x 32 (AVX-512), 6 x 16 (AVX2) or 6 x 8
// (SSE2): these shapes cross every block boundary with partial tiles, in each
// transpose combination, at 1 and 2 threads, on every target.
TEST_CASE("f32 matmul across the kernel's cache blocks", "[matmul][threads]") {
  const int saved = ops::num_threads();
  const int64_t M = 37, K = 600, N = 545;
  std::vector<double> a = random_stored(M * K, 70, DType::F32);
  std::vector<double> b = random_stored(K * N, 71, DType::F32);
  Index out_shape;
  const std::vector<double> expected = ref_matmul(a, {M, K}, b, {K, N}, out_shape);
  // The same values stored transposed, viewed back as (M, K) and (K, N).
  std::vector<double> at(a.size()), bt(b.size());
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k)
      at[k * M + m] = a[m * K + k];
  }
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t n = 0; n < N; ++n)
      bt[n * K + k] = b[k * N + n];
  }
  const Tensor an = tensor_of(a, {M, K}), bn = tensor_of(b, {K, N});
  const Tensor atv = ops::transpose(tensor_of(at, {K, M}), 0, 1);
  const Tensor btv = ops::transpose(tensor_of(bt, {N, K}), 0, 1);
  // A's rows 4 KiB apart: packed, where the rows of `an` (2400 bytes apart)
  // are read in place (Note [GEMM A in place]).
  const Tensor wide = ops::zeros({M, 1024});
  ops::copy_(ops::narrow(wide, 1, 0, K), an);
  const Tensor a4k = ops::narrow(wide, 1, 0, K);
  // Note [CPU GEMM backend]: on every target an f32 product has the same bits
  // at any thread count, alone or as an item of a batch, and in any layout of
  // its operands.
  std::vector<double> one_thread;
  for (int threads : {1, 2}) {
    ops::set_num_threads(threads);
    std::vector<double> first;
    for (const auto& [x, y, name] :
         {std::tuple{an, bn, "A B"}, std::tuple{atv, bn, "A^T B"}, std::tuple{an, btv, "A B^T"},
          std::tuple{atv, btv, "A^T B^T"}, std::tuple{a4k, bn, "A (rows 4 KiB apart) B"}}) {
      INFO(name << " on " << threads << " threads");
      std::vector<double> got = values_of(ops::matmul(x, y));
      TANDEM_REQUIRE_CLOSE(got, expected, 1e-5, 2e-6 * K);
      if (first.empty()) first = got;
      REQUIRE(got == first);
    }
    // A batch of two different products: each item is computed on its own.
    const Tensor batch_a = ops::stack({an, ops::neg(an)}, 0);
    std::vector<double> batched = values_of(ops::matmul(batch_a, bn));
    REQUIRE(batched.size() == 2 * expected.size());
    std::vector<double> first_item(batched.begin(), batched.begin() + M * N);
    REQUIRE(first_item == first);
    for (size_t i = 0; i < expected.size(); ++i)
      REQUIRE(batched[expected.size() + i] == -first[i]);
    if (one_thread.empty()) one_thread = first;
    REQUIRE(first == one_thread);
  }
  ops::set_num_threads(saved);
}

// Note [GEMM split over threads]: a product with one row tile on every target
// (M = 5) is cut along n on two threads; each piece packs all of A. The bits
// are those of one thread in every transpose combination. K = 301 leaves a
// last block of 45 k steps: 8 x 8 register transposes, one block of 4 steps
// and one step alone in the packing of the transposed operands.
TEST_CASE("f32 matmul cut along n keeps the bits of one thread", "[matmul][threads]") {
  const int saved = ops::num_threads();
  const int64_t M = 5, K = 301, N = 545;
  std::vector<double> a = random_stored(M * K, 72, DType::F32);
  std::vector<double> b = random_stored(K * N, 73, DType::F32);
  Index out_shape;
  const std::vector<double> expected = ref_matmul(a, {M, K}, b, {K, N}, out_shape);
  const Tensor an = tensor_of(a, {M, K}), bn = tensor_of(b, {K, N});
  const Tensor at = ops::contiguous(ops::transpose(an, 0, 1));
  const Tensor bt = ops::contiguous(ops::transpose(bn, 0, 1));
  for (const auto& [x, y, name] :
       {std::tuple{an, bn, "A B"}, std::tuple{ops::transpose(at, 0, 1), bn, "A^T B"},
        std::tuple{an, ops::transpose(bt, 0, 1), "A B^T"},
        std::tuple{ops::transpose(at, 0, 1), ops::transpose(bt, 0, 1), "A^T B^T"}}) {
    INFO(name);
    ops::set_num_threads(1);
    const std::vector<double> one = values_of(ops::matmul(x, y));
    ops::set_num_threads(2);
    const std::vector<double> two = values_of(ops::matmul(x, y));
    TANDEM_REQUIRE_CLOSE(one, expected, 1e-5, 2e-6 * K);
    REQUIRE(two == one);
  }
  ops::set_num_threads(saved);
}
