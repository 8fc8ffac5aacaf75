// tandem-trace: reads a Chrome trace written by tandem (runtime/trace.h) and
// prints a per-rank summary of compute, communication and exposed
// communication (Note [Exposed communication]), and writes an SVG timeline.
//
//   tandem-trace TRACE.json [-o out.svg] [--json] [--from-us T] [--to-us T]
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <optional>

#include "tools/trace/trace_view.h"

namespace {

// TRACE.json → TRACE.svg, anything else → anything.svg
std::string default_svg_path(const std::string& trace) {
  const std::string ext = ".json";
  if (trace.size() > ext.size() && trace.compare(trace.size() - ext.size(), ext.size(), ext) == 0)
    return trace.substr(0, trace.size() - ext.size()) + ".svg";
  return trace + ".svg";
}

}  // namespace

int main(int argc, char** argv) {
  using namespace tandem::trace_view;
  CLI::App app{
      "tandem-trace: per-rank compute / communication / exposed-communication summary and an "
      "SVG timeline of a tandem Chrome trace (runtime/trace.h; e.g. tandem-bench overlap --trace)"};
  std::string trace_path, svg_path;
  bool json = false, no_svg = false;
  double from_us = 0, to_us = 0;
  double width = 1400;
  app.add_option("trace", trace_path, "Chrome trace-event JSON file")->required();
  app.add_option("-o,--output", svg_path, "SVG timeline to write (default: TRACE with .svg)");
  app.add_flag("--no-svg", no_svg, "print the summary only");
  app.add_flag("--json", json, "print the summary as one JSON object instead of the table");
  CLI::Option* from = app.add_option("--from-us", from_us,
                                     "only events from this time (microseconds, trace clock)");
  CLI::Option* to = app.add_option("--to-us", to_us, "only events up to this time (microseconds)");
  app.add_option("--width", width, "SVG width in pixels (default 1400)");
  CLI11_PARSE(app, argc, argv);

  try {
    Window window;
    if (*from) window.from_us = from_us;
    if (*to) window.to_us = to_us;
    const Trace trace = load_trace(trace_path, window);
    const std::vector<RankSummary> ranks = summarize(trace);
    if (json) {
      fmt::print("{}\n", summary_json(trace, ranks).dump(2));
    } else {
      fmt::print("{}", summary_text(trace, ranks));
    }
    if (!no_svg) {
      if (svg_path.empty()) svg_path = default_svg_path(trace_path);
      std::ofstream out(svg_path, std::ios::binary);
      if (!out.good()) {
        fmt::print(stderr, "tandem-trace: error: cannot write the SVG to \"{}\": {}\n", svg_path,
                   std::strerror(errno));
        return 1;
      }
      SvgOptions options;
      options.width = width;
      out << render_svg(trace, ranks, options);
      out.close();
      if (!out.good()) {
        fmt::print(stderr, "tandem-trace: error: writing \"{}\" failed\n", svg_path);
        return 1;
      }
      // stderr, so that --json leaves stdout one JSON document.
      fmt::print(stderr, "tandem-trace: wrote {}\n", svg_path);
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "tandem-trace: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
