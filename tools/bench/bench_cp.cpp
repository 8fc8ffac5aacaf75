// `tandem-bench cp`: context parallelism (DESIGN §7) on a simulated link
// (Note [Simulated link timing]). One causal self-attention layer with its
// q/k/v/o projections, forward + backward in f32, runs on 4 rank threads in
// each CP mode: Ulysses (ds=4), all-gather KV (ds=1, with and without load
// balance), hybrid (ds=2), ring (with and without load balance), and the
// async variants of Ulysses, all-gather KV (with and without load balance)
// and hybrid (AsyncContextParallel; ring's transfers are in flight behind its
// blocks in the ring rows themselves: Note [Ring backward in flight]).
//
// Note [CP benchmark method]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// The link. At start-up the 4 rank threads run the local q-projection GEMM,
// (B, S/4, d) x (d, d), concurrently — as they do inside a CP step, sharing
// this machine's cores — and the bandwidth is chosen so that one all-to-all of
// that projection's output, (n-1)/n of its bytes per rank, takes as long as
// that GEMM. Communication and projection compute are then of similar size,
// the regime in which the async variant should hide most communication.
//
// Time. Each mode builds two copies of the layer on the same rank threads:
// one on the simulated link, and one on a link of zero latency and infinite
// bandwidth that still moves the data (compute only). Their steps alternate,
// (link, ideal), (ideal, link), …, each step between two barriers of the rank
// threads, so adjacent steps see the same machine (Note [Benchmark timing]).
// step = median link step; compute = median ideal step; exposed
// communication = median over pairs of (link step - ideal step), the time the
// link adds beyond compute alone. An async mode runs on the same rank threads
// as its sync counterpart, their pairs taking turns, so that the two exposed
// times being compared see the same machine load.
//
// That wall-clock difference is fragile here: 4 rank threads share 2 cores
// with other users' jobs, so steps vary by more than the link costs, and a
// rank that waits for the link hands its core to another rank (on GPUs each
// rank has its own device, and a wait idles it). Exposed communication is
// therefore also measured per rank thread: its step's wall time minus its
// time on a CPU and its time runnable but waiting for one (the kernel's
// scheduler statistics) is the time it slept, blocked in a wait; "exp slept"
// is the median over pairs of the ranks' mean extra sleep on the link. That
// is the per-rank exposure a rank with its own device would see, and what the
// async-vs-sync comparison uses (the wall-clock figure where the statistics
// are unavailable).
//
// Bytes and link time come from the simulated link itself: the bytes and
// durations it charges (its trace events) during one traced step, summed per
// rank over every group the rank uses. "link ms" is that sum, what the step
// would lose with no overlap at all (separate groups of the hybrid mode may
// use their links at once, so there it is an upper bound).
//
// Peak memory. The single-rank layer runs alone on this thread: peak
// allocated bytes of one step minus what was allocated before its layer and
// input existed. The CP run: the same over the whole process (before: before
// the mode's layers and shards existed), divided by the 4 ranks. The rank
// threads share the process-wide CPU allocator, so a rank's own peak cannot
// be read; process peak / 4 is the mean per-rank footprint at the moment of
// the highest total. Ranks running the same program in step peak together,
// so this is close to the per-rank peak, but it understates a rank whose
// peak falls while the others are low.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "tandem/autograd/engine.h"
#include "tandem/autograd/nn/attention.h"
#include "tandem/autograd/nn/linear.h"
#include "tandem/autograd/ops.h"
#include "tandem/comm/sim_link.h"
#include "tandem/comm/threads/threads_backend.h"
#include "tandem/parallel/context_parallel.h"
#include "tandem/runtime/allocator.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/stream.h"
#include "tandem/runtime/trace.h"
#include "tandem/tensor/ops.h"
#include "tools/bench/bench.h"
#include "tools/bench/bench_cp.h"

