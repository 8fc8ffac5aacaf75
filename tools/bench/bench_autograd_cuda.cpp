// `tandem-bench autograd --device cuda`: the block step of bench_autograd.cpp
// on a GPU, tandem on cuda:0 against PyTorch 2.x on its own GPU (Note
// [Autograd on a GPU]). run_autograd() dispatches here.
//
// Note [Autograd on a GPU]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// - What runs: the block step (Note [Autograd benchmark workload]), one
//   row: tandem on cuda:0 against `pytorch_autograd.py --device cuda`; then
//   the attention rows (Note [Attention on a GPU]). Both
//   sides copy the CPU's bit-identical weights and input to the device. The
//   overhead chain measures the tape's host-side cost on 4-element tensors; it
//   stays CPU-only, and the JSON's "overhead" field says so.
// - Correctness first: tandem's loss and gradient norms on cuda:0 are compared
//   with tandem's on the CPU, and with PyTorch's when it ran, before any ratio
//   is reported, at kGpuRtol: the GPU kernels sum in other orders (tiled
//   attention, atomics, cuBLAS's own blocking), so the sides agree to f32
//   rounding grown over sums of thousands of terms, not bit for bit. Neither
//   side multiplies in TF32 (tensor/cuda/gemm.cu; the script turns it off).
// - Timing: each phase of a step ends by synchronising the device (tandem: the
//   current CUDA stream; PyTorch: torch.cuda.synchronize()), with the trial
//   protocol of measure(). Rounds alternate tandem and a PyTorch process as on
//   the CPU (Note [LibTorch rounds]), with one setting per side: thread counts
//   and OpenMP wait policies mean nothing to a GPU step.
// - Attention: PyTorch's F.scaled_dot_product_attention(is_causal=True) picks
//   its fused kernel for the inputs: flash attention takes f16/bf16 only, so for
//   this f32 block it is the memory-efficient kernel (the script records which
//   backends were enabled); tandem runs its tiled kernel (tensor/cuda/attention.cu).
// - Without a PyTorch that has CUDA (machines without a GPU, where
//   TANDEM_CUDA=emulated gives tandem an emulated cuda:0), the row is skipped
//   with the reason; tandem's check against the CPU and its step time are still
//   reported. Times on the emulated device say nothing about a GPU.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "tandem/autograd/ops.h"
#include "tandem/runtime/allocator.h"
#include "tandem/runtime/device.h"
#include "tools/bench/bench.h"
#include "tools/bench/bench_autograd_baselines.h"
#include "tools/bench/bench_autograd_workload.h"

