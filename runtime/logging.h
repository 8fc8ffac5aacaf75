// Logging with a rank prefix: `[tandem r2/4 I] message`. The rank is per thread
// (ranks of the threads backend are threads of one process), falling back to
// the process-wide one. Level from TANDEM_LOG_LEVEL=debug|info|warn|error.
#pragma once

#include <fmt/format.h>

#include <string>
#include <vector>

namespace tandem {

enum class LogLevel { Debug, Info, Warn, Error };
// The number of levels, for log_message's letter table: the last value + 1, not
// an enumerator (switches stay exhaustive).
constexpr int kLogLevelCount = static_cast<int>(LogLevel::Error) + 1;

struct LogContext {
  int rank = -1;  // -1: not part of a group
  int world = 0;
};

LogContext current_log_context();
void set_log_context(LogContext context);          // this thread
void set_process_log_context(LogContext context);  // default for every thread
void set_thread_name(const std::string& name);
const std::string& thread_name();

LogLevel log_level();
void set_log_level(LogLevel level);
void log_message(LogLevel level, const std::string& message);

// Keeps the lines logged while it lives (they still go to stderr), at
// `level` and above, with their rank prefix: for tests that check what the
// runtime says. One capture at a time.
class LogCapture {
 public:
  explicit LogCapture(LogLevel level = LogLevel::Debug);
  ~LogCapture();
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;
  std::vector<std::string> lines() const;
  // The lines that contain `text`.
  std::vector<std::string> matching(const std::string& text) const;

 private:
  LogLevel saved_;
};

template <class... Args>
void log_debug(fmt::format_string<Args...> f, Args&&... args) {
  if (log_level() <= LogLevel::Debug)
    log_message(LogLevel::Debug, fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
void log_info(fmt::format_string<Args...> f, Args&&... args) {
  if (log_level() <= LogLevel::Info)
    log_message(LogLevel::Info, fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
void log_warn(fmt::format_string<Args...> f, Args&&... args) {
  if (log_level() <= LogLevel::Warn)
    log_message(LogLevel::Warn, fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
void log_error(fmt::format_string<Args...> f, Args&&... args) {
  log_message(LogLevel::Error, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace tandem
