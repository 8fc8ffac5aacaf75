// tandem-trace's library (tools/trace/trace_view.h): parsing Chrome traces,
// the per-rank summary (Note [Exposed communication]) on a hand-made trace with
// known numbers, a trace recorded through the runtime's tracing API, errors,
// and the SVG checked by a small XML well-formedness checker below.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tandem/runtime/error.h"
#include "tandem/runtime/logging.h"
#include "tandem/runtime/trace.h"
#include "tools/trace/trace_view.h"

using namespace tandem;
using namespace tandem::trace_view;
using Catch::Matchers::Contains;

namespace {

// ---- a minimal XML checker ----

// One element: its attributes (unescaped) and its direct text (unescaped).
struct Node {
  std::string name;
  std::map<std::string, std::string> attrs;
  std::string text;
  std::vector<std::unique_ptr<Node>> children;
};

// Checks that `xml` is one well-formed element (after an optional <?xml ?>
// declaration): tags balanced, attribute values quoted, every '&' a known
// entity, no '<' in text or attribute values. Throws std::runtime_error with
// the offset of the first problem.
class XmlChecker {
 public:
  explicit XmlChecker(const std::string& xml) : s_(xml) {}

  std::unique_ptr<Node> parse() {
    skip_space();
    if (s_.compare(i_, 5, "<?xml") == 0) {
      const size_t end = s_.find("?>", i_);
      if (end == std::string::npos) fail("unterminated XML declaration");
      i_ = end + 2;
    }
    skip_space();
    if (i_ >= s_.size() || s_[i_] != '<') fail("expected the root element");
    auto root = element();
    skip_space();
    if (i_ != s_.size()) fail("content after the root element");
    return root;
  }

 private:
  [[noreturn]] void fail(const std::string& what) {
    throw std::runtime_error(what + " at offset " + std::to_string(i_) + ": \"" +
                             s_.substr(i_ < 30 ? 0 : i_ - 30, 60) + "\"");
  }
  void skip_space() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_])))
      ++i_;
  }
  std::string name() {
    const size_t start = i_;
    while (i_ < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[i_])) || s_[i_] == '-' ||
                              s_[i_] == '_' || s_[i_] == ':'))
      ++i_;
    if (i_ == start) fail("expected a name");
    return s_.substr(start, i_ - start);
  }
  // Text up to `stop`, entities resolved.
  std::string chars(char stop) {
    std::string out;
    while (i_ < s_.size() && s_[i_] != stop) {
      const char c = s_[i_];
      if (c == '<') fail("raw '<' in text or attribute");
      if (c == '&') {
        const size_t semi = s_.find(';', i_);
        if (semi == std::string::npos) fail("unterminated entity");
        const std::string entity = s_.substr(i_ + 1, semi - i_ - 1);
        static const std::map<std::string, char> kEntities = {
            {"amp", '&'}, {"lt", '<'}, {"gt", '>'}, {"quot", '"'}, {"apos", '\''}};
        auto it = kEntities.find(entity);
        if (it == kEntities.end()) fail("unknown entity &" + entity + ";");
        out += it->second;
        i_ = semi + 1;
        continue;
      }
      if (static_cast<unsigned char>(c) < 0x20 && c != '\n' && c != '\t' && c != '\r')
        fail("control character");
      out += c;
      ++i_;
    }
    return out;
  }
  std::unique_ptr<Node> element() {
    ++i_;  // '<'
    auto node = std::make_unique<Node>();
    node->name = name();
    for (;;) {
      const size_t before = i_;
      skip_space();
      if (i_ >= s_.size()) fail("unterminated tag");
      if (s_.compare(i_, 2, "/>") == 0) {
        i_ += 2;
        return node;
      }
      if (s_[i_] == '>') {
        ++i_;
        break;
      }
      if (i_ == before) fail("expected whitespace before an attribute");
      const std::string key = name();
      if (i_ >= s_.size() || s_[i_] != '=') fail("expected '=' after attribute " + key);
      ++i_;
      if (i_ >= s_.size() || s_[i_] != '"') fail("expected a quoted value for " + key);
      ++i_;
      std::string value = chars('"');
      if (i_ >= s_.size()) fail("unterminated attribute value");
      ++i_;
      if (!node->attrs.emplace(key, value).second) fail("duplicate attribute " + key);
    }
    for (;;) {
      node->text += chars('<');
      if (i_ >= s_.size()) fail("unclosed <" + node->name + ">");
      if (s_.compare(i_, 2, "</") == 0) {
        i_ += 2;
        const std::string closing = name();
        if (closing != node->name) fail("</" + closing + "> closes <" + node->name + ">");
        skip_space();
        if (i_ >= s_.size() || s_[i_] != '>') fail("expected '>'");
        ++i_;
        return node;
      }
      node->children.push_back(element());
    }
  }

  const std::string& s_;
  size_t i_ = 0;
};

