// CUDA kernels against the CPU reference (STYLE: the CPU backend is the
// reference; every CUDA kernel is compared with it when a GPU is present).
//
// Each case builds its inputs on the CPU, copies them to cuda:0, runs the same
// public op (tensor/ops.h) on both devices and compares: exactly for copies,
// casts, indexing, sorting, uniform random numbers and integer arithmetic;
// within a per-dtype tolerance for float math, whose evaluation order or
// libm differs between the backends. The suite runs with TANDEM_CUDA=emulated
// (tests/meson.build), so without a GPU these cases run on the emulated device
// (Note [CUDA backends]); with neither, every case but the first says SKIP and
// passes, and the first checks that a CUDA build runs its CPU paths on a
// machine without a driver (Note [CUDA stubs]).
#include <catch2/catch.hpp>
#include <iostream>

#include <functional>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "tandem/runtime/device.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/stream.h"
#include "tandem/tensor/ops.h"
#include "tests/support/skip_cuda.h"
#include "tests/support/test_util.h"

using namespace tandem;
using tandem::test::random_tensor;
using tandem::test::tensor_of;
using tandem::test::values_of;

namespace {

const DType kFloatTypes[] = {DType::F32, DType::F64, DType::BF16, DType::F16};
const DType kAllTypes[] = {DType::F32, DType::F64, DType::BF16, DType::F16,
                           DType::I32, DType::I64, DType::Bool};
static_assert(std::size(kAllTypes) == kDTypeCount, "every DType");

struct Tol {
  double rtol, atol;
};

// Elementwise math: 16-bit results may differ by one rounding step.
Tol math_tol(DType t) {
  switch (t) {
    case DType::F32:
      return {1e-5, 1e-6};
    case DType::F64:
      return {1e-12, 1e-14};
    case DType::BF16:
      return {1.6e-2, 1e-2};
    case DType::F16:
      return {2e-3, 1e-3};
    default:
      return {0, 0};
  }
}

// Sums and products: accumulation order differs too.
Tol sum_tol(DType t) {
  switch (t) {
    case DType::F32:
      return {1e-4, 1e-4};
    case DType::F64:
      return {1e-10, 1e-10};
    case DType::BF16:
      return {2e-2, 5e-2};
    case DType::F16:
      return {5e-3, 1e-2};
    default:
      return {0, 0};
  }
}

Tensor gpu(const Tensor& t) {
  return ops::to(t, Device::cuda(0));
}

// `got` (computed on the GPU) against `expected` (the CPU reference).
void check_close(const Tensor& expected, const Tensor& got, Tol tol) {
  REQUIRE(got.device().is_cuda());
  REQUIRE(got.shape() == expected.shape());
  REQUIRE(got.dtype() == expected.dtype());
  TANDEM_CHECK_CLOSE(values_of(got), values_of(expected), tol.rtol, tol.atol);
}

void check_same(const Tensor& expected, const Tensor& got) {
  check_close(expected, got, {0, 0});
}

using Unary = std::function<Tensor(const Tensor&)>;
using Binary = std::function<Tensor(const Tensor&, const Tensor&)>;

}  // namespace

TEST_CASE("CUDA build and device queries work with or without a GPU", "[cuda]") {
  int count = cuda_device_count();
  REQUIRE(count >= 0);
  REQUIRE(cuda_device_count() == count);
  REQUIRE(cuda_available() == (count > 0));
  if (!built_with_cuda()) REQUIRE(count == 0);
  if (count == 0) {
    REQUIRE(default_device() == Device::cpu());
    REQUIRE_THROWS_AS(Device::cuda(0), Error);
    REQUIRE_THROWS_WITH(Device::cuda(0), Catch::Contains("CUDA device"));
    REQUIRE_THROWS_AS(Device::parse("cuda:0"), Error);
  } else {
    REQUIRE(Device::cuda(0).is_cuda());
    REQUIRE_THROWS_WITH(Device::cuda(count), Catch::Contains("CUDA device"));
  }
}

