// `tandem-bench cp --device cuda`: the context-parallel modes with their 4
// rank threads sharing cuda:0.
//
// Note [CP on a GPU]
// ~~~~~~~~~~~~~~~~~~
// - What runs: the layer of Note [CP benchmark method] on cuda:0, in every
//   selected mode, on 4 rank threads that share the device through the
//   threads backend (Note [Threads ranks on one CUDA device]): the
//   collectives are the backend's device-to-device copies. No simulated link.
//   The attention is the tiled CUDA kernel, which never holds (B, H, S, S)
//   scores, so the full run takes the S = 8192 as it is.
// - Correctness first: each rank's first step also computes sum(out * out) of
//   its output shard; the sum over ranks must match the single-rank layer's
//   on the same device within kCheckRtol (the kernels sum in other orders
//   than the single-rank layer, so not bit for bit). A mismatch makes the
//   mode's rows errors.
// - Time: a mode and the async variants compared with it run on the same rank
//   threads, their steps alternating, each step between two barriers and
//   ended when the device has run it; rank 0's wall time, median over steps.
//   Rows: each mode's step against the single-rank layer's step on the same
//   GPU (4 ranks sharing one device do the single rank's work between them,
//   plus their collectives), and each async mode's step against its sync
//   mode's. Neither has a target: issue 21 asks that the rows run on a GPU;
//   issue 17's targets are the simulated link's and the CPU's.
// - Peak memory: as on the link run, the device's allocator is shared by the
//   rank threads, so the per-rank figure is (peak - allocated before the
//   mode's layers existed) / 4, against the single-rank layer's.
// - On the emulated device (TANDEM_CUDA=emulated) the run checks the code path
//   and the numbers; its times say nothing about a GPU.
#include <chrono>
#include <cmath>
#include <exception>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "tandem/autograd/ops.h"
#include "tandem/comm/threads/threads_backend.h"
#include "tandem/runtime/allocator.h"
#include "tandem/runtime/device.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/stream.h"
#include "tandem/tensor/ops.h"
#include "tools/bench/bench.h"
#include "tools/bench/bench_cp.h"

