// `tandem-bench autograd`: what recording and replaying the tape costs, against
// baselines measured in the same run (Note [Benchmark timing]).
//
//   overhead   forward+backward of a chain of 1,000 tiny elementwise ops on a
//              4-element tensor: against the same chain through the raw,
//              non-differentiable tandem::ops (forward only, same process), and
//              against LibTorch 1.13
//   block      forward+backward step of one pre-norm transformer block (causal
//              attention, SwiGLU MLP) at 1 and 2 threads against LibTorch's best
//              thread setting, with the step's peak memory
//
// LibTorch runs in its own process (tools/bench/libtorch_autograd.cpp, built
// only when libtorch-dev is installed) so that its OpenMP threads never share
// the process with tandem's; it is found next to this executable. Tandem and
// LibTorch take turns over several rounds (Note [LibTorch rounds]). Both sides
// start from bit-identical weights (Note [Autograd benchmark workload]), and
// their losses and gradients are compared before any ratio is reported.
#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <exception>
#include <filesystem>
#include <functional>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "runtime/allocator.h"
#include "runtime/device.h"
#include "runtime/stream.h"
#include "tools/bench/bench.h"
#include "tools/bench/bench_autograd_workload.h"

namespace tandem::bench {
namespace {

using namespace autograd_workload;
using Json = nlohmann::ordered_json;

// Targets, as baseline/tandem ratios (Row::target): per-op overhead at most
// 0.25x LibTorch's; a block step at most 0.8x LibTorch's best thread setting.
constexpr double kOverheadTargetMax = 0.25;
constexpr double kBlockTargetMax = 0.8;
constexpr const char* kLibTorchProgram = "tandem-libtorch-autograd";

// Note [LibTorch rounds]
// ~~~~~~~~~~~~~~~~~~~~~~
// LibTorch cannot share tandem's process, so the pairing of Note [Benchmark
// timing] happens one level up: a round measures tandem (chain; block at 1 and
// 2 threads) and runs the LibTorch program twice (OpenMP wait policy left unset,
// and OMP_WAIT_POLICY=passive, which on 2 shared cores can decide whether its
// 2-thread step beats its 1-thread step; on AVX-512 machines a third,
// informational run: Note [LibTorch on OpenBLAS's AVX-512 kernel]), in an
// order that alternates between
// rounds. Each side reports per-call medians of the same trial protocol; a
// row's ratio is the median over rounds of LibTorch's time / tandem's time in
// that round, against the LibTorch setting with the lowest median over rounds.
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

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char ch : s)
    q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return q + "'";
}

// The LibTorch program next to this executable, or empty with `why` set.
std::string find_libtorch_program(std::string& why) {
  std::error_code ec;
  std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) {
    why = fmt::format("cannot read /proc/self/exe ({})", ec.message());
    return {};
  }
  std::filesystem::path path = self.parent_path() / kLibTorchProgram;
  if (!std::filesystem::exists(path, ec)) {
    why = fmt::format(
        "{} not found next to tandem-bench (it is built only when libtorch-dev is installed; "
        "install it and re-run `meson setup --reconfigure`)",
        path.string());
    return {};
  }
  if (access(path.c_str(), X_OK) != 0) {
    why = fmt::format("{} is not executable", path.string());
    return {};
  }
  return path.string();
}

// `env`: the environment prefix of the command (an `env` invocation).
Json run_libtorch_program(const std::string& program, const std::string& env,
                          const CompareConfig& config) {
  std::string command = fmt::format("{} {} --chain-trials {} --block-trials {} --min-trial-ms {}",
                                    env, shell_quote(program), config.chain_trials,
                                    config.block_trials, config.min_trial_s * 1e3);
  std::fflush(stdout);
  FILE* pipe = popen(command.c_str(), "r");
  TANDEM_CHECK(pipe != nullptr, "[bench::autograd] expected to start `{}`, got popen failing",
               command);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0)
    out.append(buf, n);
  int status = pclose(pipe);
  TANDEM_CHECK(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
               "[bench::autograd] expected `{}` to exit with status 0, got {} (its stderr is "
               "above)",
               command,
               status == -1        ? std::string("pclose failing")
               : WIFEXITED(status) ? fmt::format("status {}", WEXITSTATUS(status))
                                   : fmt::format("signal {}", WTERMSIG(status)));
  Json j = Json::parse(out, nullptr, false);
  TANDEM_CHECK(!j.is_discarded() && j.is_object(),
               "[bench::autograd] expected one JSON object from {}, got: {}", program,
               out.substr(0, 200));
  return j;
}

