// Parsing a Chrome trace-event file into lanes, and the per-rank summary
// (Note [Exposed communication]). The SVG timeline is in trace_svg.cpp.
#include "tools/trace/trace_view.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <tuple>

#include "tandem/runtime/error.h"

namespace tandem::trace_view {
namespace {

using Json = nlohmann::json;
using Intervals = std::vector<std::pair<double, double>>;

const char* type_name(const Json& j) {
  return j.type_name();  // "object", "array", "string", "number", …
}

// A required or optional number field of event `index`.
std::optional<double> number_field(const Json& e, const char* key, size_t index,
                                   const std::string& source, bool required) {
  auto it = e.find(key);
  if (it == e.end()) {
    TANDEM_CHECK(!required,
                 "[trace_view::parse] expected a \"{}\" field in event {} of {}, got none ({})",
                 key, index, source, e.dump());
    return std::nullopt;
  }
  TANDEM_CHECK(it->is_number(),
               "[trace_view::parse] expected \"{}\" of event {} of {} to be a number, got {} ({})",
               key, index, source, type_name(*it), e.dump());
  return it->get<double>();
}

std::string string_field(const Json& e, const char* key) {
  auto it = e.find(key);
  return it != e.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// pid and tid: integers in tandem's traces; other writers may use strings,
// which are not worth a second id space here.
int id_field(const Json& e, const char* key, size_t index, const std::string& source) {
  auto it = e.find(key);
  if (it == e.end()) return 0;
  TANDEM_CHECK(
      it->is_number_integer(),
      "[trace_view::parse] expected \"{}\" of event {} of {} to be an integer, got {} ({})", key,
      index, source, type_name(*it), e.dump());
  return it->get<int>();
}

std::string args_of(const Json& e) {
  auto it = e.find("args");
  if (it == e.end() || (it->is_object() && it->empty())) return {};
  return it->dump(-1, ' ', false, Json::error_handler_t::replace);
}

Mark mark_of(const std::string& category, const std::string& name) {
  if (category == "coordinator") return name == "rendezvous" ? Mark::Rendezvous : Mark::Coordinator;
  if (category == "comm" && name.rfind("issue", 0) == 0) return Mark::Issue;
  return Mark::Other;
}

// Sorts spans outer-first and gives each its nesting depth: the number of
// spans still open (ending strictly after it starts) when it begins.
void nest(Lane& lane) {
  std::sort(lane.spans.begin(), lane.spans.end(), [](const Span& a, const Span& b) {
    return a.ts != b.ts ? a.ts < b.ts : a.dur > b.dur;
  });
  std::vector<double> open;  // end times, innermost last
  for (Span& s : lane.spans) {
    while (!open.empty() && open.back() <= s.ts)
      open.pop_back();
    s.depth = static_cast<int>(open.size());
    lane.max_depth = std::max(lane.max_depth, s.depth);
    open.push_back(s.end());
  }
  std::sort(lane.instants.begin(), lane.instants.end(),
            [](const Instant& a, const Instant& b) { return a.ts < b.ts; });
}

bool comm_only(const Lane& lane) {
  return !lane.spans.empty() && std::all_of(lane.spans.begin(), lane.spans.end(),
                                            [](const Span& s) { return is_comm(s.kind); });
}

// Sorted, disjoint union of intervals.
Intervals merge(Intervals v) {
  std::sort(v.begin(), v.end());
  Intervals out;
  for (const auto& [a, b] : v) {
    if (!out.empty() && a <= out.back().second) {
      out.back().second = std::max(out.back().second, b);
    } else {
      out.emplace_back(a, b);
    }
  }
  return out;
}

double measure(const Intervals& v) {
  double total = 0;
  for (const auto& [a, b] : v)
    total += b - a;
  return total;
}

// m \ c, both sorted and disjoint.
Intervals subtract(const Intervals& m, const Intervals& c) {
  Intervals out;
  size_t j = 0;
  for (auto [a, b] : m) {
    while (j < c.size() && c[j].second <= a)
      ++j;
    for (size_t k = j; k < c.size() && c[k].first < b; ++k) {
      if (c[k].first > a) out.emplace_back(a, c[k].first);
      a = std::max(a, c[k].second);
      if (a >= b) break;
    }
    if (a < b) out.emplace_back(a, b);
  }
  return out;
}

// The intervals of `lane` during which its innermost open span is compute.
// Spans are sorted outer-first (nest()); one that outlives its parent is
// clipped to it, as the viewers draw it.
Intervals innermost_compute(const Lane& lane) {
  Intervals out;
  struct Open {
    double end;
    Kind kind;
  };
  std::vector<Open> stack;
  double cursor = 0;
  auto emit = [&](double until) {
    if (!stack.empty() && stack.back().kind == Kind::Compute && until > cursor)
      out.emplace_back(cursor, until);
    cursor = std::max(cursor, until);
  };
  for (const Span& s : lane.spans) {
    if (is_comm(s.kind)) continue;  // communication spans never hide compute
    while (!stack.empty() && stack.back().end <= s.ts) {
      emit(stack.back().end);
      stack.pop_back();
    }
    emit(s.ts);
    cursor = s.ts;
    const double end = stack.empty() ? s.end() : std::min(s.end(), stack.back().end);
    stack.push_back({end, s.kind});
  }
  while (!stack.empty()) {
    emit(stack.back().end);
    stack.pop_back();
  }
  return out;
}

// Parses the events into lanes, before windowing.
struct Builder {
  const std::string& source;
  const Window& window;
  std::map<std::pair<int, int>, Lane> lanes;
  std::map<int, std::string> process_names;
  // Open "B" events per lane, innermost last.
  std::map<std::pair<int, int>, std::vector<Span>> open;
  size_t skipped = 0;
  double last_ts = 0;

  Lane& lane(int pid, int tid) {
    Lane& l = lanes[{pid, tid}];
    l.pid = pid;
    l.tid = tid;
    return l;
  }

  // Keeps the part of `s` inside the window, if any.
  void add_span(int pid, int tid, Span s) {
    const double lo = window.from_us.value_or(s.ts), hi = window.to_us.value_or(s.end());
    const double a = std::max(s.ts, lo), b = std::min(s.end(), hi);
    if (b < a || (b == a && s.dur > 0)) return;
    s.ts = a;
    s.dur = b - a;
    lane(pid, tid).spans.push_back(std::move(s));
  }

  void add(const Json& e, size_t index) {
    TANDEM_CHECK(e.is_object(),
                 "[trace_view::parse] expected event {} of {} to be an object, got {}", index,
                 source, type_name(e));
    auto ph_it = e.find("ph");
    TANDEM_CHECK(ph_it != e.end() && ph_it->is_string() && !ph_it->get<std::string>().empty(),
                 "[trace_view::parse] expected a \"ph\" (phase) string in event {} of {}, got {}",
                 index, source, e.dump());
    const char ph = ph_it->get<std::string>()[0];
    const int pid = id_field(e, "pid", index, source), tid = id_field(e, "tid", index, source);
    if (ph == 'M') {
      auto args = e.find("args");
      std::string name;
      if (args != e.end() && args->is_object()) name = string_field(*args, "name");
      const std::string what = string_field(e, "name");
      if (what == "thread_name") {
        lane(pid, tid).name = name;
      } else if (what == "process_name") {
        process_names[pid] = name;
      }
      return;
    }
    if (ph != 'X' && ph != 'B' && ph != 'E' && ph != 'i' && ph != 'I') {
      ++skipped;
      return;
    }
    const double ts = *number_field(e, "ts", index, source, true);
    last_ts = std::max(last_ts, ts);
    if (ph == 'E') {
      auto& stack = open[{pid, tid}];
      if (stack.empty()) {
        ++skipped;  // an end without a begin
        return;
      }
      Span s = std::move(stack.back());
      stack.pop_back();
      s.dur = std::max(0.0, ts - s.ts);
      add_span(pid, tid, std::move(s));
      return;
    }
    const std::string name = string_field(e, "name"), category = string_field(e, "cat");
    if (ph == 'i' || ph == 'I') {
      if ((window.from_us && ts < *window.from_us) || (window.to_us && ts > *window.to_us)) return;
      lane(pid, tid).instants.push_back(
          Instant{ts, name, category, mark_of(category, name), args_of(e)});
      return;
    }
    Span s{ts, 0, name, category, kind_of(category, name), 0, args_of(e)};
    if (ph == 'B') {
      open[{pid, tid}].push_back(std::move(s));
      return;
    }
    s.dur = *number_field(e, "dur", index, source, true);
    TANDEM_CHECK(s.dur >= 0,
                 "[trace_view::parse] expected a duration >= 0 in event {} of {}, got {} ({})",
                 index, source, s.dur, e.dump());
    last_ts = std::max(last_ts, s.end());
    add_span(pid, tid, std::move(s));
  }

  Trace finish() {
    // A "B" never ended runs to the end of the trace, as Chrome's viewer shows it.
    for (auto& [key, stack] : open) {
      for (Span& s : stack) {
        s.dur = std::max(0.0, last_ts - s.ts);
        add_span(key.first, key.second, std::move(s));
      }
    }
    Trace t;
    t.source = source;
    t.skipped = skipped;
    bool any = false;
    for (auto& [key, l] : lanes) {
      if (l.spans.empty() && l.instants.empty()) continue;  // metadata only, or windowed out
      if (l.name.empty()) l.name = fmt::format("tid {}", l.tid);
      nest(l);
      for (const Span& s : l.spans) {
        t.start_us = any ? std::min(t.start_us, s.ts) : s.ts;
        t.end_us = any ? std::max(t.end_us, s.end()) : s.end();
        any = true;
      }
      for (const Instant& i : l.instants) {
        t.start_us = any ? std::min(t.start_us, i.ts) : i.ts;
        t.end_us = any ? std::max(t.end_us, i.ts) : i.ts;
        any = true;
      }
      t.events += l.spans.size() + l.instants.size();
      t.lanes.push_back(std::move(l));
    }
    if (window.from_us) t.start_us = *window.from_us;
    if (window.to_us) t.end_us = *window.to_us;
    std::stable_sort(t.lanes.begin(), t.lanes.end(), [](const Lane& a, const Lane& b) {
      return std::make_tuple(a.pid, comm_only(a), a.tid) <
             std::make_tuple(b.pid, comm_only(b), b.tid);
    });
    for (auto& [pid, name] : process_names)
      t.process_names.emplace_back(pid, name);
    return t;
  }
};

}  // namespace

const char* const kWaitSpanNames[] = {"Wait",
                                      "SyncHook",
                                      "Exchange",
                                      "AllToAllBackward",
                                      "AllGatherBackward",
                                      "ReduceScatterBackward",
                                      "AllReduceGradBackward",
                                      "RedistributeBackward",
                                      nullptr};

Kind kind_of(const std::string& category, const std::string& name) {
  if (category == "link") return Kind::Link;
  if (category == "comm") return Kind::Comm;
  if (category == "wait") return Kind::Wait;  // a host blocked in Work (comm/work.cpp)
  for (const char* const* w = kWaitSpanNames; *w != nullptr; ++w) {
    if (name.find(*w) != std::string::npos) return Kind::Wait;
  }
  return Kind::Compute;
}

bool is_comm(Kind kind) {
  return kind == Kind::Comm || kind == Kind::Link;
}

Trace parse_trace(const std::string& text, const std::string& source, const Window& window) {
  if (window.from_us && window.to_us) {
    TANDEM_CHECK(*window.from_us < *window.to_us,
                 "[trace_view::parse] expected a window with from < to, got [{}, {}] us",
                 *window.from_us, *window.to_us);
  }
  const std::string where = "\"" + source + "\"";  // messages
  Json doc;
  try {
    doc = Json::parse(text);
  } catch (const Json::parse_error& e) {
    TANDEM_FAIL("[trace_view::parse] expected JSON in {}, got a syntax error: {}", where, e.what());
  }
  const Json* events = &doc;
  if (doc.is_object()) {
    auto it = doc.find("traceEvents");
    TANDEM_CHECK(it != doc.end(),
                 "[trace_view::parse] expected a \"traceEvents\" array in {}, got an object "
                 "without one (keys: {})",
                 where, [&] {
                   std::string keys;
                   for (auto& [k, v] : doc.items())
                     keys += (keys.empty() ? "" : ", ") + k;
                   return keys.empty() ? std::string("none") : keys;
                 }());
    TANDEM_CHECK(it->is_array(),
                 "[trace_view::parse] expected \"traceEvents\" in {} to be an "
                 "array, got {}",
                 where, type_name(*it));
    events = &*it;
  } else {
    TANDEM_CHECK(doc.is_array(),
                 "[trace_view::parse] expected a trace object {{\"traceEvents\": [...]}} or an "
                 "array of events in {}, got {}",
                 where, type_name(doc));
  }
  Builder b{where, window, {}, {}, {}, 0, 0};
  size_t index = 0;
  for (const Json& e : *events)
    b.add(e, index++);
  Trace t = b.finish();
  t.source = source;
  return t;
}

Trace load_trace(const std::string& path, const Window& window) {
  std::ifstream in(path, std::ios::binary);
  TANDEM_CHECK(in.good(), "[trace_view::load] expected a readable trace file, got \"{}\": {}", path,
               std::strerror(errno));
  std::stringstream text;
  text << in.rdbuf();
  TANDEM_CHECK(!in.bad(), "[trace_view::load] reading \"{}\" failed", path);
  return parse_trace(text.str(), path, window);
}

std::vector<RankSummary> summarize(const Trace& trace) {
  std::map<int, RankSummary> by_rank;
  std::map<int, std::pair<Intervals, Intervals>> sets;  // rank → (compute, comm)
  for (const Lane& lane : trace.lanes) {
    RankSummary& r = by_rank[lane.pid];
    r.rank = lane.pid;
    auto& [compute, comm] = sets[lane.pid];
    for (const Span& s : lane.spans) {
      if (is_comm(s.kind)) {
        ++r.comm_spans;
        comm.emplace_back(s.ts, s.end());
      } else if (s.kind == Kind::Wait) {
        ++r.wait_spans;
      } else {
        ++r.compute_spans;
      }
    }
    for (const auto& interval : innermost_compute(lane))
      compute.push_back(interval);
    for (const Instant& i : lane.instants)
      r.rendezvous += i.mark == Mark::Rendezvous ? 1 : 0;
  }
  std::vector<RankSummary> out;
  for (auto& [rank, r] : by_rank) {
    const Intervals compute = merge(sets[rank].first), comm = merge(sets[rank].second);
    r.compute_us = measure(compute);
    r.comm_us = measure(comm);
    r.exposed_intervals = subtract(comm, compute);
    r.exposed_us = measure(r.exposed_intervals);
    r.hidden_us = r.comm_us - r.exposed_us;
    if (r.comm_us > 0) r.overlap = r.hidden_us / r.comm_us;
    out.push_back(std::move(r));
  }
  return out;
}

std::string summary_text(const Trace& trace, const std::vector<RankSummary>& ranks) {
  std::string out = fmt::format(
      "{}: {} ranks, {} lanes, {} events, {:.3f} .. {:.3f} ms{}\n", trace.source, ranks.size(),
      trace.lanes.size(), trace.events, trace.start_us * 1e-3, trace.end_us * 1e-3,
      trace.skipped > 0 ? fmt::format(" ({} events of other phases skipped)", trace.skipped)
                        : std::string());
  constexpr const char* kFormat = "{:>5} {:>12} {:>12} {:>12} {:>12} {:>8} {:>14} {:>5}\n";
  out += fmt::format(kFormat, "rank", "compute ms", "comm ms", "exposed ms", "hidden ms", "overlap",
                     "spans c/w/m", "rdv");
  for (const RankSummary& r : ranks) {
    out += fmt::format(
        kFormat, r.rank, fmt::format("{:.3f}", r.compute_us * 1e-3),
        fmt::format("{:.3f}", r.comm_us * 1e-3), fmt::format("{:.3f}", r.exposed_us * 1e-3),
        fmt::format("{:.3f}", r.hidden_us * 1e-3),
        r.overlap ? fmt::format("{:.1f}%", 100 * *r.overlap) : std::string("-"),
        fmt::format("{}/{}/{}", r.compute_spans, r.wait_spans, r.comm_spans), r.rendezvous);
  }
  out +=
      "compute = time some thread of the rank is inside a compute span (innermost; waits "
      "excluded); comm = time a comm or link span is open; exposed = comm while no thread "
      "computes; overlap = hidden / comm (spans: compute/wait/comm)\n";
  return out;
}

nlohmann::ordered_json summary_json(const Trace& trace, const std::vector<RankSummary>& ranks) {
  using OJson = nlohmann::ordered_json;
  OJson j = {{"tool", "tandem-trace"},
             {"file", trace.source},
             {"start_us", trace.start_us},
             {"end_us", trace.end_us},
             {"lanes", trace.lanes.size()},
             {"events", trace.events},
             {"skipped_events", trace.skipped},
             {"definitions",
              {{"compute_us",
                "time at which some thread of the rank is inside a compute span "
                "(its innermost open span; wait spans are not compute)"},
               {"comm_us", "union of the rank's comm and link spans"},
               {"exposed_comm_us",
                "time in comm_us during which no thread of the rank is "
                "inside compute"},
               {"hidden_comm_us", "comm_us - exposed_comm_us"},
               {"overlap_ratio", "hidden_comm_us / comm_us (null without communication)"}}},
             {"ranks", OJson::array()}};
  for (const RankSummary& r : ranks) {
    OJson lanes = OJson::array();
    for (const Lane& l : trace.lanes) {
      if (l.pid == r.rank) lanes.push_back(l.name);
    }
    j["ranks"].push_back({{"rank", r.rank},
                          {"compute_us", r.compute_us},
                          {"comm_us", r.comm_us},
                          {"exposed_comm_us", r.exposed_us},
                          {"hidden_comm_us", r.hidden_us},
                          {"overlap_ratio", r.overlap ? OJson(*r.overlap) : OJson(nullptr)},
                          {"compute_spans", r.compute_spans},
                          {"comm_spans", r.comm_spans},
                          {"wait_spans", r.wait_spans},
                          {"rendezvous", r.rendezvous},
                          {"lanes", std::move(lanes)}});
  }
  return j;
}

std::string xml_escape(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        // XML 1.0 forbids most control characters, even escaped.
        if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n' && c != '\r') {
          out += '?';
        } else {
          out += c;
        }
    }
  }
  return out;
}

}  // namespace tandem::trace_view