void visit(const Node& n, const std::function<void(const Node&)>& f) {
  f(n);
  for (const auto& c : n.children)
    visit(*c, f);
}

std::string attr(const Node& n, const std::string& key) {
  auto it = n.attrs.find(key);
  return it == n.attrs.end() ? std::string() : it->second;
}

// ---- a hand-made trace ----
//
// rank 0:  forward-worker   compute [0,100] (autograd) with matmul [10,40] nested
//          backward-worker  compute [150,200] with a wait (SyncHookBackward)
//                           [190,200] nested: compute there is [150,190]
//          comm r0 ep       comm [80,120]   → hidden [80,100], exposed [100,120]
//          link r0 ep       link [190,220]  → all exposed (the wait is not compute)
//          a rendezvous at 50 and a collective issue at 79 on forward-worker
// rank 1:  rank 1           compute [0,200]
//          comm r1 world    comm [50,150] (hidden), comm [190,210] (10 exposed)
// rank 2:  an odd name      compute [0,30]; a B/E pair [0,10] on tid 1; no comm
const char* kHandMade = R"({"displayTimeUnit":"ms","traceEvents":[
{"ph":"M","name":"thread_name","pid":0,"tid":0,"args":{"name":"forward-worker"}},
{"ph":"M","name":"thread_name","pid":0,"tid":1,"args":{"name":"backward-worker"}},
{"ph":"M","name":"thread_name","pid":0,"tid":2,"args":{"name":"comm r0 ep"}},
{"ph":"M","name":"thread_name","pid":0,"tid":3,"args":{"name":"link r0 ep"}},
{"ph":"M","name":"thread_name","pid":1,"tid":0,"args":{"name":"rank 1"}},
{"ph":"M","name":"thread_name","pid":1,"tid":1,"args":{"name":"comm r1 world"}},
{"ph":"M","name":"thread_name","pid":2,"tid":0,"args":{"name":"<\"odd\" & 'lane'>"}},
{"ph":"X","cat":"autograd","name":"attn","ts":0,"dur":100,"pid":0,"tid":0,"args":{}},
{"ph":"X","cat":"ops","name":"matmul","ts":10,"dur":30,"pid":0,"tid":0,"args":{}},
{"ph":"X","cat":"autograd","name":"MulBackward","ts":150,"dur":50,"pid":0,"tid":1,"args":{}},
{"ph":"X","cat":"autograd","name":"SyncHookBackward","ts":190,"dur":10,"pid":0,"tid":1,"args":{}},
{"ph":"X","cat":"comm","name":"all_to_all #0","ts":80,"dur":40,"pid":0,"tid":2,"args":{"seq":0}},
{"ph":"X","cat":"link","name":"all_to_all #1","ts":190,"dur":30,"pid":0,"tid":3,"args":{"seq":1,"bytes":4096}},
{"ph":"i","cat":"coordinator","name":"rendezvous","ts":50,"pid":0,"tid":0,"s":"t","args":{"role":"Comm"}},
{"ph":"i","cat":"comm","name":"issue all_to_all #0","ts":79,"pid":0,"tid":0,"s":"t","args":{"seq":0}},
{"ph":"X","cat":"autograd","name":"block","ts":0,"dur":200,"pid":1,"tid":0,"args":{}},
{"ph":"X","cat":"comm","name":"all_reduce #0","ts":50,"dur":100,"pid":1,"tid":1,"args":{}},
{"ph":"X","cat":"comm","name":"all_reduce #1","ts":190,"dur":20,"pid":1,"tid":1,"args":{}},
{"ph":"X","cat":"test","name":"a<b&c","ts":0,"dur":30,"pid":2,"tid":0,"args":{}},
{"ph":"B","cat":"test","name":"begin-end","ts":0,"pid":2,"tid":1},
{"ph":"E","ts":10,"pid":2,"tid":1},
{"ph":"C","name":"counter","ts":5,"pid":2,"tid":0,"args":{"v":1}}
]})";