namespace tandem::bench {
namespace {

using namespace cp;

using Clock = std::chrono::steady_clock;
using Json = nlohmann::ordered_json;

// The issue's layer, and the smoke-run layer of --quick.
constexpr int64_t kIssueSeq = 8192, kIssueDim = 1024, kIssueHeads = 16;
constexpr int64_t kQuickSeq = 1024, kQuickDim = 256;
// What the full run may use: allocated peak times a margin for the cached
// blocks the allocator holds on top, and wall time.
constexpr double kMemoryBudgetBytes = 8.0 * (1ll << 30);
constexpr double kCacheMargin = 1.25;
constexpr double kRunBudgetS = 360;
constexpr double kAsyncTarget = 0.4;    // exposed comm async / exposed comm sync
constexpr double kLinkLatencyUs = 2.0;  // NVLink-like; negligible against the GEMM

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

// ---- shared with bench_cp_plain.cpp (bench_cp.h) ----

namespace cp {

const Mode kModes[] = {
    {"ulysses", kRanks, false, false, false, nullptr, true},
    {"allgather-kv", 1, false, false, false, nullptr, false},
    {"allgather-kv-lb", 1, false, true, false, nullptr, false},
    {"hybrid", 2, false, false, false, nullptr, false},
    {"ring", 1, true, false, false, nullptr, true},
    {"ring-lb", 1, true, true, false, nullptr, true},
    {"async-ulysses", kRanks, false, false, true, "ulysses", true},
    {"async-allgather-kv", 1, false, false, true, "allgather-kv", false},
    {"async-allgather-kv-lb", 1, false, true, true, "allgather-kv-lb", false},
    {"async-hybrid", 2, false, false, true, "hybrid", false},
};

std::span<const Mode> all_modes() {
  return kModes;
}

int64_t allocated_bytes() {
  return memory_stats(Device::cpu()).allocated_bytes;
}
int64_t peak_allocated_bytes() {
  return memory_stats(Device::cpu()).peak_allocated_bytes;
}

void train_step(nn::SelfAttention& layer, const Tensor& x, const Tensor& w) {
  Tensor input = detach(x);
  set_requires_grad(input);
  Tensor out = layer(input);
  backward(sum(mul(out, w)));
  layer.zero_grad();
  current_stream(x.device()).synchronize();
}

SingleRun run_single(const Size& size, const Tensor& x, const Tensor& w, int steps) {
  SingleRun r;
  const int64_t base = allocated_bytes();
  {
    Generator gen(1);
    auto layer = nn::make<nn::SelfAttention>(
        {.d_model = size.dim, .n_heads = size.heads, .n_kv_heads = size.heads, .causal = true},
        gen);
    Tensor xs = ops::clone(x), ws = ops::clone(w);
    reset_peak_memory(Device::cpu());
    train_step(*layer, xs, ws);
    r.peak_bytes = static_cast<double>(peak_allocated_bytes() - base);
    r.weight_bytes = weight_state_bytes(*layer);
    for (int i = 0; i < steps; ++i) {
      Clock::time_point start = Clock::now();
      train_step(*layer, xs, ws);
      r.step_s.push_back(seconds_since(start));
    }
  }
  empty_cache(Device::cpu());
  return r;
}

std::shared_ptr<nn::SelfAttention> make_layer(const Size& size, const Mode& mode,
                                              const DeviceMesh& mesh) {
  Generator gen(1);  // the same weights on every rank
  auto layer = nn::make<nn::SelfAttention>(
      {.d_model = size.dim, .n_heads = size.heads, .n_kv_heads = size.heads, .causal = true}, gen);
  ContextParallel config;
  config.ulysses_degree = mode.ds;
  config.load_balance = mode.load_balance;
  config.mode = mode.ring ? CPMode::Ring : CPMode::Auto;
  apply_context_parallel(*layer, config, mesh, mode.async);
  return layer;
}

LayerCopy make_copy(const Size& size, const Mode& mode, ProcessGroupPtr group, const Tensor& x,
                    const Tensor& w, Device device) {
  LayerCopy c;
  const int r = group->rank();
  c.mesh = DeviceMesh(std::move(group), {kRanks}, {"cp"}, {}, device);
  c.layer = make_layer(size, mode, c.mesh);
  c.layer->to(device);
  c.x = ops::to(shard_sequence(x, 1, kRanks, r, mode.load_balance), device);
  c.w = ops::to(shard_sequence(w, 1, kRanks, r, mode.load_balance), device);
  return c;
}

double activation_ratio(double peak_per_rank, const SingleRun& single) {
  return (peak_per_rank - single.weight_bytes) / (single.peak_bytes - single.weight_bytes);
}

double weight_state_bytes(nn::SelfAttention& layer) {
  double bytes = 0;
  for (const Tensor& p : layer.parameters())
    bytes += 2.0 * static_cast<double>(p.nbytes());
  return bytes;
}

std::vector<const Mode*> selected_modes(const std::string& filter) {
  std::vector<const Mode*> out;
  auto wanted = [&](const Mode& m) {
    if (std::string(m.name).find(filter) != std::string::npos) return true;
    for (const Mode& a : kModes) {  // the sync side of a selected async mode
      if (a.sync_of != nullptr && a.sync_of == std::string(m.name) &&
          std::string(a.name).find(filter) != std::string::npos)
        return true;
    }
    return false;
  };
  for (const Mode& m : kModes) {
    if (wanted(m)) out.push_back(&m);
  }
  return out;
}

std::vector<std::vector<const Mode*>> mode_groups(const std::vector<const Mode*>& modes,
                                                  bool sync_alone) {
  std::vector<std::vector<const Mode*>> groups;
  for (const Mode* m : modes) {
    if (m->async) continue;  // joins its sync counterpart below
    std::vector<const Mode*> g = {m};
    for (const Mode* a : modes) {
      if (a->async && a->sync_of == std::string(m->name)) g.push_back(a);
    }
    if (g.size() > 1 || sync_alone) groups.push_back(std::move(g));
  }
  return groups;
}

}  // namespace cp

namespace {

// ---- choosing S ----

// Dense attention materialises (B, H, S, S) scores several times over, so the
// issue's S = 8192 needs tens of GiB. Small single-rank probes measure peak
// memory and step time; the largest S that fits both budgets is used.
struct SeqChoice {
  int64_t seq = 0;
  std::vector<std::string> lines;
  Json json;
};

// The quadratic through three points, evaluated at s (Lagrange form).
double quadratic_at(const double (&xs)[3], const double (&ys)[3], double s) {
  double y = 0;
  for (int i = 0; i < 3; ++i) {
    double l = 1;
    for (int j = 0; j < 3; ++j) {
      if (j != i) l *= (s - xs[j]) / (xs[i] - xs[j]);
    }
    y += ys[i] * l;
  }
  return y;
}

SeqChoice choose_seq(const Size& size, int steps_in_run) {
  const double probe[3] = {256, 512, 1024};
  double peak[3], time_s[3];
  for (int i = 0; i < 3; ++i) {
    Generator gen(11);
    const auto s = static_cast<int64_t>(probe[i]);
    Tensor x = ops::randn({kBatch, s, size.dim}, gen), w = ops::randn({kBatch, s, size.dim}, gen);
    SingleRun r = run_single({s, size.dim, size.heads}, x, w, 1);
    peak[i] = r.peak_bytes;
    time_s[i] = r.step_s[0];
  }
  // Time: a S^2 + b S through the two largest probes (the smallest is noise).
  const double s1 = probe[1], s2 = probe[2];
  double a = std::max(0.0, (time_s[2] / s2 - time_s[1] / s1) / (s2 - s1));
  double b = std::max(0.0, time_s[2] / s2 - a * s2);
  SeqChoice c;
  c.json = {{"memory_budget_gib", kMemoryBudgetBytes / (1 << 30)},
            {"cache_margin", kCacheMargin},
            {"run_budget_s", kRunBudgetS},
            {"probes", Json::array()},
            {"candidates", Json::array()}};
  for (int i = 0; i < 3; ++i) {
    c.json["probes"].push_back(
        {{"seq", probe[i]}, {"peak_mib", peak[i] / kMiB}, {"step_ms", time_s[i] * 1e3}});
  }
  for (int64_t s : {kIssueSeq, kIssueSeq / 2, kIssueSeq / 4, kIssueSeq / 8}) {
    const double sd = static_cast<double>(s);
    const double mem = quadratic_at(probe, peak, sd) * kCacheMargin;
    const double run = (a * sd * sd + b * sd) * steps_in_run;
    const bool fits = mem <= kMemoryBudgetBytes && run <= kRunBudgetS;
    c.json["candidates"].push_back({{"seq", s},
                                    {"projected_memory_gib", mem / (1 << 30)},
                                    {"projected_run_s", run},
                                    {"fits", fits}});
    c.lines.push_back(fmt::format(
        "  S={:<5} projected single-rank memory {:6.2f} GiB (budget {:.0f}), run {:6.0f} s "
        "(budget {:.0f}): {}",
        s, mem / (1 << 30), kMemoryBudgetBytes / (1 << 30), run, kRunBudgetS,
        fits ? "fits" : "too big"));
    if (fits && c.seq == 0) c.seq = s;
  }
  if (c.seq == 0) c.seq = kIssueSeq / 16;
  return c;
}

// ---- the link ----

struct LinkChoice {
  LinkModel model;
  double gemm_s = 0;     // one q-projection GEMM, 4 rank threads at once
  double a2a_bytes = 0;  // per rank, one all-to-all of the q projection's output
};

LinkChoice calibrate_link(const Size& size) {
  constexpr int kWarmup = 2, kTrials = 9;
  const int64_t local = (size.seq + kRanks - 1) / kRanks;
  Generator gen(5);
  Tensor x = ops::randn({kBatch, local, size.dim}, gen);
  std::vector<double> times;
  Lockstep lockstep(kRanks);
  run_ranks(kRanks, [&](ProcessGroupPtr world) {
    lockstep.guard([&] {
      Generator g(1);
      auto proj = nn::make<nn::Linear>(
          {.in_features = size.dim, .out_features = size.dim, .bias = false}, g);
      NoGradGuard no_grad;
      for (int i = 0; i < kWarmup + kTrials; ++i) {
        lockstep.sync();
        Clock::time_point start = Clock::now();
        Tensor y = (*proj)(x);
        current_stream(Device::cpu()).synchronize();
        lockstep.sync();  // the slowest of the concurrent GEMMs
        if (world->rank() == 0 && i >= kWarmup) times.push_back(seconds_since(start));
      }
    });
  });
  LinkChoice c;
  c.gemm_s = sample_median(times);
  c.a2a_bytes = static_cast<double>(kRanks - 1) / kRanks * static_cast<double>(x.nbytes());
  c.model = LinkModel{kLinkLatencyUs, c.a2a_bytes / c.gemm_s / 1e9, {}};
  return c;
}

// ---- one CP mode ----

// This thread's time on a CPU and time runnable but waiting for one, from the
// kernel's scheduler statistics (Linux /proc/thread-self/schedstat, in ns);
// nullopt where unavailable. A step's wall time minus both is the time the
// thread slept: blocked in a wait, not computing and not crowded out.
struct SchedTimes {
  double on_cpu_s = 0, runnable_s = 0;
};
std::optional<SchedTimes> thread_sched_times() {
  std::ifstream in("/proc/thread-self/schedstat");
  double on_cpu_ns = 0, runnable_ns = 0;
  if (!(in >> on_cpu_ns >> runnable_ns)) return std::nullopt;
  return SchedTimes{on_cpu_ns * 1e-9, runnable_ns * 1e-9};
}

struct ModeRun {
  std::vector<double> step_s, compute_s;  // adjacent (link, ideal) pairs
  // Mean over ranks of the time a rank thread slept in that step (NaN where
  // the scheduler statistics are unavailable), for the same pairs.
  std::vector<double> slept_step_s, slept_compute_s;
  std::vector<double> moved_bytes;  // per rank, one step
  std::vector<double> link_s;       // per rank, one step
  double process_peak_bytes = 0;
  std::string error;

