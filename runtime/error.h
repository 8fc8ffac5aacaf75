// Errors: one exception type and the checking macros every layer uses.
//
// Messages follow `[component::op] expected <what>, got <what>` (STYLE.md). The
// macros format lazily: the message is built only when the check fails, so a
// TANDEM_CHECK on a hot path costs one predictable branch.
#pragma once

#include <fmt/format.h>

#include <exception>
#include <stdexcept>
#include <string>

namespace tandem {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Thrown when a bounded wait expires (stream event waits, worker joins, comm).
class TimeoutError : public Error {
 public:
  explicit TimeoutError(const std::string& what) : Error(what) {}
};

// The message of a captured exception ("unknown error" when it is not a
// std::exception), for reports that name what failed.
std::string what_of(const std::exception_ptr& error);

namespace detail {
[[noreturn]] void throw_error(const char* file, int line, std::string msg);
[[noreturn]] void throw_internal(const char* file, int line, const char* cond, std::string msg);
}  // namespace detail

}  // namespace tandem

// User-facing check: the format string says what was expected and what came.
#define TANDEM_CHECK(cond, ...)                                                      \
  do {                                                                               \
    if (!(cond)) [[unlikely]] {                                                      \
      ::tandem::detail::throw_error(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__)); \
    }                                                                                \
  } while (0)

#define TANDEM_FAIL(...) \
  ::tandem::detail::throw_error(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__))

// Always-on internal invariant (never compiled out, unlike assert()).
#define TANDEM_INTERNAL_ASSERT(cond, ...)                                                         \
  do {                                                                                            \
    if (!(cond)) [[unlikely]] {                                                                   \
      ::tandem::detail::throw_internal(__FILE__, __LINE__, #cond, ::fmt::format("" __VA_ARGS__)); \
    }                                                                                             \
  } while (0)
