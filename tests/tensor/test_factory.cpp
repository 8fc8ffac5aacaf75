// Tensor factories, the counter-based RNG, dtype conversion and the copy ops
// (contiguous, clone, copy_, fill_, cat, stack), checked against values the
// test computes itself.
#include <fmt/format.h>
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <string>
#include <vector>

#include "tandem/runtime/allocator.h"
#include "tandem/tensor/cpu/copy_bytes.h"
#include "tandem/tensor/ops.h"
#include "tandem/tensor/random.h"
#include "tests/support/test_util.h"

using namespace tandem;
using namespace tandem::test;
using Catch::Matchers::Contains;

namespace {

const DType kAllDTypes[] = {DType::F32, DType::F64, DType::BF16, DType::F16,
                            DType::I32, DType::I64, DType::Bool};
static_assert(std::size(kAllDTypes) == kDTypeCount, "every DType");

double mean_of(const std::vector<double>& v) {
  double s = 0;
  for (double x : v)
    s += x;
  return s / static_cast<double>(v.size());
}

double min_of(const std::vector<double>& v) {
  return *std::min_element(v.begin(), v.end());
}
double max_of(const std::vector<double>& v) {
  return *std::max_element(v.begin(), v.end());
}

double stddev_of(const std::vector<double>& v) {
  double m = mean_of(v), s = 0;
  for (double x : v)
    s += (x - m) * (x - m);
  return std::sqrt(s / static_cast<double>(v.size()));
}

}  // namespace

TEST_CASE("zeros, ones and full for every dtype", "[factory]") {
  for (DType dt : kAllDTypes) {
    INFO("dtype " << dtype_name(dt));
    Tensor z = ops::zeros({2, 3}, dt);
    REQUIRE(z.dtype() == dt);
    REQUIRE(z.shape() == Shape{2, 3});
    REQUIRE(z.is_contiguous());
    REQUIRE(z.device() == Device::cpu());
    REQUIRE(values_of(z) == std::vector<double>(6, 0.0));

    Tensor o = ops::ones({3, 1, 2}, dt);
    REQUIRE(o.dtype() == dt);
    REQUIRE(o.shape() == Shape{3, 1, 2});
    REQUIRE(values_of(o) == std::vector<double>(6, 1.0));

    const double value = dt == DType::Bool ? 1.0 : is_integral(dt) ? -7.0 : 2.71828;
    Tensor f = ops::full({4}, value, dt);
    REQUIRE(f.dtype() == dt);
    REQUIRE(values_of(f) == std::vector<double>(4, stored_value(dt, value)));

    Tensor e = ops::zeros({0, 3}, dt);
    REQUIRE(e.numel() == 0);
    REQUIRE(values_of(e).empty());
  }
}

TEST_CASE("the *_like factories copy shape and dtype", "[factory]") {
  Tensor t = ops::zeros({2, 5}, DType::BF16);
  for (const Tensor& like :
       {ops::empty_like(t), ops::zeros_like(t), ops::ones_like(t), ops::full_like(t, 3.5)}) {
    REQUIRE(like.shape() == t.shape());
    REQUIRE(like.dtype() == DType::BF16);
    REQUIRE_FALSE(like.is_alias_of(t));
  }
  REQUIRE(values_of(ops::ones_like(t)) == std::vector<double>(10, 1.0));
  REQUIRE(values_of(ops::full_like(t, 3.5)) == std::vector<double>(10, 3.5));
  REQUIRE(values_of(ops::zeros_like(ops::ones({3}, DType::I32))) == std::vector<double>(3, 0.0));
}

TEST_CASE("empty allocates a contiguous tensor and rejects negative extents", "[factory]") {
  Tensor t = empty({2, 3, 4}, DType::F64);
  REQUIRE(t.shape() == Shape{2, 3, 4});
  REQUIRE(t.strides() == Dims{12, 4, 1});
  REQUIRE(t.nbytes() == 24 * 8);
  REQUIRE(t.storage()->nbytes >= t.nbytes());
  REQUIRE(t.storage_offset() == 0);
  REQUIRE(t.is_contiguous());
  REQUIRE_THROWS_WITH(empty({2, -1}), Contains("[tensor::empty] expected non-negative extents"));
}

