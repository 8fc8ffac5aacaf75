// Simulated links (DESIGN §5): a ProcessGroup wrapper that runs every
// collective on an inner group (real data movement, e.g. the threads backend)
// and delays the completion of its Work as if the bytes had crossed an NVLink
// or InfiniBand link, so that compute/communication overlap can be measured on
// a CPU-only machine.
//
// Note [Simulated link timing]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A collective issued at time t on a group whose link is free at time f
// occupies the link from start = max(t, f) for
//     latency + bytes / bandwidth
// where `bytes` is what each rank sends, by the nccl-tests bus-bandwidth
// conventions for a group of n ranks and a buffer of S bytes:
//     all_reduce            2 (n-1)/n · S
//     all_gather            (n-1)/n · S   (S = the gathered output)
//     reduce_scatter        (n-1)/n · S   (S = the full input)
//     all_to_all            the larger of the bytes sent to and received from
//                           the other ranks ((n-1)/n · S for even splits)
//     broadcast             S
//     send/recv/batch       the larger of the bytes sent and received
//     barrier               0 (latency only)
// Collectives of one group use the link one after another, as the kernels of
// one NCCL communicator do on its stream; separate groups (sub-groups) have
// separate links. A group of one rank crosses no link and is not delayed.
// The Work completes at max(inner completion, start + duration); an inner
// failure completes it at once, with that error.
//
// The delay costs no CPU: one process-wide timer thread sleeps on a priority
// queue of deadlines (condition_variable::wait_until) and finishes the
// wrapper's Works. Completion callbacks of those Works (Work::on_completion)
// run on that timer thread, so they must be short and must not block.
#pragma once

#include <map>

#include "tandem/comm/process_group.h"

namespace tandem {

// Cost of one class of collectives on a link.
struct LinkCost {
  double latency_us = 0;
  // GB/s: 10^9 bytes per second in each direction (gigabytes, not gigabits).
  // Must be > 0; infinity makes the transfer latency-only.
  double bandwidth_gbps = 0;
};

struct LinkModel {
  double latency_us = 0;
  double bandwidth_gbps = 0;  // GB/s per direction, as in LinkCost
  // Per-collective overrides of latency and bandwidth. A batch that is a
  // single send (or a single recv) looks up Send (Recv) before BatchP2P.
  std::map<CollectiveKind, LinkCost> overrides;

  LinkCost cost(CollectiveKind kind) const;
  // Simulated duration in microseconds of one collective of `kind` in which
  // each rank sends `bytes` (Note [Simulated link timing]).
  double transfer_us(CollectiveKind kind, double bytes) const;

  // H100 SXM NVLink4: 18 links of 25 GB/s per direction = 450 GB/s per
  // direction per GPU (the "900 GB/s" of the data sheet counts both
  // directions); 2 µs per collective, the order of NCCL's small-message
  // latency inside one NVSwitch node.
  static LinkModel nvlink();
  // NDR InfiniBand, one 400 Gb/s ConnectX-7 port per GPU: 50 GB/s per
  // direction; 5 µs per collective (RDMA round trip plus NCCL's proxy).
  static LinkModel infiniband();
};

// Wraps `inner`: same rank, size, world ranks and options; backend_name()
// is "sim(<inner backend>)". Every collective runs on `inner` and completes
// per Note [Simulated link timing]. split() splits `inner` and wraps the
// result with the same model. With tracing on, each transfer is a complete
// event on the lane "link r<rank> <group>".
ProcessGroupPtr simulate_link(ProcessGroupPtr inner, LinkModel model);

}  // namespace tandem
