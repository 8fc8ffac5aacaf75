// The workloads of `tandem-bench autograd` and their timing protocol: a chain
// of tiny elementwise ops and one pre-norm transformer block step, both built
// from bit-reproducible values that tools/bench/libtorch_autograd.cpp repeats
// (Note [Autograd benchmark workload]). bench_autograd.cpp runs them against
// LibTorch.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <vector>

#include "tandem/autograd/ops.h"
#include "tandem/runtime/device.h"

namespace tandem::bench::autograd_workload {

// Note [Autograd benchmark workload]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Shared with tools/bench/libtorch_autograd.cpp, which repeats these constants
// and workload_values(): change both together. Every value is an integer hash
// converted exactly to a multiple of 2^-23 in [-1, 1), times a power-of-two
// scale (exact), plus an offset of 0 or 1 (one rounding, the same whether or
// not the compiler contracts it into an FMA), so both programs start from the
// same bits and their losses and gradients can be compared.
inline constexpr int kChainOps = 1000;  // mul by 0.9, add a (4) tensor, tanh, repeated
inline constexpr int64_t kChainNumel = 4;
inline constexpr int64_t kBatch = 4, kSeq = 256, kModel = 256, kHeads = 4, kHidden = 1024;
// A block step's target, on the CPU and on a GPU: at most this fraction of the
// baseline's step time (Row::target = 1 / kBlockTargetMax).
inline constexpr double kBlockTargetMax = 0.8;

using Clock = std::chrono::steady_clock;

// Note [Autograd benchmark workload]'s values: n of them for `salt`, and a
// tensor of them (made on the CPU, then copied to `device`).
std::vector<float> workload_values(uint64_t salt, int64_t n, float scale, float offset);
Tensor workload_tensor(uint64_t salt, const Shape& shape, float scale, float offset = 0.0f,
                       Device device = Device::cpu());

double seconds(Clock::time_point a, Clock::time_point b);
double median_of(std::vector<double> v);
void synchronize_cpu();
// Synchronises the calling thread's current stream of `device`.
void synchronize(Device device);

// kChainOps ops (mul by 0.9, add c, tanh, repeated) on the (4) f32 leaf x,
// then sum.
struct ChainWorkload {
  ChainWorkload();
  Tensor x, c;

  // One forward+backward; adds the two phase times. The gradient is dropped
  // afterwards (set to none) so every call does the same work.
  void step(double& forward_s, double& backward_s);
  // (chain output, sum of x's gradient): compared with LibTorch's.
  std::vector<float> check();
  // The same chain through the raw, non-differentiable tandem::ops (forward).
  Tensor raw_forward() const;
};

// The block's weights and input are made on the CPU and then copied to
// `device`, so they hold the same bits on every device.
struct BlockParams {
  explicit BlockParams(Device device = Device::cpu());
  Tensor ln1_w, ln1_b, w_qkv, w_o, ln2_w, ln2_b, w_gate, w_up, w_down;

  // In the order of LibTorch's "check" array.
  std::vector<Tensor*> all();
};

struct BlockWorkload {
  explicit BlockWorkload(Device device = Device::cpu());
  Device device;
  BlockParams p;
  Tensor x;

  // Each phase ends by synchronising `device`'s current stream, so that the
  // times count the kernels, not their launches.
  void step(double& forward_s, double& backward_s);
  // (loss, L2 norm of each parameter's gradient): compared with LibTorch's.
  std::vector<float> check();
};

// Per-call medians over trials; each trial repeats the call enough times to
// last min_trial_s (the same protocol as the LibTorch program). cpu_s is the
// process CPU time: at one thread it counts the work done whatever other
// users' load steals from the wall clock.
struct StepTimes {
  double total_s = 0, forward_s = 0, backward_s = 0, cpu_s = 0;
  int reps = 0;
};
using Step = std::function<void(double& forward_s, double& backward_s)>;

StepTimes measure(const Step& step, int trials, double min_trial_s);

}  // namespace tandem::bench::autograd_workload