TEST_CASE("a big tensor shows in the CPU allocator's statistics", "[factory][allocator]") {
  current_stream(Device::cpu()).synchronize();
  const int64_t before = memory_stats(Device::cpu()).allocated_bytes;
  const int64_t nbytes = int64_t{1} << 22;  // (1 << 20) f32
  {
    Tensor big = empty({1 << 20});
    MemoryStats during = memory_stats(Device::cpu());
    REQUIRE(during.allocated_bytes - before >= nbytes);
    REQUIRE(during.peak_allocated_bytes >= during.allocated_bytes);
    REQUIRE(during.reserved_bytes >= during.allocated_bytes);
  }
  current_stream(Device::cpu()).synchronize();
  REQUIRE(memory_stats(Device::cpu()).allocated_bytes == before);
}

TEST_CASE("arange", "[factory]") {
  SECTION("defaults to i64") {
    Tensor t = ops::arange(0, 5);
    REQUIRE(t.dtype() == DType::I64);
    REQUIRE(t.shape() == Shape{5});
    REQUIRE(t.to_vector<int64_t>() == std::vector<int64_t>{0, 1, 2, 3, 4});
  }
  SECTION("fractional step, end excluded") {
    Tensor t = ops::arange(1, 2, 0.25, DType::F32);
    REQUIRE(t.to_vector<float>() == std::vector<float>{1.0f, 1.25f, 1.5f, 1.75f});
  }
  SECTION("a step that does not divide the range") {
    Tensor t = ops::arange(0, 10, 3, DType::I32);
    REQUIRE(t.to_vector<int32_t>() == std::vector<int32_t>{0, 3, 6, 9});
  }
  SECTION("negative step counts down") {
    Tensor t = ops::arange(5, 0, -2, DType::F64);
    REQUIRE(t.to_vector<double>() == std::vector<double>{5, 3, 1});
  }
  SECTION("empty range") {
    Tensor t = ops::arange(3, 3);
    REQUIRE(t.numel() == 0);
  }
  SECTION("every numeric dtype") {
    for (DType dt : {DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::I64}) {
      INFO("dtype " << dtype_name(dt));
      Tensor t = ops::arange(-2, 6, 2, dt);
      REQUIRE(t.dtype() == dt);
      REQUIRE(values_of(t) == std::vector<double>{-2, 0, 2, 4});
    }
  }
  SECTION("a zero step is an error") {
    REQUIRE_THROWS_AS(ops::arange(0, 5, 0), Error);
  }
}

TEST_CASE("from_vector and to_vector round trip every dtype", "[factory]") {
  SECTION("f32") {
    std::vector<float> v{1.5f, -2.25f, 3e-8f, 1e30f, 0.0f, -0.0f};
    Tensor t = ops::from_vector(v, {2, 3});
    REQUIRE(t.dtype() == DType::F32);
    REQUIRE(t.shape() == Shape{2, 3});
    REQUIRE(t.to_vector<float>() == v);
  }
  SECTION("f64") {
    std::vector<double> v{1.0 / 3.0, -1e300, 5e-324};
    REQUIRE(ops::from_vector(v, {3}).to_vector<double>() == v);
  }
  SECTION("bf16 and f16 keep their bits") {
    std::vector<BFloat16> b{BFloat16(1.0f), BFloat16(-3.140625f), BFloat16(1e-20f)};
    std::vector<BFloat16> b2 = ops::from_vector(b, {3}).to_vector<BFloat16>();
    std::vector<Half> h{Half(1.0f), Half(-0.0999755859375f), Half(65504.0f), Half(6e-8f)};
    std::vector<Half> h2 = ops::from_vector(h, {2, 2}).to_vector<Half>();
    for (size_t i = 0; i < b.size(); ++i)
      REQUIRE(b2[i].bits == b[i].bits);
    for (size_t i = 0; i < h.size(); ++i)
      REQUIRE(h2[i].bits == h[i].bits);
    REQUIRE(ops::from_vector(b, {3}).dtype() == DType::BF16);
    REQUIRE(ops::from_vector(h, {4}).dtype() == DType::F16);
  }
  SECTION("integers and bool") {
    std::vector<int32_t> i{INT32_MIN, -1, 0, INT32_MAX};
    REQUIRE(ops::from_vector(i, {4}).to_vector<int32_t>() == i);
    std::vector<int64_t> l{INT64_MIN, 1, INT64_MAX};
    REQUIRE(ops::from_vector(l, {3, 1}).to_vector<int64_t>() == l);
    std::vector<bool> b{true, false, false, true, true};
    Tensor tb = ops::from_vector(b, {5});
    REQUIRE(tb.dtype() == DType::Bool);
    REQUIRE(tb.to_vector<bool>() == b);
  }
  SECTION("the element count must match the shape") {
    REQUIRE_THROWS_WITH(ops::from_vector(std::vector<float>{1, 2, 3}, {2, 2}),
                        Contains("[tensor::from_vector] expected 4 values for shape [2,2], got 3"));
  }
}

