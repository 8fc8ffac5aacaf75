// The SVG timeline of tandem-trace: per rank a header, one lane per thread or
// named lane (spans stacked by nesting depth, instants as markers), and a strip
// of the rank's exposed communication (Note [Exposed communication]); a time
// axis with a grid, and a legend. Plain SVG 1.1 with presentation attributes
// only (no scripts, styles or external references), so any browser shows it.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "tools/trace/trace_view.h"

namespace tandem::trace_view {
namespace {

constexpr double kLeft = 240;  // label column
constexpr double kRight = 24;
constexpr double kRowHeight = 13;  // one nesting level
constexpr double kBarHeight = 11;
constexpr double kLanePad = 3;
constexpr double kRankHeader = 20;
constexpr double kExposedHeight = 8;
constexpr int kMaxDrawnDepth = 7;   // deeper spans share the last row
constexpr double kMinPixels = 0.6;  // narrower spans merge with their neighbours
constexpr size_t kLabelChars = 34;
constexpr size_t kKinds = 4;  // Kind's values

const char* fill_of(Kind kind) {
  switch (kind) {
    case Kind::Compute:
      return "#4e79a7";
    case Kind::Comm:
      return "#f28e2b";
    case Kind::Link:
      return "#b07aa1";
    case Kind::Wait:
      return "#bab0ac";
  }
  return "#888888";
}
constexpr const char* kExposedFill = "#e15759";
constexpr const char* kRendezvousColour = "#59a14f";
constexpr const char* kCoordinatorColour = "#76b7b2";
constexpr const char* kIssueColour = "#9c5b13";
constexpr const char* kOtherColour = "#333333";

std::string shorten(const std::string& s, size_t chars) {
  if (s.size() <= chars) return s;
  if (chars <= 2) return s.substr(0, chars);
  // Cut on a UTF-8 character boundary.
  size_t cut = chars - 2;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80)
    --cut;
  return s.substr(0, cut) + "..";
}

std::string format_time(double us, double step) {
  if (step >= 1e6) return fmt::format("{:g} s", us * 1e-6);
  if (step >= 1e3) return fmt::format("{:g} ms", us * 1e-3);
  return fmt::format("{:g} us", us);
}

// 1, 2 or 5 times a power of ten, giving about `ticks` ticks over `range`.
double tick_step(double range, int ticks) {
  const double raw = range / ticks;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0}) {
    if (m * p >= raw) return m * p;
  }
  return 10 * p;
}

struct Canvas {
  std::string body;
  double start = 0, scale = 1;  // pixels per microsecond

  double x(double us) const { return kLeft + (us - start) * scale; }

  void rect(double x0, double y, double w, double h, const char* fill,
            const std::string& title = {}, const char* extra = "") {
    body += fmt::format(R"(<rect x="{:.2f}" y="{:.2f}" width="{:.2f}" height="{:.2f}" fill="{}"{})",
                        x0, y, std::max(w, 0.5), h, fill, extra);
    if (title.empty()) {
      body += "/>\n";
    } else {
      body += fmt::format("><title>{}</title></rect>\n", xml_escape(title));
    }
  }
  void line(double x1, double y1, double x2, double y2, const char* stroke, double width,
            const std::string& title = {}) {
    body += fmt::format(
        R"(<line x1="{:.2f}" y1="{:.2f}" x2="{:.2f}" y2="{:.2f}" stroke="{}" stroke-width="{}")",
        x1, y1, x2, y2, stroke, width);
    if (title.empty()) {
      body += "/>\n";
    } else {
      body += fmt::format("><title>{}</title></line>\n", xml_escape(title));
    }
  }
  void text(double x0, double y, const std::string& s, const char* attrs = "") {
    body += fmt::format(R"(<text x="{:.2f}" y="{:.2f}"{}>{}</text>)", x0, y, attrs, xml_escape(s));
    body += "\n";
  }
  void polygon(const std::string& points, const char* fill, const std::string& title) {
    body += fmt::format(R"(<polygon points="{}" fill="{}"><title>{}</title></polygon>)", points,
                        fill, xml_escape(title));
    body += "\n";
  }
};

std::string span_title(const Span& s) {
  std::string t =
      fmt::format("{} [{}] start {:.1f} us, {:.1f} us", s.name, s.category, s.ts, s.dur);
  if (!s.args.empty()) t += " " + s.args;
  return t;
}

