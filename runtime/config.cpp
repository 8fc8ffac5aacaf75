#include "tandem/runtime/config.h"

#include <atomic>
#include <cstdlib>
#include <string>

#include "tandem/runtime/error.h"

namespace tandem {
namespace {

std::chrono::milliseconds timeout_from_env() {
  const char* text = std::getenv("TANDEM_WAIT_TIMEOUT_S");
  if (text == nullptr) return std::chrono::seconds(600);
  char* end = nullptr;
  double seconds = std::strtod(text, &end);
  TANDEM_CHECK(end != text && *end == '\0' && seconds > 0,
               "[runtime::config] expected TANDEM_WAIT_TIMEOUT_S to be a positive number of "
               "seconds, got \"{}\"",
               text);
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000));
}

CpuStreamMode mode_from_env() {
  const char* text = std::getenv("TANDEM_CPU_STREAMS");
  if (text == nullptr || std::string(text) == "inline") return CpuStreamMode::Inline;
  TANDEM_CHECK(std::string(text) == "async",
               "[runtime::config] expected TANDEM_CPU_STREAMS=inline|async, got \"{}\"", text);
  return CpuStreamMode::Async;
}

std::atomic<long long>& timeout_ms() {
  static std::atomic<long long> value{timeout_from_env().count()};
  return value;
}

std::atomic<CpuStreamMode>& stream_mode() {
  static std::atomic<CpuStreamMode> value{mode_from_env()};
  return value;
}

}  // namespace

std::chrono::milliseconds wait_timeout() {
  return std::chrono::milliseconds(timeout_ms().load());
}
void set_wait_timeout(std::chrono::milliseconds timeout) {
  TANDEM_CHECK(timeout.count() > 0, "[runtime::config] expected a positive wait timeout, got {} ms",
               timeout.count());
  timeout_ms() = timeout.count();
}

CpuStreamMode default_cpu_stream_mode() {
  return stream_mode().load();
}
void set_default_cpu_stream_mode(CpuStreamMode mode) {
  stream_mode() = mode;
}

}  // namespace tandem
