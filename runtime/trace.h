// Chrome trace-event (Perfetto) recording: host spans per thread, ops per
// stream, collectives, coordinator rendezvous (DESIGN §2).
//
// Off by default. When off, a TraceSpan costs one relaxed atomic load and
// nothing is allocated. When on, events go to a per-thread buffer (no lock on
// the hot path) and trace_write() merges them into one JSON file:
// pid = rank (or 0), tid = a small number per thread or stream, with a
// thread_name metadata event so the viewer shows names.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

namespace tandem {

namespace detail {
extern std::atomic<bool> trace_on;
}

inline bool trace_enabled() {
  return detail::trace_on.load(std::memory_order_relaxed);
}
void trace_start();  // clears earlier events
void trace_stop();
// Writes every event recorded since trace_start() as Chrome trace JSON.
void trace_write(const std::string& path);
// The JSON document as a string (tests, tandem-trace).
std::string trace_json();
size_t trace_event_count();

// Microseconds since trace_start().
int64_t trace_now_us();

// A complete event ("ph":"X") on this thread, or on a named lane (e.g. a stream
// or a simulated link) when `lane` is given. `args_json` is a JSON object body
// without braces, e.g. "\"seq\":17".
void trace_complete(const char* category, std::string name, int64_t start_us, int64_t dur_us,
                    std::string args_json = {}, const std::string& lane = {});
void trace_instant(const char* category, std::string name, std::string args_json = {});

class TraceSpan {
 public:
  TraceSpan(const char* category, const char* name) {
    if (trace_enabled()) begin(category, name);
  }
  ~TraceSpan() {
    if (start_us_ >= 0) end();
  }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

 private:
  void begin(const char* category, const char* name);
  void end();
  const char* category_ = nullptr;
  const char* name_ = nullptr;
  int64_t start_us_ = -1;
};

}  // namespace tandem
