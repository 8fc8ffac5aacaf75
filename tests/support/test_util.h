// Helpers shared by the Catch2 suites: gates that hold a stream task until the
// test opens them, a scoped wait timeout, tensors built from plain doubles,
// naive n-d index iteration for reference loops, and an allclose that says
// where and by how much two results differ.
//
// Expected values in tests come from naive loops over std::vector<double>;
// these helpers only move data in and out of tensors so those loops stay short.
#pragma once

#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "tandem/runtime/config.h"
#include "tandem/tensor/dtype.h"
#include "tandem/tensor/ops.h"
#include "tandem/tensor/tensor.h"

namespace tandem::test {

// ---- threads and streams ----

// Holds a stream task until open(). Declare a Gate *after* the streams that
// wait on it: its destructor opens it, so a failing REQUIRE never leaves a
// stream thread blocked while that stream is being joined. The waiting side
// gives up after 60 s so a broken test cannot hang the suite.
class Gate {
 public:
  Gate() : future_(promise_.get_future().share()) {}
  ~Gate() { open(); }
  Gate(const Gate&) = delete;
  Gate& operator=(const Gate&) = delete;

  void open() {
    if (!opened_) {
      opened_ = true;
      promise_.set_value();
    }
  }
  // A closure to enqueue on a stream: blocks that stream until open().
  std::function<void()> waiter() const {
    return [f = future_] { f.wait_for(std::chrono::seconds(60)); };
  }

 private:
  std::promise<void> promise_;
  std::shared_future<void> future_;
  bool opened_ = false;
};

// A fresh directory under the system temp dir, removed with everything in it
// at scope exit. `tag` names it (tandem-<tag>-<pid>-<n>).
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "test") {
    static std::atomic<int> counter{0};
    path = std::filesystem::temp_directory_path() /
           ("tandem-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  // The path of `name` inside the directory.
  std::string file(const std::string& name) const { return (path / name).string(); }
  // The names of the entries in the directory.
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(path))
      names.push_back(e.path().filename().string());
    return names;
  }

  std::filesystem::path path;
};

// Sets wait_timeout() for one scope (Note [Bounded waits]), restoring it on exit.
class ScopedWaitTimeout {
 public:
  explicit ScopedWaitTimeout(std::chrono::milliseconds timeout) : previous_(wait_timeout()) {
    set_wait_timeout(timeout);
  }
  ~ScopedWaitTimeout() { set_wait_timeout(previous_); }
  ScopedWaitTimeout(const ScopedWaitTimeout&) = delete;
  ScopedWaitTimeout& operator=(const ScopedWaitTimeout&) = delete;

 private:
  std::chrono::milliseconds previous_;
};

inline void sleep_ms(int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

// ---- n-d indices (row-major) ----

inline std::vector<int64_t> shape_vec(const Shape& s) {
  return s.vec();
}

inline int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t e : shape)
    n *= e;
  return n;
}

inline int64_t ravel(const std::vector<int64_t>& idx, const std::vector<int64_t>& shape) {
  int64_t linear = 0;
  for (size_t d = 0; d < shape.size(); ++d)
    linear = linear * shape[d] + idx[d];
  return linear;
}

inline std::vector<int64_t> unravel(int64_t linear, const std::vector<int64_t>& shape) {
  std::vector<int64_t> idx(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    idx[d] = linear % shape[d];
    linear /= shape[d];
  }
  return idx;
}

// Calls fn(idx) for every index of `shape` in row-major order.
template <class F>
void for_each_index(const std::vector<int64_t>& shape, F&& fn) {
  int64_t n = numel_of(shape);
  for (int64_t i = 0; i < n; ++i)
    fn(unravel(i, shape));
}

// Numpy broadcasting of `idx` (an index of the broadcast result) into an
// operand of shape `shape`; returns the operand's linear index.
inline int64_t broadcast_linear(const std::vector<int64_t>& idx,
                                const std::vector<int64_t>& shape) {
  size_t lead = idx.size() - shape.size();
  int64_t linear = 0;
  for (size_t d = 0; d < shape.size(); ++d) {
    int64_t i = shape[d] == 1 ? 0 : idx[lead + d];
    linear = linear * shape[d] + i;
  }
  return linear;
}

inline std::vector<int64_t> broadcast_shape(const std::vector<int64_t>& a,
                                            const std::vector<int64_t>& b) {
  size_t n = std::max(a.size(), b.size());
  std::vector<int64_t> out(n, 1);
  for (size_t i = 0; i < n; ++i) {
    int64_t da = i + a.size() >= n ? a[i + a.size() - n] : 1;
    int64_t db = i + b.size() >= n ? b[i + b.size() - n] : 1;
    out[i] = da == 1 ? db : da;
  }
  return out;
}

// ---- values in and out of tensors ----

// `v` rounded to float. The round trip goes through a volatile: GCC 12.2 at
// -O3 SLP-vectorised an inlined (double)(float)x over a two-element vector
// and dropped the rounding, so expected values silently kept full precision.
inline double round_to_float(double v) {
  volatile float f = static_cast<float>(v);
  return f;
}

// The value `v` becomes once stored in `dtype` (the rounding a test must expect).
inline double stored_value(DType dtype, double v) {
  switch (dtype) {
    case DType::F32:
      return round_to_float(v);
    case DType::F64:
      return v;
    case DType::BF16:
      return static_cast<float>(BFloat16(static_cast<float>(round_to_float(v))));
    case DType::F16:
      return static_cast<float>(Half(static_cast<float>(round_to_float(v))));
    case DType::I32:
      return static_cast<double>(static_cast<int32_t>(v));
    case DType::I64:
      return static_cast<double>(static_cast<int64_t>(v));
    case DType::Bool:
      return v != 0 ? 1.0 : 0.0;
  }
  return v;
}

