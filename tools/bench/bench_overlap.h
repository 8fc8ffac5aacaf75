// The traffic and the trace of `tandem-bench overlap` (Note [Overlap benchmark
// method] in bench_overlap.cpp): the bytes of each collective of one step, read
// from the simulated link's trace events, and the checks and per-side sums of
// the trace of one overlapped step.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tandem/comm/sim_link.h"

namespace tandem::bench::overlap {

using Json = nlohmann::ordered_json;

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