const RankSummary& rank_of(const std::vector<RankSummary>& ranks, int rank) {
  for (const RankSummary& r : ranks) {
    if (r.rank == rank) return r;
  }
  FAIL("no rank " << rank);
  throw std::logic_error("unreachable");
}

const Lane* lane_named(const Trace& t, int pid, const std::string& name) {
  for (const Lane& l : t.lanes) {
    if (l.pid == pid && l.name == name) return &l;
  }
  return nullptr;
}

// The (pid, tid) → full label of every lane label in the SVG.
std::map<std::pair<int, int>, std::string> svg_lanes(const Node& root) {
  std::map<std::pair<int, int>, std::string> lanes;
  visit(root, [&](const Node& n) {
    if (attr(n, "class") != "lane-label") return;
    std::string title;
    for (const auto& c : n.children) {
      if (c->name == "title") title = c->text;
    }
    lanes[{std::stoi(attr(n, "data-pid")), std::stoi(attr(n, "data-tid"))}] = title;
  });
  return lanes;
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("tandem_trace_view_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

}  // namespace

TEST_CASE("hand-made trace: lanes, nesting and instants", "[trace_view]") {
  const Trace t = parse_trace(kHandMade, "hand-made");
  REQUIRE(t.lanes.size() == 8);
  REQUIRE(t.events == 13);  // 10 X, one B/E pair, 2 instants
  REQUIRE(t.skipped == 1);  // the counter
  REQUIRE(t.start_us == 0);
  REQUIRE(t.end_us == 220);
  // Rank 0: worker lanes first, then the comm-only lanes.
  std::vector<std::string> rank0;
  for (const Lane& l : t.lanes) {
    if (l.pid == 0) rank0.push_back(l.name);
  }
  REQUIRE(rank0 == std::vector<std::string>{"forward-worker", "backward-worker", "comm r0 ep",
                                            "link r0 ep"});
  const Lane* fwd = lane_named(t, 0, "forward-worker");
  REQUIRE(fwd != nullptr);
  REQUIRE(fwd->spans.size() == 2);
  REQUIRE(fwd->spans[0].name == "attn");
  REQUIRE(fwd->spans[0].depth == 0);
  REQUIRE(fwd->spans[1].name == "matmul");
  REQUIRE(fwd->spans[1].depth == 1);
  REQUIRE(fwd->max_depth == 1);
  REQUIRE(fwd->instants.size() == 2);
  REQUIRE(fwd->instants[0].mark == Mark::Rendezvous);
  REQUIRE(fwd->instants[1].mark == Mark::Issue);
  const Lane* link = lane_named(t, 0, "link r0 ep");
  REQUIRE(link != nullptr);
  REQUIRE(link->spans[0].kind == Kind::Link);
  REQUIRE_THAT(link->spans[0].args, Contains("\"bytes\":4096"));
  const Lane* be = nullptr;
  for (const Lane& l : t.lanes) {
    if (l.pid == 2 && l.tid == 1) be = &l;
  }
  REQUIRE(be != nullptr);
  REQUIRE(be->name == "tid 1");  // no thread_name metadata
  REQUIRE(be->spans.size() == 1);
  REQUIRE(be->spans[0].name == "begin-end");
  REQUIRE(be->spans[0].dur == 10);
}

TEST_CASE("hand-made trace: exact busy, exposed and overlap per rank", "[trace_view]") {
  const std::vector<RankSummary> ranks = summarize(parse_trace(kHandMade, "hand-made"));
  REQUIRE(ranks.size() == 3);

  const RankSummary& r0 = rank_of(ranks, 0);
  REQUIRE(r0.compute_us == 140);  // [0,100] ∪ [150,190]; the nested matmul counts once
  REQUIRE(r0.comm_us == 70);      // [80,120] ∪ [190,220]
  REQUIRE(r0.exposed_us == 50);   // [100,120] ∪ [190,220]
  REQUIRE(r0.hidden_us == 20);
  REQUIRE(r0.overlap.has_value());
  REQUIRE(*r0.overlap == Approx(20.0 / 70.0));
  REQUIRE(r0.exposed_intervals == std::vector<std::pair<double, double>>{{100, 120}, {190, 220}});
  REQUIRE(r0.compute_spans == 3);
  REQUIRE(r0.wait_spans == 1);
  REQUIRE(r0.comm_spans == 2);
  REQUIRE(r0.rendezvous == 1);

  const RankSummary& r1 = rank_of(ranks, 1);
  REQUIRE(r1.compute_us == 200);
  REQUIRE(r1.comm_us == 120);
  REQUIRE(r1.exposed_us == 10);
  REQUIRE(r1.hidden_us == 110);
  REQUIRE(*r1.overlap == Approx(110.0 / 120.0));

  const RankSummary& r2 = rank_of(ranks, 2);
  REQUIRE(r2.compute_us == 30);  // [0,30] ∪ [0,10]
  REQUIRE(r2.comm_us == 0);
  REQUIRE(r2.exposed_us == 0);
  REQUIRE_FALSE(r2.overlap.has_value());

  SECTION("text and JSON summaries carry the same numbers") {
    const Trace t = parse_trace(kHandMade, "hand-made");
    const std::string text = summary_text(t, ranks);
    REQUIRE_THAT(text, Contains("0.140"));  // rank 0 compute, ms
    REQUIRE_THAT(text, Contains("28.6%"));  // rank 0 overlap
    REQUIRE_THAT(text, Contains("91.7%"));  // rank 1 overlap
    nlohmann::ordered_json j = summary_json(t, ranks);
    REQUIRE(j["ranks"].size() == 3);
    REQUIRE(j["ranks"][0]["compute_us"] == 140.0);
    REQUIRE(j["ranks"][0]["comm_us"] == 70.0);
    REQUIRE(j["ranks"][0]["exposed_comm_us"] == 50.0);
    REQUIRE(j["ranks"][0]["hidden_comm_us"] == 20.0);
    REQUIRE(j["ranks"][2]["overlap_ratio"].is_null());
    REQUIRE(j["ranks"][0]["lanes"].size() == 4);
  }
}

TEST_CASE("the innermost open span decides what is compute", "[trace_view]") {
  REQUIRE(kind_of("autograd", "MatmulBackward") == Kind::Compute);
  REQUIRE(kind_of("autograd", "SyncHookBackward") == Kind::Wait);
  REQUIRE(kind_of("autograd", "ExchangeOpenBackward") == Kind::Wait);
  REQUIRE(kind_of("autograd", "AllToAllBackward") == Kind::Wait);
  REQUIRE(kind_of("ops", "event-wait") == Kind::Compute);  // case-sensitive "Wait"
  REQUIRE(kind_of("comm", "all_gather #3") == Kind::Comm);
  REQUIRE(kind_of("link", "all_gather #3") == Kind::Link);

  // One lane: a wait [0,100] with compute [20,30] inside it; a compute span
  // [100,160] whose child [150,170] outlives it (clipped to 160); a comm span
  // [0,200] on another lane of the same rank.
  const char* trace = R"([
{"ph":"X","cat":"autograd","name":"ExchangeWaitBackward","ts":0,"dur":100,"pid":0,"tid":0},
{"ph":"X","cat":"autograd","name":"MulBackward","ts":20,"dur":10,"pid":0,"tid":0},
{"ph":"X","cat":"autograd","name":"backward","ts":100,"dur":60,"pid":0,"tid":0},
{"ph":"X","cat":"autograd","name":"SyncHookBackward","ts":150,"dur":20,"pid":0,"tid":0},
{"ph":"X","cat":"comm","name":"all_to_all #0","ts":0,"dur":200,"pid":0,"tid":1}])";
  const std::vector<RankSummary> ranks = summarize(parse_trace(trace, "inline"));
  REQUIRE(ranks.size() == 1);
  REQUIRE(ranks[0].compute_us == 60);  // [20,30] ∪ [100,150]
  REQUIRE(ranks[0].comm_us == 200);
  REQUIRE(ranks[0].exposed_us == 140);
  REQUIRE(ranks[0].exposed_intervals ==
          std::vector<std::pair<double, double>>{{0, 20}, {30, 100}, {150, 200}});
  REQUIRE(ranks[0].wait_spans == 2);
}