TEST_CASE("scalar_tensor is 0-d", "[factory]") {
  for (DType dt : kAllDTypes) {
    INFO("dtype " << dtype_name(dt));
    const double value = dt == DType::Bool ? 1.0 : is_integral(dt) ? 42.0 : -0.375;
    Tensor s = ops::scalar_tensor(value, dt);
    REQUIRE(s.dim() == 0);
    REQUIRE(s.numel() == 1);
    REQUIRE(s.dtype() == dt);
    REQUIRE(s.item_double() == value);
  }
  REQUIRE(ops::scalar_tensor(2.5).item<float>() == 2.5f);
}

TEST_CASE("item and to_vector check their preconditions", "[factory]") {
  Tensor t = tensor_of({1, 2, 3, 4}, {2, 2});
  REQUIRE_THROWS_WITH(t.item<float>(), Contains("[tensor::item] expected exactly one element"));
  REQUIRE_THROWS_WITH(t.to_vector<double>(), Contains("expected dtype f64, got f32"));
  REQUIRE_THROWS_AS(Tensor().to_vector<float>(), Error);
  REQUIRE(ops::reshape(ops::narrow(t, 1, 1, 1), {2}).to_vector<float>() ==
          std::vector<float>{2, 4});
  REQUIRE(ops::select(ops::select(t, 0, 1), 0, 0).item<float>() == 3.0f);
  REQUIRE(tensor_of({7}, {1}, DType::I64).item<int64_t>() == 7);
  REQUIRE(tensor_of({0}, {1, 1}, DType::Bool).item<bool>() == false);
  REQUIRE(tensor_of({-1.5}, {}, DType::BF16).item_double() == -1.5);
}

TEST_CASE("rand is uniform in [0, 1)", "[factory]") {
  Generator gen(1234);
  const int64_t n = 100000;
  Tensor u = ops::rand({n}, gen);
  REQUIRE(u.dtype() == DType::F32);
  REQUIRE(gen.offset() == static_cast<uint64_t>(n));  // the generator advanced by numel
  std::vector<double> v = values_of(u);
  REQUIRE(min_of(v) >= 0.0);
  REQUIRE(max_of(v) < 1.0);
  REQUIRE(std::abs(mean_of(v) - 0.5) < 0.01);
  REQUIRE(std::abs(stddev_of(v) - std::sqrt(1.0 / 12.0)) < 0.01);
  // Ten equal bins each get about a tenth.
  std::vector<int> bins(10, 0);
  for (double x : v)
    ++bins[static_cast<int>(x * 10)];
  for (int b : bins)
    REQUIRE(std::abs(b - n / 10) < n / 100);
}

TEST_CASE("rand and randn follow the documented Philox counter scheme", "[factory]") {
  // random.h: element i of a draw uses counter offset + i and key seed.
  Generator gen(77);
  gen.advance(1000);
  Tensor u = ops::rand({64}, gen);
  Tensor z = ops::randn({64}, gen);
  std::vector<float> uv = u.to_vector<float>();
  std::vector<float> zv = z.to_vector<float>();
  for (int64_t i = 0; i < 64; ++i) {
    REQUIRE(uv[i] == philox_uniform(1000, 77, i));
    REQUIRE(zv[i] == static_cast<float>(philox_normal(1064, 77, i)));
  }
  REQUIRE(gen.offset() == 1128);
}

TEST_CASE("randn has mean 0 and standard deviation 1", "[factory]") {
  Generator gen(99);
  std::vector<double> v = values_of(ops::randn({100000}, gen));
  REQUIRE(std::isfinite(min_of(v)));
  REQUIRE(std::isfinite(max_of(v)));
  REQUIRE(std::abs(mean_of(v)) < 0.02);
  REQUIRE(std::abs(stddev_of(v) - 1.0) < 0.02);
  // About 68% within one standard deviation.
  size_t inside = 0;
  for (double x : v)
    inside += std::abs(x) < 1.0;
  REQUIRE(std::abs(static_cast<double>(inside) / v.size() - 0.6827) < 0.01);
}

TEST_CASE("normal and uniform scale and shift", "[factory]") {
  Generator gen(5);
  std::vector<double> nv = values_of(ops::normal({100000}, 3.0, 2.0, gen, DType::F64));
  REQUIRE(std::abs(mean_of(nv) - 3.0) < 0.04);
  REQUIRE(std::abs(stddev_of(nv) - 2.0) < 0.04);
  std::vector<double> uv = values_of(ops::uniform({100000}, -2.0, 5.0, gen));
  REQUIRE(min_of(uv) >= -2.0);
  REQUIRE(max_of(uv) < 5.0);
  REQUIRE(std::abs(mean_of(uv) - 1.5) < 0.05);
}

