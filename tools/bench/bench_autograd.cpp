// `tandem-bench autograd`: what recording and replaying the tape costs, against
// baselines measured in the same run (Note [Benchmark timing]).
//
//   overhead   forward+backward of a chain of 1,000 tiny elementwise ops on a
//              4-element tensor: against the same chain through the raw,
//              non-differentiable tandem::ops (forward only, same process), and
//              against each baseline program
//   block      forward+backward step of one pre-norm transformer block (causal
//              attention, SwiGLU MLP) at 1 and 2 threads against each
//              baseline's best thread setting, tandem's 2-thread step against
//              its 1-thread step, and the step's peak memory
//   llama-block  forward+backward of one Llama decoder layer (RMSNorm, GQA
//              with RoPE, SwiGLU) at 1 and 2 threads against PyTorch's best
//              (bench_autograd_llama.cpp, Note [Llama block benchmark])
//
// The baselines, LibTorch 1.13 and PyTorch 2.x (Note [Autograd baselines]),
// run in processes of their own so that their OpenMP threads never share the
// process with tandem's. Tandem and the baselines take turns over several
// rounds (Note [LibTorch rounds]). All sides start from bit-identical weights
// (Note [Autograd benchmark workload]), and their losses and gradients are
// compared before any ratio is reported (Note [Autograd baselines] in
// bench_autograd_baselines.cpp says how they are found and run).
//
// --device cuda (default cpu) is the GPU mode (bench_autograd_cuda.cpp, Note
// [Autograd on a GPU]): the block step only, tandem on cuda:0 against PyTorch
// on its GPU, one row; the overhead rows stay CPU-only. It has not yet run on
// a real GPU, only on the emulated device (TANDEM_CUDA=emulated).
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <exception>
#include <filesystem>
#include <functional>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tandem/autograd/ops.h"
#include "tandem/runtime/allocator.h"
#include "tandem/runtime/device.h"
#include "tandem/runtime/stream.h"
#include "tools/bench/bench.h"
#include "tools/bench/bench_autograd_baselines.h"
#include "tools/bench/bench_autograd_workload.h"