// Every element of `t` in row-major logical order, as double (synchronises).
inline std::vector<double> values_of(const Tensor& t) {
  std::vector<double> out;
  out.reserve(static_cast<size_t>(t.numel()));
  dispatch_dtype(t.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, bool>) {
      for (bool b : t.to_vector<bool>())
        out.push_back(b ? 1.0 : 0.0);
    } else {
      for (T v : t.to_vector<T>())
        out.push_back(static_cast<double>(static_cast<acc_t<T>>(v)));
    }
  });
  return out;
}

// A tensor of `dtype` holding `values` (rounded as the dtype stores them).
inline Tensor tensor_of(const std::vector<double>& values, const Shape& shape,
                        DType dtype = DType::F32) {
  return dispatch_dtype(dtype, [&](auto tag) -> Tensor {
    using T = typename decltype(tag)::type;
    std::vector<T> typed;
    typed.reserve(values.size());
    for (double v : values) {
      if constexpr (std::is_same_v<T, bool>) {
        typed.push_back(v != 0);
      } else if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>) {
        typed.push_back(T(static_cast<float>(v)));
      } else {
        typed.push_back(static_cast<T>(v));
      }
    }
    return ops::from_vector<T>(typed, shape);
  });
}

// Deterministic test data from the standard library (independent of tandem's RNG).
inline std::vector<double> random_values(size_t n, uint32_t seed, double lo = -1.0,
                                         double hi = 1.0) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(n);
  for (double& x : v)
    x = dist(gen);
  return v;
}

// Random values already rounded to `dtype`, so a reference computed from them
// sees exactly what the tensor holds (integers: whole numbers in [lo, hi]).
inline std::vector<double> random_stored(size_t n, uint32_t seed, DType dtype, double lo = -1.0,
                                         double hi = 1.0) {
  std::vector<double> v = random_values(n, seed, lo, hi);
  for (double& x : v)
    x = is_integral(dtype) ? std::round(x) : stored_value(dtype, x);
  return v;
}

inline Tensor random_tensor(const Shape& shape, DType dtype, uint32_t seed, double lo = -1.0,
                            double hi = 1.0) {
  return tensor_of(random_stored(static_cast<size_t>(shape.numel()), seed, dtype, lo, hi), shape,
                   dtype);
}

// Values 0, 1, 2, ... : every element distinct, so index mix-ups show.
inline std::vector<double> iota_values(int64_t n, double start = 0.0) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[static_cast<size_t>(i)] = start + static_cast<double>(i);
  return v;
}

inline Tensor iota_tensor(const Shape& shape, DType dtype = DType::F32) {
  return tensor_of(iota_values(shape.numel()), shape, dtype);
}

// ---- comparison ----

struct CloseReport {
  bool ok = true;
  std::string message;
};

// |got - expected| <= atol + rtol * |expected| elementwise (NaNs must match).
// The message names the number of mismatches and the worst one.
inline CloseReport compare_close(const std::vector<double>& got,
                                 const std::vector<double>& expected, double rtol, double atol) {
  CloseReport r;
  if (got.size() != expected.size()) {
    r.ok = false;
    r.message = "size mismatch: got " + std::to_string(got.size()) + " elements, expected " +
                std::to_string(expected.size());
    return r;
  }
  size_t bad = 0, worst = 0;
  double worst_excess = -1.0;
  for (size_t i = 0; i < got.size(); ++i) {
    double g = got[i], e = expected[i];
    bool fine;
    double excess;
    if (std::isnan(e) || std::isnan(g)) {
      fine = std::isnan(e) && std::isnan(g);
      excess = fine ? 0.0 : INFINITY;
    } else if (std::isinf(e) || std::isinf(g)) {
      fine = g == e;
      excess = fine ? 0.0 : INFINITY;
    } else {
      double diff = std::fabs(g - e);
      double tol = atol + rtol * std::fabs(e);
      fine = diff <= tol;
      excess = diff - tol;
    }
    if (!fine) {
      ++bad;
      if (excess > worst_excess) {
        worst_excess = excess;
        worst = i;
      }
    }
  }
  if (bad > 0) {
    r.ok = false;
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "%zu of %zu elements differ (rtol=%g atol=%g); worst at flat index %zu: got "
                  "%.17g, expected %.17g",
                  bad, got.size(), rtol, atol, worst, got[worst], expected[worst]);
    r.message = buf;
  }
  return r;
}

}  // namespace tandem::test

// Asserts that two vectors of doubles agree within tolerance, printing the
// worst mismatch on failure.
#define TANDEM_REQUIRE_CLOSE(got, expected, rtol, atol)                   \
  do {                                                                    \
    ::tandem::test::CloseReport tandem_close_report_ =                    \
        ::tandem::test::compare_close((got), (expected), (rtol), (atol)); \
    INFO(tandem_close_report_.message);                                   \
    REQUIRE(tandem_close_report_.ok);                                     \
  } while (0)

#define TANDEM_CHECK_CLOSE(got, expected, rtol, atol)                     \
  do {                                                                    \
    ::tandem::test::CloseReport tandem_close_report_ =                    \
        ::tandem::test::compare_close((got), (expected), (rtol), (atol)); \
    INFO(tandem_close_report_.message);                                   \
    CHECK(tandem_close_report_.ok);                                       \
  } while (0)