  double step() const { return sample_median(step_s); }
  double compute() const { return sample_median(compute_s); }
  double exposed() const {
    std::vector<double> d;
    for (size_t i = 0; i < step_s.size(); ++i)
      d.push_back(step_s[i] - compute_s[i]);
    return sample_median(d);
  }
  // Exposed communication as the extra time the rank threads slept.
  double exposed_slept() const {
    std::vector<double> d;
    for (size_t i = 0; i < slept_step_s.size(); ++i)
      d.push_back(slept_step_s[i] - slept_compute_s[i]);
    return d.empty() || std::isnan(d[0]) ? std::nan("") : sample_median(d);
  }
  // The exposed figure the async comparison uses (Note [CP benchmark method]).
  double exposed_best() const {
    const double b = exposed_slept();
    return std::isnan(b) ? exposed() : b;
  }
  double max_moved() const { return *std::max_element(moved_bytes.begin(), moved_bytes.end()); }
  double max_link() const { return *std::max_element(link_s.begin(), link_s.end()); }
  double peak_per_rank() const { return process_peak_bytes / kRanks; }
};

// Bytes and durations the simulated links charged, per rank, from the trace
// (Note [Simulated link timing]). An event's pid is the world rank of the
// thread that issued the collective (run_ranks sets each rank thread's log
// context); its lane names the group rank, which differs in sub-groups.
void read_link_traffic(ModeRun& run) {
  Json doc = Json::parse(trace_json());
  run.moved_bytes.assign(kRanks, 0.0);
  run.link_s.assign(kRanks, 0.0);
  for (const Json& e : doc["traceEvents"]) {
    if (e["ph"] != "X" || e["cat"] != "link") continue;
    const int rank = e["pid"].get<int>();
    TANDEM_CHECK(rank >= 0 && rank < kRanks,
                 "[bench::cp] expected link events from world ranks 0..{}, got pid {} ({})",
                 kRanks - 1, rank, e.dump());
    run.moved_bytes[rank] += e["args"]["bytes"].get<double>();
    run.link_s[rank] += e["dur"].get<double>() * 1e-6;
  }
}

// Runs `modes` together on one set of rank threads (an async mode with its
// sync counterpart, so that both see the same machine load): for each mode a
// traced step on the link (peak memory, bytes), then `pairs` rounds in which
// every mode runs an adjacent (link, ideal) pair of steps.
std::vector<ModeRun> run_group(const Size& size, const std::vector<const Mode*>& modes,
                               const LinkModel& link, const Tensor& x, const Tensor& w, int pairs) {
  const size_t n = modes.size();
  std::vector<ModeRun> runs(n);
  std::vector<double> slept(kRanks);  // per rank, the last timed step; each rank writes its own
  const LinkModel ideal{0.0, std::numeric_limits<double>::infinity(), {}};
  Lockstep lockstep(kRanks);
  try {
    run_ranks(kRanks, [&](ProcessGroupPtr world) {
      lockstep.guard([&] {
        const int rank = world->rank();
        const bool leader = rank == 0;
        std::vector<LayerCopy> on_link, on_ideal;
        for (size_t m = 0; m < n; ++m) {
          // Base: what exists before this mode's layer and shards (the global
          // input, the copies of modes traced before).
          int64_t base = 0;
          lockstep.sync();
          if (leader) base = allocated_bytes();
          lockstep.sync();
          on_link.push_back(make_copy(size, *modes[m], simulate_link(world, link), x, w));
          lockstep.sync();
          if (leader) {
            reset_peak_memory(Device::cpu());
            trace_start();
          }
          lockstep.sync();
          train_step(*on_link[m].layer, on_link[m].x, on_link[m].w);
          lockstep.sync();
          if (leader) {
            runs[m].process_peak_bytes = static_cast<double>(peak_allocated_bytes() - base);
            trace_stop();
            read_link_traffic(runs[m]);
          }
          lockstep.sync();
        }
        for (size_t m = 0; m < n; ++m)
          on_ideal.push_back(make_copy(size, *modes[m], simulate_link(world, ideal), x, w));
        // Returns the step's wall time (to the slowest rank) and, on the
        // leader, sets `mean_slept` to the ranks' mean sleeping time.
        auto timed = [&](const LayerCopy& c, double& mean_slept) {
          lockstep.sync();
          Clock::time_point start = Clock::now();
          std::optional<SchedTimes> before = thread_sched_times();
          train_step(*c.layer, c.x, c.w);
          std::optional<SchedTimes> after = thread_sched_times();
          const double wall = seconds_since(start);
          slept[rank] = before && after ? wall - (after->on_cpu_s - before->on_cpu_s) -
                                              (after->runnable_s - before->runnable_s)
                                        : std::nan("");
          lockstep.sync();
          if (leader) {
            mean_slept = 0;
            for (double s : slept)
              mean_slept += s / kRanks;
          }
          return seconds_since(start);
        };
        // No warm-up: the traced steps filled the allocator's cache with the
        // sizes every copy uses.
        for (int i = 0; i < pairs; ++i) {
          for (size_t m = 0; m < n; ++m) {
            double step, compute, slept_step = 0, slept_compute = 0;
            if (i % 2 == 0) {
              step = timed(on_link[m], slept_step);
              compute = timed(on_ideal[m], slept_compute);
            } else {
              compute = timed(on_ideal[m], slept_compute);
              step = timed(on_link[m], slept_step);
            }
            if (leader) {
              runs[m].step_s.push_back(step);
              runs[m].compute_s.push_back(compute);
              runs[m].slept_step_s.push_back(slept_step);
              runs[m].slept_compute_s.push_back(slept_compute);
            }
          }
        }
      });
    });
  } catch (const std::exception& e) {
    for (ModeRun& run : runs)
      run.error = e.what();
    if (trace_enabled()) trace_stop();
  }
  empty_cache(Device::cpu());
  return runs;
}

// ---- the report ----

struct Measured {
  const Mode* mode;
  ModeRun run;
};

const Measured* find_measured(const std::vector<Measured>& all, const std::string& name) {
  for (const Measured& m : all) {
    if (name == m.mode->name) return &m;
  }
  return nullptr;
}

void report_modes(Report& report, const std::vector<Measured>& all, const SingleRun& single) {
  constexpr const char* kFormat =
      "{:<19} {:>2} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>9} {:>9} {:>7} {:>7} {:>11}  {}\n";
  std::string text = fmt::format(
      "\nper mode ({} ranks; per rank per step: link = what the link charged, moved = its "
      "bytes, peak = process peak / {}; exp wall = step - compute; exp slept = extra time the "
      "rank threads slept; hidden = 1 - exp slept / link; /single = peak vs the single-rank "
      "layer's {:.1f} MiB; act = the same without the {:.1f} MiB of weights and gradients "
      "every rank holds)\n",
      kRanks, kRanks, single.peak_bytes / kMiB, single.weight_bytes / kMiB);
  text +=
      fmt::format(kFormat, "mode", "ds", "step ms", "compute", "exp wall", "exp slept", "link ms",
                  "hidden", "moved MiB", "peak MiB", "/single", "act", "target", "result");
  Json rows = Json::array();
  for (const Measured& m : all) {
    const ModeRun& r = m.run;
    if (!r.error.empty()) {
      text += fmt::format("{:<19} {:>2}  ERROR: {}\n", m.mode->name, m.mode->ds, r.error);
      rows.push_back({{"mode", m.mode->name}, {"status", "error"}, {"error", r.error}});
      continue;
    }
    const double ratio = r.peak_per_rank() / single.peak_bytes;
    const double act = activation_ratio(r.peak_per_rank(), single);
    const bool pass = ratio <= kPeakTarget && act <= kActivationTarget;
    const double hidden = r.max_link() > 0 ? 1.0 - r.exposed_best() / r.max_link() : 0.0;
    auto ms = [](double s) {
      return std::isnan(s) ? std::string("n/a") : fmt::format("{:.1f}", s * 1e3);
    };
    text += fmt::format(
        kFormat, m.mode->name, m.mode->ds, ms(r.step()), ms(r.compute()), ms(r.exposed()),
        ms(r.exposed_slept()), ms(r.max_link()), fmt::format("{:.0f}%", 100 * hidden),
        fmt::format("{:.2f}", r.max_moved() / kMiB),
        fmt::format("{:.1f}", r.peak_per_rank() / kMiB), fmt::format("{:.3f}", ratio),
        fmt::format("{:.3f}", act),
        m.mode->peak_target ? fmt::format("<={:.2f}/{:.2f}", kPeakTarget, kActivationTarget) : "-",
        m.mode->peak_target ? (pass ? "PASS" : "FAIL") : "");
    Json j = {{"mode", m.mode->name},
              {"ulysses_degree", m.mode->ds},
              {"ring", m.mode->ring},
              {"load_balance", m.mode->load_balance},
              {"async", m.mode->async},
              {"step_ms", r.step() * 1e3},
              {"compute_ms", r.compute() * 1e3},
              {"exposed_comm_ms", r.exposed() * 1e3},
              {"exposed_comm_slept_ms",
               std::isnan(r.exposed_slept()) ? Json(nullptr) : Json(r.exposed_slept() * 1e3)},
              {"link_ms_per_rank", r.max_link() * 1e3},
              {"hidden_fraction", hidden},
              {"moved_bytes_per_rank", r.max_moved()},
              {"moved_bytes_by_rank", r.moved_bytes},
              {"peak_bytes_per_rank", r.peak_per_rank()},
              {"process_peak_bytes", r.process_peak_bytes},
              {"peak_ratio_vs_single", ratio},
              {"activation_ratio_vs_single", act},
              {"step_ms_trials", Json::array()},
              {"compute_ms_trials", Json::array()}};
    for (double s : r.step_s)
      j["step_ms_trials"].push_back(s * 1e3);
    for (double s : r.compute_s)
      j["compute_ms_trials"].push_back(s * 1e3);
    j["slept_ms_trials"] = Json::array();
    j["slept_compute_ms_trials"] = Json::array();
    for (size_t i = 0; i < r.slept_step_s.size() && !std::isnan(r.slept_step_s[i]); ++i) {
      j["slept_ms_trials"].push_back(r.slept_step_s[i] * 1e3);
      j["slept_compute_ms_trials"].push_back(r.slept_compute_s[i] * 1e3);
    }
    if (m.mode->peak_target) {
      j["peak_target_max"] = kPeakTarget;
      j["activation_target_max"] = kActivationTarget;
      j["peak_status"] = pass ? "pass" : "fail";
    }
    rows.push_back(std::move(j));
  }
  text.pop_back();
  report.set("modes", std::move(rows), text);
}

void add_rows(Report& report, const std::vector<Measured>& all) {
  for (const Measured& m : all) {
    Row row;
    row.group = "cp-step";
    row.name = m.mode->name;
    row.device = "cpu";
    row.threads = kRanks;
    row.baseline = "same mode, ideal link";
    row.target = 0;  // informational: ratio = compute-only / step
    row.error = m.run.error;
    if (row.error.empty()) {
      std::vector<double> ratios;
      for (size_t i = 0; i < m.run.step_s.size(); ++i)
        ratios.push_back(m.run.compute_s[i] / m.run.step_s[i]);
      row.timing = {timing_of_steps(m.run.step_s), timing_of_steps(m.run.compute_s),
                    sample_median(ratios)};
    }
    report.add(std::move(row));
  }
  for (const Measured& m : all) {
    if (!m.mode->async) continue;
    const Measured* sync = find_measured(all, m.mode->sync_of);
    if (sync == nullptr) continue;  // selected_modes() always adds it
    Row row;
    row.group = "cp-async";
    row.name = fmt::format("{} exposed", m.mode->sync_of);
    row.device = "cpu";
    row.threads = kRanks;
    row.baseline = fmt::format("{} (sync)", m.mode->sync_of);
    row.target = 1.0 / kAsyncTarget;  // exposed sync / exposed async >= 2.5
    if (!m.run.error.empty() || !sync->run.error.empty()) {
      row.error = !m.run.error.empty() ? m.run.error : sync->run.error;
    } else {
      const double async_s = m.run.exposed_best(), sync_s = sync->run.exposed_best();
      row.timing.tandem = timing_of_steps({async_s});
      row.timing.baseline = timing_of_steps({sync_s});
      // Sync exposure within noise (<= 0): nothing measurable to hide, the
      // row fails. An async side hidden within noise caps the ratio at 100.
      row.timing.ratio = sync_s <= 0 ? 0.0 : sync_s / std::max(async_s, sync_s / 100);
    }
    report.add(std::move(row));
  }
}

}  // namespace

int run_cp(const Options& options) {
  TimingConfig config = timing_config(options);
  Report report("cp", options, config);
  ops::set_num_threads(1);  // one BLAS thread per rank thread
  const int pairs = options.quick ? 3 : 7;
  std::vector<const Mode*> modes = selected_modes(options.filter);
  // Not the interleaved timer of Note [Benchmark timing]: whole steps in
  // adjacent pairs (Note [CP benchmark method]).
  report.set("timing",
             {{"statistic",
               "median over steps; exposed: median over adjacent pairs of the "
               "difference"},
              {"pairs", pairs},
              {"order", "(link, ideal) pairs, alternating which goes first"}},
             fmt::format("cp timing: {} adjacent (simulated link, ideal link) step pairs per mode "
                         "(the trial settings above do not apply); cp-step ratio = compute-only / "
                         "step, cp-async ratio = sync exposed / async exposed",
                         pairs));
  if (options.quick) {
    report.note(
        "--quick is a smoke run: a collective takes ~1 ms against a step of ~100 ms, so "
        "exposed communication is within the noise");
  }

  Size size{options.quick ? kQuickSeq : kIssueSeq, options.quick ? kQuickDim : kIssueDim,
            kIssueHeads};
  if (options.dim > 0) size.dim = options.dim;
  if (options.heads > 0) size.heads = options.heads;
  TANDEM_CHECK(size.dim % size.heads == 0 && size.heads % kRanks == 0,
               "[bench::cp] expected heads dividing d and divisible by {} ranks, got d={} heads={}",
               kRanks, size.dim, size.heads);
  Json seq_json;
  if (options.seq > 0) {
    size.seq = options.seq;
    seq_json = {{"source", "--seq"}};
    report.note(fmt::format("S={} (from --seq)", size.seq));
  } else if (options.quick) {
    seq_json = {{"source", "--quick"}};
    report.note(fmt::format("S={} d={} (--quick smoke run; the issue's layer is S={} d={})",
                            size.seq, size.dim, kIssueSeq, kIssueDim));
  } else {
    const int steps = 2 + static_cast<int>(modes.size()) * (1 + 2 * pairs);
    SeqChoice choice = choose_seq(size, steps);
    size.seq = choice.seq;
    seq_json = {{"source", "largest S within budget"}, {"selection", choice.json}};
    report.note(fmt::format(
        "choosing S: the issue asks for S={}; dense attention holds (B, H, S, S) f32 scores "
        "({:.0f} MiB each at S={}), so S is the largest that fits, projected from single-rank "
        "probes at S=256/512/1024:",
        kIssueSeq, static_cast<double>(kBatch * size.heads * kIssueSeq * kIssueSeq * 4) / kMiB,
        kIssueSeq));
    for (const std::string& line : choice.lines)
      report.note(line);
    report.note(fmt::format("using S={}{}", size.seq,
                            size.seq == kIssueSeq ? "" : " (the issue's S=8192 does not fit)"));
  }
  TANDEM_CHECK(size.seq >= 2 * kRanks, "[bench::cp] expected S >= {}, got {}", 2 * kRanks,
               size.seq);

  LinkChoice link = calibrate_link(size);
  report.set("setup",
             {{"ranks", kRanks},
              {"backend", "threads, wrapped by simulate_link"},
              {"batch", kBatch},
              {"seq", size.seq},
              {"dim", size.dim},
              {"heads", size.heads},
              {"head_dim", size.dim / size.heads},
              {"dtype", "f32"},
              {"causal", true},
              {"step", "forward + backward of SelfAttention (q/k/v/o projections + core)"},
              {"seq_choice", seq_json},
              {"pairs", pairs},
              {"memory_method",
               "per rank = (process peak allocated - allocated before) / ranks: the rank threads "
               "share one allocator (Note [CP benchmark method])"}},
             fmt::format("layer: B={} {} head_dim={} f32 causal, forward+backward of "
                         "SelfAttention on {} rank threads; {} (link, ideal) step pairs per mode",
                         kBatch, size.str(), size.dim / size.heads, kRanks, pairs));
  report.set("link",
             {{"latency_us", link.model.latency_us},
              {"bandwidth_gbps", link.model.bandwidth_gbps},
              {"q_projection_gemm_ms", link.gemm_s * 1e3},
              {"q_all_to_all_bytes_per_rank", link.a2a_bytes}},
             fmt::format("link: {:.1f} us + bytes / {:.3f} GB/s per direction, so one q all-to-all "
                         "({:.2f} MiB per rank) takes {:.1f} ms = one q-projection GEMM "
                         "({}x{} @ {}x{}, {} rank threads at once)",
                         link.model.latency_us, link.model.bandwidth_gbps, link.a2a_bytes / kMiB,
                         link.gemm_s * 1e3, kBatch * ((size.seq + kRanks - 1) / kRanks), size.dim,
                         size.dim, size.dim, kRanks));

  Generator gen(7);
  Tensor x = ops::randn({kBatch, size.seq, size.dim}, gen);
  Tensor w = ops::randn({kBatch, size.seq, size.dim}, gen);
  SingleRun single = run_single(size, x, w, 1);
  report.set("single_rank",
             {{"peak_bytes", single.peak_bytes},
              {"weight_bytes", single.weight_bytes},
              {"step_ms", sample_median(single.step_s) * 1e3}},
             fmt::format("single-rank layer (no CP, 1 thread): step {:.1f} ms, peak {:.1f} MiB",
                         sample_median(single.step_s) * 1e3, single.peak_bytes / kMiB));

  std::vector<Measured> measured;
  for (const std::vector<const Mode*>& group : mode_groups(modes, true)) {
    std::vector<ModeRun> runs = run_group(size, group, link.model, x, w, pairs);
    for (size_t i = 0; i < group.size(); ++i)
      measured.push_back({group[i], std::move(runs[i])});
  }
  add_rows(report, measured);
  report_modes(report, measured, single);
  run_plain_threads(report, size, modes, x, w, pairs);
  return report.finish();
}

}  // namespace tandem::bench
