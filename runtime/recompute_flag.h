// The per-thread "recomputing" flag (Note [Recompute flag]).
//
// Note [Recompute flag]: activation checkpointing re-runs a forward segment
// inside backward. Hooks fired by that re-run must not act a second time: the
// HookCoordinator (runtime/hook_coordinator.h) turns rendezvous and
// notify_dispatched into no-ops while the flag is set. The flag lives here, in
// runtime, because runtime includes nothing above it; autograd's
// RecomputeGuard / is_recomputing() (autograd/checkpoint.h) set and read this
// same flag, so a checkpoint re-run is seen by the coordinator without the
// caller bridging the two.
#pragma once

namespace tandem {

namespace detail {
inline thread_local bool thread_recomputing = false;
}

inline bool thread_is_recomputing() {
  return detail::thread_recomputing;
}

// Sets this thread's flag and returns its previous value (for nesting).
inline bool set_thread_recomputing(bool on) {
  bool previous = detail::thread_recomputing;
  detail::thread_recomputing = on;
  return previous;
}

// Sets the flag for one scope and restores the previous value on exit.
class RecomputingScope {
 public:
  explicit RecomputingScope(bool on = true) : previous_(set_thread_recomputing(on)) {}
  ~RecomputingScope() { set_thread_recomputing(previous_); }
  RecomputingScope(const RecomputingScope&) = delete;
  RecomputingScope& operator=(const RecomputingScope&) = delete;

 private:
  bool previous_;
};

}  // namespace tandem
