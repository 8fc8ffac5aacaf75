#include "runtime/worker_pair.h"

#include <atomic>
#include <exception>
#include <mutex>

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
  std::exception_ptr first;
  {
    std::lock_guard<std::mutex> lock(state->mu);
    first = state->first;
  }
  if (first) std::rethrow_exception(first);
  if (sync_error) std::rethrow_exception(sync_error);
}

void run_pair(const std::function<void()>& fwd, const std::function<void()>& bwd,
              const std::function<void()>& on_failure) {
  WorkerPair pair;
  pair.run(fwd, bwd, on_failure);
}

}  // namespace tandem