TEST_CASE("generator state determines the numbers", "[factory]") {
  Generator a(42), b(42), c(43);
  std::vector<float> va = ops::rand({1000}, a).to_vector<float>();
  std::vector<float> vb = ops::rand({1000}, b).to_vector<float>();
  std::vector<float> vc = ops::rand({1000}, c).to_vector<float>();
  REQUIRE(va == vb);
  REQUIRE(va != vc);

  // The next draw continues the counter: it differs from the first...
  std::vector<float> va2 = ops::rand({1000}, a).to_vector<float>();
  REQUIRE(va2 != va);
  // ...and equals the tail of one draw twice as long.
  Generator d(42);
  std::vector<float> both = ops::rand({2000}, d).to_vector<float>();
  REQUIRE(std::vector<float>(both.begin(), both.begin() + 1000) == va);
  REQUIRE(std::vector<float>(both.begin() + 1000, both.end()) == va2);

  // Offsets: set_state to another offset gives other numbers; back gives the same.
  Generator e(42);
  e.set_state(42, 10);
  std::vector<float> shifted = ops::rand({990}, e).to_vector<float>();
  REQUIRE(shifted == std::vector<float>(va.begin() + 10, va.end()));
  e.set_state(42, 0);
  REQUIRE(ops::rand({1000}, e).to_vector<float>() == va);

  // The shape does not matter, only the element order.
  Generator f(42);
  REQUIRE(ops::rand({10, 100}, f).to_vector<float>() == va);
}

TEST_CASE("random draws in other dtypes", "[factory]") {
  for (DType dt : {DType::F64, DType::BF16, DType::F16}) {
    INFO("dtype " << dtype_name(dt));
    Generator g(3);
    Tensor u = ops::rand({4096}, g, dt);
    REQUIRE(u.dtype() == dt);
    std::vector<double> v = values_of(u);
    REQUIRE(min_of(v) >= 0.0);
    REQUIRE(max_of(v) <= 1.0);  // 16-bit rounding may reach 1
    REQUIRE(std::abs(mean_of(v) - 0.5) < 0.03);
    // Normals: the same draw as in double, rounded once to the dtype.
    Generator g2(3);
    std::vector<double> z = values_of(ops::randn({256}, g2, dt));
    std::vector<double> expected;
    for (int64_t i = 0; i < 256; ++i)
      expected.push_back(philox_normal(0, 3, i));
    double rtol = dt == DType::F64 ? 0.0 : dt == DType::BF16 ? 1.0 / 256 : 1.0 / 2048;
    TANDEM_REQUIRE_CLOSE(z, expected, rtol, dt == DType::F64 ? 0.0 : 1e-7);
  }
  Generator g(1);
  REQUIRE_THROWS_AS(ops::rand({4}, g, DType::I32), Error);
}