// Spans of one lane; runs of spans too narrow to see on the same row and of
// the same kind are drawn as one bar (its tooltip says how many).
void draw_spans(Canvas& c, const Lane& lane, double top) {
  struct Pending {
    double x0 = 0, x1 = -1;
    size_t count = 0;
    const Span* first = nullptr;
  };
  std::vector<Pending> pending(static_cast<size_t>(kMaxDrawnDepth + 1) * kKinds);
  auto flush = [&](Pending& p, int row, Kind kind) {
    if (p.count == 0) return;
    const double y = top + kLanePad + row * kRowHeight;
    c.rect(p.x0, y, p.x1 - p.x0, kBarHeight, fill_of(kind),
           p.count == 1 ? span_title(*p.first)
                        : fmt::format("{} spans from {} [{}] on", p.count, p.first->name,
                                      p.first->category));
    p = Pending{};
  };
  for (const Span& s : lane.spans) {
    const int row = std::min(s.depth, kMaxDrawnDepth);
    const double x0 = c.x(s.ts), x1 = c.x(s.end());
    const size_t k = static_cast<size_t>(row) * kKinds + static_cast<size_t>(s.kind);
    Pending& p = pending[k];
    if (x1 - x0 < kMinPixels) {
      if (p.count > 0 && x0 <= p.x1 + kMinPixels) {
        p.x1 = std::max(p.x1, x1);
        ++p.count;
        continue;
      }
      flush(p, row, s.kind);
      p = Pending{x0, x1, 1, &s};
      continue;
    }
    flush(p, row, s.kind);
    const double y = top + kLanePad + row * kRowHeight;
    c.rect(x0, y, x1 - x0, kBarHeight, fill_of(s.kind), span_title(s));
    // A name inside the bar when it has room for a few characters.
    const auto room = static_cast<size_t>((x1 - x0 - 4) / 5.6);
    if (room >= 4) {
      c.text(x0 + 2, y + kBarHeight - 2, shorten(s.name, room),
             R"( font-size="9" fill="#ffffff" pointer-events="none")");
    }
  }
  for (size_t k = 0; k < pending.size(); ++k)
    flush(pending[k], static_cast<int>(k / kKinds), static_cast<Kind>(k % kKinds));
}

std::string instant_title(const Instant& i) {
  std::string t = fmt::format("{} [{}] at {:.1f} us", i.name, i.category, i.ts);
  if (!i.args.empty()) t += " " + i.args;
  return t;
}

void draw_instants(Canvas& c, const Lane& lane, double top, double height) {
  for (const Instant& i : lane.instants) {
    const double x = c.x(i.ts), bottom = top + height;
    switch (i.mark) {
      case Mark::Rendezvous:
        // A thin line across the lane, a notch on top to find it.
        c.line(x, top, x, bottom, kRendezvousColour, 1.2, instant_title(i));
        c.polygon(fmt::format("{:.2f},{:.2f} {:.2f},{:.2f} {:.2f},{:.2f}", x - 3, top, x + 3, top,
                              x, top + 4),
                  kRendezvousColour, instant_title(i));
        break;
      case Mark::Coordinator:
        c.line(x, bottom - 6, x, bottom, kCoordinatorColour, 1, instant_title(i));
        break;
      case Mark::Issue:
        c.polygon(fmt::format("{:.2f},{:.2f} {:.2f},{:.2f} {:.2f},{:.2f}", x - 3, bottom, x + 3,
                              bottom, x, bottom - 5),
                  kIssueColour, instant_title(i));
        break;
      case Mark::Other:
        c.polygon(fmt::format("{:.2f},{:.2f} {:.2f},{:.2f} {:.2f},{:.2f} {:.2f},{:.2f}", x,
                              bottom - 7, x + 3, bottom - 4, x, bottom - 1, x - 3, bottom - 4),
                  kOtherColour, instant_title(i));
        break;
    }
  }
}

double lane_height(const Lane& lane) {
  return (std::min(lane.max_depth, kMaxDrawnDepth) + 1) * kRowHeight + 2 * kLanePad;
}

// Two rows: what the bars mean, then what the markers mean.
void draw_legend(Canvas& c, double y) {
  double x = kLeft;
  auto advance = [&](const std::string& label) {
    x += 30 + 6.0 * static_cast<double>(label.size());
  };
  auto box = [&](const char* fill, const std::string& label) {
    c.rect(x, y - 9, 14, 10, fill);
    c.text(x + 18, y, label);
    advance(label);
  };
  box(fill_of(Kind::Compute), "compute (autograd, ops, ...)");
  box(fill_of(Kind::Wait), "waiting (sync hook, collective node)");
  box(fill_of(Kind::Comm), "collective executing (comm)");
  box(fill_of(Kind::Link), "simulated link transfer (link)");
  box(kExposedFill, "exposed communication");
  x = kLeft;
  y += 16;
  auto marker = [&](const std::string& label) {
    c.text(x + 10, y, label);
    advance(label);
  };
  c.line(x + 4, y - 10, x + 4, y + 1, kRendezvousColour, 1.5);
  marker("rendezvous");
  c.line(x + 4, y - 5, x + 4, y + 1, kCoordinatorColour, 1.5);
  marker("coordinator event (gate, notify, enable, ...)");
  c.polygon(fmt::format("{:.2f},{:.2f} {:.2f},{:.2f} {:.2f},{:.2f}", x + 1, y + 1, x + 7, y + 1,
                        x + 4, y - 5),
            kIssueColour, "collective issue");
  marker("collective issue");
  c.polygon(fmt::format("{:.2f},{:.2f} {:.2f},{:.2f} {:.2f},{:.2f} {:.2f},{:.2f}", x + 4, y - 6,
                        x + 7, y - 3, x + 4, y, x + 1, y - 3),
            kOtherColour, "other instant event");
  marker("other instant");
}

}  // namespace