TEST_CASE("CUDA unary ops match the CPU", "[cuda]") {
  TANDEM_SKIP_WITHOUT_CUDA();
  // Every op of the table (tensor/unary_ops.h), so that a new one is checked
  // here without an edit (Note [Adding a unary op]), and gelu's two forms.
  const std::pair<const char*, Unary> cases[] = {
#define TANDEM_UNARY_CASE(E, name, linear) {#name, [](const Tensor& t) { return ops::name(t); }},
      TANDEM_UNARY_OPS(TANDEM_UNARY_CASE)
#undef TANDEM_UNARY_CASE
          {"gelu", [](const Tensor& t) { return ops::gelu(t); }},
      {"gelu exact", [](const Tensor& t) { return ops::gelu(t, GeluApproximate::None); }},
  };
  for (DType dt : kFloatTypes) {
    Tensor signed_x = random_tensor({7, 9}, dt, 1, -3.0, 3.0);
    Tensor positive_x = random_tensor({7, 9}, dt, 2, 0.1, 4.0);
    for (const auto& [name, fn] : cases) {
      INFO(name << " " << dtype_name(dt));
      bool needs_positive =
          std::string(name) == "log" || std::string(name).find("sqrt") != std::string::npos;
      Tensor x = needs_positive ? positive_x : signed_x;
      check_close(fn(x), fn(gpu(x)), math_tol(dt));
      // A transposed (strided) input takes the index-decomposition path.
      check_close(fn(ops::transpose(x, 0, 1)), fn(ops::transpose(gpu(x), 0, 1)), math_tol(dt));
    }
  }
  for (DType dt : {DType::I32, DType::I64}) {
    INFO(dtype_name(dt));
    Tensor x = random_tensor({5, 6}, dt, 3, -20.0, 20.0);
    check_same(ops::neg(x), ops::neg(gpu(x)));
    check_same(ops::abs(x), ops::abs(gpu(x)));
    check_same(ops::relu(x), ops::relu(gpu(x)));
  }
}