TEST_CASE("to(dtype) converts values", "[factory]") {
  SECTION("f32 -> f64 -> f32 is exact") {
    std::vector<double> v = random_stored(257, 1, DType::F32, -1e3, 1e3);
    Tensor t = tensor_of(v, {257});
    Tensor d = ops::to(t, DType::F64);
    REQUIRE(d.dtype() == DType::F64);
    REQUIRE(values_of(d) == v);
    REQUIRE(ops::to(d, DType::F32).to_vector<float>() == t.to_vector<float>());
  }
  SECTION("f32 -> bf16 rounds to nearest even like BFloat16(float)") {
    std::vector<float> v;
    for (double x : random_values(300, 2, -50, 50))
      v.push_back(static_cast<float>(x));
    // Exact ties between two bf16 values: even stays, odd rounds up.
    for (uint32_t bits : {0x3f808000u, 0x3f818000u, 0xbf808000u, 0x3f80ffffu, 0x7f7fffffu}) {
      float f;
      std::memcpy(&f, &bits, 4);
      v.push_back(f);
    }
    v.push_back(0.0f);
    v.push_back(-0.0f);
    Tensor b = ops::to(ops::from_vector(v, {static_cast<int64_t>(v.size())}), DType::BF16);
    REQUIRE(b.dtype() == DType::BF16);
    std::vector<BFloat16> got = b.to_vector<BFloat16>();
    for (size_t i = 0; i < v.size(); ++i) {
      INFO("value " << v[i]);
      REQUIRE(got[i].bits == BFloat16(v[i]).bits);
    }
    REQUIRE(got[got.size() - 7].bits == 0x3f80);  // 0x3f808000: tie, even -> down
    REQUIRE(got[got.size() - 6].bits == 0x3f82);  // 0x3f818000: tie, odd -> up
    // Back to f32 is exact.
    std::vector<float> back = ops::to(b, DType::F32).to_vector<float>();
    for (size_t i = 0; i < v.size(); ++i)
      REQUIRE(back[i] == static_cast<float>(got[i]));
  }
  SECTION("f32 -> f16 rounds like Half(float), incl. subnormals and overflow") {
    std::vector<float> v;
    for (double x : random_values(300, 3, -100, 100))
      v.push_back(static_cast<float>(x));
    for (float f : {65504.0f, 65519.0f, 65520.0f, 1e6f, -1e6f, 6e-8f, 3e-5f, 1e-9f, 1.0009765625f,
                    1.00048828125f}) {
      v.push_back(f);
    }
    Tensor h = ops::to(ops::from_vector(v, {static_cast<int64_t>(v.size())}), DType::F16);
    std::vector<Half> got = h.to_vector<Half>();
    for (size_t i = 0; i < v.size(); ++i) {
      INFO("value " << v[i]);
      REQUIRE(got[i].bits == Half(v[i]).bits);
    }
    std::vector<double> back = values_of(ops::to(h, DType::F64));
    REQUIRE(std::isinf(back[back.size() - 8]));  // 65520 overflows
    REQUIRE(back[back.size() - 10] == 65504.0);
  }
  SECTION("f64 -> bf16 goes through float") {
    std::vector<double> v = random_values(100, 4, -10, 10);
    std::vector<BFloat16> got =
        ops::to(tensor_of(v, {100}, DType::F64), DType::BF16).to_vector<BFloat16>();
    for (size_t i = 0; i < v.size(); ++i) {
      REQUIRE(got[i].bits == BFloat16(static_cast<float>(v[i])).bits);
    }
  }
  SECTION("float -> integer truncates toward zero") {
    Tensor t = tensor_of({2.7, -2.7, 0.5, -0.5, 100.0, -3.0}, {6});
    REQUIRE(ops::to(t, DType::I32).to_vector<int32_t>() ==
            std::vector<int32_t>{2, -2, 0, 0, 100, -3});
    REQUIRE(ops::to(t, DType::I64).to_vector<int64_t>() ==
            std::vector<int64_t>{2, -2, 0, 0, 100, -3});
  }
  SECTION("integers and bool") {
    Tensor i = tensor_of({-3, 0, 5, 1 << 24}, {4}, DType::I64);
    REQUIRE(values_of(ops::to(i, DType::F32)) == std::vector<double>{-3, 0, 5, 1 << 24});
    REQUIRE(ops::to(i, DType::I32).to_vector<int32_t>() == std::vector<int32_t>{-3, 0, 5, 1 << 24});
    REQUIRE(ops::to(i, DType::Bool).to_vector<bool>() ==
            std::vector<bool>{true, false, true, true});
    Tensor b = tensor_of({1, 0, 1}, {3}, DType::Bool);
    REQUIRE(values_of(ops::to(b, DType::F32)) == std::vector<double>{1, 0, 1});
    REQUIRE(ops::to(tensor_of({0.0, -0.25, 3.0}, {3}), DType::Bool).to_vector<bool>() ==
            std::vector<bool>{false, true, true});
  }
  SECTION("a strided source converts in logical order") {
    Tensor t = iota_tensor({3, 4});
    Tensor tt = ops::transpose(t, 0, 1);  // (4, 3)
    std::vector<double> got = values_of(ops::to(tt, DType::F64));
    for (int64_t i = 0; i < 4; ++i) {
      for (int64_t j = 0; j < 3; ++j)
        REQUIRE(got[i * 3 + j] == static_cast<double>(j * 4 + i));
    }
  }
}

// Note [F16C conversions]: the hardware conversions (F16C builds) and the
// portable ones agree on every half and on floats of every exponent, the
// rounding boundaries, subnormals and overflow included.
TEST_CASE("Half converts like its portable arithmetic", "[factory][f16]") {
  // The first disagreement (bits in, bits out, bits wanted), or none.
  std::string first;
  int64_t checked = 0;
  auto round = [&](float x) {
    if (std::isnan(x) || !first.empty()) return;
    ++checked;
    if (Half(x).bits != Half::round_portable(x))
      first = fmt::format("f32 {:#x} -> {:#x}, portable {:#x}", float_bits(x), Half(x).bits,
                          Half::round_portable(x));
  };
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    Half h;
    h.bits = static_cast<uint16_t>(b);
    const float wide = static_cast<float>(h), want = Half::widen_portable(h.bits);
    if (std::isnan(want) != std::isnan(wide) ||
        (!std::isnan(want) && float_bits(wide) != float_bits(want))) {
      first =
          fmt::format("f16 {:#x} -> {:#x}, portable {:#x}", b, float_bits(wide), float_bits(want));
    }
    // The halfway points on either side, and one ulp of f32 off them.
    const uint32_t w = float_bits(want);
    for (uint32_t f : {w, w + 0x1000u, w + 0x0fffu, w + 0x1001u, w - 0x1000u, w + 1u, w - 1u})
      round(bits_float(f));
  }
  for (uint32_t f = 0; f < 0xffffffffu - 7919u; f += 7919u)  // every exponent, both signs
    round(bits_float(f));
  CHECK(first == "");
  CHECK(checked > 900000);
}

