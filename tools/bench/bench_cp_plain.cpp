// `tandem-bench cp` on the plain backends, without a simulated link: the
// threads backend (part of the default run) and MPI (`--backend mpi`, under
// `mpirun -n 4`).
//
// Note [CP on the plain backends]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The simulated link (Note [CP benchmark method]) shows how much of a link's
// time an async mode could hide. These rows ask whether the CPU backends
// themselves overlap a collective with compute (Note [Progress without a
// waiter]): the same layer on the threads backend (rank threads copying
// through shared memory) and on MPI (one process per rank).
//
// Exposed communication is the time a rank spends in waits for collectives
// (comm_wait_ns()), per rank per step. A threads-backend waiter that copies
// counts its copies: it does them instead of computing. A sync mode and its
// async variant run on the same ranks, their steps alternating, and the
// row's ratio is the sync mode's median exposure over the async one's,
// target >= 2 (issue 17: async <= 0.5x sync). The step times are printed for
// information: on a machine with fewer cores than ranks the copies a
// background thread takes over still compete with the ranks' compute, so the
// step does not shrink by what the waits lose.
//
// Reading the counter. On the threads backend it is process-wide: one rank
// reads it between barriers that are not comm waits (Lockstep), and the
// per-rank figure is the step's delta / 4. Under MPI each process reads its
// own around the step, and the means over ranks are all-reduced at the end.
//
// Peak memory. Under MPI each process has its own allocator, so the per-rank
// peak is exact (the rank threads of the link run share one: Note [CP
// benchmark method]); the figure reported is the largest over the ranks, each
// against the single-rank layer measured in the same process.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "tandem/comm/mpi/mpi_backend.h"
#include "tandem/comm/threads/threads_backend.h"
#include "tandem/comm/work.h"
#include "tandem/runtime/allocator.h"
#include "tandem/runtime/error.h"
#include "tandem/tensor/ops.h"
#include "tools/bench/bench_cp.h"