std::vector<float> json_floats(const Json& j) {
  std::vector<float> v;
  for (const auto& x : j)
    v.push_back(x.get<float>());
  return v;
}

// Seconds of one LibTorch measurement in one round, e.g. ("chain", 0) or
// ("block", 2); `field` is "median_ms" (wall) or "cpu_median_ms".
double libtorch_seconds(const Json& run, const std::string& what, int threads,
                        const char* field = "median_ms") {
  if (what == "chain") return run.at("chain").at(field).get<double>() * 1e-3;
  for (const auto& b : run.at("block").at("threads")) {
    if (b.at("threads").get<int>() == threads) return b.at(field).get<double>() * 1e-3;
  }
  TANDEM_FAIL("[bench::autograd] expected LibTorch block times at {} threads, got none", threads);
}

Timing timing_over_rounds(const std::vector<double>& per_round, int reps) {
  Timing t;
  t.median_s = median_of(per_round);
  t.min_s = *std::min_element(per_round.begin(), per_round.end());
  t.reps = reps;
  t.trials = static_cast<int>(per_round.size());
  return t;
}

// A LibTorch setting (wait policy, threads) with its per-round times.
struct LibTorchSetting {
  std::string label;
  std::vector<double> per_round;
};

// The setting with the lowest median over rounds.
const LibTorchSetting& best_setting(const std::vector<LibTorchSetting>& settings) {
  return *std::min_element(settings.begin(), settings.end(), [](const auto& a, const auto& b) {
    return median_of(a.per_round) < median_of(b.per_round);
  });
}