namespace tandem::bench {
namespace {

using namespace cp;

using Clock = std::chrono::steady_clock;
using Json = nlohmann::ordered_json;

constexpr double kCheckRtol = 1e-3;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// train_step(), returning sum(out * out) of this rank's output.
double checked_step(nn::SelfAttention& layer, const Tensor& x, const Tensor& w) {
  Tensor input = detach(x);
  set_requires_grad(input);
  Tensor out = layer(input);
  const double square_norm = ops::sum(ops::mul(out, out)).item_double();
  backward(sum(mul(out, w)));
  layer.zero_grad();
  current_stream(x.device()).synchronize();
  return square_norm;
}

struct GpuSingle {
  double peak_bytes = 0, square_norm = 0;
  std::vector<double> step_s;
};

GpuSingle run_single_gpu(const Size& size, const Tensor& x, const Tensor& w, int steps,
                         Device device) {
  GpuSingle r;
  const int64_t base = memory_stats(device).allocated_bytes;
  {
    Generator gen(1);  // the weights of make_layer()
    auto layer = nn::make<nn::SelfAttention>(
        {.d_model = size.dim, .n_heads = size.heads, .n_kv_heads = size.heads, .causal = true},
        gen);
    layer->to(device);
    Tensor xs = ops::to(x, device), ws = ops::to(w, device);
    reset_peak_memory(device);
    r.square_norm = checked_step(*layer, xs, ws);
    r.peak_bytes = static_cast<double>(memory_stats(device).peak_allocated_bytes - base);
    for (int i = 0; i < steps; ++i) {
      const Clock::time_point start = Clock::now();
      train_step(*layer, xs, ws);
      r.step_s.push_back(seconds_since(start));
    }
  }
  empty_cache(device);
  return r;
}

struct GpuRun {
  const Mode* mode = nullptr;
  std::vector<double> step_s;  // rank 0's, per timed step
  double peak_bytes = 0;       // per rank (Note [CP on a GPU])
  double square_norm = 0;      // summed over ranks
  std::string error;
};

// The modes of `group` on 4 rank threads sharing `device`.
void run_group_gpu(const Size& size, const std::vector<const Mode*>& group, const Tensor& x,
                   const Tensor& w, int pairs, Device device, std::vector<GpuRun>& runs) {
  Lockstep lockstep(kRanks);
  run_ranks(kRanks, [&](ProcessGroupPtr world) {
    lockstep.guard([&] {
      const bool leader = world->rank() == 0;
      std::vector<LayerCopy> copies;
      for (size_t m = 0; m < group.size(); ++m) {
        lockstep.sync();
        const int64_t base = memory_stats(device).allocated_bytes;
        lockstep.sync();  // the leader has read before anybody allocates
        copies.push_back(make_copy(size, *group[m], world, x, w, device));
        lockstep.sync();
        if (leader) reset_peak_memory(device);
        lockstep.sync();
        const double mine = checked_step(*copies[m].layer, copies[m].x, copies[m].w);
        WorkPtr work = world->all_reduce(ops::from_vector(std::vector<double>{mine}, Shape{1}));
        work->wait();
        const double total = work->result().to_vector<double>()[0];
        lockstep.sync();
        if (leader) {
          runs[m].square_norm = total;
          runs[m].peak_bytes =
              static_cast<double>(memory_stats(device).peak_allocated_bytes - base) / kRanks;
        }
      }
      for (int i = 0; i < pairs; ++i) {
        for (size_t k = 0; k < group.size(); ++k) {
          const size_t m = i % 2 == 0 ? k : group.size() - 1 - k;
          lockstep.sync();
          const Clock::time_point start = Clock::now();
          train_step(*copies[m].layer, copies[m].x, copies[m].w);
          lockstep.sync();
          if (leader) runs[m].step_s.push_back(seconds_since(start));
        }
      }
    });
  });
}

Row gpu_row(const std::string& name, const std::string& device, const std::string& baseline) {
  Row row;
  row.group = "cp-cuda";
  row.name = name;
  row.device = device;
  row.threads = 0;  // a GPU row
  row.baseline = baseline;
  row.target = 0;  // Note [CP on a GPU]: no target
  return row;
}

const GpuRun* find_gpu_run(const std::vector<GpuRun>& runs, const std::string& name) {
  for (const GpuRun& r : runs) {
    if (name == r.mode->name) return &r;
  }
  return nullptr;
}

void report_gpu(Report& report, const std::vector<GpuRun>& runs, const GpuSingle& single,
                const std::string& device) {
  const double single_s = sample_median(single.step_s);
  std::string text = fmt::format(
      "\n{} ranks sharing {} (per rank: peak = (process peak - before) / {}; check = sum over "
      "ranks of sum(out * out) against the single rank's {:.6g})\n",
      kRanks, device, kRanks, single.square_norm);
  constexpr const char* kFormat = "{:<22} {:>9} {:>9} {:>8} {:>12}\n";
  text += fmt::format(kFormat, "mode", "step ms", "peak MiB", "/single", "check");
  Json rows = Json::array();
  for (const GpuRun& r : runs) {
    if (!r.error.empty()) {
      text += fmt::format("{:<22} ERROR: {}\n", r.mode->name, r.error);
      rows.push_back({{"mode", r.mode->name}, {"status", "error"}, {"error", r.error}});
      continue;
    }
    const double step = sample_median(r.step_s);
    const double rel = std::abs(r.square_norm - single.square_norm) / single.square_norm;
    text += fmt::format(kFormat, r.mode->name, fmt::format("{:.2f}", step * 1e3),
                        fmt::format("{:.1f}", r.peak_bytes / kMiB),
                        fmt::format("{:.3f}", r.peak_bytes / single.peak_bytes),
                        fmt::format("{:.1e} rel", rel));
    rows.push_back({{"mode", r.mode->name},
                    {"step_ms", step * 1e3},
                    {"peak_bytes_per_rank", r.peak_bytes},
                    {"peak_ratio_vs_single", r.peak_bytes / single.peak_bytes},
                    {"square_norm", r.square_norm},
                    {"square_norm_rel_diff", rel}});
  }
  text.pop_back();
  report.set("modes", std::move(rows), text);

  for (const GpuRun& r : runs) {
    Row row = gpu_row(fmt::format("{} step", r.mode->name), device, "single-rank layer, step");
    if (!r.error.empty()) {
      row.error = r.error;
    } else {
      row.timing = {timing_of_steps(r.step_s), timing_of_steps(single.step_s),
                    single_s / sample_median(r.step_s)};
    }
    if (report.wants(row)) report.add(std::move(row));
    if (!r.mode->async) continue;
    const GpuRun* sync = find_gpu_run(runs, r.mode->sync_of);
    if (sync == nullptr) continue;
    Row vs = gpu_row(fmt::format("{} async", r.mode->sync_of), device,
                     fmt::format("{} (sync), step", r.mode->sync_of));
    if (!r.error.empty() || !sync->error.empty()) {
      vs.error = !r.error.empty() ? r.error : sync->error;
    } else {
      vs.timing = {timing_of_steps(r.step_s), timing_of_steps(sync->step_s),
                   sample_median(sync->step_s) / sample_median(r.step_s)};
    }
    if (report.wants(vs)) report.add(std::move(vs));
  }
}

}  // namespace

int run_cp_cuda(const Options& options) {
  Report report("cp", options, timing_config(options));
  const std::string device_name = cuda_available() ? Device::cuda(0).str() : "cuda";
  const int pairs = options.quick ? 2 : 7;
  Size size{options.quick ? 256 : 8192, options.quick ? 128 : 1024, options.quick ? 8 : 16};
  if (options.seq > 0) size.seq = options.seq;
  if (options.dim > 0) size.dim = options.dim;
  if (options.heads > 0) size.heads = options.heads;
  TANDEM_CHECK(size.dim % size.heads == 0 && size.heads % kRanks == 0 && size.seq >= 2 * kRanks,
               "[bench::cp] expected heads dividing d and divisible by {}, S >= {}; got {}", kRanks,
               2 * kRanks, size.str());
  report.set(
      "timing",
      {{"statistic", "median over steps (rank 0's wall time)"},
       {"pairs", pairs},
       {"order", "the modes of a group alternate, the order reversed every other round"}},
      fmt::format("cp timing on {}: {} steps per mode (Note [CP on a GPU])", device_name, pairs));
  report.set("device", device_name,
             fmt::format("device: {}{}", device_name,
                         cuda_emulated() ? " (emulated: times say nothing about a GPU)" : ""));
  report.set("setup",
             {{"ranks", kRanks},
              {"backend", "threads, rank threads sharing the device"},
              {"batch", kBatch},
              {"seq", size.seq},
              {"dim", size.dim},
              {"heads", size.heads},
              {"dtype", "f32"},
              {"causal", true},
              {"pairs", pairs}},
             fmt::format("layer: B={} {} f32 causal, forward+backward of SelfAttention on {} rank "
                         "threads sharing {}",
                         kBatch, size.str(), kRanks, device_name));
  if (!cuda_available()) {
    Row row = gpu_row("every mode", device_name, "single-rank layer, step");
    row.error = no_cuda_device_error("cp");
    report.add(std::move(row));
    return report.finish();
  }
  const Device device = Device::cuda(0);
  Generator gen(7);  // the global input of the CPU run
  Tensor x = ops::randn({kBatch, size.seq, size.dim}, gen);
  Tensor w = ops::randn({kBatch, size.seq, size.dim}, gen);
  GpuSingle single;
  try {
    single = run_single_gpu(size, x, w, pairs, device);
  } catch (const std::exception& e) {
    Row row = gpu_row("single-rank layer", device_name, "-");
    row.error = e.what();
    report.add(std::move(row));
    return report.finish();
  }
  report.set("single_rank",
             {{"peak_bytes", single.peak_bytes},
              {"step_ms", sample_median(single.step_s) * 1e3},
              {"square_norm", single.square_norm}},
             fmt::format("single-rank layer on {}: step {:.2f} ms, peak {:.1f} MiB", device_name,
                         sample_median(single.step_s) * 1e3, single.peak_bytes / kMiB));

  std::vector<GpuRun> all;
  for (const std::vector<const Mode*>& group : mode_groups(selected_modes(options.filter), true)) {
    std::vector<GpuRun> runs(group.size());
    for (size_t i = 0; i < group.size(); ++i)
      runs[i].mode = group[i];
    try {
      run_group_gpu(size, group, x, w, pairs, device, runs);
    } catch (const std::exception& e) {
      for (GpuRun& r : runs)
        r.error = e.what();
    }
    for (GpuRun& r : runs) {
      const double rel = std::abs(r.square_norm - single.square_norm) / single.square_norm;
      if (r.error.empty() && !(rel <= kCheckRtol)) {
        r.error = fmt::format(
            "sum over ranks of sum(out * out) {:.8g}, expected the single rank's {:.8g} within "
            "{:.0e} relative (got {:.2e})",
            r.square_norm, single.square_norm, kCheckRtol, rel);
      }
    }
    empty_cache(device);
    all.insert(all.end(), runs.begin(), runs.end());
  }
  report_gpu(report, all, single, device_name);
  return report.finish();
}

}  // namespace tandem::bench
