#include "tandem/runtime/error.h"

#include <cstring>

namespace tandem {

std::string what_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

namespace detail {

static const char* basename_of(const char* file) {
  const char* slash = std::strrchr(file, '/');
  return slash ? slash + 1 : file;
}

void throw_error(const char* file, int line, std::string msg) {
  msg += fmt::format(" ({}:{})", basename_of(file), line);
  throw Error(msg);
}

void throw_internal(const char* file, int line, const char* cond, std::string msg) {
  throw Error(fmt::format("[internal] invariant `{}` failed at {}:{}{}{} (this is a tandem bug)",
                          cond, basename_of(file), line, msg.empty() ? "" : ": ", msg));
}

}  // namespace detail
}  // namespace tandem
