// The interleaved timer (Note [Benchmark timing]) and the table/JSON report of
// tandem-bench.
#include "tools/bench/bench.h"

#include "tandem/runtime/device.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include <unistd.h>

#include "tandem/tensor/ops.h"

namespace tandem::bench {

// Note [Baselines on a narrower build] (bench.h).
bool kernels_below_machine() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512f") && std::string(ops::cpu_vector_isa()) != "avx512";
#else
  return false;
#endif
}

const char* openblas_core_for_kernels() {
  const std::string isa = ops::cpu_vector_isa();
  if (isa == "avx512") return "SkylakeX";
  if (isa == "avx2") return "Haswell";
  return nullptr;
}

void hold_blas_to_kernel_isa(char** argv) {
  bool changed = false;
  const char* core = openblas_core_for_kernels();
  if (core != nullptr && std::getenv("OPENBLAS_CORETYPE") == nullptr) {
    setenv("OPENBLAS_CORETYPE", core, 1);
    changed = true;
  }
  if (std::getenv("OPENBLAS_THREAD_TIMEOUT") == nullptr) {  // Note [Idle BLAS threads]
    setenv("OPENBLAS_THREAD_TIMEOUT", "4", 1);
    changed = true;
  }
  if (changed) execv("/proc/self/exe", argv);  // on failure, go on as OpenBLAS chose
}

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double time_trial(const Kernel& kernel, int reps) {
  auto start = std::chrono::steady_clock::now();
  kernel(reps);
  return seconds_since(start);
}

// Warms the kernel up, then finds the calls per trial that make one trial
// last at least `min_trial_s`. The first call pays for page faults, lazy
// initialisation and the allocator filling its cache, so it is not timed.
int calibrate(const Kernel& kernel, double min_trial_s) {
  kernel(1);
  int reps = 1;
  constexpr int kMaxReps = 1 << 22;
  for (;;) {
    double t = time_trial(kernel, reps);
    if (t >= min_trial_s || reps >= kMaxReps) return reps;
    // Aim 20% past the goal so the next try usually lands; at least double.
    double wanted = std::ceil(reps * 1.2 * min_trial_s / std::max(t, 1e-9));
    reps = static_cast<int>(std::min<double>(kMaxReps, std::max<double>(2.0 * reps, wanted)));
  }
}

Timing summarize(const std::vector<double>& per_call, int reps) {
  Timing t;
  t.median_s = sample_median(per_call);
  t.min_s = *std::min_element(per_call.begin(), per_call.end());
  t.reps = reps;
  t.trials = static_cast<int>(per_call.size());
  return t;
}

// Shows a time as a rate when the row knows its flops (GFLOP/s on CPU,
// TFLOP/s on a GPU), else in milliseconds.
std::string format_speed(const Row& row, double seconds) {
  if (row.memory) return fmt::format("{:.2f} MiB", seconds / (1 << 20));  // bytes
  if (row.flops > 0) {
    bool gpu = row.device != "cpu";
    double scale = gpu ? 1e12 : 1e9;
    return fmt::format("{:.1f} {}", row.flops / seconds / scale, gpu ? "TFLOP/s" : "GFLOP/s");
  }
  return fmt::format("{:.3f} ms", seconds * 1e3);
}

constexpr const char* kTableFormat = "{:<12} {:<20} {:<7} {:>4}  {:>15} {:>15}  {:>6} {:>7}  {}\n";

}  // namespace

std::string no_cuda_device_error(const std::string& component) {
  return built_with_cuda()
             ? fmt::format(
                   "[bench::{}] expected a CUDA device, got none (without a GPU, "
                   "TANDEM_CUDA=emulated gives an emulated one)",
                   component)
             : fmt::format("[bench::{}] expected a CUDA device, got a tandem built without CUDA",
                           component);
}

