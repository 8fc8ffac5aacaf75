// The baseline programs of `tandem-bench autograd` (Note [Autograd baselines]):
// finding LibTorch's and PyTorch's, running them, and the helpers that read
// their JSON. Shared by the CPU rows (bench_autograd.cpp) and the GPU mode
// (bench_autograd_cuda.cpp).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tools/bench/bench.h"

namespace tandem::bench::autograd_baselines {

struct Baseline {
  std::string key;      // "libtorch", "pytorch"
  std::string name;     // "LibTorch 1.13", "PyTorch 2.x"
  std::string command;  // shell words that run it
  std::string env;      // NAME=value words for every run
};

// `s` as one single-quoted shell word.
std::string shell_quote(const std::string& s);
// Runs `command` through the shell; its stdout, or a failure naming the
// command and its exit status.
std::string run_command(const std::string& command);
std::vector<float> json_floats(const nlohmann::ordered_json& j);
// Median and minimum of per-round seconds, as a Timing of `reps` calls a trial.
Timing timing_over_rounds(const std::vector<double>& per_round, int reps);

// The LibTorch program next to this executable, or nothing with `why` set.
std::optional<Baseline> find_libtorch(std::string& why);
// PyTorch 2.x through pytorch_autograd.py, or nothing with `why` set. With
// `cuda`, also nothing when that PyTorch has no usable CUDA device.
std::optional<Baseline> find_pytorch(std::string& why, bool cuda = false);

}  // namespace tandem::bench::autograd_baselines
