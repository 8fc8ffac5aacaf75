// What the two runs of `tandem-bench cp` share: the simulated-link run on
// rank threads (bench_cp.cpp, Note [CP benchmark method]) and the runs on the
// plain threads and MPI backends (bench_cp_plain.cpp, Note [CP on the plain
// backends]).
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "tandem/autograd/nn/attention.h"
#include "tandem/comm/process_group.h"
#include "tandem/parallel/device_mesh.h"
#include "tandem/tensor/tensor.h"
#include "tools/bench/bench.h"

namespace tandem::bench::cp {

constexpr int kRanks = 4;
constexpr int64_t kBatch = 1;
constexpr double kMiB = 1 << 20;
// Issue 17's memory targets at cp = 4: per-rank peak / single-rank peak, and
// the same for the activation part (peak minus the replicated weights and
// their gradients, weight_state_bytes()).
constexpr double kPeakTarget = 0.30;
constexpr double kActivationTarget = 0.27;

struct Mode {
  const char* name;
  int ds;  // ulysses_degree
  bool ring;
  bool load_balance;
  bool async;
  const char* sync_of;  // async modes: the sync mode they are compared with
  bool peak_target;     // Ulysses and ring: the memory targets above apply
};

// Every mode, sync ones first, each async one after the sync mode it is
// compared with.
std::span<const Mode> all_modes();

// The modes whose name contains `filter`, with the sync side of every
// selected async mode, in all_modes() order.
std::vector<const Mode*> selected_modes(const std::string& filter);

// Modes measured together: each sync mode with the async variants compared
// with it; with `sync_alone`, sync modes without one as groups of their own.
std::vector<std::vector<const Mode*>> mode_groups(const std::vector<const Mode*>& modes,
                                                  bool sync_alone);

struct Size {
  int64_t seq = 0, dim = 0, heads = 0;
  std::string str() const { return fmt::format("S={} d={} heads={}", seq, dim, heads); }
};

int64_t allocated_bytes();       // the CPU allocator's, process-wide
int64_t peak_allocated_bytes();  // since the last reset_peak_memory()

// One training step on this thread: forward, loss sum(out * w), backward,
// then the gradients are dropped so that every step allocates the same; it
// returns when x's device has run it.
void train_step(nn::SelfAttention& layer, const Tensor& x, const Tensor& w);

// The single-rank layer alone on this thread.
struct SingleRun {
  double peak_bytes = 0;       // one step, layer and input included
  double weight_bytes = 0;     // weight_state_bytes() of its layer
  std::vector<double> step_s;  // timed steps after the measured one
};
SingleRun run_single(const Size& size, const Tensor& x, const Tensor& w, int steps);

// (peak - weights) / (single-rank peak - weights), weights being
// single.weight_bytes: the same on every rank, the layer being replicated.
double activation_ratio(double peak_per_rank, const SingleRun& single);

// The layer every rank builds for `mode` (the same weights on every rank).
std::shared_ptr<nn::SelfAttention> make_layer(const Size& size, const Mode& mode,
                                              const DeviceMesh& mesh);

// One mode's layer on `group`, with this rank's shards of the input, on
// `device` (the rank threads of `cp --device cuda` share cuda:0).
struct LayerCopy {
  DeviceMesh mesh;
  std::shared_ptr<nn::SelfAttention> layer;
  Tensor x, w;
};
LayerCopy make_copy(const Size& size, const Mode& mode, ProcessGroupPtr group, const Tensor& x,
                    const Tensor& w, Device device = Device::cpu());

// The layer's parameters and as many bytes again for their gradients: the
// replicated part of every rank's peak. Counted whole, although at the peak
// some gradients may not exist yet, so the activation part derived from it is
// a lower bound (for the single-rank layer and the CP ranks alike).
double weight_state_bytes(nn::SelfAttention& layer);

// Runs the plain threads backend's rows into `report` (part of the default
// `tandem-bench cp`): Note [CP on the plain backends].
void run_plain_threads(Report& report, const Size& size, const std::vector<const Mode*>& modes,
                       const Tensor& x, const Tensor& w, int pairs);

}  // namespace tandem::bench::cp

namespace tandem::bench {
// `tandem-bench cp --backend mpi`, under `mpirun -n 4`.
int run_cp_mpi(const Options& options);
// `tandem-bench cp --device cuda` (bench_cp_cuda.cpp).
int run_cp_cuda(const Options& options);
}  // namespace tandem::bench