TEST_CASE("CUDA binary, scalar and where ops match the CPU", "[cuda]") {
  TANDEM_SKIP_WITHOUT_CUDA();
  const std::pair<const char*, Binary> arith[] = {
      {"add", [](const Tensor& a, const Tensor& b) { return ops::add(a, b); }},
      {"sub", [](const Tensor& a, const Tensor& b) { return ops::sub(a, b); }},
      {"mul", [](const Tensor& a, const Tensor& b) { return ops::mul(a, b); }},
      {"div", [](const Tensor& a, const Tensor& b) { return ops::div(a, b); }},
      {"pow", [](const Tensor& a, const Tensor& b) { return ops::pow(a, b); }},
      {"maximum", [](const Tensor& a, const Tensor& b) { return ops::maximum(a, b); }},
      {"minimum", [](const Tensor& a, const Tensor& b) { return ops::minimum(a, b); }},
  };
  const std::pair<const char*, Binary> compare[] = {
      {"eq", [](const Tensor& a, const Tensor& b) { return ops::eq(a, b); }},
      {"ne", [](const Tensor& a, const Tensor& b) { return ops::ne(a, b); }},
      {"lt", [](const Tensor& a, const Tensor& b) { return ops::lt(a, b); }},
      {"le", [](const Tensor& a, const Tensor& b) { return ops::le(a, b); }},
      {"gt", [](const Tensor& a, const Tensor& b) { return ops::gt(a, b); }},
      {"ge", [](const Tensor& a, const Tensor& b) { return ops::ge(a, b); }},
  };
  for (DType dt : kAllTypes) {
    if (dt == DType::Bool) continue;
    bool integral = is_integral(dt);
    // Positive operands keep pow real and div finite; small integers keep
    // integer pow in range. (3, 1, 5) with (4, 5) broadcasts both ways.
    Tensor a = random_tensor({3, 1, 5}, dt, 4, integral ? 0.0 : 0.2, integral ? 4.0 : 3.0);
    Tensor b = random_tensor({4, 5}, dt, 5, integral ? 1.0 : 0.2, integral ? 3.0 : 3.0);
    Tensor ga = gpu(a), gb = gpu(b);
    Tol tol = integral ? Tol{0, 0} : math_tol(dt);
    for (const auto& [name, fn] : arith) {
      INFO(name << " " << dtype_name(dt));
      check_close(fn(a, b), fn(ga, gb), tol);
      // Strided operand: (5, 4) transposed view against a broadcast row.
      Tensor bt = ops::transpose(b, 0, 1), row = ops::narrow(bt, 0, 0, 1);
      check_close(fn(bt, row), fn(ops::transpose(gb, 0, 1), gpu(row)), tol);
    }
    for (const auto& [name, fn] : compare) {
      INFO(name << " " << dtype_name(dt));
      Tensor c = ops::narrow(b, 1, 0, 1);  // (4, 1): ties with b's first column
      check_same(fn(b, c), fn(gb, gpu(c)));
    }
    INFO("scalar ops " << dtype_name(dt));
    check_close(ops::add(a, 2.0), ops::add(ga, 2.0), tol);
    check_close(ops::rsub(a, 3.0), ops::rsub(ga, 3.0), tol);
    check_close(ops::mul(a, -2.0), ops::mul(ga, -2.0), tol);
    check_close(ops::pow(a, 2.0), ops::pow(ga, 2.0), tol);
    check_same(ops::gt(a, 1.5), ops::gt(ga, 1.5));
    check_same(ops::le(b, 2.0), ops::le(gb, 2.0));
    if (!integral) {
      check_close(ops::rdiv(a, 1.5), ops::rdiv(ga, 1.5), tol);
      check_close(ops::div(a, 4.0), ops::div(ga, 4.0), tol);
    }
    Tensor cond = ops::gt(b, ops::narrow(b, 0, 1, 1));
    check_same(ops::where(cond, a, b), ops::where(gpu(cond), ga, gb));
    check_same(ops::where(cond, b, 7.0), ops::where(gpu(cond), gb, 7.0));
  }
}

TEST_CASE("CUDA copies, casts, fills and factories match the CPU exactly", "[cuda]") {
  TANDEM_SKIP_WITHOUT_CUDA();
  for (DType from : kAllTypes) {
    Tensor x = random_tensor({3, 5}, from, 6, -300.0, 300.0);
    Tensor gx = gpu(x);
    check_same(x, gx);
    check_same(ops::contiguous(ops::transpose(x, 0, 1)), ops::contiguous(ops::transpose(gx, 0, 1)));
    for (DType to : kAllTypes) {
      INFO(dtype_name(from) << " -> " << dtype_name(to));
      check_same(ops::to(x, to), ops::to(gx, to));
      check_same(ops::to(ops::transpose(x, 0, 1), to), ops::to(ops::transpose(gx, 0, 1), to));
    }
  }
  for (DType dt : kAllTypes) {
    INFO(dtype_name(dt));
    Device cuda = Device::cuda(0);
    check_same(ops::full({4, 3}, 2.5, dt), ops::full({4, 3}, 2.5, dt, cuda));
    check_same(ops::zeros({5}, dt), ops::zeros({5}, dt, cuda));
    check_same(ops::ones({2, 2}, dt), ops::ones({2, 2}, dt, cuda));
    // copy_ of a broadcast row into a strided view; fill_ of a stepped slice.
    Tensor dst = ops::zeros({4, 6}, dt), gdst = ops::zeros({4, 6}, dt, cuda);
    Tensor row = random_tensor({1, 3}, dt, 7, -5.0, 5.0);
    ops::copy_(ops::narrow(dst, 1, 2, 3), row);
    ops::copy_(ops::narrow(gdst, 1, 2, 3), gpu(row));
    ops::fill_(ops::slice(dst, 0, 0, 4, 2), 3.0);
    ops::fill_(ops::slice(gdst, 0, 0, 4, 2), 3.0);
    check_same(dst, gdst);
  }
  for (DType dt : {DType::F32, DType::F64, DType::BF16, DType::I32, DType::I64}) {
    INFO("arange " << dtype_name(dt));
    check_same(ops::arange(-3, 17, 1, dt), ops::arange(-3, 17, 1, dt, Device::cuda(0)));
  }
  check_same(ops::arange(0, 10, 0.25, DType::F32),
             ops::arange(0, 10, 0.25, DType::F32, Device::cuda(0)));
  Tensor a = random_tensor({2, 3}, DType::F32, 8), b = random_tensor({2, 3}, DType::F32, 9);
  check_same(ops::cat({a, b}, 1), ops::cat({gpu(a), gpu(b)}, 1));
  check_same(ops::stack({a, b}, 0), ops::stack({gpu(a), gpu(b)}, 0));
}

