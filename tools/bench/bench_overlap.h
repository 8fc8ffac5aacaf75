// What the runs of `tandem-bench overlap` share: the model every rank thread
// builds and its timed step (bench_overlap.cpp on the simulated link,
// bench_overlap_cuda.cpp on a CUDA device), the bytes of each collective of
// one step, read from the simulated link's trace events, and the checks and
// per-side sums of the trace of one overlapped step (bench_overlap_trace.cpp;
// Note [Overlap benchmark method]).
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "tandem/autograd/nn/transformer.h"
#include "tandem/comm/sim_link.h"
#include "tandem/parallel/dual_pipe.h"
#include "tools/bench/bench.h"

namespace tandem::bench::overlap {

using Json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

struct Setup {
  nn::TransformerLMConfig model;
  int64_t batch = 0, seq = 0;
  int ranks = 0, micro_batches = 0;
  int trials = 0, calibration_steps = 0;
};

// The model and step of the run; --ranks and --micro-batches override the
// defaults (checked: ranks >= 2 dividing the experts, >= 2 micro-batches).
Setup make_setup(const Options& options);

inline double seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// When one step began and ended, and when each micro-batch's forward and
// backward began (on whichever thread ran them).
struct StepMarks {
  Clock::time_point start, end;
  std::vector<Clock::time_point> forward, backward;
  std::vector<double> losses;

  double total() const { return seconds(end - start); }
};

// The "setup" field of a run's report: the model and step, `backend` the
// ranks' transport, `where` appended to the text ("" or " on cuda:0").
void report_setup(Report& report, const Setup& setup, const std::string& backend,
                  const std::string& where);

// One rank's copy of the model on `device`, expert-parallel over `world`
// (behind a simulated link when `link` is given; not owned, read at
// construction), with its dual-pipe schedule. Every copy has the same weights.
class RankModel {
 public:
  RankModel(const Setup& setup, const ProcessGroupPtr& world, const LinkModel* link,
            Device device = Device::cpu());

  int moe_layers() const { return pipe_.moe_layers(); }

  // One training step of n micro-batches, ended when the device has finished
  // it; the gradients are dropped after it so that every step does the same
  // work.
  StepMarks step(bool overlap);

 private:
  Setup setup_;
  Device device_;
  DeviceMesh mesh_;
  std::shared_ptr<nn::TransformerLM> model_;
  DualPipe pipe_;
  std::vector<std::pair<Tensor, Tensor>> batches_;
};

// Bytes of each collective of one step, per micro-batch and direction, the
// larger of the ranks' for each collective (the slower rank sets the pace).
struct Traffic {
  // [micro-batch][0 = forward, 1 = backward] → bytes of each collective.
  std::vector<std::array<std::vector<double>, 2>> bytes;

  double seconds_of(const LinkModel& link, size_t i, int direction) const {
    double us = 0;
    for (double b : bytes[i][direction])
      us += link.transfer_us(CollectiveKind::AllToAll, b);
    return us * 1e-6;
  }
  double forward_s(const LinkModel& link, size_t i) const { return seconds_of(link, i, 0); }
  double backward_s(const LinkModel& link, size_t i) const { return seconds_of(link, i, 1); }
  double step_s(const LinkModel& link) const {
    double s = 0;
    for (size_t i = 0; i < bytes.size(); ++i)
      s += forward_s(link, i) + backward_s(link, i);
    return s;
  }
  double bytes_per_micro_batch() const {
    double total = 0;
    for (const auto& mb : bytes) {
      for (const auto& dir : mb) {
        for (double b : dir)
          total += b;
      }
    }
    return total / static_cast<double>(bytes.size());
  }
  size_t collectives_per_micro_batch() const { return bytes[0][0].size() + bytes[0][1].size(); }
};

// The link events of one sequential step (Note [Simulated link timing]). In
// launch order, each micro-batch's forward issues per MoE layer the counts,
// dispatch and combine all-to-alls, and its backward the reverse combine and
// dispatch ones: 3L then 2L collectives.
Traffic read_traffic(const Json& doc, int ranks, int micro_batches, int moe_layers);

struct SideTraffic {
  int collectives = 0;
  double link_ms = 0;    // the link time they were charged
  double queued_ms = 0;  // from issue until the link was free for them
  // The split-size exchanges ("ep counts", at most 8 bytes per expert): tiny,
  // but waited for on the host right after their issue.
  int counts = 0;
  double counts_queued_ms = 0;
};

struct TraceCheck {
  std::string error;  // empty when the trace has what it must
  int events = 0;
  int rounds = 0;                    // rendezvous rounds checked for their order, all ranks
  std::array<SideTraffic, 2> rank0;  // forward, backward worker
  double rank0_link_busy_ms = 0;
  double rank0_window_ms = 0;  // inside the overlap windows (the pairs)
  double rank0_window_busy_ms = 0;
};

// Checks that every rank's trace has rendezvous and collective issue events
// from both workers, and that in every rendezvous round the Compute side went
// on only after the Comm side had issued its collective (Note [Hook
// coordinator]); sums rank 0's link traffic per side and inside the windows.
TraceCheck check_trace(const Json& doc, int ranks, int64_t experts);

}  // namespace tandem::bench::overlap

namespace tandem::bench {
// `tandem-bench overlap --device cuda` (bench_overlap_cuda.cpp).
int run_overlap_cuda(const Options& options);
}  // namespace tandem::bench
