// Reading the Chrome trace of `tandem-bench overlap`: the traffic of one
// sequential step and the checks of one overlapped step (bench_overlap.h).
#include "tools/bench/bench_overlap.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <utility>

#include "tandem/runtime/error.h"

namespace tandem::bench::overlap {
namespace {

struct Rendezvous {
  int worker;
  bool comm;  // the role it announced
  double ts;  // when it returned
};

}  // namespace

Traffic read_traffic(const Json& doc, int ranks, int micro_batches, int moe_layers) {
  const size_t per_forward = 3 * static_cast<size_t>(moe_layers);
  const size_t per_micro_batch = 5 * static_cast<size_t>(moe_layers);
  std::map<int, std::vector<std::pair<int64_t, double>>> by_rank;  // rank → (seq, bytes)
  for (const Json& e : doc["traceEvents"]) {
    if (e["ph"] != "X" || e["cat"] != "link") continue;
    by_rank[e["pid"].get<int>()].emplace_back(e["args"]["seq"].get<int64_t>(),
                                              e["args"]["bytes"].get<double>());
  }
  TANDEM_CHECK(static_cast<int>(by_rank.size()) == ranks,
               "[bench::overlap] expected link events from {} ranks, got {}", ranks,
               by_rank.size());
  Traffic t;
  t.bytes.resize(static_cast<size_t>(micro_batches));
  for (auto& [rank, events] : by_rank) {
    TANDEM_CHECK(events.size() == per_micro_batch * micro_batches,
                 "[bench::overlap] expected {} collectives per micro-batch x {} on rank {}, got {}",
                 per_micro_batch, micro_batches, rank, events.size());
    std::sort(events.begin(), events.end());
    for (size_t j = 0; j < events.size(); ++j) {
      const size_t within = j % per_micro_batch;
      const int direction = within < per_forward ? 0 : 1;
      const size_t slot = direction == 0 ? within : within - per_forward;
      std::vector<double>& v = t.bytes[j / per_micro_batch][direction];
      if (v.size() <= slot) v.resize(slot + 1, 0.0);
      v[slot] = std::max(v[slot], events[j].second);
    }
  }
  return t;
}

TraceCheck check_trace(const Json& doc, int ranks, int64_t experts) {
  static const char* kWorkers[2] = {"forward-worker", "backward-worker"};
  TraceCheck c;
  std::map<std::pair<int, int>, std::string> lanes;  // (pid, tid) → thread name
  for (const Json& e : doc["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") {
      lanes[{e["pid"].get<int>(), e["tid"].get<int>()}] = e["args"]["name"].get<std::string>();
    }
  }
  std::map<std::pair<int, int>, std::vector<double>> issues;  // (rank, worker) → issue times
  // (rank, window, round) → its two rendezvous.
  std::map<std::array<int64_t, 3>, std::vector<Rendezvous>> rounds;
  std::map<int64_t, std::pair<int, double>> issued;  // rank 0: seq → (worker, issue ts)
  std::vector<double> enables, disables;             // rank 0
  for (const Json& e : doc["traceEvents"]) {
    if (e["ph"] == "M") continue;
    ++c.events;
    const int pid = e["pid"].get<int>();
    const std::string name = e["name"].get<std::string>();
    const double ts = e["ts"].get<double>();
    if (pid == 0 && e["cat"] == "coordinator" && (name == "enable" || name == "disable")) {
      (name == "enable" ? enables : disables).push_back(ts);
    }
    const std::string& lane = lanes[{pid, e["tid"].get<int>()}];
    const int worker = lane == kWorkers[0] ? 0 : lane == kWorkers[1] ? 1 : -1;
    if (worker < 0) continue;
    const Json& args = e["args"];
    if (e["cat"] == "coordinator" && name == "rendezvous" && !args.contains("skipped")) {
      rounds[{pid, args["window"].get<int64_t>(), args["round"].get<int64_t>()}].push_back(
          {worker, args["role"] == "Comm", ts});
    } else if (e["cat"] == "comm" && name.rfind("issue ", 0) == 0) {
      issues[{pid, worker}].push_back(ts);
      if (pid == 0) issued[args["seq"].get<int64_t>()] = {worker, ts};
    }
  }
  for (int r = 0; r < ranks && c.error.empty(); ++r) {
    for (int w = 0; w < 2; ++w) {
      const bool has_rendezvous = std::any_of(rounds.begin(), rounds.end(), [&](const auto& kv) {
        return kv.first[0] == r && std::any_of(kv.second.begin(), kv.second.end(),
                                               [&](const Rendezvous& z) { return z.worker == w; });
      });
      if (!has_rendezvous || issues[{r, w}].empty()) {
        c.error = fmt::format(
            "expected rendezvous and collective issue events from rank {}'s {}, got {} and {}", r,
            kWorkers[w], has_rendezvous ? "some" : "none", issues[{r, w}].size());
        break;
      }
    }
  }
  for (auto& [key, pair] : rounds) {
    if (!c.error.empty()) break;
    if (pair.size() != 2 || pair[0].comm == pair[1].comm) {
      c.error = fmt::format(
          "expected one Comm and one Compute rendezvous in round {} of window "
          "{} on rank {}, got {} rendezvous",
          key[2], key[1], key[0], pair.size());
      break;
    }
    const Rendezvous& comm = pair[0].comm ? pair[0] : pair[1];
    const Rendezvous& compute = pair[0].comm ? pair[1] : pair[0];
    std::vector<double>& times = issues[{static_cast<int>(key[0]), comm.worker}];
    std::sort(times.begin(), times.end());
    auto first_issue = std::lower_bound(times.begin(), times.end(), comm.ts);
    if (first_issue == times.end() || *first_issue > compute.ts) {
      c.error = fmt::format(
          "expected the Compute side of round {} of window {} on rank {} to go "
          "on after the Comm side's issue, got it at {} us, before it",
          key[2], key[1], key[0], compute.ts);
      break;
    }
    ++c.rounds;
  }
  // Rank 0's link events in launch order (seq): the order the link serves them.
  std::map<int64_t, const Json*> links;
  for (const Json& e : doc["traceEvents"]) {
    if (e["ph"] == "X" && e["cat"] == "link" && e["pid"].get<int>() == 0) {
      links[e["args"]["seq"].get<int64_t>()] = &e;
    }
  }
  std::vector<std::pair<double, double>> busy;  // rank 0's link intervals, us
  double previous_end = 0;
  for (const auto& [seq, e] : links) {
    const double ts = (*e)["ts"].get<double>(), dur = (*e)["dur"].get<double>();
    auto it = issued.find(seq);
    if (it != issued.end()) {
      SideTraffic& s = c.rank0[static_cast<size_t>(it->second.first)];
      // Waited for the link: from the issue until the previous collective
      // left it. (The event's own start is stamped after the launch into the
      // inner backend returned, so on a loaded machine it can lag the
      // simulated start; the previous end bounds the real wait.)
      const double issue = it->second.second;
      const double queued_ms =
          std::clamp(ts - issue, 0.0, std::max(0.0, previous_end - issue)) * 1e-3;
      ++s.collectives;
      s.link_ms += dur * 1e-3;
      s.queued_ms += queued_ms;
      if ((*e)["args"]["bytes"].get<double>() <= 8.0 * static_cast<double>(experts)) {
        ++s.counts;
        s.counts_queued_ms += queued_ms;
      }
    }
    c.rank0_link_busy_ms += dur * 1e-3;
    busy.emplace_back(ts, ts + dur);
    previous_end = std::max(previous_end, ts + dur);
  }
  for (size_t w = 0; w < std::min(enables.size(), disables.size()); ++w) {
    const double a = enables[w], b = disables[w];
    c.rank0_window_ms += (b - a) * 1e-3;
    for (const auto& [x, y] : busy)
      c.rank0_window_busy_ms += std::max(0.0, std::min(b, y) - std::max(a, x)) * 1e-3;
  }
  return c;
}

}  // namespace tandem::bench::overlap