TEST_CASE("CUDA random numbers equal the CPU's for the same generator state", "[cuda]") {
  TANDEM_SKIP_WITHOUT_CUDA();
  Device cuda = Device::cuda(0);
  for (DType dt : kFloatTypes) {
    INFO(dtype_name(dt));
    Generator cpu_gen(1234), gpu_gen(1234);
    check_same(ops::rand({17, 33}, cpu_gen, dt), ops::rand({17, 33}, gpu_gen, dt, cuda));
    check_same(ops::uniform({1000}, -2.0, 3.0, cpu_gen, dt),
               ops::uniform({1000}, -2.0, 3.0, gpu_gen, dt, cuda));
    REQUIRE(cpu_gen.offset() == gpu_gen.offset());
    // Box-Muller runs through libm (CPU) and CUDA's math library: equal up to
    // their last-place differences, which a 16-bit store usually hides.
    check_close(ops::randn({40, 25}, cpu_gen, dt), ops::randn({40, 25}, gpu_gen, dt, cuda),
                math_tol(dt));
    check_close(ops::normal({999}, 1.5, 0.5, cpu_gen, dt),
                ops::normal({999}, 1.5, 0.5, gpu_gen, dt, cuda), math_tol(dt));
    // Dropout's mask comes from the same counters on both devices; the kept
    // values are one product, rounded alike.
    Tensor x = random_tensor({33, 31}, dt, 5, -2.0, 2.0);
    check_same(ops::dropout(x, 0.3, 77, 5), ops::dropout(gpu(x), 0.3, 77, 5));
  }
}

TEST_CASE("CUDA long sums stay accurate (Note [Cascade summation])", "[cuda]") {
  TANDEM_SKIP_WITHOUT_CUDA();
  // The same bound as tests/tensor/test_summation.cpp: |error| / sum |x| below
  // 1e-6 at 1M and 4M elements, summed along and across the last dim, and a
  // cumsum's last prefix. The emulated device runs a block's threads as host
  // fibers (a 4M-long scan is ~10^8 fiber switches, minutes under TSan), so
  // there the rows are 16K and 64K long; the kernels' paths are the same
  // (several tiles per scan, many blocks per reduction).
  const bool emulated = cuda_emulated();
  const int64_t lengths[] = {emulated ? int64_t{1} << 14 : int64_t{1} << 20,
                             emulated ? int64_t{1} << 16 : int64_t{4} << 20};
  for (int64_t n : lengths) {
    INFO("n = " << n);
    std::vector<double> v = tandem::test::random_stored(n, 6, DType::F32, 0.0, 1.0);
    double exact = 0;
    for (double e : v)
      exact += e;
    Tensor x = gpu(tensor_of(v, {n}, DType::F32));
    CHECK(std::abs(ops::sum(x).item_double() - exact) / exact < 1e-6);
    const std::vector<double> cols = values_of(ops::sum(ops::reshape(x, {n / 4, 4}), {0}));
    double by_cols = 0;
    for (double c : cols)
      by_cols += c;
    CHECK(std::abs(by_cols - exact) / exact < 1e-6);
    const std::vector<double> scan = values_of(ops::cumsum(x, 0));
    CHECK(std::abs(scan.back() - exact) / exact < 1e-6);
  }
}