namespace tandem::bench {
namespace {

using namespace autograd_workload;
using namespace autograd_baselines;
using Json = nlohmann::ordered_json;

// Loss and gradient norms on a GPU against the CPU or PyTorch's GPU
// (Note [Autograd on a GPU]); the CPU rows use 2e-3.
constexpr double kGpuRtol = 5e-3;
constexpr double kGpuAtol = 1e-5;

struct CudaConfig {
  int rounds = 5;
  int trials = 7;
  double min_trial_s = 0.02;
};

CudaConfig cuda_config(const Options& options) {
  CudaConfig c;
  if (options.quick) {
    c.rounds = 2;
    c.trials = 3;
    c.min_trial_s = 0.01;
  }
  return c;
}

Row cuda_block_row(const std::string& device) {
  Row row;
  row.group = "block";
  row.name = fmt::format("B{} S{} d{} h{}", kBatch, kSeq, kModel, kHeads);
  row.device = device;
  row.threads = 0;  // a GPU row
  row.baseline = "PyTorch 2.x on its GPU";
  row.target = 1.0 / kBlockTargetMax;
  return row;
}

Json run_pytorch_cuda(const Baseline& b, const CudaConfig& config) {
  std::string out =
      run_command(fmt::format("env {} {} --device cuda --block-trials {} --min-trial-ms {}", b.env,
                              b.command, config.trials, config.min_trial_s * 1e3));
  Json j = Json::parse(out, nullptr, false);
  TANDEM_CHECK(!j.is_discarded() && j.is_object(),
               "[bench::autograd] expected one JSON object from {} --device cuda, got: {}", b.name,
               out.substr(0, 200));
  return j;
}

// Peak memory of one block step on the block's device (after a warm-up step).
Json measure_step_memory(BlockWorkload& block, std::string& text) {
  constexpr double kMiB = 1024.0 * 1024.0;
  double f = 0, b = 0;
  block.step(f, b);
  MemoryStats before = memory_stats(block.device);
  reset_peak_memory(block.device);
  block.step(f, b);
  MemoryStats after = memory_stats(block.device);
  double peak = static_cast<double>(after.peak_allocated_bytes);
  double held = static_cast<double>(before.allocated_bytes);
  text = fmt::format(
      "block step peak memory on {}: {:.1f} MiB allocated at peak ({:.1f} MiB above the {:.1f} "
      "MiB held before the step), {:.1f} MiB reserved",
      block.device.str(), peak / kMiB, (peak - held) / kMiB, held / kMiB,
      after.peak_reserved_bytes / kMiB);
  return {{"device", block.device.str()},
          {"peak_allocated_mib", peak / kMiB},
          {"allocated_before_mib", held / kMiB},
          {"step_peak_above_before_mib", (peak - held) / kMiB},
          {"peak_reserved_mib", after.peak_reserved_bytes / kMiB},
          {"system_allocs_in_step", after.num_system_allocs - before.num_system_allocs}};
}

// Tandem's figures over rounds: the "tandem" JSON field and its text.
Json summarize_tandem(const std::vector<StepTimes>& rounds, const std::string& device,
                      std::string& text) {
  auto get = [&](double StepTimes::*field) {
    std::vector<double> v;
    for (const StepTimes& r : rounds)
      v.push_back(r.*field);
    return median_of(v);
  };
  double total = get(&StepTimes::total_s), fwd = get(&StepTimes::forward_s);
  double bwd = get(&StepTimes::backward_s);
  text = fmt::format("\ntandem block step on {}: {:.2f} ms (forward {:.2f}, backward {:.2f})",
                     device, total * 1e3, fwd * 1e3, bwd * 1e3);
  return {{"device", device},
          {"emulated", cuda_emulated()},
          {"block_step",
           {{"step_ms", total * 1e3},
            {"forward_ms", fwd * 1e3},
            {"backward_ms", bwd * 1e3},
            {"reps", rounds.front().reps}}}};
}

// Fills `row` from the per-round times of both sides; returns its
// "comparison" entry.
Json compare_rounds(Row& row, const std::vector<StepTimes>& tandem,
                    const std::vector<Json>& pytorch, const std::string& pytorch_name) {
  std::vector<double> t, b, ratios;
  for (size_t r = 0; r < tandem.size() && r < pytorch.size(); ++r) {
    t.push_back(tandem[r].total_s);
    b.push_back(pytorch[r].at("block").at("step").at("median_ms").get<double>() * 1e-3);
    ratios.push_back(b.back() / t.back());
  }
  row.baseline = pytorch_name + " on its GPU";
  row.timing = {timing_over_rounds(t, tandem.front().reps), timing_over_rounds(b, 1),
                median_of(ratios)};
  const double over = 1.0 / row.timing.ratio;
  return {{"what", "block step on a GPU"},
          {"device", row.device},
          {"baseline", pytorch_name},
          {"tandem", median_of(t) * 1e3},
          {"baseline_value", median_of(b) * 1e3},
          {"unit", "ms"},
          {"tandem_over_baseline", over},
          {"target_max", kBlockTargetMax},
          {"pass", over <= kBlockTargetMax}};
}

// The row against PyTorch, after the checks; sets the "tandem", "check",
// "baselines" and "comparison" JSON fields.
void bench_block_cuda(Report& report, const CudaConfig& config, Row& row) {
  const Device device = Device::cuda(0);
  BlockWorkload block(device);
  const std::vector<float> got = block.check();
  Json check = {{"values", "loss, then the L2 norm of each parameter's gradient"},
                {"rtol", kGpuRtol},
                {"atol", kGpuAtol},
                {"tandem_" + device.str(), got}};
  {
    BlockWorkload cpu_block;
    const std::vector<float> cpu = cpu_block.check();
    check["tandem_cpu"] = cpu;
    const std::string m = compare(got, cpu, kGpuRtol, kGpuAtol);
    check["against_tandem_cpu"] = m.empty() ? "agree" : m;
    if (!m.empty()) {
      report.set("check", std::move(check), "");
      row.error = fmt::format("tandem on {} against tandem on the CPU (loss, gradient norms): {}",
                              device.str(), m);
      return;
    }
  }

  Json baselines = {{"libtorch",
                     {{"skipped", true},
                      {"reason", "the LibTorch program is built on Debian's CPU-only libtorch"}}}};
  std::string why;
  const std::optional<Baseline> pytorch = find_pytorch(why, /*cuda=*/true);
  if (!pytorch) baselines["pytorch"] = {{"skipped", true}, {"reason", why}};
  report.note(pytorch
                  ? fmt::format("\nalternating tandem on {} and {} on its GPU for {} rounds ...",
                                device.str(), pytorch->name, config.rounds)
                  : fmt::format("\nmeasuring tandem on {} ({} rounds); PyTorch skipped: {}",
                                device.str(), config.rounds, why));

  // Note [LibTorch rounds], with one setting per side.
  std::vector<StepTimes> tandem_rounds;
  std::vector<Json> pytorch_runs;
  std::string pytorch_error;
  auto run_tandem = [&] {
    tandem_rounds.push_back(measure([&](double& f, double& b) { block.step(f, b); }, config.trials,
                                    config.min_trial_s));
  };
  auto run_pytorch = [&] {
    if (!pytorch || !pytorch_error.empty()) return;
    try {
      pytorch_runs.push_back(run_pytorch_cuda(*pytorch, config));
    } catch (const std::exception& e) {
      pytorch_error = e.what();
    }
  };
  for (int round = 0; round < config.rounds; ++round) {
    if (round % 2 == 0) {
      run_tandem();
      run_pytorch();
    } else {
      run_pytorch();
      run_tandem();
    }
  }
  std::string text, memory_text;
  Json tandem_json = summarize_tandem(tandem_rounds, device.str(), text);
  tandem_json["block_memory"] = measure_step_memory(block, memory_text);
  report.set("tandem", std::move(tandem_json), text + "\n" + memory_text);

  Json comparison = Json::array();
  if (!pytorch) {
    row.skipped = "PyTorch baseline not run: " + why;
  } else if (!pytorch_error.empty()) {
    baselines["pytorch"] = {{"skipped", false}, {"name", pytorch->name}, {"error", pytorch_error}};
    row.error = pytorch->name + " run failed: " + pytorch_error;
  } else {
    const Json& first = pytorch_runs.front();
    const std::vector<float> want = json_floats(first.at("check").at("block"));
    check["pytorch_cuda"] = want;
    const std::string m = compare(got, want, kGpuRtol, kGpuAtol);
    check["against_pytorch"] = m.empty() ? "agree" : m;
    baselines["pytorch"] = {{"skipped", false},
                            {"name", pytorch->name},
                            {"command", pytorch->command},
                            {"device", first.at("block").value("device", "cuda")},
                            {"gpu", first.at("block").value("gpu", "")},
                            {"attention", first.value("attention", "")},
                            {"runs", pytorch_runs}};
    if (m.empty()) {
      comparison.push_back(compare_rounds(row, tandem_rounds, pytorch_runs, pytorch->name));
    } else {
      row.error = fmt::format("tandem on {} against {} on its GPU (loss, gradient norms): {}",
                              device.str(), pytorch->name, m);
    }
  }
  report.set("check", std::move(check), "");
  std::string baselines_text;
  for (const auto& [key, value] : baselines.items()) {
    if (value.value("skipped", false)) {
      baselines_text +=
          fmt::format("\n{} comparison skipped: {}", key, value.at("reason").get<std::string>());
    }
  }
  report.set("baselines", std::move(baselines), baselines_text);
  std::string comparison_text;
  for (const Json& c : comparison) {
    comparison_text +=
        fmt::format("\ntandem / {} on {}, median over rounds: {:.3f} (target <= {:.2f}) {}",
                    c.at("baseline").get<std::string>(), c.at("device").get<std::string>(),
                    c.at("tandem_over_baseline").get<double>(), c.at("target_max").get<double>(),
                    c.at("pass").get<bool>() ? "PASS" : "MISS");
  }
  report.set("comparison", std::move(comparison), comparison_text);
}

}  // namespace

int run_autograd_cuda(const Options& options) {
  const CudaConfig config = cuda_config(options);
  Report report("autograd", options, timing_config(options));
  // The rounds of Note [LibTorch rounds], not the interleaved trials that the
  // Report's default "timing" field describes.
  report.set("timing",
             {{"statistic",
               "median over rounds of the per-round ratio; times: median over rounds of each "
               "side's median per call"},
              {"rounds", config.rounds},
              {"trials_per_round", config.trials},
              {"min_trial_ms", config.min_trial_s * 1e3},
              {"order", "tandem and a PyTorch process alternate which goes first each round"}},
             "");
  const std::string device = cuda_available() ? Device::cuda(0).str() : "cuda";
  report.set(
      "device", device,
      fmt::format("device: {}{}", device, cuda_emulated() ? " (emulated: times say nothing)" : ""));
  report.set("workload",
             {{"block", fmt::format("pre-norm causal attention + SwiGLU (hidden {}), B={} S={} "
                                    "d={} heads={}, f32, loss = mean",
                                    kHidden, kBatch, kSeq, kModel, kHeads)},
              {"device", device},
              {"rounds", config.rounds},
              {"block_trials", config.trials}},
             fmt::format("block on {}: B={} S={} d={} heads={} hidden={}", device, kBatch, kSeq,
                         kModel, kHeads, kHidden));
  report.set("overhead",
             {{"skipped", true},
              {"device", "cpu"},
              {"reason",
               "the per-op overhead rows are CPU-only (the tape's host-side cost); run "
               "`tandem-bench autograd` without --device cuda"}},
             "overhead rows: CPU-only, not run with --device cuda");
  Row row = cuda_block_row(device);
  if (!cuda_available()) {
    row.error = no_cuda_device_error("autograd");
    report.add(std::move(row));
    return report.finish();
  }
  if (report.wants(row)) {
    try {
      bench_block_cuda(report, config, row);
    } catch (const std::exception& e) {  // a tandem op failing on the GPU
      row.error = e.what();
    }
    report.add(std::move(row));
  }
  bench_attention_cuda(report, options);  // Note [Attention on a GPU]
  return report.finish();
}

}  // namespace tandem::bench
