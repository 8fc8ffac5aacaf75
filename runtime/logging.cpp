#include "tandem/runtime/logging.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <mutex>
#include <optional>

#include "tandem/runtime/error.h"

namespace tandem {
namespace {

LogLevel level_from_env() {
  const char* text = std::getenv("TANDEM_LOG_LEVEL");
  if (text == nullptr) return LogLevel::Info;
  std::string s(text);
  if (s == "debug") return LogLevel::Debug;
  if (s == "warn") return LogLevel::Warn;
  if (s == "error") return LogLevel::Error;
  return LogLevel::Info;
}

std::atomic<LogLevel>& level_slot() {
  static std::atomic<LogLevel> level{level_from_env()};
  return level;
}

std::mutex process_mu;
LogContext process_context;
thread_local std::optional<LogContext> thread_context;
thread_local std::string thread_label;

// The live LogCapture's lines; guarded by out_mu.
std::mutex out_mu;  // one line at a time across threads
std::vector<std::string>* captured = nullptr;

}  // namespace

LogContext current_log_context() {
  if (thread_context) return *thread_context;
  std::lock_guard<std::mutex> lock(process_mu);
  return process_context;
}

void set_log_context(LogContext context) {
  thread_context = context;
}

void set_process_log_context(LogContext context) {
  std::lock_guard<std::mutex> lock(process_mu);
  process_context = context;
}

void set_thread_name(const std::string& name) {
  thread_label = name;
}
const std::string& thread_name() {
  return thread_label;
}

LogLevel log_level() {
  return level_slot().load(std::memory_order_relaxed);
}
void set_log_level(LogLevel level) {
  level_slot() = level;
}

void log_message(LogLevel level, const std::string& message) {
  static const char kLetters[] = {'D', 'I', 'W', 'E'};
  static_assert(std::size(kLetters) == kLogLevelCount, "one letter per LogLevel");
  LogContext c = current_log_context();
  std::string prefix = c.rank >= 0 ? fmt::format("[tandem r{}/{} {}]", c.rank, c.world,
                                                 kLetters[static_cast<int>(level)])
                                   : fmt::format("[tandem {}]", kLetters[static_cast<int>(level)]);
  std::string line = fmt::format("{} {}\n", prefix, message);
  std::lock_guard<std::mutex> lock(out_mu);
  std::fputs(line.c_str(), stderr);
  if (captured != nullptr) captured->push_back(line.substr(0, line.size() - 1));
}

LogCapture::LogCapture(LogLevel level) : saved_(log_level()) {
  std::lock_guard<std::mutex> lock(out_mu);
  TANDEM_CHECK(captured == nullptr,
               "[runtime::LogCapture] expected one capture at a time, got a "
               "second while the first lives");
  captured = new std::vector<std::string>();
  set_log_level(level);
}

LogCapture::~LogCapture() {
  set_log_level(saved_);
  std::lock_guard<std::mutex> lock(out_mu);
  delete captured;
  captured = nullptr;
}

std::vector<std::string> LogCapture::lines() const {
  std::lock_guard<std::mutex> lock(out_mu);
  return *captured;
}

std::vector<std::string> LogCapture::matching(const std::string& text) const {
  std::vector<std::string> out;
  for (std::string& line : lines()) {
    if (line.find(text) != std::string::npos) out.push_back(std::move(line));
  }
  return out;
}

}  // namespace tandem