TEST_CASE("contiguous copies only when needed", "[factory]") {
  Tensor t = iota_tensor({3, 4});
  Tensor same = ops::contiguous(t);
  REQUIRE(same.is_alias_of(t));
  REQUIRE(same.raw_data() == t.raw_data());
  REQUIRE(same.strides() == t.strides());

  Tensor tt = ops::transpose(t, 0, 1);
  REQUIRE_FALSE(tt.is_contiguous());
  Tensor c = ops::contiguous(tt);
  REQUIRE_FALSE(c.is_alias_of(t));
  REQUIRE(c.is_contiguous());
  REQUIRE(c.shape() == Shape{4, 3});
  REQUIRE(c.strides() == Dims{3, 1});
  std::vector<double> v = values_of(c);
  for (int64_t i = 0; i < 4; ++i) {
    for (int64_t j = 0; j < 3; ++j)
      REQUIRE(v[i * 3 + j] == static_cast<double>(j * 4 + i));
  }
  // A narrowed row block of a contiguous tensor is itself contiguous.
  Tensor rows = ops::narrow(t, 0, 1, 2);
  REQUIRE(ops::contiguous(rows).is_alias_of(t));
}

TEST_CASE("clone copies data", "[factory]") {
  Tensor t = iota_tensor({2, 3}, DType::F64);
  Tensor c = ops::clone(t);
  REQUIRE_FALSE(c.is_alias_of(t));
  REQUIRE(c.dtype() == DType::F64);
  REQUIRE(values_of(c) == values_of(t));
  ops::fill_(c, -1.0);
  REQUIRE(values_of(t) == iota_values(6));
  REQUIRE(values_of(c) == std::vector<double>(6, -1.0));

  Tensor strided = ops::slice(iota_tensor({10}), 0, 1, 10, 3);  // 1, 4, 7
  Tensor sc = ops::clone(strided);
  REQUIRE(sc.is_contiguous());
  REQUIRE(values_of(sc) == std::vector<double>{1, 4, 7});
}

// Note [Large copies]: from cpu::kRepMovsbFrom bytes up copy_bytes() may
// issue `rep movsb` itself; every size and alignment around that threshold
// must copy exactly the bytes memcpy would, and nothing past them.
TEST_CASE("copy_bytes copies exactly n bytes at every size around the rep movsb threshold",
          "[factory]") {
  const size_t from = cpu::kRepMovsbFrom;
  std::vector<unsigned char> src(from + 4096), dst(from + 4096);
  for (size_t i = 0; i < src.size(); ++i)
    src[i] = static_cast<unsigned char>(i * 131 + 7);
  for (size_t n : {size_t{0}, size_t{1}, size_t{4095}, from - 1, from, from + 1, from + 63}) {
    for (size_t offset : {size_t{0}, size_t{1}, size_t{63}}) {
      std::fill(dst.begin(), dst.end(), 0xAB);
      cpu::copy_bytes(dst.data() + offset, src.data() + 64 - offset, n);
      INFO("n = " << n << ", offset = " << offset
                  << ", rep movsb: " << cpu::copy_bytes_uses_rep_movsb());
      CHECK(std::memcmp(dst.data() + offset, src.data() + 64 - offset, n) == 0);
      CHECK(std::all_of(dst.begin(), dst.begin() + static_cast<std::ptrdiff_t>(offset),
                        [](unsigned char c) { return c == 0xAB; }));
      CHECK(std::all_of(dst.begin() + static_cast<std::ptrdiff_t>(offset + n), dst.end(),
                        [](unsigned char c) { return c == 0xAB; }));
    }
  }
  // A contiguous tensor copy above the threshold goes through it.
  const size_t count = from / 4 + 3;
  Tensor big = ops::arange(0, static_cast<double>(count), 1, DType::F32);
  std::vector<float> want(count);
  for (size_t i = 0; i < count; ++i)
    want[i] = static_cast<float>(i);
  CHECK(ops::clone(big).to_vector<float>() == want);
}

