// The forward/backward worker pair of the dual-pipe schedule (DESIGN §2, §8).
//
// run(fwd, bwd) runs `fwd` on the forward worker and `bwd` on the backward
// worker at the same time, each on its own stream, and returns when both are
// done. If either throws, `on_failure` (e.g. HookCoordinator::disable) is
// called at once so the other side is released from any rendezvous, and the
// first exception is rethrown on the caller after both have stopped. Waits are
// bounded (Note [Bounded waits]); a side stuck in user code past them aborts
// the process rather than be unwound under (Note [Stuck worker]).
//
// Stream ordering between the pair: activations saved by the forward of
// micro-batch i are consumed by the backward of micro-batch i in a *later*
// run(). At the end of each run the forward stream's position is recorded in
// an event that the backward stream waits on before the next bwd runs (Note
// [Stream ordering]); on CUDA the caching allocator keeps the blocks alive
// across the two streams (record_stream in the op dispatch).
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <string>

#include "tandem/runtime/stream.h"
#include "tandem/runtime/worker.h"

namespace tandem {

class WorkerPair {
 public:
  explicit WorkerPair(Device device = Device::cpu());
  WorkerPair(const WorkerPair&) = delete;
  WorkerPair& operator=(const WorkerPair&) = delete;

  // Either function may be empty (the schedule's first forward, last backward).
  void run(const std::function<void()>& fwd, const std::function<void()>& bwd,
           const std::function<void()>& on_failure = {});

  Worker& forward_worker() { return forward_; }
  Worker& backward_worker() { return backward_; }

 private:
  // After a timed-out synchronize (Note [Stuck worker]).
  void wait_out_stuck_sides(const std::exception_ptr& timeout);

  Worker forward_;
  Worker backward_;
  Event forward_done_;
};

// One-shot convenience: a fresh pair runs fwd ‖ bwd once.
void run_pair(const std::function<void()>& fwd, const std::function<void()>& bwd,
              const std::function<void()>& on_failure = {});

}  // namespace tandem