TEST_CASE("CUDA reductions, softmax and cumsum match the CPU", "[cuda]") {
  TANDEM_SKIP_WITHOUT_CUDA();
  const Dims dim_sets[] = {{}, {0}, {1}, {2}, {0, 2}};
  for (DType dt : kAllTypes) {
    if (dt == DType::Bool) continue;
    bool integral = is_integral(dt);
    INFO(dtype_name(dt));
    Tensor x = random_tensor({6, 7, 5}, dt, 10, integral ? -50.0 : -2.0, integral ? 50.0 : 2.0);
    Tensor gx = gpu(x);
    Tol tol = integral ? Tol{0, 0} : sum_tol(dt);
    for (const Dims& dims : dim_sets) {
      for (bool keepdim : {false, true}) {
        INFO("dims " << dims.str() << " keepdim " << keepdim);
        check_close(ops::sum(x, dims, keepdim), ops::sum(gx, dims, keepdim), tol);
        check_same(ops::amax(x, dims, keepdim), ops::amax(gx, dims, keepdim));
        check_same(ops::amin(x, dims, keepdim), ops::amin(gx, dims, keepdim));
        if (!integral) check_close(ops::mean(x, dims, keepdim), ops::mean(gx, dims, keepdim), tol);
      }
    }
    for (int64_t dim = 0; dim < 3; ++dim) {
      INFO("dim " << dim);
      auto [values, indices] = ops::max(x, dim);
      auto [gvalues, gindices] = ops::max(gx, dim);
      check_same(values, gvalues);
      check_same(indices, gindices);
      check_same(ops::argmax(x, dim), ops::argmax(gx, dim));
      check_same(ops::argmin(x, dim, true), ops::argmin(gx, dim, true));
      check_close(ops::cumsum(x, dim), ops::cumsum(gx, dim), tol);
      if (!integral) {
        check_close(ops::softmax(x, dim), ops::softmax(gx, dim), math_tol(dt));
        check_close(ops::log_softmax(x, dim), ops::log_softmax(gx, dim), sum_tol(dt));
      }
    }
  }
  // Shapes that pick each kernel layout: long contiguous rows (block per row),
  // few strided outputs (block per output), many strided outputs (thread per
  // output), and a whole-tensor sum.
  const std::pair<Shape, int64_t> layouts[] = {
      {{3, 5000}, 1}, {{5000, 3}, 0}, {{300, 4096}, 0}, {{2, 3000}, 1}};
  for (const auto& [shape, dim] : layouts) {
    INFO("shape " << shape.str() << " dim " << dim);
    Tensor x = random_tensor(shape, DType::F32, 11);
    Tensor gx = gpu(x);
    check_close(ops::sum(x, {dim}), ops::sum(gx, {dim}), {1e-4, 1e-3});
    check_same(ops::argmax(x, dim), ops::argmax(gx, dim));
    check_close(ops::softmax(x, dim), ops::softmax(gx, dim), {1e-5, 1e-7});
    check_close(ops::cumsum(x, dim), ops::cumsum(gx, dim), {1e-4, 1e-3});
    Tensor xi = random_tensor(shape, DType::I64, 12, -1000.0, 1000.0);
    check_same(ops::cumsum(xi, dim), ops::cumsum(gpu(xi), dim));
  }
  Tensor big = random_tensor({1000, 1000}, DType::F32, 13);
  check_close(ops::sum(big), ops::sum(gpu(big)), {1e-4, 5e-2});
  Tensor empty = ops::zeros({0, 4});
  check_same(ops::sum(empty, {0}), ops::sum(gpu(empty), {0}));
  check_same(ops::add(empty, empty), ops::add(gpu(empty), gpu(empty)));
}