TEST_CASE("copy_ writes into a view of the destination", "[factory]") {
  Tensor base = ops::zeros({4, 5});
  std::vector<double> src_values = random_stored(12, 7, DType::F32);
  Tensor src = tensor_of(src_values, {4, 3});

  SECTION("same shape") {
    ops::copy_(ops::narrow(base, 1, 1, 3), src);
    std::vector<double> got = values_of(base);
    for (int64_t i = 0; i < 4; ++i) {
      for (int64_t j = 0; j < 5; ++j) {
        double expected = (j >= 1 && j < 4) ? src_values[i * 3 + (j - 1)] : 0.0;
        REQUIRE(got[i * 5 + j] == expected);
      }
    }
  }
  SECTION("transposed source") {
    Tensor src_t = ops::transpose(tensor_of(src_values, {3, 4}), 0, 1);  // (4, 3)
    ops::copy_(ops::narrow(base, 1, 1, 3), src_t);
    std::vector<double> got = values_of(base);
    for (int64_t i = 0; i < 4; ++i) {
      for (int64_t j = 0; j < 5; ++j) {
        double expected = (j >= 1 && j < 4) ? src_values[(j - 1) * 4 + i] : 0.0;
        REQUIRE(got[i * 5 + j] == expected);
      }
    }
  }
  SECTION("broadcast source and dtype conversion") {
    Tensor row = tensor_of({1, 2, 3}, {3}, DType::I32);
    ops::copy_(ops::narrow(base, 1, 2, 3), row);
    std::vector<double> got = values_of(base);
    for (int64_t i = 0; i < 4; ++i) {
      for (int64_t j = 0; j < 5; ++j)
        REQUIRE(got[i * 5 + j] == (j >= 2 ? j - 1.0 : 0.0));
    }
  }
  SECTION("a row into a strided column view") {
    Tensor col_src = tensor_of({10, 20, 30, 40}, {1, 4});
    ops::copy_(ops::select(base, 1, 4), ops::select(col_src, 0, 0));
    std::vector<double> got = values_of(base);
    for (int64_t i = 0; i < 4; ++i) {
      for (int64_t j = 0; j < 5; ++j)
        REQUIRE(got[i * 5 + j] == (j == 4 ? 10.0 * (i + 1) : 0.0));
    }
  }
  SECTION("shape mismatch is an error") {
    REQUIRE_THROWS_AS(ops::copy_(ops::narrow(base, 1, 0, 2), src), Error);
  }
}

TEST_CASE("fill_ touches exactly the viewed elements", "[factory]") {
  Tensor base = ops::zeros({3, 4}, DType::I64);
  ops::fill_(ops::select(base, 1, 2), 9);                           // column 2
  ops::fill_(ops::slice(ops::select(base, 0, 0), 0, 0, 4, 3), -1);  // row 0, cols 0 and 3
  std::vector<double> got = values_of(base);
  for (int64_t i = 0; i < 3; ++i) {
    for (int64_t j = 0; j < 4; ++j) {
      double expected = j == 2 ? 9 : (i == 0 && (j == 0 || j == 3)) ? -1 : 0;
      REQUIRE(got[i * 4 + j] == expected);
    }
  }
  for (DType dt : kAllDTypes) {
    Tensor t = ops::zeros({5}, dt);
    ops::fill_(t, 1.0);
    REQUIRE(values_of(t) == std::vector<double>(5, 1.0));
  }
  Tensor h = ops::zeros({2}, DType::BF16);
  ops::fill_(h, 0.1);
  REQUIRE(values_of(h) == std::vector<double>(2, stored_value(DType::BF16, 0.1)));
}

namespace {

// Reference cat: out[idx] comes from the input whose range along `dim` holds idx[dim].
std::vector<double> ref_cat(const std::vector<std::vector<double>>& values,
                            const std::vector<std::vector<int64_t>>& shapes, int dim,
                            std::vector<int64_t>& out_shape) {
  out_shape = shapes[0];
  out_shape[dim] = 0;
  for (const auto& s : shapes)
    out_shape[dim] += s[dim];
  std::vector<double> out;
  for_each_index(out_shape, [&](const std::vector<int64_t>& idx) {
    int64_t k = idx[dim];
    size_t which = 0;
    while (k >= shapes[which][dim])
      k -= shapes[which++][dim];
    std::vector<int64_t> src = idx;
    src[dim] = k;
    out.push_back(values[which][ravel(src, shapes[which])]);
  });
  return out;
}

}  // namespace