namespace {

nlohmann::ordered_json row_json(const Row& row) {
  nlohmann::ordered_json j = {
      {"group", row.group},     {"name", row.name},         {"device", row.device},
      {"threads", row.threads}, {"baseline", row.baseline}, {"target", row.target},
  };
  if (!row.error.empty()) {
    j["status"] = "error";
    j["error"] = row.error;
    return j;
  }
  if (!row.skipped.empty()) {
    j["status"] = "skipped";
    j["reason"] = row.skipped;
    return j;
  }
  const Timing& t = row.timing.tandem;
  const Timing& b = row.timing.baseline;
  j["status"] = row.passed() ? "pass" : "fail";
  j["ratio"] = row.ratio();
  if (row.memory) {
    j["tandem_bytes"] = t.median_s;
    j["baseline_bytes"] = b.median_s;
    return j;
  }
  j["tandem_ms"] = t.median_s * 1e3;
  j["baseline_ms"] = b.median_s * 1e3;
  j["tandem_min_ms"] = t.min_s * 1e3;
  j["baseline_min_ms"] = b.min_s * 1e3;
  j["tandem_reps"] = t.reps;
  j["baseline_reps"] = b.reps;
  j["trials"] = t.trials;
  if (row.flops > 0) {
    bool gpu = row.device != "cpu";
    double scale = gpu ? 1e12 : 1e9;
    const char* unit = gpu ? "tflops" : "gflops";
    j[fmt::format("tandem_{}", unit)] = row.flops / t.median_s / scale;
    j[fmt::format("baseline_{}", unit)] = row.flops / b.median_s / scale;
  }
  return j;
}

}  // namespace

double sample_median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

Timing timing_of_steps(const std::vector<double>& per_step) {
  Timing t;
  t.median_s = sample_median(per_step);
  t.min_s = per_step.empty() ? 0 : *std::min_element(per_step.begin(), per_step.end());
  t.reps = 1;
  t.trials = static_cast<int>(per_step.size());
  return t;
}

void Lockstep::guard(const std::function<void()>& body) {
  try {
    body();
  } catch (...) {
    barrier_.arrive_and_drop();
    throw;
  }
}

TimingConfig timing_config(const Options& options) {
  TimingConfig config;
  if (options.quick) {
    config.trials = 7;
    config.min_trial_s = 0.01;
  }
  return config;
}

PairTiming time_interleaved(const Kernel& tandem, const Kernel& baseline,
                            const TimingConfig& config) {
  int tandem_reps = calibrate(tandem, config.min_trial_s);
  int baseline_reps = calibrate(baseline, config.min_trial_s);
  std::vector<double> t, b;
  for (int i = 0; i < config.trials; ++i) {
    auto run_tandem = [&] { t.push_back(time_trial(tandem, tandem_reps) / tandem_reps); };
    auto run_baseline = [&] { b.push_back(time_trial(baseline, baseline_reps) / baseline_reps); };
    if (i % 2 == 0) {
      run_tandem();
      run_baseline();
    } else {
      run_baseline();
      run_tandem();
    }
  }
  std::vector<double> ratios(t.size());
  for (size_t i = 0; i < t.size(); ++i)
    ratios[i] = b[i] / t[i];
  return {summarize(t, tandem_reps), summarize(b, baseline_reps), sample_median(ratios)};
}

std::string compare(const std::vector<float>& got, const std::vector<float>& want, double rtol,
                    double atol) {
  if (got.size() != want.size()) {
    return fmt::format("expected {} elements, got {}", want.size(), got.size());
  }
  size_t worst = 0;
  double worst_excess = 0;  // error / allowed error
  for (size_t i = 0; i < got.size(); ++i) {
    double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    double allowed = atol + rtol * std::fabs(static_cast<double>(want[i]));
    double excess = std::isnan(err) ? INFINITY : err / allowed;
    if (excess > worst_excess) {
      worst_excess = excess;
      worst = i;
    }
  }
  if (worst_excess <= 1.0) return {};
  return fmt::format(
      "tandem disagrees with the baseline: expected {} at element {}, got {} (rtol={}, atol={})",
      want[worst], worst, got[worst], rtol, atol);
}