TEST_CASE("CUDA matmul matches the CPU", "[cuda]") {
  TANDEM_SKIP_WITHOUT_CUDA();
  const std::pair<Shape, Shape> shapes[] = {
      {{5, 7}, {7, 3}}, {{2, 5, 7}, {7, 3}},    {{4, 1, 5, 7}, {3, 7, 6}}, {{7}, {7, 3}},
      {{5, 7}, {7}},    {{64, 128}, {128, 96}}, {{3, 1, 33}, {33, 65}},
  };
  for (DType dt : kFloatTypes) {
    for (const auto& [sa, sb] : shapes) {
      INFO(dtype_name(dt) << " " << sa.str() << " @ " << sb.str());
      Tensor a = random_tensor(sa, dt, 14), b = random_tensor(sb, dt, 15);
      check_close(ops::matmul(a, b), ops::matmul(gpu(a), gpu(b)), sum_tol(dt));
    }
    INFO(dtype_name(dt) << " transposed operands");
    Tensor at = random_tensor({7, 5}, dt, 16), bt = random_tensor({3, 7}, dt, 17);
    Tensor a = ops::transpose(at, 0, 1), b = ops::transpose(bt, 0, 1);
    Tensor ga = ops::transpose(gpu(at), 0, 1), gb = ops::transpose(gpu(bt), 0, 1);
    check_close(ops::matmul(a, b), ops::matmul(ga, gb), sum_tol(dt));
    check_close(ops::matmul(a, ops::transpose(a, 0, 1)), ops::matmul(ga, ops::transpose(ga, 0, 1)),
                sum_tol(dt));
  }
}

TEST_CASE("CUDA layer_norm and rms_norm match the CPU", "[cuda]") {
  TANDEM_SKIP_WITHOUT_CUDA();
  const Shape shapes[] = {{7, 33}, {2, 3, 3000}, {1, 1}};
  for (DType dt : kFloatTypes) {
    for (const Shape& shape : shapes) {
      INFO(dtype_name(dt) << " " << shape.str());
      int64_t d = shape.back();
      Tensor x = random_tensor(shape, dt, 18, -3.0, 5.0);
      Tensor w = random_tensor({d}, dt, 19, 0.5, 1.5), b = random_tensor({d}, dt, 20);
      Tensor gx = gpu(x), gw = gpu(w), gb = gpu(b);
      Tol tol = sum_tol(dt);
      for (bool affine : {false, true}) {
        INFO("affine " << affine);
        ops::NormResult ln = ops::layer_norm(x, affine ? w : Tensor(), affine ? b : Tensor());
        ops::NormResult gln = ops::layer_norm(gx, affine ? gw : Tensor(), affine ? gb : Tensor());
        check_close(ln.out, gln.out, tol);
        check_close(ln.mean, gln.mean, {1e-4, 1e-4});
        check_close(ln.rstd, gln.rstd, {1e-4, 1e-4});
        ops::NormResult rn = ops::rms_norm(x, affine ? w : Tensor());
        ops::NormResult grn = ops::rms_norm(gx, affine ? gw : Tensor());
        check_close(rn.out, grn.out, tol);
        check_close(rn.rstd, grn.rstd, {1e-4, 1e-4});
      }
    }
  }
}