PairTiming pair_over_rounds(const std::vector<double>& tandem, int tandem_reps,
                            const LibTorchSetting& libtorch) {
  std::vector<double> ratios;
  for (size_t r = 0; r < tandem.size(); ++r)
    ratios.push_back(libtorch.per_round[r] / tandem[r]);
  return {timing_over_rounds(tandem, tandem_reps), timing_over_rounds(libtorch.per_round, 1),
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

// ---- the rounds against LibTorch ----

constexpr const char* kPolicies[] = {"unset", "passive"};  // OMP_WAIT_POLICY

std::string policy_env(size_t p) {
  return std::string(kPolicies[p]) == "passive" ? "env OMP_WAIT_POLICY=passive"
                                                : "env -u OMP_WAIT_POLICY";
}

// Note [LibTorch on OpenBLAS's AVX-512 kernel]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Debian's OpenBLAS 0.3.21 runs its AVX2 Haswell kernel on AVX-512 CPUs it
// does not know (AMD Zen 4/5), while tandem's f32 GEMM uses AVX-512 there
// (Note [CPU GEMM backend] in tensor/cpu/gemm.cpp), which is most of tandem's
// lead on the block. So on AVX-512 machines every round also runs LibTorch
// with OPENBLAS_CORETYPE=SkylakeX (OpenBLAS's own AVX-512 kernels) and
// OMP_WAIT_POLICY=passive, and reports tandem against it. It is informational:
// the target rows compare with LibTorch as installed, as the issue defines them.
bool avx512_machine() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}
constexpr const char* kAvx512Env = "env OMP_WAIT_POLICY=passive OPENBLAS_CORETYPE=SkylakeX";

struct Rounds {
  std::vector<TandemRound> tandem;
  std::vector<std::vector<Json>> libtorch;  // [round][policy]
  std::vector<Json> libtorch_avx512;        // [round]; empty when not run
  std::string libtorch_error;               // the first failed LibTorch run
};

// Note [LibTorch rounds]. Without `program`, tandem only.
Rounds run_rounds(const std::string& program, bool want_chain, bool want_block,
                  const CompareConfig& config, ChainWorkload& chain, BlockWorkload& block) {
  Rounds rounds;
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
    // Let OpenBLAS's second thread go idle before LibTorch's process starts.
    ops::set_num_threads(1);
    rounds.tandem.push_back(std::move(r));
  };
  const bool avx512 = want_block && avx512_machine();
  auto run_libtorch = [&](bool reversed) {
    std::vector<Json> runs(std::size(kPolicies));
    for (size_t i = 0; i < runs.size(); ++i) {
      size_t p = reversed ? runs.size() - 1 - i : i;
      runs[p] = run_libtorch_program(program, policy_env(p), config);
    }
    // Note [LibTorch on OpenBLAS's AVX-512 kernel].
    if (avx512) rounds.libtorch_avx512.push_back(run_libtorch_program(program, kAvx512Env, config));
    rounds.libtorch.push_back(std::move(runs));
  };
  for (int round = 0; round < config.rounds; ++round) {
    bool tandem_first = round % 2 == 0;
    if (tandem_first) run_tandem();
    if (!program.empty() && rounds.libtorch_error.empty()) {
      try {
        run_libtorch(!tandem_first);
      } catch (const std::exception& e) {
        rounds.libtorch_error = e.what();
      }
    }
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

// Correctness first: the same loss and gradients as LibTorch from the same
// bits (its first run's "check"). Returns the mismatch, or empty.
std::string check_against_libtorch(const Rounds& rounds, bool want_chain, bool want_block,
                                   ChainWorkload& chain, BlockWorkload& block) {
  if (!rounds.libtorch_error.empty()) return rounds.libtorch_error;
  const Json& check = rounds.libtorch.front().front().at("check");
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

// LibTorch's settings for "chain" (per wait policy) or "block" (per wait
// policy and threads), with their per-round times.
std::vector<LibTorchSetting> libtorch_settings(const Rounds& rounds, const std::string& what) {
  std::vector<LibTorchSetting> settings;
  for (size_t p = 0; p < std::size(kPolicies); ++p) {
    for (int threads : kThreadSettings) {
      LibTorchSetting s;
      s.label = what == "chain" ? fmt::format("OMP_WAIT_POLICY {}", kPolicies[p])
                                : fmt::format("{} thr, OMP_WAIT_POLICY {}", threads, kPolicies[p]);
      for (const auto& runs : rounds.libtorch)
        s.per_round.push_back(libtorch_seconds(runs[p], what, threads));
      settings.push_back(std::move(s));
      if (what == "chain") break;  // one thread
    }
  }
  return settings;
}

// The "libtorch" JSON field: versions, medians of every setting, every run.
Json libtorch_summary(const Rounds& rounds, const std::string& program, std::string& text) {
  Json j = {{"skipped", false}, {"program", program}};
  if (!rounds.libtorch_error.empty()) {
    j["error"] = rounds.libtorch_error;
    text = fmt::format("\nLibTorch run failed: {}", rounds.libtorch_error);
    return j;
  }
  const Json& first = rounds.libtorch.front().front();
  j["torch_version"] = first.value("torch_version", "");
  j["blas_threads"] = first.value("blas_threads", "");
  Json medians = Json::object();
  for (const auto& s : libtorch_settings(rounds, "chain"))
    medians["chain ns/op, " + s.label] = median_of(s.per_round) * 1e9 / kChainOps;
  for (const auto& s : libtorch_settings(rounds, "block"))
    medians["block step ms, " + s.label] = median_of(s.per_round) * 1e3;
  text =
      fmt::format("\nLibTorch {} ({}), medians over rounds:", j["torch_version"].get<std::string>(),
                  j["blas_threads"].get<std::string>());
  for (const auto& [key, value] : medians.items())
    text += fmt::format("\n  {}: {:.1f}", key, value.get<double>());
  j["medians_over_rounds"] = std::move(medians);
  j["rounds"] = rounds.libtorch;
  return j;
}

// Fills `row` against LibTorch's best setting; returns its "comparison" entry,
// in which `scale` turns seconds into `unit` (ns per op, ms per step).
Json compare_with_best(Row& row, const std::vector<double>& tandem_s, int reps,
                       const std::vector<LibTorchSetting>& settings, const std::string& what,
                       double scale, const char* unit, double target_max) {
  const LibTorchSetting& best = best_setting(settings);
  row.baseline = "LibTorch, " + best.label;
  row.timing = pair_over_rounds(tandem_s, reps, best);
  double over = 1.0 / row.timing.ratio;
  return {{"what", what},
          {"tandem", median_of(tandem_s) * scale},
          {"libtorch", median_of(best.per_round) * scale},
          {"unit", unit},
          {"libtorch_setting", best.label},
          {"tandem_over_libtorch", over},
          {"target_max", target_max},
          {"pass", over <= target_max}};
}

// Process CPU time per call at one thread, tandem / LibTorch (median over
// rounds): a second view of the one-thread rows that other users' load on the
// shared cores hardly moves, since time spent descheduled is not counted.
Json compare_cpu_time(const Rounds& rounds, bool want_chain, bool want_block, std::string& text) {
  auto compare_one = [&](const std::string& what, auto tandem_cpu) {
    std::vector<double> t, l, ratios;
    for (size_t r = 0; r < rounds.tandem.size(); ++r) {
      double lt = INFINITY;  // the faster wait policy
      for (const Json& run : rounds.libtorch[r])
        lt = std::min(lt, libtorch_seconds(run, what, 1, "cpu_median_ms"));
      t.push_back(tandem_cpu(rounds.tandem[r]));
      l.push_back(lt);
      ratios.push_back(t.back() / lt);
    }
    return Json{{"tandem_ms", median_of(t) * 1e3},
                {"libtorch_ms", median_of(l) * 1e3},
                {"tandem_over_libtorch", median_of(ratios)}};
  };
  Json cpu = Json::object();
  if (want_chain) {
    cpu["chain"] = compare_one("chain", [](const TandemRound& r) { return r.chain.cpu_s; });
  }
  if (want_block) {
    cpu["block"] = compare_one("block", [](const TandemRound& r) { return r.block.at(1).cpu_s; });
  }
  text = "\nprocess CPU time per call at 1 thread (robust to other users' load):";
  for (const auto& [what, c] : cpu.items()) {
    text += fmt::format("\n  {}: tandem {:.3f} ms, LibTorch {:.3f} ms, tandem / LibTorch {:.3f}",
                        what, c.at("tandem_ms").get<double>(), c.at("libtorch_ms").get<double>(),
                        c.at("tandem_over_libtorch").get<double>());
  }
  return cpu;
}

// Note [LibTorch on OpenBLAS's AVX-512 kernel]: tandem's block step at each
// thread setting over LibTorch's faster thread setting with OpenBLAS's AVX-512
// kernels (median over rounds of the per-round ratio). Not a target row.
Json compare_with_avx512_libtorch(const Rounds& rounds, std::string& text) {
  LibTorchSetting best;
  for (int threads : kThreadSettings) {
    LibTorchSetting s;
    s.label = fmt::format("{} thr, OMP_WAIT_POLICY passive, OPENBLAS_CORETYPE=SkylakeX", threads);
    for (const Json& run : rounds.libtorch_avx512)
      s.per_round.push_back(libtorch_seconds(run, "block", threads));
    if (best.per_round.empty() || median_of(s.per_round) < median_of(best.per_round)) best = s;
  }
  Json j = {{"libtorch_setting", best.label},
            {"libtorch_ms", median_of(best.per_round) * 1e3},
            {"informational", true}};
  text = fmt::format(
      "\nLibTorch on OpenBLAS's AVX-512 kernels (informational, Note [LibTorch on OpenBLAS's "
      "AVX-512 kernel]): block step {:.1f} ms ({}); tandem / that:",
      median_of(best.per_round) * 1e3, best.label);
  for (int threads : kThreadSettings) {
    std::vector<double> ratios;
    for (size_t r = 0; r < rounds.tandem.size() && r < best.per_round.size(); ++r)
      ratios.push_back(rounds.tandem[r].block.at(threads).total_s / best.per_round[r]);
    const double ratio = median_of(ratios);
    j[fmt::format("tandem_{}_thread_over_libtorch", threads)] = ratio;
    text += fmt::format(" {:.3f} at {} thread{}", ratio, threads, threads == 1 ? "" : "s");
    if (threads != kThreadSettings[std::size(kThreadSettings) - 1]) text += ",";
  }
  return j;
}

// The rounds against LibTorch; without the LibTorch program, tandem's figures
// only. Sets the "tandem" (adding to `tandem_json`), "libtorch",
// "cpu_time_1_thread" and "comparison" JSON fields.
void bench_against_libtorch(Report& report, const Options& options, Json tandem_json) {
  const CompareConfig config = compare_config(options);
  const bool want_chain = report.wants(overhead_row("LibTorch", 0));
  const bool want_block = report.wants(block_row(1, "LibTorch"));
  if (!want_chain && !want_block) {
    report.set("tandem", std::move(tandem_json), "");
    return;
  }
  std::string why_not;
  const std::string program = find_libtorch_program(why_not);
  report.note(program.empty()
                  ? fmt::format("\nmeasuring tandem ({} rounds); LibTorch comparison skipped",
                                config.rounds)
                  : fmt::format("\nalternating tandem and {} (OMP_WAIT_POLICY unset, passive) "
                                "for {} rounds ...",
                                kLibTorchProgram, config.rounds));
  ChainWorkload chain;
  BlockWorkload block;
  const Rounds rounds = run_rounds(program, want_chain, want_block, config, chain, block);
  std::string tandem_text = summarize_tandem(rounds, want_chain, want_block, tandem_json);
  if (want_block) {
    std::string text;
    tandem_json["block_memory"] = measure_block_memory(block, text);
    tandem_text += "\n" + text;
  }
  if (program.empty()) {
    report.set("tandem", std::move(tandem_json), tandem_text);
    report.set("libtorch", {{"skipped", true}, {"reason", why_not}},
               fmt::format("LibTorch comparison skipped: {}", why_not));
    return;
  }

  const std::string mismatch = check_against_libtorch(rounds, want_chain, want_block, chain, block);
  Json comparison = Json::array();
  if (want_chain) {
    Row row = overhead_row("LibTorch 1.13", 1.0 / kOverheadTargetMax);
    if (mismatch.empty()) {
      comparison.push_back(compare_with_best(
          row, tandem_per_round(rounds, [](const TandemRound& r) { return r.chain.total_s; }),
          rounds.tandem.front().chain.reps, libtorch_settings(rounds, "chain"),
          "per-op overhead, forward+backward", 1e9 / kChainOps, "ns/op", kOverheadTargetMax));
    }
    row.error = mismatch;
    report.add(std::move(row));
  }
  for (int threads : kThreadSettings) {
    if (!want_block) break;
    Row row = block_row(threads, "LibTorch 1.13 best setting");
    if (mismatch.empty()) {
      comparison.push_back(compare_with_best(
          row,
          tandem_per_round(rounds,
                           [&](const TandemRound& r) { return r.block.at(threads).total_s; }),
          1, libtorch_settings(rounds, "block"),
          fmt::format("block step, tandem at {} thread{}", threads, threads == 1 ? "" : "s"), 1e3,
          "ms", kBlockTargetMax));
    }
    row.error = mismatch;
    report.add(std::move(row));
  }

  std::string text;
  report.set("tandem", std::move(tandem_json), tandem_text);
  Json libtorch_json = libtorch_summary(rounds, program, text);
  report.set("libtorch", std::move(libtorch_json), text);
  if (!mismatch.empty()) return;
  Json cpu = compare_cpu_time(rounds, want_chain, want_block, text);
  report.set("cpu_time_1_thread", std::move(cpu), text);
  text = "\ntandem / LibTorch, median over rounds of the per-round ratio:";
  for (const Json& c : comparison) {
    text +=
        fmt::format("\n  {}: {:.3f} (target <= {:.2f}) {}", c.at("what").get<std::string>(),
                    c.at("tandem_over_libtorch").get<double>(), c.at("target_max").get<double>(),
                    c.at("pass").get<bool>() ? "PASS" : "MISS");
  }
  report.set("comparison", std::move(comparison), text);
  if (want_block && !rounds.libtorch_avx512.empty()) {
    Json avx = compare_with_avx512_libtorch(rounds, text);
    report.set("libtorch_openblas_avx512", std::move(avx), text);
  }
}

}  // namespace

int run_autograd(const Options& options) {
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
    bench_against_libtorch(report, options, std::move(tandem_json));
  } catch (const std::exception& e) {  // a tandem op failing in the rounds
    Row row = block_row(1, "LibTorch");
    row.error = e.what();
    report.add(std::move(row));
  }
  return report.finish();
}

}  // namespace tandem::bench
