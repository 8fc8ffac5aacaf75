#include "tandem/runtime/worker_pair.h"

#include <atomic>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>

#include "tandem/runtime/config.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/logging.h"

namespace tandem {

WorkerPair::WorkerPair(Device device)
    : forward_("forward-worker", device), backward_("backward-worker", device) {}

void WorkerPair::run(const std::function<void()>& fwd, const std::function<void()>& bwd,
                     const std::function<void()>& on_failure) {
  // Shared with the closures: a side that outlives a timed-out synchronize()
  // must not touch this stack frame.
  struct State {
    std::mutex mu;
    std::exception_ptr first;
    std::atomic<bool> failed{false};
    std::function<void()> on_failure;
  };
  auto state = std::make_shared<State>();
  state->on_failure = on_failure;
  auto guarded = [state](std::function<void()> fn) {
    return [state, fn = std::move(fn)] {
      if (!fn) return;
      try {
        fn();
      } catch (...) {
        {
          std::lock_guard<std::mutex> lock(state->mu);
          if (!state->first) state->first = std::current_exception();
        }
        // Release the partner before it waits on us forever.
        if (!state->failed.exchange(true) && state->on_failure) {
          try {
            state->on_failure();
          } catch (...) {
          }
        }
      }
    };
  };
  Event forward_done = forward_done_;
  Stream bwd_stream = backward_.stream();
  backward_.submit([forward_done, bwd_stream] { forward_done.wait(bwd_stream); });
  forward_.submit(guarded(fwd));
  backward_.submit(guarded(bwd));
  Stream fwd_stream = forward_.stream();
  forward_.submit([forward_done, fwd_stream]() mutable { forward_done.record(fwd_stream); });
  std::exception_ptr sync_error;
  for (Worker* w : {&forward_, &backward_}) {
    try {
      w->synchronize();
    } catch (...) {
      if (!sync_error) sync_error = std::current_exception();
    }
  }
  if (sync_error) wait_out_stuck_sides(sync_error);
  std::exception_ptr first;
  {
    std::lock_guard<std::mutex> lock(state->mu);
    first = state->first;
  }
  if (first) std::rethrow_exception(first);
  if (sync_error) std::rethrow_exception(sync_error);
}

// Note [Stuck worker]
// ~~~~~~~~~~~~~~~~~~~
// A side whose closure has not ended within synchronize()'s bound still runs
// code that may use the caller's frame (the closures capture the step's
// locals by reference), so unwinding now would free them under it. run()
// first gives both sides another wait_timeout(): a closure inside a bounded
// wait of its own (a collective whose peer is gone) ends with that wait's
// error, which is then the one rethrown. A side still running after that is
// stuck in unbounded user code; a thread cannot be stopped in C++ and must
// not be unwound under, so the process reports which worker is stuck and
// since when, and aborts (as PyTorch's NCCL watchdog tears a process down);
// under mpirun that ends the job with the report on stderr.
void WorkerPair::wait_out_stuck_sides(const std::exception_ptr& timeout) {
  for (Worker* w : {&forward_, &backward_}) {
    if (w->wait_idle(wait_timeout())) continue;
    log_error(
        "[runtime::WorkerPair] the {} is still running a closure {} ms after its synchronize "
        "timed out ({}); its closure may use the caller's stack frame, which unwinding would "
        "free under it, so the process aborts (Note [Stuck worker])",
        w->name(), wait_timeout().count(), what_of(timeout));
    std::abort();
  }
}

void run_pair(const std::function<void()>& fwd, const std::function<void()>& bwd,
              const std::function<void()>& on_failure) {
  WorkerPair pair;
  pair.run(fwd, bwd, on_failure);
}

}  // namespace tandem