TEST_CASE("CUDA elementwise ops in 16-byte packs give the scalar kernel's results", "[cuda]") {
  TANDEM_SKIP_WITHOUT_CUDA();
  // Contiguous aligned operands go through the packs, the last n % pack
  // elements through the scalar kernel (Note [Vectorised elementwise]); a view
  // one element in is unaligned and a broadcast is strided: scalar throughout.
  for (DType dt : {DType::F32, DType::F64, DType::BF16, DType::F16, DType::I64}) {
    for (int64_t n : {1, 7, 8, 9, 4099, 100003}) {
      INFO(dtype_name(dt) << " n " << n);
      Tensor a = random_tensor({n}, dt, 31, -4.0, 4.0);
      Tensor b = random_tensor({n}, dt, 32, 0.5, 4.0);
      Tensor ga = gpu(a), gb = gpu(b);
      check_same(ops::neg(a), ops::neg(ga));
      check_same(ops::add(a, b), ops::add(ga, gb));
      check_same(ops::mul(a, b), ops::mul(ga, gb));
      check_same(ops::maximum(a, b), ops::maximum(ga, gb));
      check_same(ops::mul(a, 3.0), ops::mul(ga, 3.0));
      check_same(ops::sub(a, 2.0), ops::sub(ga, 2.0));
      if (dt != DType::I64) check_close(ops::exp(a), ops::exp(ga), math_tol(dt));
      if (n > 1) {
        Tensor va = ops::narrow(a, 0, 1, n - 1), vb = ops::narrow(b, 0, 1, n - 1);
        Tensor gva = ops::narrow(ga, 0, 1, n - 1), gvb = ops::narrow(gb, 0, 1, n - 1);
        check_same(ops::add(va, vb), ops::add(gva, gvb));
        check_same(ops::neg(va), ops::neg(gva));
        check_same(ops::mul(va, 3.0), ops::mul(gva, 3.0));
      }
      Tensor row = ops::narrow(a, 0, 0, 1);
      check_same(ops::add(ops::expand(row, {n}), b), ops::add(ops::expand(gpu(row), {n}), gb));
    }
  }
}

TEST_CASE("CUDA indexing ops match the CPU exactly", "[cuda]") {
  TANDEM_SKIP_WITHOUT_CUDA();
  // Index tensors match t (6, 6) in every dim but the indexed one (the
  // (outer, k, inner) contract of gather and scatter_add).
  Tensor idx = tensor_of({4, 0, 0, 5, 2}, {5}, DType::I64);
  Tensor idx_rows = random_tensor({3, 6}, DType::I64, 21, 0.0, 5.0);
  Tensor idx_cols = random_tensor({6, 8}, DType::I64, 22, 0.0, 5.0);  // k > n: repeats
  Tensor tokens = tensor_of({9, 0, 3, 3, 1, 8}, {2, 3}, DType::I64);
  for (DType dt : kAllTypes) {
    INFO(dtype_name(dt));
    Tensor t = random_tensor({6, 6}, dt, 23, -9.0, 9.0);
    Tensor gt = gpu(t);
    check_same(ops::index_select(t, 0, idx), ops::index_select(gt, 0, gpu(idx)));
    check_same(ops::index_select(t, 1, idx), ops::index_select(gt, 1, gpu(idx)));
    check_same(ops::gather(t, 0, idx_rows), ops::gather(gt, 0, gpu(idx_rows)));
    check_same(ops::gather(t, 1, idx_cols), ops::gather(gt, 1, gpu(idx_cols)));
    if (dt == DType::Bool) continue;
    Tensor weight = random_tensor({10, 4}, dt, 24, -9.0, 9.0);
    check_same(ops::embedding(weight, tokens), ops::embedding(gpu(weight), gpu(tokens)));
    // Fractional sources: the same bits only when every output adds its
    // sources in the CPU's order, rounding after each addition (Note
    // [Deterministic scatter_add]). 96 sources over 6 rows: many repeats.
    Tensor src_rows = random_tensor({3, 6}, dt, 25, -8.0, 8.0);
    Tensor src_cols = random_tensor({6, 8}, dt, 26, -8.0, 8.0);
    Tensor idx_many = random_tensor({96, 6}, DType::I64, 27, 0.0, 5.0);
    Tensor src_many = random_tensor({96, 6}, dt, 28, -8.0, 8.0);
    check_same(ops::scatter_add(t, 0, idx_rows, src_rows),
               ops::scatter_add(gt, 0, gpu(idx_rows), gpu(src_rows)));
    check_same(ops::scatter_add(t, 1, idx_cols, src_cols),
               ops::scatter_add(gt, 1, gpu(idx_cols), gpu(src_cols)));
    check_same(ops::scatter_add(t, 0, idx_many, src_many),
               ops::scatter_add(gt, 0, gpu(idx_many), gpu(src_many)));
  }
  Tensor classes = tensor_of({0, 6, 2, 2, 5}, {5}, DType::I64);
  check_same(ops::one_hot(classes, 7), ops::one_hot(gpu(classes), 7));
}