TEST_CASE("a window clips spans and drops events outside it", "[trace_view]") {
  Window w;
  w.from_us = 90;
  w.to_us = 195;
  const Trace t = parse_trace(kHandMade, "hand-made", w);
  REQUIRE(t.start_us == 90);
  REQUIRE(t.end_us == 195);
  const std::vector<RankSummary> ranks = summarize(t);
  const RankSummary& r0 = rank_of(ranks, 0);
  REQUIRE(r0.compute_us == 50);  // [90,100] ∪ [150,190]
  REQUIRE(r0.comm_us == 35);     // [90,120] ∪ [190,195]
  REQUIRE(r0.exposed_us == 25);  // [100,120] ∪ [190,195]
  REQUIRE(r0.rendezvous == 0);   // at 50, outside
  // Rank 2 ends at 30: nothing of it is left.
  for (const Lane& l : t.lanes)
    REQUIRE(l.pid != 2);

  Window bad;
  bad.from_us = 10;
  bad.to_us = 10;
  REQUIRE_THROWS_WITH(parse_trace(kHandMade, "hand-made", bad), Contains("from < to"));
}

TEST_CASE("a trace recorded through the runtime API parses", "[trace_view][trace]") {
  trace_start();
  { TraceSpan span("autograd", "main-span"); }
  std::thread worker([] {
    set_log_context(LogContext{1, 2});
    set_thread_name("worker <1>");
    TraceSpan outer("autograd", "outer");
    {
      TraceSpan inner("ops", "inner");
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    trace_complete("link", "all_gather #0", trace_now_us(), 25, "\"seq\":0,\"bytes\":64",
                   "link r1 world");
    trace_instant("coordinator", "rendezvous", "\"role\":\"Comm\"");
  });
  worker.join();
  trace_stop();

  Trace t;
  REQUIRE_NOTHROW(t = parse_trace(trace_json(), "recorded"));
  REQUIRE(t.skipped == 0);
  const Lane* w = lane_named(t, 1, "worker <1>");
  REQUIRE(w != nullptr);
  REQUIRE(w->spans.size() == 2);
  REQUIRE(w->spans[0].name == "outer");
  REQUIRE(w->spans[1].name == "inner");
  REQUIRE(w->spans[1].depth == 1);
  REQUIRE(w->instants.size() == 1);
  REQUIRE(w->instants[0].mark == Mark::Rendezvous);
  const Lane* link = lane_named(t, 1, "link r1 world");
  REQUIRE(link != nullptr);
  REQUIRE(link->spans.size() == 1);
  REQUIRE(link->spans[0].kind == Kind::Link);
  REQUIRE(link->spans[0].dur == 25);

  const std::vector<RankSummary> ranks = summarize(t);
  REQUIRE(ranks.size() == 2);  // the main thread's rank 0 and the worker's rank 1
  const RankSummary& r1 = rank_of(ranks, 1);
  REQUIRE(r1.comm_us == 25);
  REQUIRE(r1.compute_us >= 2000);
  REQUIRE(r1.rendezvous == 1);

  // The SVG of a real trace is well formed too.
  std::unique_ptr<Node> root;
  REQUIRE_NOTHROW(root = XmlChecker(render_svg(t, ranks)).parse());
  const auto lanes = svg_lanes(*root);
  REQUIRE(lanes.size() == t.lanes.size());
  REQUIRE(lanes.at({w->pid, w->tid}) == "worker <1>");
}

TEST_CASE("the SVG is well formed with one labelled lane per (pid, tid)", "[trace_view][svg]") {
  const Trace t = parse_trace(kHandMade, "hand-made <&>");
  const std::vector<RankSummary> ranks = summarize(t);
  const std::string svg = render_svg(t, ranks);
  std::unique_ptr<Node> root;
  REQUIRE_NOTHROW(root = XmlChecker(svg).parse());
  REQUIRE(root->name == "svg");
  REQUIRE(attr(*root, "xmlns") == "http://www.w3.org/2000/svg");

  const auto lanes = svg_lanes(*root);
  REQUIRE(lanes.size() == t.lanes.size());
  for (const Lane& l : t.lanes)
    REQUIRE(lanes.at({l.pid, l.tid}) == l.name);
  REQUIRE(lanes.at({2, 0}) == "<\"odd\" & 'lane'>");  // escaped in the file, intact when read

  // Names reach the file escaped: the raw text never appears.
  REQUIRE(svg.find("a<b&c") == std::string::npos);
  REQUIRE(svg.find("a&lt;b&amp;c") != std::string::npos);

  // Every span is a rect with a tooltip naming it; rendezvous are drawn.
  std::set<std::string> titles;
  int rendezvous_lines = 0;
  visit(*root, [&](const Node& n) {
    for (const auto& c : n.children) {
      if (c->name == "title") titles.insert(c->text);
    }
    if (n.name == "line" && attr(n, "stroke") == "#59a14f") ++rendezvous_lines;
  });
  for (const char* name : {"attn [autograd]", "matmul [ops]", "all_to_all #1 [link]",
                           "a<b&c [test]", "rendezvous [coordinator]"}) {
    INFO(name);
    REQUIRE(std::any_of(titles.begin(), titles.end(),
                        [&](const std::string& s) { return s.rfind(name, 0) == 0; }));
  }
  REQUIRE(rendezvous_lines >= 1);
  // The legend names both kinds of work.
  REQUIRE_THAT(svg, Contains("compute (autograd"));
  REQUIRE_THAT(svg, Contains("exposed communication"));
}

TEST_CASE("the XML checker rejects malformed documents", "[trace_view][svg]") {
  // The checker must be able to fail, or the SVG test proves nothing.
  for (const char* bad : {"<svg><g></svg>", "<svg a=b/>", "<svg>a < b</svg>", "<svg/><svg/>",
                          "<svg>&nbsp;</svg>", "<svg><g></g>", "<svg a=\"1\" a=\"2\"/>"}) {
    INFO(bad);
    REQUIRE_THROWS(XmlChecker(bad).parse());
  }
  REQUIRE_NOTHROW(
      XmlChecker("<?xml version=\"1.0\"?>\n<svg a=\"&lt;\"><g/>x &amp; y</svg>\n").parse());
}

TEST_CASE("xml_escape escapes markup characters", "[trace_view][svg]") {
  REQUIRE(xml_escape("a<b>&\"c'") == "a&lt;b&gt;&amp;&quot;c&apos;");
  REQUIRE(xml_escape(std::string("x\x01y")) == "x?y");
  REQUIRE(xml_escape("plain") == "plain");
}

TEST_CASE("bad input is an error naming the source and the problem", "[trace_view][errors]") {
  REQUIRE_THROWS_AS(parse_trace("{not json", "bad.json"), Error);
  REQUIRE_THROWS_WITH(parse_trace("{not json", "bad.json"),
                      Contains("bad.json") && Contains("syntax error"));
  REQUIRE_THROWS_WITH(parse_trace(R"({"events": []})", "x.json"),
                      Contains("x.json") && Contains("\"traceEvents\"") && Contains("events"));
  REQUIRE_THROWS_WITH(parse_trace(R"({"traceEvents": 3})", "x.json"),
                      Contains("to be an array") && Contains("number"));
  REQUIRE_THROWS_WITH(parse_trace("42", "x.json"), Contains("array of events"));
  REQUIRE_THROWS_WITH(parse_trace(R"([{"name":"a","ts":1}])", "x.json"),
                      Contains("\"ph\"") && Contains("event 0"));
  REQUIRE_THROWS_WITH(parse_trace(R"([{"ph":"X","name":"a","ts":1}])", "x.json"),
                      Contains("\"dur\"") && Contains("event 0"));
  REQUIRE_THROWS_WITH(parse_trace(R"([{"ph":"X","ts":"1","dur":2}])", "x.json"),
                      Contains("\"ts\"") && Contains("string"));
  REQUIRE_THROWS_WITH(parse_trace(R"([{"ph":"X","ts":1,"dur":-2}])", "x.json"),
                      Contains("duration >= 0"));
  REQUIRE_THROWS_WITH(parse_trace(R"([{"ph":"X","ts":1,"dur":2}, 7])", "x.json"),
                      Contains("event 1") && Contains("object"));
  // The bare array form and an empty trace are fine.
  REQUIRE(parse_trace(R"([{"ph":"X","ts":1,"dur":2}])", "x.json").lanes.size() == 1);
  REQUIRE(summarize(parse_trace(R"({"traceEvents":[]})", "x.json")).empty());
  REQUIRE_NOTHROW(XmlChecker(render_svg(parse_trace(R"({"traceEvents":[]})", "x"), {})).parse());

  SECTION("files") {
    const std::string missing = temp_path("missing.json");
    REQUIRE_THROWS_WITH(load_trace(missing), Contains(missing) && Contains("No such file"));
    const std::string path = temp_path("bad.json");
    {
      std::ofstream out(path);
      out << "{\"traceEvents\": [";
    }
    REQUIRE_THROWS_WITH(load_trace(path), Contains(path) && Contains("syntax error"));
    {
      std::ofstream out(path);
      out << kHandMade;
    }
    REQUIRE(load_trace(path).lanes.size() == 8);
    std::filesystem::remove(path);
  }
}
