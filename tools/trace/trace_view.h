// The library behind tandem-trace: reads a Chrome trace-event JSON file as
// runtime/trace.cpp writes it (pid = rank, tid = a thread or a named lane such
// as a comm executor or a simulated link, thread_name metadata), builds a
// per-lane model, and turns it into a per-rank summary (compute, communication,
// exposed communication, overlap) and a self-contained SVG timeline.
//
// Parsing accepts what Chrome's viewer accepts of the format tandem uses:
// "X" complete events, "B"/"E" pairs, "i"/"I" instants and "M" metadata
// (thread_name, process_name), in the object form {"traceEvents": [...]} or
// the bare array form. Other phases (counters, flows, async) are counted and
// skipped. Errors throw tandem::Error naming the source and what was wrong.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace tandem::trace_view {

// What a span stands for in the summary and in the timeline's colours.
// Categories "comm" (a collective executing) and "link" (its simulated
// transfer, Note [Simulated link timing]) are communication. Among the other
// spans ("autograd", "ops", user spans), those that stand for waiting are
// Wait: the nodes whose host time is a rendezvous or a collective launched
// and waited for (kWaitSpanNames); the rest are compute.
enum class Kind { Compute, Comm, Link, Wait };
// Substrings of span names that make a non-communication span a Wait:
// SyncHookBackward (coordinator rendezvous, DESIGN §8), the Exchange* nodes
// of parallel/collectives.h (expert parallelism, async context parallelism),
// the differentiable collectives of parallel/ (AllToAll/AllGather/
// ReduceScatter/AllReduceGrad/Redistribute Backward) and anything named
// "...Wait...".
extern const char* const kWaitSpanNames[];
Kind kind_of(const std::string& category, const std::string& name);
bool is_comm(Kind kind);

struct Span {
  double ts = 0, dur = 0;  // microseconds, trace clock
  std::string name, category;
  Kind kind = Kind::Compute;
  int depth = 0;     // nesting level within its lane (0 = outermost)
  std::string args;  // the event's args, as compact JSON (tooltips)
  double end() const { return ts + dur; }
};

// Instant events. Coordinator rendezvous are singled out: they are where the
// two workers of a dual-pipe step meet (DESIGN §8).
enum class Mark { Rendezvous, Coordinator, Issue, Other };
struct Instant {
  double ts = 0;
  std::string name, category;
  Mark mark = Mark::Other;
  std::string args;
};

// One (pid, tid): a thread or a named lane of one rank.
struct Lane {
  int pid = 0, tid = 0;
  std::string name;               // thread_name metadata, else "tid N"
  std::vector<Span> spans;        // sorted by start, outer before inner
  std::vector<Instant> instants;  // sorted by time
  int max_depth = 0;
};

struct Trace {
  std::string source;       // file name (messages)
  std::vector<Lane> lanes;  // sorted by pid, then worker lanes before comm lanes, then tid
  std::vector<std::pair<int, std::string>> process_names;  // pid → process_name metadata
  double start_us = 0, end_us = 0;  // extent of the events (or of the window)
  size_t events = 0;                // span and instant events kept
  size_t skipped = 0;               // events of phases this tool does not draw
};

struct Window {
  std::optional<double> from_us, to_us;
};

// Parses the text of a trace. `source` names it in error messages. Events
// outside `window` are dropped and spans crossing its edges are clipped.
Trace parse_trace(const std::string& text, const std::string& source, const Window& window = {});
// Reads and parses a file; a missing or unreadable file is an Error too.
Trace load_trace(const std::string& path, const Window& window = {});

// Note [Exposed communication]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Per rank (pid), over every lane of that rank:
//   C = the set of times at which, on at least one lane, the innermost open
//       span is a compute span (Kind::Compute),
//   M = the union of the intervals of its communication spans ("comm" and
//       "link": a collective executing or in flight on a simulated link).
//   compute busy = |C|, comm busy = |M|,
//   exposed comm = |M \ C|: time at which communication is in flight and no
//                  thread of the rank is inside compute,
//   hidden comm  = |M ∩ C| = comm busy - exposed comm,
//   overlap      = hidden / comm busy (undefined when comm busy is 0).
// Unions, so concurrent threads count once. "Innermost" because spans nest:
// an outer span ("backward") counts only where none of its children is open,
// so a Wait node inside it (a rendezvous, a collective waited for) is not
// compute even though its parent is. Wait spans are also every host wait in
// comm::Work (category "wait", comm/work.cpp). Spans are host spans: tandem
// traces each module's forward (category "forward", Module::call) and each
// backward node; compute that runs on an untraced thread, or that no span
// covers, is invisible, and communication under it counts as exposed. Only
// the window (if any) counts.
struct RankSummary {
  int rank = 0;
  double compute_us = 0, comm_us = 0, exposed_us = 0, hidden_us = 0;
  std::optional<double> overlap;  // hidden / comm; empty when comm is 0
  size_t compute_spans = 0, comm_spans = 0, wait_spans = 0, rendezvous = 0;
  // M \ C as disjoint intervals (drawn as the rank's "exposed" strip).
  std::vector<std::pair<double, double>> exposed_intervals;
};

std::vector<RankSummary> summarize(const Trace& trace);
std::string summary_text(const Trace& trace, const std::vector<RankSummary>& ranks);
nlohmann::ordered_json summary_json(const Trace& trace, const std::vector<RankSummary>& ranks);

struct SvgOptions {
  double width = 1400;  // pixels, labels included
};
// A standalone SVG document: one lane per (pid, tid) labelled with its thread
// name, a time axis, a legend, per rank a strip of exposed communication.
std::string render_svg(const Trace& trace, const std::vector<RankSummary>& ranks,
                       const SvgOptions& options = {});

// Escapes &, <, >, " and ' for SVG text and attribute values.
std::string xml_escape(const std::string& text);

}  // namespace tandem::trace_view