TEST_CASE("cat along each dim", "[factory]") {
  const std::vector<int64_t> base{2, 3, 4};
  for (int dim = -3; dim < 3; ++dim) {
    const int d = dim < 0 ? dim + 3 : dim;
    INFO("dim " << dim);
    std::vector<std::vector<int64_t>> shapes{base, base, base};
    shapes[1][d] = 1;
    shapes[2][d] = 2;
    std::vector<std::vector<double>> values;
    std::vector<Tensor> tensors;
    for (size_t i = 0; i < shapes.size(); ++i) {
      values.push_back(random_stored(numel_of(shapes[i]), 10 + i, DType::F32));
      tensors.push_back(tensor_of(values.back(), Shape(shapes[i])));
    }
    std::vector<int64_t> out_shape;
    std::vector<double> expected = ref_cat(values, shapes, d, out_shape);
    Tensor out = ops::cat(tensors, dim);
    REQUIRE(out.shape() == Shape(out_shape));
    REQUIRE(values_of(out) == expected);
  }
  // Non-contiguous inputs and a single input.
  Tensor t = iota_tensor({3, 2});
  Tensor tt = ops::transpose(t, 0, 1);  // (2, 3): [[0,2,4],[1,3,5]]
  REQUIRE(values_of(ops::cat({tt, tt}, 1)) ==
          std::vector<double>{0, 2, 4, 0, 2, 4, 1, 3, 5, 1, 3, 5});
  REQUIRE(values_of(ops::cat({tt}, 0)) == std::vector<double>{0, 2, 4, 1, 3, 5});
}

TEST_CASE("cat and stack reject mismatched shapes", "[factory]") {
  Tensor a = ops::zeros({2, 3}), b = ops::zeros({2, 4}), c = ops::zeros({2, 3, 1});
  REQUIRE_NOTHROW(ops::cat({a, b}, 1));
  REQUIRE_THROWS_WITH(ops::cat({a, b}, 0), Contains("[tensor::cat]"));
  REQUIRE_THROWS_AS(ops::cat({a, c}, 0), Error);
  REQUIRE_THROWS_AS(ops::cat({a, a}, 2), Error);
  REQUIRE_THROWS_AS(ops::cat({}, 0), Error);
  REQUIRE_THROWS_WITH(ops::stack({a, b}, 0), Contains("[tensor::stack]"));
  REQUIRE_THROWS_AS(ops::stack({a, a}, 3), Error);
  REQUIRE_THROWS_AS(ops::stack({}, 0), Error);
}

TEST_CASE("stack along each dim", "[factory]") {
  const std::vector<int64_t> shape{2, 3};
  std::vector<std::vector<double>> values;
  std::vector<Tensor> tensors;
  for (uint32_t i = 0; i < 4; ++i) {
    values.push_back(random_stored(6, 20 + i, DType::F64));
    tensors.push_back(tensor_of(values.back(), {2, 3}, DType::F64));
  }
  for (int dim = -3; dim <= 2; ++dim) {
    const int d = dim < 0 ? dim + 3 : dim;
    INFO("dim " << dim);
    Tensor out = ops::stack(tensors, dim);
    std::vector<int64_t> out_shape = shape;
    out_shape.insert(out_shape.begin() + d, 4);
    REQUIRE(out.shape() == Shape(out_shape));
    REQUIRE(out.dtype() == DType::F64);
    std::vector<double> got = values_of(out);
    for_each_index(out_shape, [&](const std::vector<int64_t>& idx) {
      std::vector<int64_t> src = idx;
      int64_t which = src[d];
      src.erase(src.begin() + d);
      REQUIRE(got[ravel(idx, out_shape)] == values[which][ravel(src, shape)]);
    });
  }
}

TEST_CASE("str shows shape, dtype, device and small values", "[factory]") {
  Tensor t = tensor_of({1, 2.5, -3, 4}, {2, 2});
  std::string s = t.str();
  REQUIRE_THAT(s, Contains("shape=[2,2]"));
  REQUIRE_THAT(s, Contains("dtype=f32"));
  REQUIRE_THAT(s, Contains("device=cpu"));
  REQUIRE_THAT(s, Contains("values=[1, 2.5, -3, 4]"));
  REQUIRE_THAT(ops::zeros({3}, DType::I32).str(), Contains("dtype=i32"));
  std::string big = ops::zeros({100}).str();
  REQUIRE_THAT(big, Contains("shape=[100]"));
  REQUIRE_THAT(big, !Contains("values"));
  REQUIRE(Tensor().str() == "Tensor(undefined)");
}