std::string render_svg(const Trace& trace, const std::vector<RankSummary>& ranks,
                       const SvgOptions& options) {
  const double width = std::max(options.width, kLeft + kRight + 200);
  const double plot = width - kLeft - kRight;
  const double range = std::max(trace.end_us - trace.start_us, 1.0);
  Canvas c;
  c.start = trace.start_us;
  c.scale = plot / range;

  // Layout first: the grid lines span every lane.
  constexpr double kAxisY = 78;
  double y = kAxisY + 8;
  struct Placed {
    const Lane* lane;
    double top, height;
  };
  std::vector<Placed> placed;
  std::vector<std::pair<const RankSummary*, double>> headers, strips;
  for (const RankSummary& r : ranks) {
    headers.emplace_back(&r, y);
    y += kRankHeader;
    for (const Lane& lane : trace.lanes) {
      if (lane.pid != r.rank) continue;
      placed.push_back({&lane, y, lane_height(lane)});
      y += lane_height(lane);
    }
    strips.emplace_back(&r, y);
    y += kExposedHeight + 8;
  }
  const double height = y + 10;

  c.text(8, 18,
         fmt::format("tandem-trace: {} - {} ranks, {} lanes, {} events", trace.source, ranks.size(),
                     trace.lanes.size(), trace.events),
         R"( font-size="13" font-weight="bold")");
  draw_legend(c, 38);

  // Axis and grid.
  const double step = tick_step(range, std::max(2, static_cast<int>(plot / 110)));
  c.line(kLeft, kAxisY, kLeft + plot, kAxisY, "#000000", 1);
  const double first_tick = std::ceil(trace.start_us / step);
  for (int k = 0; k < 1000; ++k) {  // bounded: huge timestamps may not advance by `step`
    const double t = (first_tick + k) * step;
    if (t > trace.end_us + 1e-9 * range) break;
    const double x = c.x(t);
    c.line(x, kAxisY + 1, x, height - 10, "#e4e4e4", 1);
    c.line(x, kAxisY - 4, x, kAxisY, "#000000", 1);
    c.text(x, kAxisY - 7, format_time(t, step), R"( text-anchor="middle" font-size="10")");
  }

  for (const auto& [r, top] : headers) {
    std::string label = fmt::format("rank {}", r->rank);
    for (const auto& [pid, name] : trace.process_names) {
      if (pid == r->rank && !name.empty()) label += " (" + name + ")";
    }
    c.line(0, top + 1, width, top + 1, "#999999", 1);
    c.text(8, top + 15, label, R"( font-weight="bold" font-size="12")");
    c.text(kLeft, top + 15,
           fmt::format("compute {:.3f} ms, comm {:.3f} ms, exposed {:.3f} ms, overlap {}",
                       r->compute_us * 1e-3, r->comm_us * 1e-3, r->exposed_us * 1e-3,
                       r->overlap ? fmt::format("{:.1f}%", 100 * *r->overlap) : "-"),
           R"( font-size="10" fill="#555555")");
  }
  for (const Placed& p : placed) {
    c.rect(kLeft, p.top + 1, plot, p.height - 2, "#f7f7f7", {}, R"( class="lane-bg")");
    c.body +=
        fmt::format(R"(<text x="16" y="{:.2f}" class="lane-label" data-pid="{}" data-tid="{}">)",
                    p.top + kLanePad + kBarHeight - 1, p.lane->pid, p.lane->tid);
    c.body += fmt::format("<title>{}</title>{}</text>\n", xml_escape(p.lane->name),
                          xml_escape(shorten(p.lane->name, kLabelChars)));
    draw_spans(c, *p.lane, p.top);
    draw_instants(c, *p.lane, p.top, p.height);
  }
  for (const auto& [r, top] : strips) {
    c.text(16, top + kExposedHeight, "exposed comm", R"( font-size="9" fill="#555555")");
    for (const auto& [a, b] : r->exposed_intervals)
      c.rect(c.x(a), top + 1, (b - a) * c.scale, kExposedHeight, kExposedFill,
             fmt::format("exposed {:.1f} us at {:.1f} us", b - a, a));
  }

  std::string out = fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      R"(<svg xmlns="http://www.w3.org/2000/svg" version="1.1" width="{:.0f}" height="{:.0f}" )"
      R"(viewBox="0 0 {:.0f} {:.0f}" font-family="sans-serif" font-size="11">)"
      "\n",
      width, height, width, height);
  out += fmt::format(R"(<rect x="0" y="0" width="{:.0f}" height="{:.0f}" fill="#ffffff"/>)", width,
                     height);
  out += "\n" + c.body + "</svg>\n";
  return out;
}

}  // namespace tandem::trace_view