namespace tandem::bench::cp {
namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::ordered_json;

constexpr double kPlainTarget = 2.0;  // sync exposed / async exposed (issue 17: <= 0.5x)

// The ranks of one run and how they meet.
struct Ranks {
  ProcessGroupPtr world;
  std::function<void()> sync;   // every rank; not a comm wait where the counter is shared
  bool shared_counter = false;  // threads: one comm_wait_ns() for every rank
};

struct PlainRun {
  const Mode* mode = nullptr;
  std::vector<double> wait_s;  // per timed step: mean comm wait per rank
  std::vector<double> step_s;  // per timed step: wall time (the slowest rank's under MPI)
  double peak_bytes = 0;       // MPI: the largest per-rank peak of one step
  std::string error;
};

// One step of `c`. Returns (this rank's share of the comm wait, wall time);
// with a shared counter only the leader's pair is meaningful.
std::pair<double, double> timed_step(const Ranks& ranks, const LayerCopy& c) {
  ranks.sync();
  const int64_t before = comm_wait_ns();
  if (ranks.shared_counter) ranks.sync();  // nobody starts before the leader has read
  const Clock::time_point start = Clock::now();
  train_step(*c.layer, c.x, c.w);
  if (ranks.shared_counter) ranks.sync();  // everybody's waits are in
  const int64_t after = comm_wait_ns();
  const double wall = std::chrono::duration<double>(Clock::now() - start).count();
  const double per_rank = ranks.shared_counter ? kRanks : 1;
  return {static_cast<double>(after - before) * 1e-9 / per_rank, wall};
}

// Runs `modes` on every rank: one step each (peak memory when asked), then
// `pairs` rounds in which each mode runs a timed step, the order reversed
// every other round. Fills `runs` (one per mode) with this rank's figures.
void run_modes(const Ranks& ranks, const Size& size, const std::vector<const Mode*>& modes,
               const Tensor& x, const Tensor& w, int pairs, bool measure_peak,
               std::vector<PlainRun>& runs) {
  std::vector<LayerCopy> copies;
  for (size_t m = 0; m < modes.size(); ++m) {
    ranks.sync();
    const int64_t base = allocated_bytes();
    copies.push_back(make_copy(size, *modes[m], ranks.world, x, w));
    if (measure_peak) reset_peak_memory(Device::cpu());
    train_step(*copies[m].layer, copies[m].x, copies[m].w);
    if (measure_peak) runs[m].peak_bytes = static_cast<double>(peak_allocated_bytes() - base);
  }
  for (int i = 0; i < pairs; ++i) {
    for (size_t k = 0; k < modes.size(); ++k) {
      const size_t m = i % 2 == 0 ? k : modes.size() - 1 - k;
      const auto [wait, wall] = timed_step(ranks, copies[m]);
      runs[m].wait_s.push_back(wait);
      runs[m].step_s.push_back(wall);
    }
  }
}

const PlainRun* find_run(const std::vector<PlainRun>& runs, const std::string& name) {
  for (const PlainRun& r : runs) {
    if (name == r.mode->name) return &r;
  }
  return nullptr;
}

// The exposure rows and a table of every mode's figures.
void report_plain(Report& report, const std::string& backend, const std::vector<PlainRun>& runs,
                  const SingleRun* single) {
  std::string text = fmt::format(
      "\n{} backend, no link model ({} ranks; per rank per step: wait = time in waits for "
      "collectives; medians over {} steps{})\n",
      backend, kRanks, runs.empty() ? 0 : runs[0].wait_s.size(),
      single != nullptr ? "; peak = the largest rank's, /single and act as above" : "");
  constexpr const char* kFormat = "{:<22} {:>9} {:>9} {:>9} {:>8} {:>8} {:>11}  {}\n";
  text += fmt::format(kFormat, "mode", "step ms", "wait ms", "peak MiB", "/single", "act", "target",
                      "result");
  Json rows = Json::array();
  for (const PlainRun& r : runs) {
    if (!r.error.empty()) {
      text += fmt::format("{:<22} ERROR: {}\n", r.mode->name, r.error);
      rows.push_back({{"mode", r.mode->name}, {"status", "error"}, {"error", r.error}});
      continue;
    }
    const double wait = sample_median(r.wait_s), step = sample_median(r.step_s);
    Json j = {{"mode", r.mode->name}, {"step_ms", step * 1e3}, {"comm_wait_ms", wait * 1e3}};
    std::string peak = "-", ratio = "-", act = "-", target = "-", result;
    if (single != nullptr) {
      const double rp = r.peak_bytes / single->peak_bytes;
      const double ra = activation_ratio(r.peak_bytes, *single);
      peak = fmt::format("{:.1f}", r.peak_bytes / kMiB);
      ratio = fmt::format("{:.3f}", rp);
      act = fmt::format("{:.3f}", ra);
      j["peak_bytes_per_rank"] = r.peak_bytes;
      j["peak_ratio_vs_single"] = rp;
      j["activation_ratio_vs_single"] = ra;
      if (r.mode->peak_target) {
        const bool pass = rp <= kPeakTarget && ra <= kActivationTarget;
        target = fmt::format("<={:.2f}/{:.2f}", kPeakTarget, kActivationTarget);
        result = pass ? "PASS" : "FAIL";
        j["peak_status"] = pass ? "pass" : "fail";
      }
    }
    text += fmt::format(kFormat, r.mode->name, fmt::format("{:.1f}", step * 1e3),
                        fmt::format("{:.2f}", wait * 1e3), peak, ratio, act, target, result);
    rows.push_back(std::move(j));
  }
  text.pop_back();
  report.set(fmt::format("plain_{}", backend), std::move(rows), text);

  for (const PlainRun& r : runs) {
    if (!r.mode->async) continue;
    const PlainRun* sync = find_run(runs, r.mode->sync_of);
    if (sync == nullptr) continue;
    Row row;
    row.group = fmt::format("cp-{}", backend);
    row.name = fmt::format("{} exposed", r.mode->sync_of);
    row.device = "cpu";
    row.threads = kRanks;
    row.baseline = fmt::format("{} (sync), comm wait", r.mode->sync_of);
    row.target = kPlainTarget;
    if (!r.error.empty() || !sync->error.empty()) {
      row.error = !r.error.empty() ? r.error : sync->error;
    } else {
      const double async_s = sample_median(r.wait_s), sync_s = sample_median(sync->wait_s);
      row.timing.tandem = timing_of_steps({async_s});
      row.timing.baseline = timing_of_steps({sync_s});
      // As the link rows: nothing to hide fails, a fully hidden side caps at 100.
      row.timing.ratio = sync_s <= 0 ? 0.0 : sync_s / std::max(async_s, sync_s / 100);
    }
    report.add(std::move(row));
  }
}

}  // namespace