Report::Report(std::string benchmark, const Options& options, const TimingConfig& config)
    : benchmark_(std::move(benchmark)), options_(options) {
  if (options_.collect != nullptr) options_.json = true;  // no table
  json_ = {
      {"benchmark", benchmark_},
      {"quick", options.quick},
      {"hardware_threads", std::thread::hardware_concurrency()},
      {"timing",
       {{"statistic", "median of the ratios of adjacent trials; times: median per call"},
        {"trials", config.trials},
        {"min_trial_ms", config.min_trial_s * 1e3},
        {"order", "interleaved, alternating which side goes first"}}},
      {"ratio", "baseline time / tandem time (> 1: tandem faster)"},
      {"rows", nlohmann::ordered_json::array()},
  };
  note(fmt::format("tandem-bench {}{}: ratio = baseline time / tandem time (> 1: tandem faster)",
                   benchmark_, options.quick ? " --quick" : ""));
  note(
      fmt::format("timing: {} interleaved trials per side, each >= {:.0f} ms; ratio = median of "
                  "the ratios of adjacent trials, times = median per call",
                  config.trials, config.min_trial_s * 1e3));
}

bool Report::wants(const Row& row) const {
  return (row.group + " " + row.name).find(options_.filter) != std::string::npos;
}

void Report::note(const std::string& line) {
  if (!options_.json) fmt::print("{}\n", line);
}

void Report::add(Row row) {
  if (!options_.json) {
    if (!header_printed_) {
      fmt::print("\n");
      fmt::print(kTableFormat, "group", "case", "device", "thr", "tandem", "baseline", "ratio",
                 "target", "result");
      header_printed_ = true;
    }
    std::string threads = row.threads > 0 ? std::to_string(row.threads) : "-";
    std::string target = fmt::format(">={:.2f}", row.target);
    if (row.error.empty() && row.skipped.empty()) {
      fmt::print(kTableFormat, row.group, row.name, row.device, threads,
                 format_speed(row, row.timing.tandem.median_s),
                 format_speed(row, row.timing.baseline.median_s),
                 fmt::format("{:.2f}", row.ratio()), target, row.passed() ? "PASS" : "FAIL");
    } else {
      fmt::print(kTableFormat, row.group, row.name, row.device, threads, "-", "-", "-", target,
                 row.error.empty() ? "SKIPPED: " + row.skipped : "ERROR: " + row.error);
    }
    std::fflush(stdout);
  }
  json_["rows"].push_back(row_json(row));
  rows_.push_back(std::move(row));
}

void Report::set(const std::string& key, nlohmann::ordered_json value, const std::string& text) {
  json_[key] = std::move(value);
  note(text);
}

int Report::finish() {
  int passed = 0, failed = 0, errors = 0, skipped = 0;
  for (const Row& row : rows_) {
    if (!row.error.empty()) {
      ++errors;
    } else if (!row.skipped.empty()) {
      ++skipped;
    } else if (row.passed()) {
      ++passed;
    } else {
      ++failed;
    }
  }
  json_["summary"] = {
      {"rows", rows_.size()}, {"passed", passed}, {"failed", failed}, {"errors", errors}};
  // Only where some row was skipped, so that the reports of benchmarks that
  // never skip keep their shape.
  if (skipped > 0) json_["summary"]["skipped"] = skipped;
  if (options_.collect != nullptr) {
    *options_.collect = json_;
  } else if (options_.json) {
    fmt::print("{}\n", json_.dump(2));
  } else {
    fmt::print("\n{} rows: {} passed, {} below target, {} errors{}\n", rows_.size(), passed, failed,
               errors, skipped > 0 ? fmt::format(", {} skipped", skipped) : "");
  }
  return errors == 0 ? 0 : 1;
}

}  // namespace tandem::bench
