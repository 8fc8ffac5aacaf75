// Assertions made on rank threads. Catch2 v2 is not thread-safe: an
// assertion macro used on a run_ranks thread races with the reporter (a crash
// under the JUnit reporter). Rank threads record their checks here; the test
// thread reports them after run_ranks returns.
#pragma once

#include <fmt/format.h>

#include <catch2/catch.hpp>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

namespace tandem::testing {

class RankChecks {
 public:
  void check(bool ok, const std::string& what) {
    std::lock_guard<std::mutex> lock(mu_);
    ++count_;
    if (!ok) failures_.push_back(what);
  }
  // Records a failure unless `fn` throws an exception whose message contains `needle`.
  template <class F>
  void throws_with(F&& fn, const std::string& needle, const std::string& what) {
    try {
      fn();
    } catch (const std::exception& e) {
      check(std::string(e.what()).find(needle) != std::string::npos,
            fmt::format("{}: message \"{}\" lacks \"{}\"", what, e.what(), needle));
      return;
    }
    check(false, fmt::format("{}: no exception", what));
  }
  // Call on the test thread after run_ranks.
  void report() {
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::string& f : failures_)
      FAIL_CHECK(f);
    CHECK(count_ > 0);
  }

 private:
  std::mutex mu_;
  std::vector<std::string> failures_;
  int count_ = 0;
};

}  // namespace tandem::testing

#define RANK_CHECK(checks, ...)                  \
  (checks).check(static_cast<bool>(__VA_ARGS__), \
                 fmt::format("{}:{}: {}", __FILE__, __LINE__, #__VA_ARGS__))
#define RANK_CHECK_THROWS_WITH(checks, expr, needle)  \
  (checks).throws_with([&] { (void)(expr); }, needle, \
                       fmt::format("{}:{}: {}", __FILE__, __LINE__, #expr))