void run_plain_threads(Report& report, const Size& size, const std::vector<const Mode*>& modes,
                       const Tensor& x, const Tensor& w, int pairs) {
  std::vector<PlainRun> all;
  for (const std::vector<const Mode*>& group : mode_groups(modes, false)) {
    std::vector<PlainRun> runs(group.size());
    std::vector<PlainRun> leader_runs;
    for (size_t i = 0; i < group.size(); ++i)
      runs[i].mode = group[i];
    Lockstep lockstep(kRanks);
    try {
      run_ranks(kRanks, [&](ProcessGroupPtr world) {
        lockstep.guard([&] {
          std::vector<PlainRun> mine(group.size());
          Ranks ranks{world, [&] { lockstep.sync(); }, true};
          run_modes(ranks, size, group, x, w, pairs, false, mine);
          if (world->rank() == 0) {
            for (size_t i = 0; i < group.size(); ++i) {
              runs[i].wait_s = mine[i].wait_s;
              runs[i].step_s = mine[i].step_s;
            }
          }
        });
      });
    } catch (const std::exception& e) {
      for (PlainRun& r : runs)
        r.error = e.what();
    }
    empty_cache(Device::cpu());
    all.insert(all.end(), runs.begin(), runs.end());
  }
  if (!all.empty()) report_plain(report, "threads", all, nullptr);
}

}  // namespace tandem::bench::cp

namespace tandem::bench {

int run_cp_mpi(const Options& options) {
  using namespace cp;
  TANDEM_CHECK(mpi_built(), "[bench::cp] --backend mpi needs a build with MPI");
  ProcessGroupPtr world = mpi_world();
  TANDEM_CHECK(world->size() == kRanks,
               "[bench::cp] --backend mpi expected {} processes (mpirun -n {}), got {}", kRanks,
               kRanks, world->size());
  ops::set_num_threads(1);  // one BLAS thread per rank, as the rank threads have
  const bool leader = world->rank() == 0;
  const int pairs = options.quick ? 3 : 7;
  Size size{options.quick ? 512 : 1024, options.quick ? 256 : 1024, 16};
  if (options.seq > 0) size.seq = options.seq;
  if (options.dim > 0) size.dim = options.dim;
  if (options.heads > 0) size.heads = options.heads;
  TANDEM_CHECK(size.dim % size.heads == 0 && size.heads % kRanks == 0 && size.seq >= 2 * kRanks,
               "[bench::cp] expected heads dividing d and divisible by {}, S >= {}; got {}", kRanks,
               2 * kRanks, size.str());
  const std::vector<const Mode*> modes = selected_modes(options.filter);

  Generator gen(7);  // the same global input in every process
  Tensor x = ops::randn({kBatch, size.seq, size.dim}, gen);
  Tensor w = ops::randn({kBatch, size.seq, size.dim}, gen);
  SingleRun single = run_single(size, x, w, 1);
  Ranks ranks{world, [&] { world->barrier()->wait(); }, false};
  AllReduceOptions max;
  max.op = RedOp::Max;
  std::vector<PlainRun> all;
  for (const std::vector<const Mode*>& group : mode_groups(modes, true)) {
    std::vector<PlainRun> runs(group.size());
    for (size_t i = 0; i < group.size(); ++i)
      runs[i].mode = group[i];
    run_modes(ranks, size, group, x, w, pairs, true, runs);
    // Means of the waits, the slowest rank's wall time, the largest peak.
    for (PlainRun& r : runs) {
      auto reduce = [&](const std::vector<double>& v, const AllReduceOptions& o) {
        WorkPtr work =
            world->all_reduce(ops::from_vector(v, Shape{static_cast<int64_t>(v.size())}), o);
        work->wait();
        return work->result().to_vector<double>();
      };
      const std::vector<double> wait_sums = reduce(r.wait_s, {});
      r.step_s = reduce(r.step_s, max);
      r.peak_bytes = reduce({r.peak_bytes}, max)[0];
      for (size_t i = 0; i < r.wait_s.size(); ++i)
        r.wait_s[i] = wait_sums[i] / kRanks;
    }
    empty_cache(Device::cpu());
    all.insert(all.end(), runs.begin(), runs.end());
  }
  int status = 0;
  if (leader) {
    Report report("cp", options, timing_config(options));
    report.set("setup",
               {{"ranks", kRanks},
                {"backend", "mpi, one process per rank"},
                {"batch", kBatch},
                {"seq", size.seq},
                {"dim", size.dim},
                {"heads", size.heads},
                {"dtype", "f32"},
                {"causal", true},
                {"pairs", pairs}},
               fmt::format("layer: B={} {} f32 causal, forward+backward of SelfAttention on {} MPI "
                           "processes; {} steps per mode, modes of a group alternating",
                           kBatch, size.str(), kRanks, pairs));
    report.set("single_rank",
               {{"peak_bytes", single.peak_bytes},
                {"weight_bytes", single.weight_bytes},
                {"step_ms", sample_median(single.step_s) * 1e3}},
               fmt::format("single-rank layer (rank 0's process): peak {:.1f} MiB, of which "
                           "{:.1f} MiB weights and gradients",
                           single.peak_bytes / kMiB, single.weight_bytes / kMiB));
    report_plain(report, "mpi", all, &single);
    status = report.finish();
  }
  world.reset();
  mpi_finalize();
  return status;
}

}  // namespace tandem::bench