namespace tandem::bench {
namespace {

using namespace autograd_workload;
using namespace autograd_baselines;
using Json = nlohmann::ordered_json;

// Targets, as baseline/tandem ratios (Row::target): per-op overhead at most
// 0.25x a baseline's; a block step at most 0.8x a baseline's best thread
// setting (kBlockTargetMax, bench_autograd_workload.h; also the GPU mode's).
constexpr double kOverheadTargetMax = 0.25;
// Tandem's 2-thread block step at most this fraction of its 1-thread step.
constexpr double kScalingTargetMax = 0.6;

// Note [LibTorch rounds]
// ~~~~~~~~~~~~~~~~~~~~~~
// A baseline cannot share tandem's process, so the pairing of Note [Benchmark
// timing] happens one level up: a round measures tandem (chain; block at 1 and
// 2 threads) and runs each baseline program twice (OpenMP wait policy left
// unset, and OMP_WAIT_POLICY=passive, which on 2 shared cores can decide
// whether its 2-thread step beats its 1-thread step), in an order that
// alternates between rounds. Each side reports
// per-call medians of the same trial protocol; a row's ratio is the median
// over rounds of the baseline's time / tandem's time in that round, against
// the baseline setting with the lowest median over rounds.
struct CompareConfig {
  int rounds = 5;
  int chain_trials = 11;
  int block_trials = 7;
  double min_trial_s = 0.02;
};

CompareConfig compare_config(const Options& options) {
  CompareConfig c;
  if (options.quick) {
    c.rounds = 2;
    c.chain_trials = 5;
    c.block_trials = 3;
    c.min_trial_s = 0.01;
  }
  return c;
}

const int kThreadSettings[] = {1, 2};

struct TandemRound {
  StepTimes chain;
  std::map<int, StepTimes> block;  // by threads
};

// Seconds of one baseline measurement in one round, e.g. ("chain", 0) or
// ("block", 2); `field` is "median_ms" (wall) or "cpu_median_ms".
double baseline_seconds(const Json& run, const std::string& what, int threads,
                        const char* field = "median_ms") {
  if (what == "chain") return run.at("chain").at(field).get<double>() * 1e-3;
  for (const auto& b : run.at("block").at("threads")) {
    if (b.at("threads").get<int>() == threads) return b.at(field).get<double>() * 1e-3;
  }
  TANDEM_FAIL("[bench::autograd] expected baseline block times at {} threads, got none", threads);
}

// A baseline setting (wait policy, threads) with its per-round times.
struct BaselineSetting {
  std::string label;
  std::vector<double> per_round;
};

// The setting with the lowest median over rounds.
const BaselineSetting& best_setting(const std::vector<BaselineSetting>& settings) {
  return *std::min_element(settings.begin(), settings.end(), [](const auto& a, const auto& b) {
    return median_of(a.per_round) < median_of(b.per_round);
  });
}

PairTiming pair_over_rounds(const std::vector<double>& tandem, int tandem_reps,
                            const BaselineSetting& baseline) {
  std::vector<double> ratios;
  for (size_t r = 0; r < tandem.size() && r < baseline.per_round.size(); ++r)
    ratios.push_back(baseline.per_round[r] / tandem[r]);
  return {timing_over_rounds(tandem, tandem_reps), timing_over_rounds(baseline.per_round, 1),
          median_of(ratios)};
}

// ---- the rows ----

Row overhead_row(const std::string& baseline, double target) {
  Row row;
  row.group = "overhead";
  row.name = fmt::format("chain {} ops", kChainOps);
  row.device = "cpu";
  row.threads = 1;
  row.baseline = baseline;
  row.target = target;
  return row;
}

Row block_row(int threads, const std::string& baseline) {
  Row row;
  row.group = "block";
  row.name = fmt::format("B{} S{} d{} h{}", kBatch, kSeq, kModel, kHeads);
  row.device = "cpu";
  row.threads = threads;
  row.baseline = baseline;
  row.target = 1.0 / kBlockTargetMax;
  return row;
}

// Autograd chain (forward+backward) against the raw ops chain (forward only),
// interleaved in this process. Informational: target 0.
void bench_overhead_vs_ops(Report& report, const TimingConfig& config, Json& tandem_json) {
  Row row = overhead_row("tandem::ops, forward only", 0.0);
  if (!report.wants(row)) return;
  try {
    ops::set_num_threads(1);
    ChainWorkload chain;
    double f = 0, b = 0;
    Kernel differentiable = [&](int reps) {
      for (int i = 0; i < reps; ++i)
        chain.step(f, b);
    };
    Tensor out;
    Kernel raw = [&](int reps) {
      for (int i = 0; i < reps; ++i)
        out = chain.raw_forward();
      synchronize_cpu();
    };
    row.timing = time_interleaved(differentiable, raw, config);
    double per_op = 1e9 / kChainOps;
    tandem_json["raw_ops_forward_ns_per_op"] = row.timing.baseline.median_s * per_op;
    tandem_json["autograd_over_raw_forward"] = 1.0 / row.timing.ratio;
  } catch (const std::exception& e) {
    row.error = e.what();
  }
  report.add(std::move(row));
}

// Peak memory of one block step per thread setting (after a warm-up step).
Json measure_block_memory(BlockWorkload& block, std::string& text) {
  constexpr double kMiB = 1024.0 * 1024.0;
  Json memory = Json::object();
  for (int threads : kThreadSettings) {
    ops::set_num_threads(threads);
    double f = 0, b = 0;
    block.step(f, b);
    MemoryStats before = memory_stats(Device::cpu());
    reset_peak_memory(Device::cpu());
    block.step(f, b);
    MemoryStats after = memory_stats(Device::cpu());
    double peak = static_cast<double>(after.peak_allocated_bytes);
    double held = static_cast<double>(before.allocated_bytes);
    memory[std::to_string(threads)] = {
        {"peak_allocated_mib", peak / kMiB},
        {"allocated_before_mib", held / kMiB},
        {"step_peak_above_before_mib", (peak - held) / kMiB},
        {"peak_reserved_mib", after.peak_reserved_bytes / kMiB},
        {"system_allocs_in_step", after.num_system_allocs - before.num_system_allocs},
    };
    text += fmt::format(
        "{}block step peak memory, {} thread{}: {:.1f} MiB allocated at peak ({:.1f} MiB above "
        "the {:.1f} MiB held before the step: weights, input, the chain), {:.1f} MiB reserved; "
        "{} system allocations in the step",
        text.empty() ? "" : "\n", threads, threads == 1 ? "" : "s", peak / kMiB,
        (peak - held) / kMiB, held / kMiB, after.peak_reserved_bytes / kMiB,
        after.num_system_allocs - before.num_system_allocs);
  }
  return memory;
}

// ---- the baselines ----

// `policy`: the wait policy's env words (kPolicyEnv).
Json run_baseline(const Baseline& b, const std::string& policy, const CompareConfig& config) {
  std::string command = fmt::format(
      "env {} {} {} --chain-trials {} --block-trials {} --min-trial-ms {}", policy, b.env,
      b.command, config.chain_trials, config.block_trials, config.min_trial_s * 1e3);
  std::string out = run_command(command);
  Json j = Json::parse(out, nullptr, false);
  TANDEM_CHECK(!j.is_discarded() && j.is_object(),
               "[bench::autograd] expected one JSON object from {}, got: {}", b.name,
               out.substr(0, 200));
  return j;
}

// ---- the rounds against the baselines ----

constexpr const char* kPolicies[] = {"unset", "passive"};  // OMP_WAIT_POLICY
constexpr const char* kPolicyEnv[] = {"-u OMP_WAIT_POLICY", "OMP_WAIT_POLICY=passive"};

struct BaselineRuns {
  Baseline baseline;
  std::vector<std::vector<Json>> rounds;  // [round][policy]
  std::string error;                      // the first failed run
};

struct Rounds {
  std::vector<TandemRound> tandem;
  std::vector<BaselineRuns> baselines;
};

// Note [LibTorch rounds]. Without baselines, tandem only.
Rounds run_rounds(const std::vector<Baseline>& baselines, bool want_chain, bool want_block,
                  const CompareConfig& config, ChainWorkload& chain, BlockWorkload& block) {
  Rounds rounds;
  for (const Baseline& b : baselines)
    rounds.baselines.push_back({b, {}, {}});
  auto run_tandem = [&] {
    TandemRound r;
    ops::set_num_threads(1);
    if (want_chain) {
      r.chain = measure([&](double& f, double& b) { chain.step(f, b); }, config.chain_trials,
                        config.min_trial_s);
    }
    for (int threads : kThreadSettings) {
      if (!want_block) break;
      ops::set_num_threads(threads);
      r.block[threads] = measure([&](double& f, double& b) { block.step(f, b); },
                                 config.block_trials, config.min_trial_s);
    }
    // Let the kernel pool's second thread go idle before a baseline starts.
    ops::set_num_threads(1);
    rounds.tandem.push_back(std::move(r));
  };
  auto run_baselines = [&](bool reversed) {
    for (BaselineRuns& runs : rounds.baselines) {
      if (!runs.error.empty()) continue;
      try {
        std::vector<Json> round(std::size(kPolicies));
        for (size_t i = 0; i < round.size(); ++i) {
          size_t p = reversed ? round.size() - 1 - i : i;
          round[p] = run_baseline(runs.baseline, kPolicyEnv[p], config);
        }
        runs.rounds.push_back(std::move(round));
      } catch (const std::exception& e) {
        runs.error = e.what();
      }
    }
  };
  for (int round = 0; round < config.rounds; ++round) {
    bool tandem_first = round % 2 == 0;
    if (tandem_first) run_tandem();
    run_baselines(!tandem_first);
    if (!tandem_first) run_tandem();
  }
  return rounds;
}

template <class Get>
std::vector<double> tandem_per_round(const Rounds& rounds, Get get) {
  std::vector<double> v;
  for (const TandemRound& r : rounds.tandem)
    v.push_back(get(r));
  return v;
}

// Tandem's own figures: the "tandem" JSON field and its lines of text.
std::string summarize_tandem(const Rounds& rounds, bool want_chain, bool want_block,
                             Json& tandem_json) {
  std::string text;
  const double per_op = 1e9 / kChainOps;
  tandem_json["cpu_vector_isa"] = ops::cpu_vector_isa();
  if (want_chain) {
    auto get = [&](double StepTimes::*field) {
      return median_of(
          tandem_per_round(rounds, [&](const TandemRound& r) { return r.chain.*field; }));
    };
    double total = get(&StepTimes::total_s), fwd = get(&StepTimes::forward_s);
    double bwd = get(&StepTimes::backward_s);
    tandem_json["autograd_ns_per_op"] = total * per_op;
    tandem_json["autograd_forward_ns_per_op"] = fwd * per_op;
    tandem_json["autograd_backward_ns_per_op"] = bwd * per_op;
    text += fmt::format(
        "\ntandem per op, forward+backward: {:.0f} ns (forward {:.0f}, backward "
        "{:.0f}); raw tandem::ops forward only: {:.0f} ns",
        total * per_op, fwd * per_op, bwd * per_op,
        tandem_json.value("raw_ops_forward_ns_per_op", std::nan("")));
  }
  if (want_block) {
    Json steps = Json::object();
    for (int threads : kThreadSettings) {
      auto get = [&](double StepTimes::*field) {
        return median_of(tandem_per_round(
            rounds, [&](const TandemRound& r) { return r.block.at(threads).*field; }));
      };
      double total = get(&StepTimes::total_s), fwd = get(&StepTimes::forward_s);
      double bwd = get(&StepTimes::backward_s), cpu = get(&StepTimes::cpu_s);
      steps[std::to_string(threads)] = {{"step_ms", total * 1e3},
                                        {"forward_ms", fwd * 1e3},
                                        {"backward_ms", bwd * 1e3},
                                        {"process_cpu_ms", cpu * 1e3}};
      text += fmt::format(
          "\ntandem block step, {} thread{}: {:.1f} ms (forward {:.1f}, backward "
          "{:.1f}; process CPU time {:.1f})",
          threads, threads == 1 ? "" : "s", total * 1e3, fwd * 1e3, bwd * 1e3, cpu * 1e3);
    }
    tandem_json["block_step"] = std::move(steps);
  }
  return text;
}

// Correctness first: the same loss and gradients as the baseline from the
// same bits (its first run's "check"). Returns the mismatch, or empty.
std::string check_against(const BaselineRuns& runs, bool want_chain, bool want_block,
                          ChainWorkload& chain, BlockWorkload& block) {
  if (!runs.error.empty()) return runs.error;
  const Json& check = runs.rounds.front().front().at("check");
  if (want_chain) {
    std::string m = compare(chain.check(), json_floats(check.at("chain")), 1e-4, 1e-6);
    if (!m.empty()) return "chain (output, gradient sum): " + m;
  }
  if (want_block) {
    std::string m = compare(block.check(), json_floats(check.at("block")), 2e-3, 1e-6);
    if (!m.empty()) return "block (loss, gradient norms): " + m;
  }
  return {};
}

// A baseline's settings for "chain" (per wait policy) or "block" (per wait
// policy and threads), with their per-round times.
std::vector<BaselineSetting> settings_of(const BaselineRuns& runs, const std::string& what) {
  std::vector<BaselineSetting> settings;
  for (size_t p = 0; p < std::size(kPolicies); ++p) {
    for (int threads : kThreadSettings) {
      BaselineSetting s;
      s.label = what == "chain" ? fmt::format("OMP_WAIT_POLICY {}", kPolicies[p])
                                : fmt::format("{} thr, OMP_WAIT_POLICY {}", threads, kPolicies[p]);
      for (const auto& round : runs.rounds)
        s.per_round.push_back(baseline_seconds(round[p], what, threads));
      settings.push_back(std::move(s));
      if (what == "chain") break;  // one thread
    }
  }
  return settings;
}

// A baseline's JSON field: versions, medians of every setting, every run.
Json baseline_summary(const BaselineRuns& runs, std::string& text) {
  Json j = {{"skipped", false},
            {"name", runs.baseline.name},
            {"command", runs.baseline.command},
            {"baseline_env", runs.baseline.env}};
  if (!runs.error.empty()) {
    j["error"] = runs.error;
    text = fmt::format("\n{} run failed: {}", runs.baseline.name, runs.error);
    return j;
  }
  const Json& first = runs.rounds.front().front();
  j["torch_version"] = first.value("torch_version", "");
  j["blas_threads"] = first.value("blas_threads", "");
  if (first.contains("cpu_capability")) j["cpu_capability"] = first["cpu_capability"];
  Json medians = Json::object();
  for (const auto& s : settings_of(runs, "chain"))
    medians["chain ns/op, " + s.label] = median_of(s.per_round) * 1e9 / kChainOps;
  for (const auto& s : settings_of(runs, "block"))
    medians["block step ms, " + s.label] = median_of(s.per_round) * 1e3;
  text = fmt::format("\n{} (torch {}{}{}), medians over rounds:", runs.baseline.name,
                     j["torch_version"].get<std::string>(), runs.baseline.env.empty() ? "" : ", ",
                     runs.baseline.env);
  for (const auto& [key, value] : medians.items())
    text += fmt::format("\n  {}: {:.1f}", key, value.get<double>());
  j["medians_over_rounds"] = std::move(medians);
  j["rounds"] = runs.rounds;
  return j;
}

// Fills `row` against the baseline's best setting; returns its "comparison"
// entry, in which `scale` turns seconds into `unit` (ns per op, ms per step).
Json compare_with_best(Row& row, const std::string& baseline_name,
                       const std::vector<double>& tandem_s, int reps,
                       const std::vector<BaselineSetting>& settings, const std::string& what,
                       double scale, const char* unit, double target_max) {
  const BaselineSetting& best = best_setting(settings);
  row.baseline = baseline_name + ", " + best.label;
  row.timing = pair_over_rounds(tandem_s, reps, best);
  double over = 1.0 / row.timing.ratio;
  return {{"what", what},
          {"baseline", baseline_name},
          {"tandem", median_of(tandem_s) * scale},
          {"baseline_value", median_of(best.per_round) * scale},
          {"unit", unit},
          {"baseline_setting", best.label},
          {"tandem_over_baseline", over},
          {"target_max", target_max},
          {"pass", over <= target_max}};
}

// Process CPU time per call at one thread, tandem / the baseline (median over
// rounds): a second view of the one-thread rows that other users' load on the
// shared cores hardly moves, since time spent descheduled is not counted.
Json compare_cpu_time(const Rounds& rounds, const BaselineRuns& runs, bool want_chain,
                      bool want_block, std::string& text) {
  auto compare_one = [&](const std::string& what, auto tandem_cpu) {
    std::vector<double> t, l, ratios;
    for (size_t r = 0; r < rounds.tandem.size() && r < runs.rounds.size(); ++r) {
      double lt = INFINITY;  // the faster wait policy
      for (const Json& run : runs.rounds[r])
        lt = std::min(lt, baseline_seconds(run, what, 1, "cpu_median_ms"));
      t.push_back(tandem_cpu(rounds.tandem[r]));
      l.push_back(lt);
      ratios.push_back(t.back() / lt);
    }
    return Json{{"tandem_ms", median_of(t) * 1e3},
                {"baseline_ms", median_of(l) * 1e3},
                {"tandem_over_baseline", median_of(ratios)}};
  };
  Json cpu = Json::object();
  if (want_chain) {
    cpu["chain"] = compare_one("chain", [](const TandemRound& r) { return r.chain.cpu_s; });
  }
  if (want_block) {
    cpu["block"] = compare_one("block", [](const TandemRound& r) { return r.block.at(1).cpu_s; });
  }
  text = fmt::format(
      "\nprocess CPU time per call at 1 thread, against {} (robust to other "
      "users' load):",
      runs.baseline.name);
  for (const auto& [what, c] : cpu.items()) {
    text += fmt::format("\n  {}: tandem {:.3f} ms, {} {:.3f} ms, tandem / {} {:.3f}", what,
                        c.at("tandem_ms").get<double>(), runs.baseline.name,
                        c.at("baseline_ms").get<double>(), runs.baseline.name,
                        c.at("tandem_over_baseline").get<double>());
  }
  return cpu;
}

// Tandem's 2-thread step against its own 1-thread step (per-round ratio):
// whether the second core pays. Target: 2 threads at most kScalingTargetMax
// of 1 thread.
void add_scaling_row(Report& report, const Rounds& rounds, Json& comparison) {
  Row row;
  row.group = "block";
  row.name = fmt::format("B{} S{} d{} h{} 2 vs 1 thread", kBatch, kSeq, kModel, kHeads);
  row.device = "cpu";
  row.threads = 2;
  row.baseline = "tandem at 1 thread";
  row.target = 1.0 / kScalingTargetMax;
  if (!report.wants(row)) return;
  BaselineSetting one{"tandem, 1 thread", tandem_per_round(rounds, [](const TandemRound& r) {
                        return r.block.at(1).total_s;
                      })};
  row.timing = pair_over_rounds(
      tandem_per_round(rounds, [](const TandemRound& r) { return r.block.at(2).total_s; }), 1, one);
  const double over = 1.0 / row.timing.ratio;
  comparison.push_back({{"what", "block step, tandem at 2 threads over 1 thread"},
                        {"baseline", "tandem at 1 thread"},
                        {"tandem", row.timing.tandem.median_s * 1e3},
                        {"baseline_value", row.timing.baseline.median_s * 1e3},
                        {"unit", "ms"},
                        {"tandem_over_baseline", over},
                        {"target_max", kScalingTargetMax},
                        {"pass", over <= kScalingTargetMax}});
  report.add(std::move(row));
}

// The rounds against every baseline found; without any, tandem's figures
// only. Sets the "tandem" (adding to `tandem_json`), "baselines",
// "cpu_time_1_thread" and "comparison" JSON fields.
void bench_against_baselines(Report& report, const Options& options, Json tandem_json) {
  const CompareConfig config = compare_config(options);
  const bool want_chain = report.wants(overhead_row("LibTorch", 0));
  const bool want_block = report.wants(block_row(1, "LibTorch"));
  if (!want_chain && !want_block) {
    report.set("tandem", std::move(tandem_json), "");
    return;
  }
  Json skipped = Json::object();
  std::vector<Baseline> baselines;
  std::string why_not;
  if (auto b = find_libtorch(why_not)) {
    baselines.push_back(*b);
  } else {
    skipped["libtorch"] = {{"skipped", true}, {"reason", why_not}};
  }
  why_not.clear();
  if (auto b = find_pytorch(why_not)) {
    baselines.push_back(*b);
  } else {
    skipped["pytorch"] = {{"skipped", true}, {"reason", why_not}};
  }
  std::string names;
  for (const Baseline& b : baselines)
    names += (names.empty() ? "" : " and ") + b.name;
  report.note(baselines.empty()
                  ? fmt::format("\nmeasuring tandem ({} rounds); no baseline found", config.rounds)
                  : fmt::format("\nalternating tandem and {} (OMP_WAIT_POLICY unset, passive) "
                                "for {} rounds ...",
                                names, config.rounds));
  ChainWorkload chain;
  BlockWorkload block;
  const Rounds rounds = run_rounds(baselines, want_chain, want_block, config, chain, block);
  std::string tandem_text = summarize_tandem(rounds, want_chain, want_block, tandem_json);
  if (want_block) {
    std::string text;
    tandem_json["block_memory"] = measure_block_memory(block, text);
    tandem_text += "\n" + text;
  }
  report.set("tandem", std::move(tandem_json), tandem_text);

  Json comparison = Json::array();
  Json baselines_json = skipped;
  Json cpu_json = Json::object();
  std::string skipped_text;
  for (const auto& [key, value] : skipped.items())
    skipped_text +=
        fmt::format("\n{} comparison skipped: {}", key, value.at("reason").get<std::string>());
  std::string cpu_text;
  for (const BaselineRuns& runs : rounds.baselines) {
    const std::string& name = runs.baseline.name;
    const std::string mismatch = check_against(runs, want_chain, want_block, chain, block);
    if (want_chain) {
      Row row = overhead_row(name, 1.0 / kOverheadTargetMax);
      if (mismatch.empty()) {
        comparison.push_back(compare_with_best(
            row, name,
            tandem_per_round(rounds, [](const TandemRound& r) { return r.chain.total_s; }),
            rounds.tandem.front().chain.reps, settings_of(runs, "chain"),
            "per-op overhead, forward+backward", 1e9 / kChainOps, "ns/op", kOverheadTargetMax));
      }
      row.error = mismatch;
      report.add(std::move(row));
    }
    for (int threads : kThreadSettings) {
      if (!want_block) break;
      Row row = block_row(threads, name + " best setting");
      if (mismatch.empty()) {
        comparison.push_back(compare_with_best(
            row, name,
            tandem_per_round(rounds,
                             [&](const TandemRound& r) { return r.block.at(threads).total_s; }),
            1, settings_of(runs, "block"),
            fmt::format("block step, tandem at {} thread{}", threads, threads == 1 ? "" : "s"), 1e3,
            "ms", kBlockTargetMax));
      }
      row.error = mismatch;
      report.add(std::move(row));
    }
    std::string text;
    baselines_json[runs.baseline.key] = baseline_summary(runs, text);
    skipped_text += text;
    if (mismatch.empty()) {
      cpu_json[runs.baseline.key] = compare_cpu_time(rounds, runs, want_chain, want_block, text);
      cpu_text += text;
    }
  }
  if (want_block) add_scaling_row(report, rounds, comparison);
  report.set("baselines", std::move(baselines_json), skipped_text);
  if (!cpu_json.empty()) report.set("cpu_time_1_thread", std::move(cpu_json), cpu_text);
  std::string text = "\ntandem / baseline, median over rounds of the per-round ratio:";
  for (const Json& c : comparison) {
    text += fmt::format(
        "\n  {} against {}: {:.3f} (target <= {:.2f}) {}", c.at("what").get<std::string>(),
        c.at("baseline").get<std::string>(), c.at("tandem_over_baseline").get<double>(),
        c.at("target_max").get<double>(), c.at("pass").get<bool>() ? "PASS" : "MISS");
  }
  report.set("comparison", std::move(comparison), text);
}

}  // namespace

int run_autograd(const Options& options) {
  if (options.device == "cuda") return run_autograd_cuda(options);
  TimingConfig config = timing_config(options);
  Report report("autograd", options, config);
  const CompareConfig compare = compare_config(options);
  report.set("workload",
             {{"chain", fmt::format("{} ops (mul 0.9, add, tanh) on a ({}) f32 leaf, then sum",
                                    kChainOps, kChainNumel)},
              {"block", fmt::format("pre-norm causal attention + SwiGLU (hidden {}), B={} S={} "
                                    "d={} heads={}, f32, loss = mean",
                                    kHidden, kBatch, kSeq, kModel, kHeads)},
              {"libtorch_rounds", compare.rounds},
              {"chain_trials", compare.chain_trials},
              {"block_trials", compare.block_trials}},
             fmt::format("chain: {} ops on {} elements (times per chain: 1 ms = 1 us/op); block: "
                         "B={} S={} d={} heads={} hidden={}",
                         kChainOps, kChainNumel, kBatch, kSeq, kModel, kHeads, kHidden));
  Json tandem_json = Json::object();
  bench_overhead_vs_ops(report, config, tandem_json);
  try {
    bench_against_baselines(report, options, std::move(tandem_json));
  } catch (const std::exception& e) {  // a tandem op failing in the rounds
    Row row = block_row(1, "LibTorch");
    row.error = e.what();
    report.add(std::move(row));
  }
  bench_llama_block(report, options);
  return report.finish();
}

}  // namespace tandem::bench
