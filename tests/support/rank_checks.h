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

// What rank threads found, reported on the test thread (REQUIRE_NO_FAILURES).
class Failures {
 public:
  void add(const std::string& what) {
    std::lock_guard<std::mutex> lock(mu_);
    list_.push_back(what);
  }
  bool empty() const {
    std::lock_guard<std::mutex> lock(mu_);
    return list_.empty();
  }
  std::string str() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::string s;
    for (size_t i = 0; i < list_.size() && i < 20; ++i)
      s += list_[i] + "\n";
    if (list_.size() > 20) s += fmt::format("... and {} more\n", list_.size() - 20);
    return s;
  }
  // Records a failure when `got != want`.
  template <class T>
  void expect_eq(int rank, const std::string& what, const T& got, const T& want) {
    if (!(got == want)) add(fmt::format("rank {}: {}: expected {}, got {}", rank, what, want, got));
  }
  void expect(int rank, const std::string& what, bool ok) {
    if (!ok) add(fmt::format("rank {}: {}", rank, what));
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::string> list_;
};

}  // namespace tandem::testing

#define REQUIRE_NO_FAILURES(failures) \
  do {                                \
    INFO((failures).str());           \
    REQUIRE((failures).empty());      \
  } while (0)

#define RANK_CHECK(checks, ...)                  \
  (checks).check(static_cast<bool>(__VA_ARGS__), \
                 fmt::format("{}:{}: {}", __FILE__, __LINE__, #__VA_ARGS__))
#define RANK_CHECK_THROWS_WITH(checks, expr, needle)  \
  (checks).throws_with([&] { (void)(expr); }, needle, \
                       fmt::format("{}:{}: {}", __FILE__, __LINE__, #expr))