TEST_CASE("CUDA topk and argsort match the CPU's stable order", "[cuda]") {
  TANDEM_SKIP_WITHOUT_CUDA();
  // Few distinct values, so ties are everywhere and the tie order is tested.
  // 5000- and 10000-long rows exceed shared memory: the global-memory path.
  // On the emulated device each of the ~100 launches of a long row's network
  // runs thousands of host fibers (tens of microseconds each under TSan), so
  // there one row of each length class is sorted (the same paths: shared
  // memory at 4096, global memory at 5000), the global-memory row by argsort
  // ascending and topk descending only.
  const bool emulated = cuda_emulated();
  const std::vector<Shape> shapes =
      emulated ? std::vector<Shape>{{6, 37}, {3, 1}, {1, 4096}, {1, 5000}}
               : std::vector<Shape>{{6, 37}, {3, 1}, {2, 4096}, {2, 5000}, {1, 10000}};
  for (DType dt : {DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::I64}) {
    for (const Shape& shape : shapes) {
      INFO(dtype_name(dt) << " " << shape.str());
      Tensor x = ops::to(random_tensor(shape, DType::I32, 27, 0.0, 4.0), dt);
      Tensor gx = gpu(x);
      const bool thin = emulated && shape.back() > 4096;
      for (bool descending : {false, true}) {
        INFO("descending " << descending);
        if (!thin || !descending) {
          check_same(ops::argsort(x, -1, descending), ops::argsort(gx, -1, descending));
        }
        if (thin && !descending) continue;
        int64_t k = std::min<int64_t>(5, shape.back());
        auto [values, indices] = ops::topk(x, k, -1, descending);
        auto [gvalues, gindices] = ops::topk(gx, k, -1, descending);
        check_same(values, gvalues);
        check_same(indices, gindices);
      }
      if (!thin) check_same(ops::argsort(x, 0), ops::argsort(gx, 0));
    }
  }
  Tensor distinct = random_tensor({4, 300}, DType::F32, 28);
  auto [values, indices] = ops::topk(distinct, 300, 1);
  auto [gvalues, gindices] = ops::topk(gpu(distinct), 300, 1);
  check_same(values, gvalues);
  check_same(indices, gindices);
}

TEST_CASE("CUDA ops run on the thread's current stream", "[cuda]") {
  TANDEM_SKIP_WITHOUT_CUDA();
  Device cuda = Device::cuda(0);
  Tensor a = random_tensor({256, 64}, DType::F32, 29), b = random_tensor({64, 32}, DType::F32, 30);
  Tensor ga = gpu(a), gb = gpu(b);
  Stream side = Stream::create(cuda);
  Event ready;
  ready.record(current_stream(cuda));
  ready.wait(side);  // the inputs were written on the default stream
  Tensor gc;
  {
    StreamGuard guard(side);
    REQUIRE(current_stream(cuda) == side);
    gc = ops::relu(ops::add(ops::matmul(ga, gb), 0.5));
  }
  side.synchronize();
  check_close(ops::relu(ops::add(ops::matmul(a, b), 0.5)), gc, sum_tol(DType::F32));
}
