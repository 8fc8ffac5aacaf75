// `tandem-bench overlap --device cuda`: the dual-pipe schedule with its rank
// threads sharing cuda:0 (issue 21's GPU target: the overlapped step on one
// GPU with 2 rank threads faster than the sequential step).
//
// Note [Overlap on a GPU]
// ~~~~~~~~~~~~~~~~~~~~~~~
// - What runs: the model of Note [Overlap benchmark method] (larger without
//   --quick, so that a GPU has kernels worth overlapping), expert-parallel on
//   --ranks rank threads that share cuda:0 through the threads backend (Note
//   [Threads ranks on one CUDA device]). There is no simulated link: the
//   all-to-alls are the backend's device-to-device copies, and what the
//   overlapped schedule can win is the forward worker's kernels and copies
//   running on the device while the backward worker's run, each worker with
//   its own stream, instead of one after the other.
// - Time: each trial runs a sequential and an overlapped step on the same
//   rank threads, between barriers, the one that goes first alternating
//   (Note [Benchmark timing]); a step ends when the device has finished it.
//   The row's ratio is the median over trials of sequential / overlapped,
//   target >= 1. Step times are rank 0's.
// - Correctness first: the overlapped steps' losses must equal the
//   sequential ones bit for bit, as on the CPU (no kernel sums with atomics:
//   Note [Deterministic scatter_add]); a difference makes the row an error.
// - On the emulated device (TANDEM_CUDA=emulated) the run checks the code path
//   and the bits; its times say nothing about a GPU.
#include <exception>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "tandem/comm/threads/threads_backend.h"
#include "tandem/runtime/device.h"
#include "tandem/runtime/error.h"
#include "tandem/tensor/ops.h"
#include "tools/bench/bench.h"
#include "tools/bench/bench_overlap.h"

namespace tandem::bench {
namespace {

using namespace overlap;

// The model of the full GPU run: a GPU step of the CPU run's model is a few
// hundred tiny kernels, bound by their launches.
Setup gpu_setup(const Options& options) {
  Setup s = make_setup(options);
  if (options.quick) return s;
  nn::TransformerLMConfig& m = s.model;
  m.vocab = 4096;
  m.d_model = 1024;
  m.heads = 16;
  m.hidden = 2048;
  s.seq = 512;
  m.max_seq = s.seq;
  return s;
}

struct GpuMeasured {
  std::vector<double> sequential, overlapped;  // rank 0's step times, one per trial
  bool losses_identical = true;
  std::vector<double> losses;  // of the last sequential step
};

GpuMeasured measure_gpu(const Setup& setup, Device device) {
  GpuMeasured out;
  Lockstep lockstep(setup.ranks);
  run_ranks(setup.ranks, [&](ProcessGroupPtr world) {
    lockstep.guard([&] {
      RankModel model(setup, world, nullptr, device);
      auto timed = [&](bool overlap) {
        lockstep.sync();
        StepMarks m = model.step(overlap);
        lockstep.sync();
        return m;
      };
      timed(false);  // warm-up: the caching allocator, kernels' first launches
      timed(true);
      for (int t = 0; t < setup.trials; ++t) {
        StepMarks seq, ovl;
        if (t % 2 == 0) {
          seq = timed(false);
          ovl = timed(true);
        } else {
          ovl = timed(true);
          seq = timed(false);
        }
        if (world->rank() == 0) {
          out.sequential.push_back(seq.total());
          out.overlapped.push_back(ovl.total());
          out.losses_identical = out.losses_identical && seq.losses == ovl.losses;
          out.losses = seq.losses;
        }
      }
    });
  });
  return out;
}

}  // namespace

int run_overlap_cuda(const Options& options) {
  Report report("overlap", options, timing_config(options));
  const Setup setup = gpu_setup(options);
  const std::string device_name = cuda_available() ? Device::cuda(0).str() : "cuda";
  report.set("timing",
             {{"statistic", "median over trials of sequential / overlapped"},
              {"trials", setup.trials},
              {"order", "a sequential and an overlapped step per trial, alternating which first"}},
             fmt::format("overlap timing on {}: {} trials of one sequential and one overlapped "
                         "step (Note [Overlap on a GPU]); rank 0's step times",
                         device_name, setup.trials));
  report.set("device", device_name,
             fmt::format("device: {}{}", device_name,
                         cuda_emulated() ? " (emulated: times say nothing about a GPU)" : ""));
  report_setup(report, setup, "threads, rank threads sharing the device", " on " + device_name);

  Row row;
  row.group = "overlap";
  row.name = fmt::format("ovl vs sequential, {} ranks on one GPU", setup.ranks);
  row.device = device_name;
  row.threads = 0;  // a GPU row
  row.baseline = "sequential schedule";
  row.target = 1.0;
  if (!report.wants(row)) return report.finish();
  if (!cuda_available()) {
    row.error = no_cuda_device_error("overlap");
    report.add(std::move(row));
    return report.finish();
  }
  try {
    const GpuMeasured m = measure_gpu(setup, Device::cuda(0));
    std::vector<double> ratios;
    for (size_t t = 0; t < m.sequential.size(); ++t)
      ratios.push_back(m.sequential[t] / m.overlapped[t]);
    row.timing = {timing_of_steps(m.overlapped), timing_of_steps(m.sequential),
                  sample_median(ratios)};
    report.set("step",
               {{"sequential_ms", sample_median(m.sequential) * 1e3},
                {"overlapped_ms", sample_median(m.overlapped) * 1e3},
                {"sequential_over_overlapped", row.timing.ratio},
                {"losses_identical", m.losses_identical},
                {"losses", m.losses}},
               fmt::format("\nstep ({} micro-batches, median over {} trials, rank 0): sequential "
                           "{:.2f} ms, overlapped {:.2f} ms; the overlapped losses {} the "
                           "sequential ones",
                           setup.micro_batches, m.sequential.size(),
                           sample_median(m.sequential) * 1e3, sample_median(m.overlapped) * 1e3,
                           m.losses_identical ? "are bit-identical to" : "DIFFER from"));
    if (!m.losses_identical) {
      row.error = "the overlapped step's losses differ from the sequential step's";
    }
  } catch (const std::exception& e) {  // a tandem op failing on the device
    row.error = e.what();
  }
  report.add(std::move(row));
  return report.finish();
}

}  // namespace tandem::bench
