#include "tandem/runtime/trace.h"

#include <fmt/format.h>

#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "tandem/runtime/error.h"
#include "tandem/runtime/logging.h"

namespace tandem {
namespace detail {
std::atomic<bool> trace_on{false};
}

namespace {

struct TraceEvent {
  char phase;
  const char* category;
  std::string name;
  int64_t ts;
  int64_t dur;
  int pid;
  std::string lane;  // thread or stream label
  std::string args;
};

struct ThreadBuffer {
  std::mutex mu;  // uncontended except during trace_write()
  std::vector<TraceEvent> events;
};

struct Registry {
  std::mutex mu;
  std::vector<std::shared_ptr<ThreadBuffer>> buffers;
  std::chrono::steady_clock::time_point origin = std::chrono::steady_clock::now();
};

Registry& registry() {
  static Registry* r = new Registry();  // leaked: threads may log during exit
  return *r;
}

ThreadBuffer& my_buffer() {
  thread_local std::shared_ptr<ThreadBuffer> buffer = [] {
    auto b = std::make_shared<ThreadBuffer>();
    std::lock_guard<std::mutex> lock(registry().mu);
    registry().buffers.push_back(b);
    return b;
  }();
  return *buffer;
}

std::string default_lane() {
  const std::string& name = thread_name();
  if (!name.empty()) return name;
  return fmt::format("thread {}",
                     std::hash<std::thread::id>{}(std::this_thread::get_id()) % 100000);
}

void push(TraceEvent e) {
  ThreadBuffer& b = my_buffer();
  std::lock_guard<std::mutex> lock(b.mu);
  b.events.push_back(std::move(e));
}

std::string escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<int>(c));
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

void trace_start() {
  Registry& r = registry();
  {
    std::lock_guard<std::mutex> lock(r.mu);
    for (auto& b : r.buffers) {
      std::lock_guard<std::mutex> lb(b->mu);
      b->events.clear();
    }
    r.origin = std::chrono::steady_clock::now();
  }
  detail::trace_on = true;
}

void trace_stop() {
  detail::trace_on = false;
}

int64_t trace_now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() -
                                                               registry().origin)
      .count();
}

void trace_complete(const char* category, std::string name, int64_t start_us, int64_t dur_us,
                    std::string args_json, const std::string& lane) {
  if (!trace_enabled()) return;
  int rank = std::max(current_log_context().rank, 0);
  push(TraceEvent{'X', category, std::move(name), start_us, dur_us, rank,
                  lane.empty() ? default_lane() : lane, std::move(args_json)});
}

void trace_instant(const char* category, std::string name, std::string args_json) {
  if (!trace_enabled()) return;
  int rank = std::max(current_log_context().rank, 0);
  push(TraceEvent{'i', category, std::move(name), trace_now_us(), 0, rank, default_lane(),
                  std::move(args_json)});
}

void TraceSpan::begin(const char* category, const char* name) {
  category_ = category;
  name_ = name;
  start_us_ = trace_now_us();
}

void TraceSpan::end() {
  trace_complete(category_, name_, start_us_, trace_now_us() - start_us_);
}

std::string trace_json() {
  std::vector<TraceEvent> all;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (auto& b : r.buffers) {
      std::lock_guard<std::mutex> lb(b->mu);
      all.insert(all.end(), b->events.begin(), b->events.end());
    }
  }
  // Lanes become small tids per pid, announced by thread_name metadata.
  std::map<std::pair<int, std::string>, int> tids;
  for (const TraceEvent& e : all)
    tids.emplace(std::make_pair(e.pid, e.lane), 0);
  std::map<int, int> next;
  for (auto& [key, tid] : tids)
    tid = next[key.first]++;
  std::string out = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  bool first = true;
  auto sep = [&] {
    if (!first) out += ",\n";
    first = false;
  };
  for (auto& [key, tid] : tids) {
    sep();
    out += fmt::format(
        "{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{},\"tid\":{},\"args\":{{\"name\":\"{}\"}}"
        "}}",
        key.first, tid, escape(key.second));
  }
  for (const TraceEvent& e : all) {
    sep();
    int tid = tids[{e.pid, e.lane}];
    out += fmt::format(
        "{{\"ph\":\"{}\",\"cat\":\"{}\",\"name\":\"{}\",\"ts\":{},\"pid\":{},\"tid\":{}", e.phase,
        e.category, escape(e.name), e.ts, e.pid, tid);
    if (e.phase == 'X') out += fmt::format(",\"dur\":{}", e.dur);
    if (e.phase == 'i') out += ",\"s\":\"t\"";
    out += fmt::format(",\"args\":{{{}}}}}", e.args);
  }
  out += "\n]}\n";
  return out;
}

size_t trace_event_count() {
  size_t n = 0;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (auto& b : r.buffers) {
    std::lock_guard<std::mutex> lb(b->mu);
    n += b->events.size();
  }
  return n;
}

void trace_write(const std::string& path) {
  std::string json = trace_json();
  std::ofstream out(path, std::ios::binary);
  TANDEM_CHECK(out.good(), "[runtime::trace_write] expected a writable path, got \"{}\"", path);
  out << json;
  TANDEM_CHECK(out.good(), "[runtime::trace_write] write to \"{}\" failed", path);
}

}  // namespace tandem
